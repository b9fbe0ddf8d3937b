import dataclasses
import json

import pytest
import torch

from spin_indexer.predictor import PRESETS, Exploration, Pooling, SpinConfig


def test_defaults_are_the_papers():
    cfg = PRESETS["paper"]
    assert cfg.alpha == 0.5 and cfg.gamma == 0.05 and cfg.exploration is Exploration.RANDOM
    assert cfg.pooling is Pooling.A1 and cfg.reduce.value == "max" and cfg.tokens_per_block == 64


def test_strings_parse_to_enums_and_round_trip_json():
    cfg = SpinConfig(pooling="a2", exploration="block_age", mtp="row-local", combine="sum", reduce="top4")
    assert cfg.pooling is Pooling.A2 and cfg.exploration is Exploration.BLOCK_AGE
    d = cfg.to_dict()
    assert d["pooling"] == "a2" and d["mtp"] == "row-local" and d["state_dtype"] == "float16"
    assert SpinConfig(**{k: v for k, v in d.items() if k != "state_dtype"}).to_dict() == d


@pytest.mark.parametrize("field, value, exc, words", [
    ("sparsity", 1.0, ValueError, "SpinConfig.sparsity"),
    ("sparsity", -0.1, ValueError, "SpinConfig.sparsity"),
    ("sparsity", "0.3", TypeError, "SpinConfig.sparsity"),
    ("alpha", 0.0, ValueError, "SpinConfig.alpha"),
    ("alpha", 1.5, ValueError, "SpinConfig.alpha"),
    ("gamma", 1.0, ValueError, "SpinConfig.gamma"),
    ("topk", 0, ValueError, "SpinConfig.topk"),
    ("topk", 2.5, TypeError, "SpinConfig.topk"),
    ("seed", -1, ValueError, "SpinConfig.seed"),
    ("seed", 1.7, TypeError, "^SpinConfig.seed: expected an int, got float 1.7$"),
    ("seed", True, TypeError, "SpinConfig.seed"),
    ("hybrid", "0.3", TypeError, "SpinConfig.hybrid"),
    ("diagonal_window", 8192.0, TypeError, "SpinConfig.diagonal_window"),
    ("diagonal_window", 0, ValueError, "SpinConfig.diagonal_window"),
    ("dense_below", "off", ValueError, "SpinConfig.dense_below: expected an int >= 0 or 'auto'"),
    ("dense_below", None, TypeError, "SpinConfig.dense_below: expected an int >= 0 or 'auto'"),
    ("pooling", None, TypeError, "SpinConfig.pooling: expected a Pooling or one of a0, a1, a2"),
    ("tokens_per_block", 0, ValueError, "SpinConfig.tokens_per_block"),
    ("pooling", "a3", ValueError, "a0, a1, a2"),
    ("exploration", "greedy", ValueError, "none, random, staleness, block_age"),
    ("mtp", "row1", ValueError, "row0, row-local"),
    ("state_dtype", torch.int8, TypeError, "SpinConfig.state_dtype"),
])
def test_every_field_is_validated(field, value, exc, words):
    with pytest.raises(exc, match=words):
        dataclasses.replace(PRESETS["paper"], **{field: value})


def test_numbers_are_stored_exactly_and_json_round_trips():
    cfg = SpinConfig(sparsity=0, gamma=0, hybrid=1, alpha=1, diagonal_window=None, dense_below="auto")
    assert all(type(getattr(cfg, f)) is float for f in ("sparsity", "gamma", "hybrid", "alpha"))
    assert cfg.diagonal_window is None and cfg.guard_tokens > 0
    assert json.loads(cfg.to_json())["sparsity"] == 0.0
    assert dataclasses.replace(cfg) == cfg and hash(cfg) == hash(dataclasses.replace(cfg))
