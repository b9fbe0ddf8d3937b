"""benchmarks/ncu_kernels.py (the launches `h200_step.sh ncu` profiles): its part names are checked before any
GPU work, so a typo fails at once instead of after ncu's start-up."""
from __future__ import annotations

import pytest

from conftest import import_benchmark


def test_unknown_part_is_rejected_with_the_known_names():
    ncu_kernels = import_benchmark("ncu_kernels")
    with pytest.raises(SystemExit, match="step96, step96x512k, step1, step1x1m, dense1, dense1x1m, mtp2.*'step2'"):
        ncu_kernels.main(["--parts", "step96,step2"])


@pytest.mark.interpreter
def test_mix_select_part_runs_dry():
    # the summary mix's select part (its set-up, plan() for the stash, the launch) as a CPU dry run
    pytest.importorskip("triton")
    from conftest import run_benchmark_dry
    proc = run_benchmark_dry("ncu_kernels.py", ["--parts", "mix8x8k"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "mix8x8k: done" in proc.stdout


@pytest.mark.parametrize("part, known", [("cuda3-w3", True), ("cuda4-ws", True), ("cuda2", True), ("cuda3", True),
                                         ("cuda5", False), ("cuda3-nosuch", False), ("cuda3w3", False),
                                         ("cuda", False)])
def test_cuda_parts_take_every_probe_variant(part, known):
    # cudaN-VARIANT profiles a cuda_logits_probe build: every variant it names, and nothing else
    ncu_kernels = import_benchmark("ncu_kernels")
    assert ncu_kernels.known_part(part) is known
    if not known:
        with pytest.raises(SystemExit, match=f"cudaN-VARIANT.*{part!r}"):
            ncu_kernels.main(["--parts", part])
