"""A CPU dry run of benchmarks/bench_mtp_logits.py (Triton under TRITON_INTERPRET=1, tiny shapes): every candidate
configuration of every next_n is checked against the reference and "timed", and the report carries the
floors and targets."""
from __future__ import annotations

import csv

import pytest
import torch

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
    for n, specs in bench.WS_SPECS.items():  # the warp-specialized kernel's launches, checked and timed too
        got = [r["config"] for r in rows if r["next_n"] == str(n) and r["provider"] == "own_ws"]
        assert got == [config_name(s) for s in specs], n
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


@pytest.mark.interpreter
def test_a_failing_warp_specialized_kernel_is_dropped_not_fatal(monkeypatch):
    """The experimental kernel failing (a compile error on the GPU host's triton, a wrong result) drops its
    launches from the run and says so; the production candidates are still checked and a mismatch of theirs
    still raises."""
    pytest.importorskip("triton")
    bench = import_benchmark("bench_mtp_logits")
    harness = import_benchmark("harness")
    if torch.cuda.is_available():
        pytest.skip("CPU (interpreter) shapes only")
    monkeypatch.setattr(harness, "DEVICE", "cpu")  # as a dry run (SPIN_BENCH_DEVICE=cpu)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "WS_SPECS", {n: list(s) for n, s in bench.WS_SPECS.items()})
    monkeypatch.setattr(bench, "CANDIDATES", {n: bench.CANDIDATES[n][:1] for n in (1, 2)})

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")
    monkeypatch.setattr(bench, "paged_indexer_logits_ws", broken)
    env = {}
    bench.check(False, env)
    assert "PassManager::run failed" in env["ws_failed"] and bench.WS_SPECS == {}
    assert {"own:g1w4s3_n1_rel_err", "own:g2w4s3p_n2_rel_err"} <= set(env["checks"])
    assert not any(k.startswith("own_ws") for k in env["checks"])
    assert all(p != "own_ws" for p, _ in bench.providers(2, False))
    # a production candidate that fails still stops the run
    monkeypatch.setattr(bench, "paged_indexer_logits_triton", broken)
    with pytest.raises(RuntimeError, match="PassManager"):
        bench.check(False, {})
