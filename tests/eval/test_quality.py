"""Quality runner: config names, Wilson interval, RULER string-match scoring, the runner on a tiny
random-weight Llama (oracle indexer), MTP self-speculation and the summary rows."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_llama
from spin_indexer.eval import quality as q
from spin_indexer.model.ruler import score_answer


# -- config names ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name, kind, s, exp, n", [
    ("dense", "dense", 0.0, True, 1), ("all-keep", "all-keep", 0.0, True, 1), ("spin-0.3", "spin", 0.3, True, 1),
    ("spin-0.5-noexp", "spin", 0.5, False, 1), ("mtp3-spin-0.4", "spin", 0.4, True, 3),
    ("mtp2-all-keep", "all-keep", 0.0, True, 2), ("spin-.25", "spin", 0.25, True, 1)])
def test_parse_config(name, kind, s, exp, n):
    c = q.parse_config(name)
    assert (c.name, c.kind, c.sparsity, c.exploration, c.next_n) == (name, kind, s, exp, n)


@pytest.mark.parametrize("name, grain, exp, n", [
    ("spin-0.4-block", "block", True, 1), ("spin-0.3-noexp-block", "block", False, 1),
    ("mtp3-spin-0.4-block", "block", True, 3), ("spin-0.4", "slot", True, 1)])
def test_parse_block_grain_configs(name, grain, exp, n):
    c = q.parse_config(name)
    cfg = c.spin_config(512, 0)
    assert (cfg.vertical_grain.value, c.exploration, c.next_n, cfg.sparsity) == (grain, exp, n, c.sparsity)


@pytest.mark.parametrize("bad", ["spin", "spin-1.0", "spin-1.5", "mtp3-dense", "mtp1-all-keep", "mtp9-all-keep",
                                 "allkeep", "spin-0.3-explore", "", None, 3, "spin-0.4-sum0.5-block",
                                 "spin-0.4-block-noexp", "all-keep-block"])
def test_parse_config_rejects(bad):
    with pytest.raises(ValueError, match="config"):
        q.parse_config(bad)


@pytest.mark.parametrize("name, s, exp, n, w, target", [
    ("spin-0.4-hybrid0.3", 0.4, True, 1, 0.3, None), ("spin-0.3-hybrid1-noexp", 0.3, False, 1, 1.0, None),
    ("mtp3-spin-0.4-hybrid.6", 0.4, True, 3, 0.6, None), ("adaptive-0.1", 0.2, True, 1, 0.0, 0.1),
    ("mtp2-adaptive-0.05", 0.2, True, 2, 0.0, 0.05), ("adaptive-0", 0.2, True, 1, 0.0, 0.0)])
def test_parse_beyond_paper_configs(name, s, exp, n, w, target):
    """hybrid / adaptive names map onto the SpinConfig the runner builds (start sparsity from PRESETS)."""
    from spin_indexer.predictor.config import PRESETS

    c = q.parse_config(name)
    assert (c.kind, c.sparsity, c.exploration, c.next_n, c.hybrid, c.adaptive) == ("spin", s, exp, n, w, target)
    sc = c.spin_config(topk=64, seed=3)
    assert (sc.sparsity, sc.hybrid, sc.topk, sc.seed, sc.gamma) == (s, w, 64, 3, 0.05 if exp else 0.0)
    if target is None:
        assert sc.adaptive is None
    else:
        assert sc.adaptive.target_miss == target and sc.adaptive.menu == PRESETS["adaptive"].adaptive.menu
        assert s == PRESETS["adaptive"].sparsity


@pytest.mark.parametrize("bad", ["spin-0.4-hybrid", "spin-0.4-hybrid1.5", "spin-0.4-noexp-hybrid0.3", "adaptive",
                                 "adaptive-1.2", "adaptive-0.1-noexp", "mtp1-adaptive-0.1", "hybrid0.3"])
def test_parse_beyond_paper_rejects(bad):
    with pytest.raises(ValueError, match=r"config.*spin-<s>-hybrid<w>.*adaptive-<t>"):
        q.parse_config(bad)


@pytest.mark.parametrize("s", [0.3, 0.4])
def test_policy_configs_are_the_policies_and_the_long_names_the_runs_used(s):
    """<policy>@<s> runs get_policy's SpinConfig. spin-layers-mix@s is exactly the long name the committed 4K quality
    runs decoded (spin-<s>-sum0.8x16b6k-quiet-profile with the shipped profile from 6144 at half strength below), and
    spin-default@s exactly spin-<s>: the demo's configs are the evaluated ones."""
    import dataclasses

    from spin_indexer.predictor import policies

    mix = q.parse_config(f"spin-layers-mix@{s:g}")
    assert (mix.kind, mix.sparsity, mix.summary, mix.policy) == ("spin", s, 0.8, "spin-layers-mix")
    assert mix.spin_config(512, 7) == policies.get_policy("spin-layers-mix", s, 512, 7)
    long = q.parse_config(f"spin-{s:g}-sum0.8x16b6k-quiet-profile")
    profile = policies.profile_at(policies.load_profiles(policies.SHIPPED_PROFILES), s, "shipped")
    long = dataclasses.replace(long, sparsity_profile=profile, profile_from=6144, short_profile_strength=0.5)
    assert mix.spin_config(512, 7) == long.spin_config(512, 7)
    assert q.parse_config(f"spin-default@{s:g}").spin_config(256, 3) == q.parse_config(f"spin-{s:g}").spin_config(256, 3)
    assert q.parse_config(f"explore-none@{s:g}").exploration is False


@pytest.mark.parametrize("bad, needle", [
    ("nope@0.3", "policy: expected one of"), ("spin-layers-mix@0.35", "no profile calibrated at sparsity 0.35"),
    ("spin-default@1.5", "sparsity"), ("spin-default@", "sparsity"), ("spin-default@0.3@0.4", "policy"),
    ("@0.3", "policy")])
def test_policy_configs_reject(bad, needle):
    with pytest.raises(ValueError, match=needle):
        q.parse_config(bad)


def test_summary_policy_needs_the_lightning_head():
    with pytest.raises(ValueError, match="spin-layers-mix@0.4.*expected mode 'lightning'"):
        q.check_configs_for_mode([q.parse_config("spin-layers-mix@0.4")], "oracle")
    q.check_configs_for_mode([q.parse_config("spin-layers@0.4")], "oracle")  # no summaries: any indexer


def test_default_configs_parse():
    names = [q.parse_config(c).name for c in q.DEFAULT_CONFIGS]
    assert len(set(names)) == len(names) and "dense" in names and any(q.parse_config(c).next_n > 1 for c in names)


# -- Wilson interval -----------------------------------------------------------------------------
def test_wilson_hand_cases():
    # p = 0.5, n = 10: centre 0.5, half-width z*sqrt(0.025 + z^2/400)/(1 + z^2/10) -> [0.2366, 0.7634]
    lo, hi = q.wilson_interval(0.5, 10)
    assert lo == pytest.approx(0.23659, abs=1e-4) and hi == pytest.approx(0.76341, abs=1e-4)
    lo, hi = q.wilson_interval(1.0, 10)  # all correct: the interval is not degenerate
    assert lo == pytest.approx(0.72246, abs=1e-4) and hi == pytest.approx(1.0)
    lo, hi = q.wilson_interval(0.0, 5)
    assert lo == 0.0 and hi == pytest.approx(0.43448, abs=1e-4)
    assert all(math.isnan(v) for v in q.wilson_interval(0.3, 0))


def test_wilson_contains_p_and_shrinks():
    for p in (0.0, 0.1, 0.37, 0.9, 1.0):
        widths = []
        for n in (1, 4, 20, 200):
            lo, hi = q.wilson_interval(p, n)
            assert lo <= p <= hi
            widths.append(hi - lo)
        assert widths == sorted(widths, reverse=True)


@pytest.mark.parametrize("p, n", [(1.2, 5), (-0.1, 5), (0.5, -1), (0.5, 2.5)])
def test_wilson_rejects(p, n):
    with pytest.raises((ValueError, TypeError)):
        q.wilson_interval(p, n)


# -- RULER scoring -------------------------------------------------------------------------------
def test_string_match_scoring():
    assert score_answer("niah_single_1", "The number is: 8056020.", ["8056020"]) == 1.0
    assert score_answer("niah_single_1", "The number is: 805602.", ["8056020"]) == 0.0
    assert score_answer("niah_multivalue", "1, 2 and 4", ["1", "2", "3", "4"]) == 0.75
    assert score_answer("cwe", "APPLE banana", ["apple", "Banana", "cherry"]) == pytest.approx(2 / 3)
    assert score_answer("vt", "anything", []) == 0.0


def test_summarize_cells():
    def row(task, cfg, score, miss=None, spars=float("nan"), acc=float("nan")):
        return {"task": task, "context": 4096, "config": cfg, "score": score, "steps": 3, "sparsity": spars,
                "acceptance": acc, "miss_values": None if miss is None else torch.tensor(miss)}
    rows = q.summarize([row("a", "dense", 1.0), row("a", "dense", 0.0), row("a", "spin-0.4", 0.5, [0.0, 0.5], 0.4),
                        row("a", "spin-0.4", 1.0, [0.25], 0.38), row("a", "all-keep", 1.0),
                        row("a", "mtp3-all-keep", 1.0, acc=2.5), row("a", "mtp3-all-keep", 1.0, acc=3.0)])
    by = {r["config"]: r for r in rows}
    assert by["dense"]["samples"] == 2 and by["dense"]["score"] == 50.0 and math.isnan(by["dense"]["mean_miss"])
    lo, hi = q.wilson_interval(0.5, 2)
    assert (by["dense"]["ci_low"], by["dense"]["ci_high"]) == pytest.approx((100 * lo, 100 * hi))
    assert by["spin-0.4"]["score"] == 75.0
    assert by["spin-0.4"]["mean_miss"] == pytest.approx(0.25) and by["spin-0.4"]["p99_miss"] == 0.5
    assert by["spin-0.4"]["sparsity"] == pytest.approx(0.39)
    assert by["all-keep"]["mean_miss"] == 0.0 and by["all-keep"]["p99_miss"] == 0.0
    assert by["mtp3-all-keep"]["acceptance"] == pytest.approx(2.75)


# -- the runner on a tiny random Llama -----------------------------------------------------------
def _tiny(seed=0):
    return tiny_llama(max_len=1024, seed=seed)


def _text(ids):
    return " ".join(f"t{i}" for i in ids)


def _prompt(seed, length=700, answers=("t999",), max_new=6):
    g = torch.Generator().manual_seed(seed)
    return q.Prompt("niah_single_1", length, seed, torch.randint(0, 40, (length,), generator=g), list(answers),
                    max_new)


def _score(text, answers):
    return sum(a in text.split() for a in answers) / len(answers)


def test_runner_tiny_model():
    model = _tiny()
    runner = q.QualityRunner(model, _text, mode="oracle", k=64, seed=0)
    names = ["dense", "all-keep", "spin-0.5", "spin-0.5-noexp", "mtp3-all-keep", "mtp2-spin-0.3"]
    configs = [q.parse_config(c) for c in names]
    seen = []
    rows = runner.run(_prompt(1), configs, _score, on_config=seen.append)
    assert [r["config"] for r in rows] == names and sorted(seen) == sorted(names)
    by = {r["config"]: r for r in rows}
    for r in rows:  # no answer can be produced ("t999" is out of vocabulary): the full budget is decoded
        assert r["tokens"] == 6 and r["score"] == 0.0 and r["text"].startswith("t")
    # the MTP verifier with all-keep reproduces the all-keep greedy output and accepts its own drafts
    assert by["mtp3-all-keep"]["text"] == by["all-keep"]["text"]
    assert by["mtp3-all-keep"]["acceptance"] == pytest.approx(3.0) or by["mtp3-all-keep"]["tokens"] < 6
    assert 1.0 <= by["mtp2-spin-0.3"]["acceptance"] <= 2.0
    for name in ("spin-0.5", "spin-0.5-noexp", "mtp2-spin-0.3"):
        r = by[name]
        assert r["miss_rows"] > 0 and 0.0 <= r["mean_miss"] <= r["p99_miss"] <= 1.0
        assert 0.05 < r["sparsity"] < 0.55  # the first step scores every block (no history yet)
        assert r["miss_values"].numel() == r["miss_rows"] and r["grid"]
    assert math.isnan(by["dense"]["mean_miss"]) and by["all-keep"]["mean_miss"] == 0.0


def test_mtp_policy_configs_decode_as_the_long_name_with_the_same_rows():
    """mtp<N>-<policy>@<s>: the policy's SpinConfig at N rows a step; on the tiny model it decodes exactly as the
    long name of the same SpinConfig with the same prefix (mtp2-spin-default@0.3 is mtp2-spin-0.3)."""
    policy = q.parse_config("mtp2-spin-default@0.3")
    assert (policy.kind, policy.sparsity, policy.next_n, policy.policy) == ("spin", 0.3, 2, "spin-default")
    assert q.parse_config("mtp3-spin-layers-mix@0.4").next_n == 3 and q.parse_config("spin-default@0.3").next_n == 1
    assert policy.spin_config(64, 0) == q.parse_config("mtp2-spin-0.3").spin_config(64, 0)
    runner = q.QualityRunner(_tiny(), _text, mode="oracle", k=64, seed=0)
    rows = runner.run(_prompt(1), [policy, q.parse_config("mtp2-spin-0.3")], _score)
    assert rows[0]["text"] == rows[1]["text"] and rows[0]["acceptance"] == rows[1]["acceptance"]
    assert torch.equal(rows[0]["miss_values"], rows[1]["miss_values"])


@pytest.mark.parametrize("bad, needle", [("mtp1-spin-default@0.3", "policy: expected one of"),
                                         ("mtp9-spin-default@0.3", "policy: expected one of"),
                                         ("mtp2-nope@0.3", "policy: expected one of")])
def test_mtp_policy_configs_reject(bad, needle):
    with pytest.raises(ValueError, match=needle):
        q.parse_config(bad)


def test_runner_miss_is_the_dense_topk_outside_kept_blocks():
    """spin-0.0 keeps every block: zero miss; the same output as all-keep (same top-k each step)."""
    runner = q.QualityRunner(_tiny(1), _text, mode="oracle", k=64)
    rows = runner.run(_prompt(2), [q.parse_config("all-keep"), q.parse_config("spin-0")], _score)
    assert rows[1]["miss_rows"] > 0 and rows[1]["mean_miss"] == 0.0 and rows[1]["p99_miss"] == 0.0
    assert rows[1]["text"] == rows[0]["text"]


def test_runner_stops_once_every_answer_is_found():
    model = _tiny(2)
    runner = q.QualityRunner(model, _text, mode="oracle", k=64)
    first = runner.run(_prompt(3, max_new=8), [q.parse_config("dense")], _score)[0]["text"].split()
    rows = runner.run(_prompt(3, answers=(first[1],), max_new=8), [q.parse_config("dense")], _score)
    assert rows[0]["score"] == 1.0 and rows[0]["text"].split() == first[:2]  # stopped after the 2nd token
    eos = runner.run(_prompt(3, max_new=8), [q.parse_config("dense")], _score)
    runner.eos_id = int(first[2][1:])
    cut = runner.run(_prompt(3, max_new=8), [q.parse_config("dense")], _score)[0]
    assert cut["text"].split() == first[:first.index(first[2])] and eos[0]["tokens"] == 8


def test_runner_rejects_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        q.QualityRunner(_tiny(), _text, mode="dense")
    with pytest.raises(ValueError, match="indexer"):
        q.QualityRunner(_tiny(), _text, mode="lightning")


def test_runner_block_records_and_step_callback():
    """record_blocks keeps (keep mask, dense top-k per block); misses counted from it equal the recorded miss."""
    runner = q.QualityRunner(_tiny(3), _text, mode="oracle", k=64, record_blocks=True, stop_when_scored=False)
    steps = []
    runner.on_step = steps.append
    answers = ("t1", "t2", "t3")  # would stop early with stop_when_scored=True
    row = runner.run(_prompt(4, answers=answers, max_new=5), [q.parse_config("spin-0.4-noexp")],
                     lambda t, a: 1.0)[0]
    assert row["tokens"] == 5 and steps == ["spin-0.4-noexp"] * 4
    assert set(row["blocks"]) == set(row["grid"]) and len(row["blocks"]) == 4 * 2  # steps x layers
    for (step, layer), (keep, hits) in row["blocks"].items():
        assert hits.sum() == 64 and keep.dtype == torch.bool
        assert float(hits[~keep].sum()) / 64 == pytest.approx(row["grid"][(step, layer)], abs=1e-6)


def test_runner_adaptive_and_hybrid():
    """adaptive-<t> moves its budget off the start (0.2) both ways; spin-0.4-hybrid0 is spin-0.4 exactly and a
    nonzero weight changes the plans; every miss stays in [0, 1] and the summary keeps the realized sparsity."""
    runner = q.QualityRunner(_tiny(5), _text, mode="oracle", k=64, seed=0, stop_when_scored=False)
    names = ["spin-0.2", "adaptive-1", "adaptive-0", "spin-0.4", "spin-0.4-hybrid0", "spin-0.4-hybrid1"]
    rows = runner.run(_prompt(6, length=900, max_new=24), [q.parse_config(c) for c in names], _score)
    by = {r["config"]: r for r in rows}
    for r in rows:
        assert r["tokens"] == 24 and r["miss_rows"] > 0 and r["miss_values"].numel() == r["miss_rows"]
        assert 0.0 <= r["miss_values"].min() and r["miss_values"].max() <= 1.0
        assert 0.0 <= r["mean_miss"] <= r["p99_miss"] <= 1.0 and 0.0 <= r["sparsity"] < 1.0
    start = by["spin-0.2"]["sparsity"]
    assert by["adaptive-1"]["sparsity"] > start + 0.03  # every audit is quiet: climbs the menu
    assert by["adaptive-0"]["sparsity"] < start - 0.05  # any miss is over target: falls to dense
    same, other = by["spin-0.4-hybrid0"], by["spin-0.4-hybrid1"]
    assert same["text"] == by["spin-0.4"]["text"] and torch.equal(same["miss_values"], by["spin-0.4"]["miss_values"])
    assert not torch.equal(other["miss_values"], by["spin-0.4"]["miss_values"])
    cells = {c["config"]: c for c in q.summarize([dict(r, task="t", context=900) for r in rows])}
    for name in names:
        assert cells[name]["sparsity"] == pytest.approx(by[name]["sparsity"])
        assert cells[name]["mean_miss"] == pytest.approx(by[name]["mean_miss"])


def test_profile_configs_take_the_runs_profile():
    """spin-<s>[...]-profile parses (the runner's profile set later); a flat profile is the uniform config exactly,
    a skewed one changes the plans at the same mean sparsity."""
    import dataclasses

    c = q.parse_config("spin-0.4-noexp-profile")
    assert (c.sparsity, c.exploration, c.profiled, c.sparsity_profile) == (0.4, False, True, ())
    assert not q.parse_config("spin-0.4").profiled
    with pytest.raises(ValueError, match="config"):
        q.parse_config("spin-0.4-profile-noexp")
    model = _tiny(5)
    layers = model.cfg.num_layers
    runner = q.QualityRunner(model, _text, mode="oracle", k=64, seed=0, stop_when_scored=False)
    skew = tuple(1.5 if i % 2 else 0.5 for i in range(layers))
    configs = [q.parse_config("spin-0.4"),
               dataclasses.replace(q.parse_config("spin-0.4-profile"), sparsity_profile=(1.0,) * layers),
               dataclasses.replace(q.parse_config("spin-0.4-profile"), name="skew", sparsity_profile=skew)]
    assert configs[2].spin_config(64, 0).sparsity_profile == skew
    assert dataclasses.replace(configs[2], profile_from=900).spin_config(64, 0).profile_from == 900
    assert dataclasses.replace(configs[2], short_profile_strength=0.5).spin_config(64, 0).short_profile_strength == 0.5
    by = {r["config"]: r for r in runner.run(_prompt(6, length=900, max_new=24), configs, _score)}
    flat, uniform, skewed = by["spin-0.4-profile"], by["spin-0.4"], by["skew"]
    assert flat["text"] == uniform["text"] and torch.equal(flat["miss_values"], uniform["miss_values"])
    assert not torch.equal(skewed["miss_values"], uniform["miss_values"])
