"""benchmarks/cuda_logits_registers.py (no GPU: nvcc, and triton's nvdisasm): every instantiation of the CUDA logits
kernel is found with its block loops, and the count it exists for: the AbsSum build's block loop at next_n = 4 has one
FFMA a score and no FMNMX, where the library's ReLU build has one FMNMX a score as well."""
from __future__ import annotations

import pytest

from conftest import import_benchmark
from spin_indexer.ops.cuda_build import nvcc_path


def _counts_or_skip(defines=()):
    if nvcc_path() is None:
        pytest.skip("needs nvcc")
    return {row["name"]: row for row in import_benchmark("cuda_logits_registers").counts(defines)}


def test_every_instantiation_and_its_block_loops():
    relu = _counts_or_skip()
    assert sorted(relu) == [f"next_n={n} maxima={m}" for n in (1, 2, 3, 4) for m in ("no", "yes")]
    for name, row in relu.items():
        assert row["registers"] is not None and row["loops"], name
        for size, ops, _ in row["loops"]:
            assert ops["QGMMA"] > 0 and size > ops["FFMA"] > 0, name
    abs_sum = _counts_or_skip(("SPIN_LOGITS_ABS_SUM=1",))
    # next_n = 4 without maxima: each of a thread's scores in the loop (2 blocks) is one FFMA with |s| in the AbsSum
    # build, FMNMX + FFMA in the ReLU build
    for (size_r, ops_r, _), (size_a, ops_a, _) in zip(relu["next_n=4 maxima=no"]["loops"],
                                                       abs_sum["next_n=4 maxima=no"]["loops"]):
        assert ops_a["FFMA"] == ops_r["FFMA"] == ops_r["FMNMX"] and ops_a["FMNMX"] == 0
        assert size_a < size_r
