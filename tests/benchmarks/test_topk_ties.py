"""benchmarks/topk_ties.py: its tie rows are the case it means to time (the k-th value a tie shared by most of
the row, fewer than k positives), and a CPU dry run prints its table (the timings need CUDA)."""
from __future__ import annotations

import torch

from conftest import import_benchmark, run_benchmark_dry


def test_tie_rows_put_the_kth_value_in_a_mass_tie():
    ties = import_benchmark("topk_ties")
    k, cols = 16, 600
    x = ties.tie_rows(3, cols, k, torch.Generator().manual_seed(0))
    assert x.shape == (3, cols) and x.dtype == torch.float32
    for row in x:
        assert int((row > 0).sum()) == k // 2  # fewer positives than k
        kth = torch.topk(row, k).values[-1]
        assert kth == 0 and int((row == 0).sum()) > cols // 2  # the k-th value is shared by most of the row


def test_dry_run_prints_both_orders():
    proc = run_benchmark_dry("topk_ties.py", ["--points", "2x300", "--k", "8"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 2 x 300 |")]
    assert [r.split("|")[3].strip() for r in rows] == ["best first", "set"], proc.stdout
