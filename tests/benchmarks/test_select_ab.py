"""benchmarks/select_ab.py (a paired A/B of plan_triton.py builds) in a CPU dry run: a variant equal to the tree's
passes its same-plan check (plan() of two layers there), and one that keeps a block fewer fails it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_benchmark_dry, write_variant

PLAN = Path(__file__).resolve().parents[2] / "src" / "spin_indexer" / "predictor" / "plan_triton.py"
BUDGET = "budget = tl.minimum(n, tl.maximum(n - skipped, cover))"


@pytest.mark.interpreter
@pytest.mark.parametrize("mutated", [False, True], ids=["same-build", "one-block-fewer"])
def test_variant_is_checked_before_it_is_timed(mutated, tmp_path):
    pytest.importorskip("triton")
    variant = write_variant(PLAN, BUDGET, BUDGET.replace("n - skipped", "n - skipped - 1") if mutated else None,
                            tmp_path)
    out = tmp_path / "ab.json"
    proc = run_benchmark_dry("select_ab.py", ["--variant", variant, "--points", "2x16384", "--rounds", "2",
                                              "--calls", "1", "--layers", "1" if mutated else "2", "--out", out],
                            timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["ctx"], r["layers"]) for r in rows] == [(2, 16384, 1 if mutated else 2)]
    if mutated:
        assert proc.returncode == 1 and not rows[0]["same_paper"] and not rows[0]["same_mix"], proc.stdout[-2000:]
    else:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert rows[0]["same_paper"] and rows[0]["same_mix"]
