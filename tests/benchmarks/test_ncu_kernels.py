"""benchmarks/ncu_kernels.py (the launches `h200_step.sh ncu` profiles): its part names are checked before any
GPU work, so a typo fails at once instead of after ncu's start-up."""
from __future__ import annotations

import pytest

from conftest import import_benchmark


def test_unknown_part_is_rejected_with_the_known_names():
    ncu_kernels = import_benchmark("ncu_kernels")
    with pytest.raises(SystemExit, match="step96, step96x512k, step1, mtp2, mtp4.*'step2'"):
        ncu_kernels.main(["--parts", "step96,step2"])
