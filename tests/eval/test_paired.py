"""eval/paired.py: the paired difference of two configs' RULER scores, its 95% interval and issue #18's verdict."""
from __future__ import annotations

import math
import statistics

from spin_indexer.eval.paired import ISSUE_BOUNDS, PairedDiff, issue_bound, paired_diff, paired_diffs, verdict


def test_paired_diff_is_the_mean_with_a_normal_interval():
    diffs = [0.0, 100.0, 0.0, 0.0, -50.0, 0.0, 0.0, 100.0]
    mean, lo, hi = paired_diff(diffs)
    half = 1.959964 * statistics.stdev(diffs) / math.sqrt(len(diffs))
    assert mean == statistics.fmean(diffs) and math.isclose(lo, mean - half) and math.isclose(hi, mean + half)
    assert paired_diff([5.0, 5.0, 5.0]) == (5.0, 5.0, 5.0)  # no spread: a point interval
    one = paired_diff([3.0])
    assert one[0] == 3.0 and math.isnan(one[1]) and math.isnan(one[2])
    assert all(math.isnan(v) for v in paired_diff([]))


def test_verdict_checks_the_whole_interval_against_the_bound():
    assert verdict(PairedDiff(102, 0.98, -0.94, 2.90), 1.0) == "not worse"  # this session's 8K spin-0.3
    assert verdict(PairedDiff(102, 1.76, -0.97, 4.50), 2.0) == "not worse"  # 8K spin-0.4
    assert verdict(PairedDiff(102, 0.0, -0.7, 0.7), 1.0) == "within"
    assert verdict(PairedDiff(102, -0.8, -3.9, 2.3), 1.0) == "no"  # 4K spin-0.3: may lose more than 1 point
    assert verdict(PairedDiff(1, 0.0, math.nan, math.nan), 1.0) == "-"
    assert ISSUE_BOUNDS == {"spin-0.3": 1.0, "spin-0.4": 2.0, "spin-0.3-profile": 1.0, "spin-0.4-profile": 2.0,
                            "spin-0.3-sum0.8x16b6k-quiet-profile": 1.0, "spin-0.4-sum0.8x16b6k-quiet-profile": 2.0}


def test_issue_bound_covers_named_policies_at_the_bounded_sparsities():
    assert issue_bound("spin-0.3") == 1.0 and issue_bound("spin-0.4-profile") == 2.0
    assert issue_bound("spin-layers-mix@0.3") == 1.0 and issue_bound("spin-default@0.4") == 2.0
    assert issue_bound("spin-layers-mix@0.5") is None  # #18 bounds 30% and 40% only
    assert issue_bound("mtp3-spin-layers-mix@0.3") is None  # nor MTP configs (one row a step)
    assert issue_bound("spin-0.5") is None and issue_bound("all-keep") is None and issue_bound("dense") is None
    assert issue_bound("@0.3") is None and issue_bound("spin-layers-mix@x") is None


def test_paired_diffs_pair_by_prompt_within_each_bin():
    def s(task, ctx, seed, cfg, score, text="x"):
        return {"task": task, "context": ctx, "seed": seed, "config": cfg, "score": score, "text": text}
    samples = [s("vt", 4096, 0, "all-keep", 1.0), s("vt", 4096, 0, "spin-0.3", 0.0, "y"),
               s("vt", 4096, 1, "all-keep", 0.0), s("vt", 4096, 1, "spin-0.3", 0.0),
               s("niah", 4096, 0, "all-keep", 0.5), s("niah", 4096, 0, "spin-0.3", 1.0, "z"),
               s("vt", 8192, 0, "all-keep", 1.0), s("vt", 8192, 0, "dense", 1.0),
               s("vt", 8192, 1, "dense", 1.0)]  # no all-keep for seed 1 at 8K: not paired
    out = paired_diffs(samples, ["dense", "all-keep", "spin-0.3"])
    assert [(c, n) for c, n, _ in out] == [("spin-0.3", 4096), ("dense", 8192)]
    d = out[0][2]
    assert (d.n, d.same, d.better, d.worse) == (3, 1, 1, 1) and math.isclose(d.mean, (-100 + 0 + 50) / 3)
    assert out[1][2].n == 1 and out[1][2].mean == 0.0 and math.isnan(out[1][2].lo)
