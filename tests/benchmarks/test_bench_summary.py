"""benchmarks/bench_summary.py (the summary mix's kernels beside the dense logits) in a CPU dry run: the Triton
twins and the select launches run interpreted, the twins are checked against their references, and every row carries
its bytes and times."""
from __future__ import annotations

import json

import pytest

from conftest import run_benchmark_dry


@pytest.mark.interpreter
def test_dry_run_checks_the_kernels(tmp_path):
    pytest.importorskip("triton")
    from spin_indexer.ops.block_summary_triton import SCORE_TILES
    out = tmp_path / "summary.json"
    proc = run_benchmark_dry("bench_summary.py", ["--points", "2x512", "--parts", "4,16", "--score-tiles", "0,1",
                                                  "--select-warps", "0,1", "--select-tiles", "4,8",
                                                  "--out", out], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["parts"] for r in rows] == [4, 16]
    for r in rows:
        assert r["write_matches"] and r["score_rel_err"] < 1e-4
        assert r["score_bytes"] == 2 * 8 * r["parts"] * 132 and r["write_bytes"] == 2 * (64 + r["parts"]) * 132
        assert r["select_us"] > 0 and r["paper_select_us"] > 0 and r["idle_select_us"] > 0 and r["mix_over_logits"] > 0
        # the variants: the default tiles (first) and 1 tile a program, the launcher's warps (first) and 1 warp
        assert r["score_us"] == r[f"score_us_t{SCORE_TILES}"] and r["score_us_t1"] > 0 and r["fused_us_t1"] > 0
        assert r["select_us"] == r["select_us_w0"] and r["select_us_w1"] > 0
        # the mix's select at other score tiles: timed, and the same plan as the default's
        assert r["select_us_s4"] > 0 and r["select_us_s8"] > 0 and r["select_same_s4"] and r["select_same_s8"]
