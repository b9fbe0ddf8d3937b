"""benchmarks/profile_step.py's command line (the profile itself needs CUDA: it runs on the H200 only)."""
from __future__ import annotations

import pytest

from conftest import import_benchmark


def test_parts_are_checked_before_anything_runs(capsys):
    prof = import_benchmark("profile_step")
    assert prof.PARTS == ("kernels", "topk", "update")
    with pytest.raises(SystemExit) as exc:
        prof.main(["--parts", "kernels,flops", "--out", "/nonexistent/never-created"])
    assert exc.value.code == 2
    assert "--parts: unknown ['flops']" in capsys.readouterr().err


def test_per_layer_rows_charge_each_layer_its_share_of_plan():
    """A step of plan() over 61 layers (a kernel of 122 us, once) and run() over 2 profiled layers (a kernel of
    40 us a layer, one launch each; a kernel both launch, 3 us each call): a layer of a 61-layer step pays 2 us of
    plan's kernel, not 61; the shared kernel splits into its two parts."""
    prof = import_benchmark("profile_step")
    step = [(122.0, 1.0, "plan_k"), (80.0, 2.0, "logits_k"), (9.0, 3.0, "shared_k")]
    plan = [(122.0, 1.0, "plan_k"), (3.0, 1.0, "shared_k")]
    rows = {name: (t, n) for t, n, name in prof.per_layer_rows(step, plan, layers=2, plan_layers=61)}
    assert rows["logits_k"] == pytest.approx((40.0, 1.0))
    assert rows["plan_k"] == pytest.approx((2.0, 1 / 61))
    assert rows["shared_k"] == pytest.approx((3.0 + 3.0 / 61, 1.0 + 1 / 61))
    assert [r[2] for r in prof.per_layer_rows(step, plan, 2, 61)] == ["logits_k", "shared_k", "plan_k"]
