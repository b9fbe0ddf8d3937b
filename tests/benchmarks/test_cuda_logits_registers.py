"""benchmarks/cuda_logits_registers.py (no GPU: nvcc, and triton's nvdisasm): every instantiation of the CUDA logits
kernel is found with its block loops, and the count it exists for: the AbsSum build's block loop at next_n = 4 has one
FFMA a score and no FMNMX, where the library's ReLU build has one FMNMX a score as well; the weights-in-shared-memory
build (cuda_logits_probe's w3) fits three warpgroups on whole blocks at next_n 3 and 4 without spilling, and the
library's next_n = 3 is that shape with its loops' code small enough to stay fetched (run 182); ptxas keeps every MMA
asynchronous in the library's build and in the row pipeline's (SPIN_LOGITS_ROW_PIPE), whose MMA in flight across a
loop edge would make it serialize them all."""
from __future__ import annotations

import functools

import pytest

from conftest import import_benchmark
from spin_indexer.ops.cuda_build import nvcc_path


def _counts_or_skip(defines=()):
    if nvcc_path() is None:
        pytest.skip("needs nvcc")
    return _counts(tuple(defines))


@functools.lru_cache(maxsize=None)
def _counts(defines: tuple) -> dict:  # one nvcc build a set of switches per process (the library's is read thrice)
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


def test_three_warpgroups_on_whole_blocks_fit_with_the_weights_in_shared_memory():
    # cuda_logits_probe's w3 (issue #17): 384 threads leave 168 registers a thread. With the weights in registers
    # next_n = 3 spills there (run 125); read from shared memory, next_n = 3 (96 accumulators) and 4 (128) fit, one
    # block loop a warpgroup, each holding next_n x 64 scores' FMNMX + FFMA a block and the weights' loads
    variants = import_benchmark("cuda_logits_probe").VARIANTS
    w3 = _counts_or_skip(variants["w3"])
    for n, spw in ((3, 2), (4, 2)):  # key blocks a loop iteration (Shape::SPW at next_n 3, 4 on three warpgroups)
        for maxima in ("no", "yes"):
            row = w3[f"next_n={n} maxima={maxima}"]
            assert row["spill"] == "0/0" and row["registers"] <= 168, row
            assert len(row["loops"]) == 3, row  # compiled once per warpgroup (PER_WG)
            for size, ops, spill_inside in row["loops"]:
                assert not spill_inside and ops["QGMMA"] == 4 * spw
                assert ops["FFMA"] == n * 32 * spw and ops["FMNMX"] >= n * 32 * spw
                assert ops["LDS"] >= 4 * n * spw  # four 16-byte loads a row and block: the weights
    # the switch's default turns it on for these shapes; off, next_n = 3 spills
    shape = tuple(d for d in variants["w3"] if "WEIGHTS_SMEM" not in d)
    assert _counts_or_skip(shape)["next_n=3 maxima=yes"]["spill"] == "0/0"
    assert _counts_or_skip((*shape, "SPIN_LOGITS_WEIGHTS_SMEM=0"))["next_n=3 maxima=yes"]["spill"] != "0/0"


def test_the_library_runs_next_n_3_on_three_warpgroups_with_little_loop_code():
    # run 183: three warpgroups, 2 key blocks a set, the weights in shared memory: 0.963x the time of two warpgroups
    # (twice, paired rounds); at 4 key blocks a set the three loops were ~64 KB an SMSP and stalled on instruction
    # fetch (run 182: 1.04x), so the loops' code is held under 40 KB here
    loop_code_bytes = import_benchmark("cuda_logits_registers").loop_code_bytes
    lib = _counts_or_skip()
    for maxima in ("no", "yes"):
        row = lib[f"next_n=3 maxima={maxima}"]
        assert row["spill"] == "0/0" and row["registers"] <= 168 and len(row["loops"]) == 3, row
        assert all(ops["LDS"] >= 4 * 3 * 2 for _, ops, _ in row["loops"])  # the weights read from shared memory
        assert loop_code_bytes(row) < 40 * 1024, row
    # next_n = 3's old shape (cuda_logits_probe's n3-2wg) differs from the library's build at next_n = 3 only
    old = _counts_or_skip(import_benchmark("cuda_logits_probe").VARIANTS["n3-2wg"])
    assert len(old["next_n=3 maxima=yes"]["loops"]) == 2
    assert [name for name in lib if lib[name] != old[name]] == ["next_n=3 maxima=no", "next_n=3 maxima=yes"]


def test_ptxas_info_reads_registers_spills_and_serialized_mmas():
    name = "_ZN53_GLOBAL__N__0_paged_logits_kernelILi{}ELb0EEEv14CUtensorMap_st"
    stderr = "\n".join([
        f"ptxas info    : Compiling entry function '{name.format(3)}' for 'sm_90a'",
        "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non "
        "wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline stage in "
        f"the function '{name.format(3)}'",
        f"ptxas info    : Function properties for {name.format(3)}",
        "    40 bytes stack frame, 72 bytes spill stores, 80 bytes spill loads",
        "ptxas info    : Used 168 registers, used 1 barriers, 40 bytes cumulative stack size",
        f"ptxas info    : Compiling entry function '{name.format(2)}' for 'sm_90a'",
        f"ptxas info    : Function properties for {name.format(2)}",
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Used 126 registers, used 1 barriers"])
    info = import_benchmark("cuda_logits_registers").ptxas_info(stderr)
    assert info == {"next_n=3 maxima=no": {"serialized": True, "spill": "72/80", "registers": 168},
                    "next_n=2 maxima=no": {"serialized": False, "spill": "0/0", "registers": 126}}


def test_the_row_pipeline_keeps_its_mmas_asynchronous():
    # SPIN_LOGITS_ROW_PIPE (run 184): one MMA a row, the next block's rows issued while this block's are summed. An
    # MMA in flight across the loop's back edge or at a `break` made ptxas serialize every MMA of the kernel (C7514 /
    # C7520), which would time a synchronous kernel under the pipeline's name
    assert not any(row["serialized"] for row in _counts_or_skip().values())
    rp3 = _counts_or_skip(import_benchmark("cuda_logits_probe").VARIANTS["rp3"])
    for n, spw in ((2, 4), (3, 2)):  # key blocks a loop iteration (Shape::SPW) on whole blocks
        for maxima in ("no", "yes"):
            row = rp3[f"next_n={n} maxima={maxima}"]
            assert not row["serialized"] and row["spill"] == "0/0", row
            assert len(row["loops"]) == 1, row  # compiled once (PER_WG=0)
            for _, ops, _ in row["loops"]:
                assert ops["QGMMA"] == 4 * n * spw  # 4 k steps a row: N = 64 MMAs, one a row
