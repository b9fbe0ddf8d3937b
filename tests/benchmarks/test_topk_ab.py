"""benchmarks/topk_ab.py (a paired A/B of topk_triton.py's threshold kernels) in a CPU dry run: a variant equal to
the tree's passes its same-top-k check, and one whose listing leaves out the groups of the threshold's bucket and
the 63 above it (half an octave of keys) fails it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_benchmark_dry, write_variant

TOPK = Path(__file__).resolve().parents[2] / "src" / "spin_indexer" / "ops" / "topk_triton.py"
LISTING = "li = (top >= lo).to(tl.int32)"


@pytest.mark.interpreter
@pytest.mark.parametrize("mutated", [False, True], ids=["same-build", "bucket-dropped"])
def test_variant_is_checked_before_it_is_timed(mutated, tmp_path):
    pytest.importorskip("triton")
    variant = write_variant(TOPK, LISTING, LISTING.replace("lo)", "lo + 64)") if mutated else None, tmp_path)
    out = tmp_path / "ab.json"
    proc = run_benchmark_dry("topk_ab.py", ["--variant", variant, "--points", "1x8192", "--rounds", "2",
                                            "--out", out], timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["ctx"]) for r in rows] == [(1, 8192)]
    if mutated:
        assert proc.returncode == 1 and not rows[0]["same"], proc.stdout[-2000:]
    else:
        assert proc.returncode == 0 and rows[0]["same"], proc.stdout[-2000:] + proc.stderr[-4000:]
