"""Every config field refuses a value of the wrong type with an error naming the field.

One table per config class: field -> its kind. Each kind brings its wrong-type values (str for a number,
bool where a bool is not the type, float where an int is, None where the field is not optional), which
must raise TypeError; out-of-range or unknown values raise ValueError; the values of every accepted type
still construct, normalized to the field's exact type. `test_tables_cover_every_field` keeps the tables in
step with the dataclasses. The vLLM settings' environment parsing is tested here too: it needs no vLLM.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spin_indexer.checks import check_bool, check_float, check_int
from spin_indexer.indexer.c4a import C4AConfig, C4AIndexer
from spin_indexer.integrations import settings as vs
from spin_indexer.predictor import Exploration, Pooling, SpinConfig
from spin_indexer.predictor.config import Grain
from spin_indexer.predictor.adaptive import AdaptiveConfig

# kind -> (wrong-type values: TypeError, bad values of the right type: ValueError)
WRONG = {
    "float01": (["0.3", True, None, torch.tensor(0.3), [0.3]], [-0.1, 1.5, float("nan")]),
    "int": (["8", True, False, 8.0, 1.7, None], [-1]),
    "bool": (["false", "no", "True", 0, 1, None], []),
    "enum": ([1, None, True, 0.5], ["bogus", "A1"]),
    "choice": ([1, None, True], ["bogus"]),
    "opt_int": (["8", True, 8.0], [0]),
    "opt_float01": (["0.1", True, False], [1.5]),
    "opt_choice": ([1, True, 0.5], ["bogus"]),
    "dense_below": ([1.0, True, None, 16384.0], ["off", "AUTO", -1]),
    "state_dtype": (["float16", None, torch.int8, 2], []),
    "adaptive": ([{"target_miss": 0.1}, True, "adaptive", 0.1], []),
    "float_seq": (["0.1", None, 0.1, ("a",), (True,), (None,), (0.0, "0.2")], [(), (0.2, 0.1), (0.0, 1.0)]),
    "int_seq": ([None, 2, "02", (0.5, 2), (True, 2), ("0", 2), (0, 2.0)], [(), (2, 0), (0, 0)]),
    "pair_seq": ([None, 3, (3, 2), ((3, 0.5),), ((3, "2"),), ((True, 2),)], [((3,),), ((3, 2, 1),)]),
    # SpinConfig.sparsity_profile at the default sparsity 0.3: an entry of 4 asks to skip 120% of the blocks
    "profile": (["0.5", None, 0.5, ("a",), (True,), (None,), (1.0, "0.2")],
                [(-0.1,), (float("nan"),), (float("inf"),), (1.0, 4.0)]),
    # SpinVllmSettings.sparsity_profile: a calibrate output's path, read at construction
    "profile_path": ([3, True, b"p.json", ("p.json",)], ["", "/no/such/profile.json"]),
}
SHIPPED_PROFILE = str(Path(__file__).resolve().parents[1] / "src" / "spin_indexer" / "weights" /
                      "smollm2_indexer.profile.json")  # has a profile at SpinVllmSettings' default sparsity 0.3

# config class -> (build(**changes), {field: kind}, {field: valid values, one per accepted type})
SPIN = {
    "sparsity": "float01", "topk": "int", "alpha": "float01", "exploration": "enum", "gamma": "float01",
    "pooling": "enum", "reduce": "enum", "combine": "enum", "mtp": "enum", "seed": "int",
    "tokens_per_block": "int", "state_dtype": "state_dtype", "adaptive": "adaptive", "hybrid": "float01",
    "summary": "float01", "summary_parts": "int", "summary_below": "int", "summary_explores": "bool",
    "sparsity_profile": "profile",
    "profile_from": "int", "short_profile_strength": "float01", "diagonal_window": "opt_int",
    "dense_below": "dense_below", "dense_batch_below": "dense_below", "vertical_grain": "enum",
}
SPIN_OK = {
    "sparsity": [0, 0.0, 0.5], "topk": [1, 2048], "alpha": [1, 0.25], "exploration": [Exploration.NONE, "staleness"],
    "gamma": [0, 0.1], "pooling": [Pooling.A2, "a0"], "reduce": ["top4"], "combine": ["vertical"],
    "mtp": ["row-local"], "seed": [0, 2**31 - 1], "tokens_per_block": [32], "state_dtype": [torch.bfloat16],
    "adaptive": [None, AdaptiveConfig()], "hybrid": [0, 1, 0.3], "summary": [0, 1, 0.5], "summary_parts": [1, 8, 64],
    "summary_below": [0, 32768], "summary_explores": [True, False], "sparsity_profile": [(), (1.0, 0.5), [1, 2]],
    "profile_from": [0, 8192], "short_profile_strength": [0, 1, 0.5],
    "diagonal_window": [None, 1, 8192],
    "dense_below": [0, 3000, "auto"], "dense_batch_below": [0, 1 << 21, "auto"], "vertical_grain": ["slot", "block"],
}
ADAPTIVE = {"target_miss": "float01", "menu": "float_seq", "audit_every": "int", "raise_below": "float01",
            "patience": "int", "probe": "bool", "controller": "choice", "decay": "float01"}
ADAPTIVE_OK = {"target_miss": [0, 0.05, 1], "menu": [(0.0, 0.5), [0, 0.25]], "audit_every": [2, 16],
               "raise_below": [0.5, 1], "patience": [1, 3], "probe": [True, False], "controller": ["step", "curve"],
               "decay": [0, 0.9]}
C4A = {"num_layers": "int", "indexer_layers": "int_seq", "reuse": "pair_seq", "ratio": "int", "window": "int"}
C4A_OK = {"num_layers": [6, 61], "indexer_layers": [(0, 2), [0, 2, 4]], "reuse": [(), ((3, 2),), [[3, 2], [5, 0]]],
          "ratio": [1, 4], "window": [0, 128]}
VLLM = {"enable": "bool", "sparsity": "float01", "policy": "choice", "exploration": "opt_choice",
        "gamma": "opt_float01", "seed": "int", "mtp": "choice", "shadow": "bool", "sparsity_profile": "profile_path",
        "profile_from": "int", "vertical_grain": "choice"}
VLLM_OK = {"enable": [True, False], "sparsity": [0, 0.4], "policy": ["spin-default", "a1-mean"],
           "exploration": [None, "none", "block_age"], "gamma": [None, 0, 0.05], "seed": [0, 7],
           "mtp": ["row0", "row-local"], "shadow": [True, False], "sparsity_profile": [None, SHIPPED_PROFILE],
           "profile_from": [0, 6144], "vertical_grain": ["auto", "slot", "block"]}

CONFIGS = {
    "SpinConfig": (SpinConfig, SPIN, SPIN_OK),
    "AdaptiveConfig": (AdaptiveConfig, ADAPTIVE, ADAPTIVE_OK),
    "C4AConfig": (lambda **kw: C4AConfig(**{"num_layers": 6, "indexer_layers": (0, 2), **kw}), C4A, C4A_OK),
    "SpinVllmSettings": (vs.SpinVllmSettings, VLLM, VLLM_OK),
}
CLASSES = {"SpinConfig": SpinConfig, "AdaptiveConfig": AdaptiveConfig, "C4AConfig": C4AConfig,
           "SpinVllmSettings": vs.SpinVllmSettings}
# A field's exact type once accepted (ints given to float fields come back as float, lists as tuples).
NORMAL = {"float01": float, "int": int, "bool": bool, "opt_int": (int, type(None)),
          "opt_float01": (float, type(None)), "float_seq": tuple, "profile": tuple, "int_seq": tuple, "pair_seq": tuple}


def _cases(bad: int):
    for cls, (_, table, _) in CONFIGS.items():
        for field, kind in table.items():
            for value in WRONG[kind][bad]:
                yield pytest.param(cls, field, value, id=f"{cls}.{field}={value!r}")


def _raises(exc, cls: str, field: str, **changes):
    build = CONFIGS[cls][0]
    # the message starts with the field's name (a sequence item adds its index: AdaptiveConfig.menu[0])
    with pytest.raises(exc, match=rf"^{re.escape(cls)}\.{field}\b") as info:
        build(**changes)
    return str(info.value)


def test_tables_cover_every_field():
    for cls, (_, table, ok) in CONFIGS.items():
        names = [f.name for f in dataclasses.fields(CLASSES[cls])]
        assert sorted(table) == sorted(names) == sorted(ok), cls


@pytest.mark.parametrize("cls, field, value", list(_cases(0)))
def test_wrong_type_is_a_type_error_naming_the_field(cls, field, value):
    _raises(TypeError, cls, field, **{field: value})


@pytest.mark.parametrize("cls, field, value", list(_cases(1)))
def test_bad_value_is_a_value_error_naming_the_field(cls, field, value):
    _raises(ValueError, cls, field, **{field: value})


@pytest.mark.parametrize("cls, field, value", [
    pytest.param(cls, field, value, id=f"{cls}.{field}={value!r}")
    for cls, (_, _, ok) in CONFIGS.items() for field, values in ok.items() for value in values])
def test_valid_values_of_every_accepted_type_still_work(cls, field, value):
    cfg = CONFIGS[cls][0](**{field: value})
    got = getattr(cfg, field)
    kind = CONFIGS[cls][1][field]
    if kind in NORMAL:
        assert isinstance(got, NORMAL[kind]) and not (kind != "bool" and isinstance(got, bool))
    if kind == "enum":
        assert got == value and isinstance(got, type(getattr(CLASSES[cls](), field)))
    elif isinstance(value, list):
        assert list(got) == [tuple(v) if isinstance(v, list) else v for v in value]
    else:
        assert got == value or (value is None and got is None)
    hash(cfg)  # frozen and hashable whatever sequence type was given
    assert dataclasses.replace(cfg) == cfg  # the normalized values pass the checks again


def test_the_house_message_form():
    assert _raises(TypeError, "SpinConfig", "seed", seed=1.7) == "SpinConfig.seed: expected an int, got float 1.7"
    assert _raises(TypeError, "SpinConfig", "sparsity", sparsity="0.3") == \
        "SpinConfig.sparsity: expected a float, got str '0.3'"
    assert _raises(TypeError, "AdaptiveConfig", "probe", probe="false") == \
        "AdaptiveConfig.probe: expected a bool, got str 'false'"
    assert _raises(TypeError, "C4AConfig", "indexer_layers", indexer_layers=(0.5, 2)) == \
        "C4AConfig.indexer_layers[0]: expected an int, got float 0.5"
    assert _raises(TypeError, "AdaptiveConfig", "menu", menu=("a",)).startswith("AdaptiveConfig.menu[0]: expected a float")
    assert _raises(ValueError, "SpinConfig", "alpha", alpha=0) == "SpinConfig.alpha: expected 0 < alpha <= 1, got 0.0"


def test_c4a_reuse_and_constructor_checks():
    _raises(ValueError, "C4AConfig", "reuse", reuse=((3, 2), (3, 0)))  # one layer, two sources
    _raises(ValueError, "C4AConfig", "reuse", reuse=((9, 2),))  # past num_layers
    with pytest.raises(TypeError, match="^spin: expected a SpinConfig"):
        C4AIndexer({"topk": 512}, C4AConfig(6, (0, 2)), max_batch=1, max_blocks=1)
    with pytest.raises(TypeError, match="^c4a: expected a C4AConfig"):
        C4AIndexer(SpinConfig(topk=512), {"num_layers": 6}, max_batch=1, max_blocks=1)


@pytest.mark.parametrize("check, value", [(check_int, True), (check_int, 2.0), (check_int, "2"),
                                          (check_float, True), (check_float, "0.5"), (check_float, None),
                                          (check_bool, 1), (check_bool, "true")])
def test_helpers_refuse_lookalikes(check, value):
    with pytest.raises(TypeError, match="^x: expected"):
        check("x", value)


# ------------------------------------------------------------------ vLLM settings: environment, additional_config
@pytest.mark.parametrize("text, want", [("1", True), ("0", False), ("true", True), ("FALSE", False),
                                        ("Yes", True), ("no", False), (" on ", True), ("Off", False)])
def test_env_bool_takes_explicit_spellings(text, want):
    assert vs.load_settings(None, {"SPIN_ENABLE": text}).enable is want


@pytest.mark.parametrize("text", ["", " ", "2", "-1", "y", "n", "t", "tru", "enabled", "none", "1.0"])
def test_env_bool_refuses_anything_else(text):
    with pytest.raises(ValueError, match="^SPIN_ENABLE: expected one of 1, true, yes, on, 0, false, no, off"):
        vs.load_settings(None, {"SPIN_ENABLE": text})


@given(st.text(max_size=6))
def test_env_bool_any_text_parses_or_names_the_variable(text):
    try:
        got = vs.load_settings(None, {"SPIN_ENABLE": text}).enable
    except ValueError as e:
        assert str(e).startswith("SPIN_ENABLE: ") and text.strip().lower() not in vs._TRUE + vs._FALSE
    else:
        assert got is (text.strip().lower() in vs._TRUE) and text.strip().lower() in vs._TRUE + vs._FALSE


@pytest.mark.parametrize("env, text, words", [
    ("SPIN_SPARSITY", "lots", "^SPIN_SPARSITY: expected a float, got 'lots'"),
    ("SPIN_SPARSITY", "1.5", r"^SpinVllmSettings.sparsity: expected 0 <= sparsity < 1, got 1.5 \(from SPIN_SPARSITY\)"),
    ("SPIN_SPARSITY", "nan", r"^SpinVllmSettings.sparsity: .*\(from SPIN_SPARSITY\)"),
    ("SPIN_GAMMA", "", "^SPIN_GAMMA: expected a float"),
    ("SPIN_SEED", "1.7", "^SPIN_SEED: expected an int, got '1.7'"),
    ("SPIN_SEED", "-3", r"^SpinVllmSettings.seed: .*\(from SPIN_SEED\)"),
    ("SPIN_POLICY", "nope", r"^SpinVllmSettings.policy: expected a policy, .*\(from SPIN_POLICY\)"),
    ("SPIN_EXPLORATION", "greedy", r"^SpinVllmSettings.exploration: .*\(from SPIN_EXPLORATION\)"),
    ("SPIN_VERTICAL_GRAIN", "token", r"^SpinVllmSettings.vertical_grain: expected one of .*\(from SPIN_VERTICAL_GRAIN\)"),
])
def test_env_values_name_the_variable(env, text, words):
    with pytest.raises(ValueError, match=words):
        vs.load_settings(None, {env: text})


def test_vertical_grain_resolves_against_the_policy_and_refuses_block_where_it_reads_slots():
    """SPIN_VERTICAL_GRAIN: "auto" (the default) is block grain for spin-default and slot grain for a rule that
    reads each slot's own V; "block" with such a rule is refused at start-up, naming the field, not at a layer."""
    assert vs.load_settings(None, {}).spin_config(512).grain is Grain.BLOCK
    assert vs.load_settings(None, {"SPIN_VERTICAL_GRAIN": "slot"}).spin_config(512).grain is Grain.SLOT
    assert vs.load_settings(None, {"SPIN_POLICY": "a1-mean"}).spin_config(512).grain is Grain.SLOT
    assert vs.load_settings({"spin": {"vertical_grain": "block"}}, {}).spin_config(512).grain is Grain.BLOCK
    with pytest.raises(ValueError, match=r"^SpinVllmSettings.vertical_grain: .*'block' keeps no per-slot history"):
        vs.load_settings(None, {"SPIN_POLICY": "a1-mean", "SPIN_VERTICAL_GRAIN": "block"})
    with pytest.raises(TypeError, match=r"^SpinVllmSettings.vertical_grain: expected a str"):
        vs.load_settings({"spin": {"vertical_grain": 1}}, {})


def test_env_numbers_and_names_parse():
    s = vs.load_settings(None, {"SPIN_ENABLE": "1", "SPIN_SPARSITY": " 0.4", "SPIN_GAMMA": "0", "SPIN_SEED": "7",
                                "SPIN_POLICY": "a1-mean", "SPIN_EXPLORATION": "staleness"})
    assert (s.enable, s.sparsity, s.gamma, s.seed, s.policy, s.exploration) == \
        (True, 0.4, 0.0, 7, "a1-mean", "staleness")
    cfg = s.spin_config(512)
    assert (cfg.sparsity, cfg.gamma, cfg.seed, cfg.exploration, cfg.reduce.value) == \
        (0.4, 0.0, 7, Exploration.STALENESS, "mean")


@pytest.mark.parametrize("key, value", [("enable", "true"), ("enable", 1), ("enable", None), ("sparsity", "0.4"),
                                        ("sparsity", True), ("gamma", "0.1"), ("seed", 2.0), ("seed", "3"),
                                        ("policy", None), ("exploration", 0), ("sparsity_profile", 3),
                                        ("profile_from", "6144")])
def test_additional_config_takes_json_types_only(key, value):
    where = re.escape(f"(from additional_config['spin']['{key}'])")
    with pytest.raises(TypeError, match=rf"^SpinVllmSettings\.{key}: .*{where}$"):
        vs.load_settings({"spin": {key: value}}, {})


def test_additional_config_shape_and_precedence():
    with pytest.raises(TypeError, match=r"^additional_config\['spin'\]: expected a mapping, got list"):
        vs.load_settings({"spin": [("enable", True)]}, {})
    with pytest.raises(ValueError, match="expected keys among"):
        vs.load_settings({"spin": {"sparsty": 0.3}}, {})
    # additional_config wins, even over a bad environment value it replaces
    s = vs.load_settings({"spin": {"enable": True, "gamma": None}}, {"SPIN_ENABLE": "maybe", "SPIN_GAMMA": "0.2"})
    assert s.enable is True and s.gamma is None
    assert vs.load_settings(object(), {}) == vs.SpinVllmSettings()  # a platform's own additional_config object
