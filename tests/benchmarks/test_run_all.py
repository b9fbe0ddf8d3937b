"""A CPU dry run of benchmarks/run_all.py (Triton under TRITON_INTERPRET=1, tiny shapes): every code path of
the step benchmark runs, and the CSV carries the columns the step issue names."""
from __future__ import annotations

import csv

import pytest

from conftest import run_benchmark_dry


@pytest.mark.interpreter
def test_run_all_dry_run(tmp_path):
    pytest.importorskip("triton")
    proc = run_benchmark_dry("run_all.py", ["--out", tmp_path, "--points", "2x2000x1,1x3000x2",
                                            "--sparsities", "0.5"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(tmp_path / "h200_indexer.csv") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    for column in ("batch", "ctx", "next_n", "sparsity", "dense_logits_us", "spin_logits_us", "topk_us",
                   "torch_topk_us", "plan_update_us", "step_us", "key_GBps", "copy_GBps", "deepgemm_logits_us",
                   "dense_step_us", "spin_own_us", "dense_other_us", "dense_step_paired_us", "vs_dense_paired",
                   "guard_vs_dense_paired"):
        assert column in reader.fieldnames, column
    assert [(r["batch"], r["ctx"], r["next_n"]) for r in rows] == [("2", "2000", "1"), ("1", "3000", "2")]
    assert all(r["deepgemm_logits_us"] == "" for r in rows)  # no DeepGEMM here: empty, not made up
    # 3000 tokens = 47 blocks; the budget covers top-k 2048 + the partial block: 33 kept, 14 skipped
    assert float(rows[1]["realized_sparsity"]) == round(14 / 47, 2)
    assert "## Targets" in (tmp_path / "h200_indexer.md").read_text()


def test_targets_without_deepgemm_columns():
    """A run where deep_gemm did not import has no DeepGEMM column: the targets against DeepGEMM read nan (run 64,
    a grid without DeepGEMM, crashed here writing its report), the others their ratios."""
    from conftest import import_benchmark
    run_all = import_benchmark("run_all")
    rows = [dict(batch=96, ctx=c, next_n=n, sparsity=0.5, torch_topk_us=100.0, step_us=50.0, dense_step_us=90.0,
                 guard_step_us=50.0, spin_own_us=2.0, dense_logits_us=80.0)
            for c, n in ((524288, 1), (131072, 2))]
    lines = run_all.targets(rows)
    assert lines[0].startswith("B=96 L=524288 n=1 s=0.5: vs DeepGEMM+torch.topk nanx") and "1.80x" in lines[0]
    assert any(line.startswith("B=96 L=131072 n=2 s=0.5: vs DeepGEMM+torch.topk nanx") for line in lines)
    rows[0]["deepgemm_logits_us"] = 50.0
    assert "3.00x" in run_all.targets(rows)[0]


def test_targets_report_the_paired_ratios_where_the_run_has_them():
    """Since run 77 the dense step is replayed in SPIN's paired rounds too: the report names the worst per-round
    ratio (3 decimals: the B = 1 points sit within 1% of 1.0), guarded and not; a run without the column (the
    CPU dry run, older csvs) reports no such line."""
    from conftest import import_benchmark
    run_all = import_benchmark("run_all")
    rows = [dict(batch=b, ctx=131072, next_n=1, sparsity=0.2, torch_topk_us=100.0, step_us=50.0, dense_step_us=90.0,
                 guard_step_us=50.0, spin_own_us=2.0, dense_logits_us=80.0) for b in (1, 96)]
    assert not any("paired" in line for line in run_all.targets(rows))
    rows[0].update(vs_dense_paired=0.9987, guard_vs_dense_paired=1.0004)
    rows[1].update(vs_dense_paired=1.8123, guard_vs_dense_paired=1.8123)
    line = next(line for line in run_all.targets(rows) if "paired" in line)
    assert "0.999x at B=1 L=131072" in line and "with the guard: 1.000x" in line
    assert run_all.fmt(0.99871, "vs_dense_paired") == "0.9987" and run_all.fmt(0.99871, "step_us") == "1.00"


def test_paired_rounds_run_again_only_off_the_dense_timing():
    from conftest import import_benchmark
    run_all = import_benchmark("run_all")
    assert run_all.drifted(3065.0, 2384.0) and run_all.drifted(2000.0, 2384.0)  # run 179's first point; a fast one
    assert not run_all.drifted(2400.0, 2384.0) and not run_all.drifted(2384.0 * 1.09, 2384.0)
    assert not run_all.drifted(float("nan"), float("nan")) and not run_all.drifted(float("nan"), 2384.0)
