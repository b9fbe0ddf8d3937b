"""benchmarks/maxima_pass_configs.py, the maxima pass's experiment: every configuration runs in a CPU dry run and
writes the same maxima (the script says so when one does not), and each configuration's constants are in force
inside its block only (the configurations share one process on the device)."""
from __future__ import annotations

import json

import pytest

from conftest import import_benchmark, run_benchmark_dry


@pytest.mark.interpreter
def test_every_configuration_runs_and_agrees_in_a_dry_run(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("SPIN_BENCH_MAX_ROTATIONS", "1")  # one buffer a shape: the interpreter's time
    configs = "32:8:4:64,8:2:4:0,16:1:8:0"
    proc = run_benchmark_dry("maxima_pass_configs.py", ["--out", tmp_path, "--shapes", "3x8192x0.8,2x4096x0.5",
                                                        "--configs", configs, "--topk", "512"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "differ" not in proc.stdout
    result = json.loads((tmp_path / "maxima_pass_configs.json").read_text())
    got = {(row["shape"], row["config"]) for row in result["rows"]}
    for shape in ("3x8192x0.8", "2x4096x0.5"):
        assert {(shape, c) for c in configs.split(",")} | {(shape, "torch amax (blocks only)")} == \
            {g for g in got if g[0] == shape}
    assert result["env"]["gpu"] == "cpu (dry run)" and result["env"]["commit"]


def test_configurations_patch_inside_their_block_only():
    pytest.importorskip("triton")
    configs = import_benchmark("maxima_pass_configs")
    from spin_indexer.ops import maxima_triton as mt
    names = ("TILE_UNITS", "PROGRAMS_PER_SM", "NUM_WARPS", "MAX_REGISTERS")
    before = [getattr(mt, n) for n in names]
    with pytest.raises(RuntimeError), configs.config("8:3:8:0"):
        assert [getattr(mt, n) for n in names] == [8, 3, 8, 0]
        raise RuntimeError("a configuration that fails still restores the constants")
    assert [getattr(mt, n) for n in names] == before
