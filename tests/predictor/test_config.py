import dataclasses
import json

import pytest
import torch

from spin_indexer.predictor import PRESETS, Exploration, Pooling, SpinConfig


def test_defaults_are_the_papers():
    cfg = PRESETS["paper"]
    assert cfg.alpha == 0.5 and cfg.gamma == 0.05 and cfg.exploration is Exploration.RANDOM
    assert cfg.pooling is Pooling.A1 and cfg.reduce.value == "max" and cfg.tokens_per_block == 64


def test_defaults_are_the_papers_but_the_vertical_history_a_block():
    """SpinConfig() keeps one EMA a block ("auto" resolves to block for the paper's A1-Max rule); the paper preset
    and evaluation's policies keep the paper's per-slot table."""
    from spin_indexer.predictor.policies import get_policy
    from spin_indexer.predictor.config import Grain
    assert SpinConfig().vertical_grain is Grain.AUTO and SpinConfig().grain is Grain.BLOCK
    assert PRESETS["paper"].grain is Grain.SLOT and get_policy("spin-default", 0.3).grain is Grain.SLOT
    assert get_policy("vertical-block", 0.3).grain is Grain.BLOCK and PRESETS["serving"].grain is Grain.BLOCK


@pytest.mark.parametrize("changes, grain", [
    ({}, "block"), ({"pooling": "a2"}, "block"), ({"combine": "vertical"}, "block"), ({"combine": "diagonal"}, "block"),
    ({"reduce": "mean"}, "slot"), ({"reduce": "top4"}, "slot"), ({"combine": "sum"}, "slot"),
    ({"summary": 0.5}, "slot"), ({"pooling": "a0"}, "slot"), ({"vertical_grain": "slot"}, "slot"),
    ({"vertical_grain": "block", "pooling": "a0"}, "block")])
def test_auto_grain_takes_slots_only_where_the_rule_reads_them(changes, grain):
    cfg = SpinConfig(**changes)
    assert cfg.grain.value == grain
    # replace() keeps "auto" (not the grain it resolved to), so a rule changed later resolves again
    assert dataclasses.replace(SpinConfig(), **changes).grain.value == grain
    assert json.loads(cfg.to_json())["vertical_grain"] == changes.get("vertical_grain", "auto")


def test_block_grain_with_a_rule_reading_slots_is_refused():
    with pytest.raises(ValueError, match="SpinConfig.vertical_grain: 'block' keeps no per-slot history.*reduce='mean'"):
        SpinConfig(vertical_grain="block", reduce="mean")
    with pytest.raises(ValueError, match="vertical_grain"):
        dataclasses.replace(SpinConfig(vertical_grain="block"), combine="sum")


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
