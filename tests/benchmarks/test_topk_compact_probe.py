"""benchmarks/topk_compact_probe.py (why SPIN's one-row top-k is slower): every variant and stage runs in a CPU dry
run, after each variant's top-k matched the reference on its inputs (the script exits otherwise)."""
from __future__ import annotations

import json

import pytest

from conftest import run_benchmark_dry


@pytest.mark.interpreter
def test_every_variant_runs_and_matches_the_reference_in_a_dry_run(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "probe.json"
    proc = run_benchmark_dry("topk_compact_probe.py", ["--points", "2x8192", "--topk", "64", "--rounds", "1",
                                                       "--out", out], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (row,) = json.loads(out.read_text())["results"]
    assert (row["rows"], row["cols"], row["k"]) == (2, 8192, 64)
    for variant in ("full", "full_map", "half", "half_map"):
        assert all(f"{variant}/{s}_us" in row for s in (2, 3, 4, 5))
