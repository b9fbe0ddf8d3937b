"""benchmarks/profile_step.py's command line (the profile itself needs CUDA: it runs on the H200 only)."""
from __future__ import annotations

import pytest

from conftest import import_benchmark


def test_parts_are_checked_before_anything_runs(capsys):
    prof = import_benchmark("profile_step")
    assert prof.PARTS == ("kernels", "topk", "update")
    with pytest.raises(SystemExit) as exc:
        prof.main(["--parts", "kernels,flops", "--out", "/nonexistent/never-created"])
    assert exc.value.code == 2
    assert "--parts: unknown ['flops']" in capsys.readouterr().err
