"""A CPU dry run of benchmarks/bench_mtp_logits.py (Triton under TRITON_INTERPRET=1, tiny shapes): every candidate
configuration of every next_n is checked against the reference and "timed", and the report carries the
floors and targets."""
from __future__ import annotations

import csv

import pytest

from conftest import import_benchmark, run_benchmark_dry


@pytest.mark.interpreter
def test_bench_mtp_logits_dry_run(tmp_path):
    pytest.importorskip("triton")
    proc = run_benchmark_dry("bench_mtp_logits.py", ["--out", tmp_path], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "checks passed" in proc.stdout
    with open(tmp_path / "mtp_logits.csv") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    for column in ("batch", "ctx", "next_n", "provider", "config", "us", "floor_us", "x_floor", "production",
                   "gpu", "commit"):
        assert column in reader.fieldnames, column
    bench = import_benchmark("bench_mtp_logits")
    CANDIDATES, config_name = bench.CANDIDATES, bench.config_name
    for n, configs in CANDIDATES.items():
        got = [r["config"] for r in rows if r["next_n"] == str(n) and r["provider"] == "own"]
        assert got == [config_name(c) for c in configs], n  # every candidate, production first
        assert [r["production"] for r in rows if r["next_n"] == str(n)][0] == "True"
    assert not any(r["provider"].startswith("deepgemm") for r in rows)  # no DeepGEMM here: no made-up rows
    text = (tmp_path / "mtp_logits.md").read_text()
    assert "## Targets" in text and "floor = max(" in text


def test_candidates_are_distinct_and_start_with_production():
    """Each next_n's sweep times the production config first and no config twice (a duplicate spent a run's
    time on n = 1's production config twice and left the prefetch variant out)."""
    bench = import_benchmark("bench_mtp_logits")
    from spin_indexer.ops.indexer_logits_triton import CONFIGS
    for n, configs in bench.CANDIDATES.items():
        names = [bench.config_name(c) for c in configs]
        assert configs[0] == CONFIGS[n]
        assert len(set(names)) == len(names), (n, names)
