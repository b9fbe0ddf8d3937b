"""Dry run of the end-to-end decoding benchmark (benchmarks/bench_e2e.py) on the CPU with a tiny random model:
the code path the H200 run takes (prefill, batch fill by copy, all-keep and SPIN greedy steps), nothing timed."""
from __future__ import annotations

import csv
import os

import pytest
import torch

from conftest import import_benchmark

if not torch.cuda.is_available():
    os.environ.setdefault("SPIN_BENCH_DEVICE", "cpu")  # harness reads it at import


@pytest.fixture(scope="module")
def bench_e2e():
    return import_benchmark("bench_e2e")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dry run (the GPU run is the benchmark itself)")
def test_dry_run_spin_at_zero_sparsity_decodes_like_all_keep(bench_e2e, tmp_path):
    assert bench_e2e.main(["--tiny", "--points", "3x300", "--configs", "all-keep", "spin-0.0", "spin-0.5",
                           "--steps", "3", "--warmup", "1", "--distinct", "2", "--k", "32",
                           "--out", str(tmp_path)]) == 0
    with open(tmp_path / "h200_e2e.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(bench_e2e.COLUMNS)
    assert [r["config"] for r in rows] == ["all-keep", "spin-0.0", "spin-0.5"]
    with open(tmp_path / "h200_e2e_detail.csv") as f:
        detail = {r["config"]: r for r in csv.DictReader(f)}
    # keeping every block, SPIN selects exactly the all-keep top-k, so greedy decoding cannot differ
    assert float(detail["spin-0.0"]["agree_all_keep"]) == 1.0
    assert float(detail["spin-0.0"]["realized_sparsity"]) == 0.0
    assert 0.3 <= float(detail["spin-0.5"]["realized_sparsity"]) <= 0.6  # 5 blocks per request at 300 tokens


def test_points_parse_and_reject(bench_e2e):
    assert bench_e2e.parse_points("32x16384, 96x32768") == [(32, 16384), (96, 32768)]
    with pytest.raises(SystemExit, match="BATCHxCONTEXT"):
        bench_e2e.parse_points("32by16384")


def test_configs_parse_and_reject(bench_e2e):
    assert bench_e2e.parse_config("all-keep") is None
    assert bench_e2e.parse_config("spin-0.4") == (0.4, True)
    assert bench_e2e.parse_config("spin-0.5-serial") == (0.5, False)
    for bad in ("spin-x", "spin-1.5", "dense", "spin-0.5-fast"):
        with pytest.raises(SystemExit, match="--configs"):
            bench_e2e.parse_config(bad)
