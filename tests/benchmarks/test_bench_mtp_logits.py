"""A CPU dry run of benchmarks/bench_mtp_logits.py (Triton under TRITON_INTERPRET=1, tiny shapes): every candidate
configuration of every next_n is checked against the reference and "timed", and the report carries the
floors and targets."""
from __future__ import annotations

import csv
import re

import pytest
import torch

from conftest import import_benchmark, run_benchmark_dry

T_ONE = 64  # tokens a block


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
    full = [r for r in rows if float(r["sparsity"]) == 0]
    for n, configs in CANDIDATES.items():
        got = [r["config"] for r in full if r["next_n"] == str(n) and r["provider"] == "own"]
        assert got == [config_name(c) for c in configs], n  # every candidate, production first
        assert [r["production"] for r in full if r["next_n"] == str(n)][0] == "True"
    assert not any(r["provider"].startswith("deepgemm") for r in rows)  # no DeepGEMM here: no made-up rows
    # the compact point (DRY_CASES' last): every candidate again, its floor over the kept tokens only
    compact = [r for r in rows if float(r["sparsity"]) == 0.5]
    case = bench.DRY_CASES[-1]
    assert [r["config"] for r in compact if r["provider"] == "own"] == [
        config_name(c) for c in CANDIDATES[case["next_n"]]]
    text = (tmp_path / "mtp_logits.md").read_text()
    assert "## Targets" in text and "floor = max(" in text
    kept = int(re.search(r"compact at s=0\.5 \(kept (\d+) tokens a request\)", text).group(1))
    assert T_ONE * 2 <= kept < case["ctx"] and kept % T_ONE == 0  # a compact table: some blocks kept, not all
    assert bench.key_bytes(dict(case, sparsity=0.0, ctx=kept)) == case["batch"] * kept * 132


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
def test_a_failing_cuda_kernel_is_dropped_not_fatal(monkeypatch):
    """bench_mtp_logits' check drops the CUDA kernel (logged, env["cuda_failed"]) when it fails and times the rest;
    a production candidate that fails still raises."""
    pytest.importorskip("triton")
    bench = import_benchmark("bench_mtp_logits")
    harness = import_benchmark("harness")
    if torch.cuda.is_available():
        pytest.skip("CPU (interpreter) shapes only")
    monkeypatch.setattr(harness, "DEVICE", "cpu")  # as a dry run (SPIN_BENCH_DEVICE=cpu)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "CUDA_LAUNCHES", list(bench.CUDA_LAUNCHES))
    monkeypatch.setattr(bench, "CANDIDATES", {n: bench.CANDIDATES[n][:1] for n in (1, 2)})

    def broken(*args, **kwargs):
        raise RuntimeError("paged_indexer_logits_cuda: the launch failed")
    monkeypatch.setattr(bench.indexer_logits_cuda, "paged_indexer_logits_cuda", broken)
    env = {}
    bench.check(False, env, have_cuda=True)
    assert any("the launch failed" in e for e in env["cuda_failed"]) and bench.CUDA_LAUNCHES == []
    assert {"own:g1w4s3_n1_rel_err", "own:g2w4s3p_n2_rel_err"} <= set(env["checks"])
    assert not any(k.startswith("own_cuda") for k in env["checks"])
    assert [p for p, _ in bench.providers(2, False, True)].count("own_cuda") == 0
    monkeypatch.setattr(bench, "paged_indexer_logits_triton", broken)  # production failing still stops the run
    with pytest.raises(RuntimeError, match="the launch failed"):
        bench.check(False, {})


def test_cuda_launches_are_named_and_listed_only_when_available():
    bench = import_benchmark("bench_mtp_logits")
    assert [bench.config_name(x) for x in bench.CUDA_LAUNCHES] == ["cuda", "cuda-c128", "cuda-c256", "cuda-nomax",
                                                                   "cuda-c256-nomax"]
    assert "own_cuda" not in [p for p, _ in bench.providers(2, True)]
    assert [p for p, _ in bench.providers(2, True, True)].count("own_cuda") == len(bench.CUDA_LAUNCHES)


def test_targets_name_the_best_with_block_maxima_when_the_logits_only_build_wins():
    """The n = 2 target line's best may be the logits-only build (as DeepGEMM's output); the line after it then
    gives the best build that also writes the block maxima SPIN's step reads."""
    bench = import_benchmark("bench_mtp_logits")

    def row(provider, config, us, production=False):
        return dict(batch=96, ctx=131072, next_n=2, provider=provider, config=config, us=us, floor_us=390.0,
                    vs_deepgemm=us / 450.0, production=production)

    rows = [row("own", "g2w4s3p", 680.0, True), row("own_cuda", "cuda", 520.0), row("own_cuda", "cuda-nomax", 490.0),
            row("deepgemm", "", 450.0)]
    lines = bench.targets(rows)
    assert "best own cuda-nomax 490.0 us" in lines[0]
    assert lines[1].strip().startswith("with the block maxima") and "cuda 520.0 us, 1.156x" in lines[1]
    rows[2]["us"] = 530.0  # the build with maxima is the best: no second line
    assert not any("with the block maxima" in line for line in bench.targets(rows))


def test_points_take_an_optional_sparsity():
    """--points: BxLxN (a full table) or BxLxNxS (SPIN's compact table at sparsity S in [0, 1)); anything else is
    refused by name. A compact point's floor counts the kept tokens only: its key bytes are those of a full point
    of that length."""
    bench = import_benchmark("bench_mtp_logits")
    assert bench.point_case("8x131072x2") == dict(batch=8, ctx=131072, next_n=2)
    assert bench.point_case("96x131072x4x0.5") == dict(batch=96, ctx=131072, next_n=4, sparsity=0.5)
    for bad in ("2x300", "2x300x3x1.5", "2x300x3x0.5x1"):
        with pytest.raises(ValueError, match="--points"):
            bench.point_case(bad)
    case = bench.point_case("96x131072x4x0.5")
    kept = bench.scored_tokens(case)
    assert kept % T_ONE == 0 and 0 < kept < case["ctx"]
    assert bench.key_bytes(case) == bench.key_bytes(dict(batch=96, ctx=kept, next_n=4))
    assert bench.mma_flops(case) == bench.mma_flops(dict(batch=96, ctx=kept, next_n=4))


def test_cuda_defines_name_a_build_and_reject_anything_else():
    """--cuda-defines: the probe's switches (a shape to be made the default timed in the #17 table), each
    SPIN_LOGITS_<NAME>=<int>; anything else is refused before a kernel builds."""
    bench = import_benchmark("bench_mtp_logits")
    assert bench.cuda_defines("") == ()
    assert bench.cuda_defines("SPIN_LOGITS_MATH_WG_N3=3, SPIN_LOGITS_WEIGHTS_SMEM=-1") == (
        "SPIN_LOGITS_MATH_WG_N3=3", "SPIN_LOGITS_WEIGHTS_SMEM=-1")
    for bad in ("MATH_WG_N3=3", "SPIN_LOGITS_MATH_WG_N3", "SPIN_LOGITS_X=3;rm", "SPIN_LOGITS_X=a"):
        with pytest.raises(ValueError, match="--cuda-defines: expected SPIN_LOGITS_<NAME>=<int>"):
            bench.cuda_defines(f"SPIN_LOGITS_MATH_WG_N3=3,{bad}")


def test_a_failing_switches_build_is_dropped_alone(monkeypatch):
    """With --cuda-defines the switches' build is timed beside the library's: a check failing in that build drops
    its launches only (each logged in env["cuda_failed"]); every other provider of that next_n is still checked."""
    bench = import_benchmark("bench_mtp_logits")
    switches = ("SPIN_LOGITS_MATH_WG_N3=3",)
    library = list(bench.CUDA_LAUNCHES)
    monkeypatch.setattr(bench, "CUDA_LAUNCHES", library + [bench.CudaLaunch(None, switches),
                                                           bench.CudaLaunch(256, switches)])
    monkeypatch.setattr(bench, "CANDIDATES", {3: bench.CANDIDATES[3][:1]})
    monkeypatch.setattr(bench, "check_inputs", lambda n: (None, None, None))
    checked = []

    def check_one(x, provider, cfg, n, ref, live, env):
        checked.append((provider, cfg))
        if provider == "own_cuda" and cfg.defines:
            raise AssertionError("logits differ")
        env.setdefault("checks", {})[f"{provider}:{bench.config_name(cfg) if cfg else ''}_n{n}"] = 0.0
    monkeypatch.setattr(bench, "_check_one", check_one)
    env = {}
    bench.check(True, env, have_cuda=True)
    assert bench.CUDA_LAUNCHES == library  # the library's launches stay
    assert len(env["cuda_failed"]) == 1 and "cuda+switches n=3" in env["cuda_failed"][0]
    assert ("own_cuda", bench.CudaLaunch(256, switches)) not in checked  # its build already failed
    assert [p for p, _ in checked].count("deepgemm_per_row") == 1  # the providers after it still checked
    assert bench.config_name(bench.CudaLaunch(256, switches, maxima=False)) == "cuda-c256-nomax+switches"


def test_a_switches_launch_never_falls_back_to_the_library(monkeypatch):
    """A switches build that does not load raises (the check then drops it) rather than timing the library's
    build under the switches' name (indexer_logits_cuda.paged_indexer_logits_cuda runs the library's when given
    library=None)."""
    bench = import_benchmark("bench_mtp_logits")
    monkeypatch.setattr(bench.indexer_logits_cuda, "load_library", lambda defines=(): None)
    with pytest.raises(RuntimeError, match="built with SPIN_LOGITS_MATH_WG_N3=3 does not build or load"):
        bench.Inputs.own_cuda(None, bench.CudaLaunch(None, ("SPIN_LOGITS_MATH_WG_N3=3",)))
    assert callable(bench.Inputs.own_cuda(None, bench.CudaLaunch()))  # the library's: no switches, no library
