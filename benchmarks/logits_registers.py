"""Registers, spills, shared memory and instructions per key block of the paged logits kernel
(ops/indexer_logits_triton.py) for each launch configuration, without a GPU.

Compiles `_paged_indexer_logits_kernel` for sm_90a with the local triton (compile only), runs ptxas -v and
disassembles the cubin. `tma` checks the PTX for Triton's pipelining of the TMA loads: `<all>/<in loop>`
counts of cp.async.bulk.tensor (a pipelined key load: num_stages - 1 copies before the loop, one in it), `sync!` when an mbarrier is initialised inside the block loop (the pipeliner
gave up: the load waits in the iteration that issues it). `instr/block` counts the SASS of the block loop's
body (the longest loop: one iteration per key block), per warp; with 4 warps one warp of each program sits
on each of the SM's 4 schedulers, so it is also the issue cycles per block each scheduler spends on that
program (8 warps: twice).
A block must take <= ~500 SM cycles to read keys at copy bandwidth (8448 B x 132 SMs / ~4.1 TB/s at
~1.8 GHz). The counts are indicative: run it with the triton of the GPU host (3.6 on the H200 runs) to match
it, e.g. a wheel unpacked into /tmp/t36: `PYTHONPATH=/tmp/t36:src python benchmarks/logits_registers.py`.

    PYTHONPATH=src python benchmarks/logits_registers.py                  # every config the benchmark sweeps
    PYTHONPATH=src python benchmarks/logits_registers.py --next-n 4 --hist
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402

from plan_registers import compile_sm90, ptxas_counts  # noqa: E402
from sass_tools import opcode_counts, sass_loops  # noqa: E402
from spin_indexer.ops import indexer_logits_triton as L  # noqa: E402

PTR = {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "w_ptr": "*fp32", "lens_ptr": "*i32", "table_ptr": "*i32",
       "out_ptr": "*fp32", "bmax_ptr": "*fp32", "gmax_ptr": "*fp32", "v_ptr": "*fp16", "vb_ptr": "*fp16", "d_ptr": "*fp16",
       "seen_ptr": "*i32", "clock_ptr": "*i32", "slot_ptr": "*i64", "kept_ptr": "*i32", "hlens_ptr": "*i32",
       "upd_ptr": "*i8"}
FLOATS = ("alpha", "lo", "hi")
OPS = ("QGMMA", "FMNMX", "FFMA", "SHFL", "BAR", "STS", "LDS", "STG", "LDG", "LDL", "STL")


def compile_counts(next_n: int, cfg: "L.LogitsConfig", hist: bool = False, heads: int = 64, dim: int = 128,
                   group_max: int = 0) -> dict:
    fn = L._paged_indexer_logits_kernel
    r = cfg.group_rows(next_n)
    consts = dict(NEXT_N=next_n, H=heads, D=dim, T=64, PAGE_BYTES=64 * (dim + 4), RB=(64 * (dim + 4)) // dim,
                  PREFETCH=cfg.prefetch,
                  G=cfg.group, R0=r[0], R1=r[1], R2=r[2], R3=r[3], FILL_TAIL=False, HIST=hist, HAS_SEEN=hist,
                  GMAX=group_max > 0, GS=group_max or 64)
    def arg_type(name):
        if name == "k_arg":
            return f"tensordesc<fp8e4nv[64, {dim}]>"
        return PTR.get(name, "fp32" if name in FLOATS else "i32")

    k = compile_sm90(fn, consts, arg_type, "logits_registers.py", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                     # the launcher drops the cap when the EMA update is fused
                     maxnreg=cfg.max_registers if cfg.max_registers and not hist else None)
    c = ptxas_counts(k)
    spill = None if c["spill_st"] is None else c["spill_st"] + c["spill_ld"]
    body = _block_loop(c["sass"])
    tma_all, tma_loop, sync = _ptx_tma(k.asm["ptx"])
    return dict(regs=c["regs"], spill=spill, tma=f"{tma_all}/{tma_loop}" + (" sync!" if sync else ""),
                smem=k.metadata.shared, instr=sum(body.values()), ops=body,
                log="" if c["regs"] is not None else c["log"][-300:])


def _ptx_tma(ptx: str) -> tuple[int, int, bool]:
    """(cp.async.bulk.tensor in the kernel, in its longest loop, whether that loop initialises an mbarrier)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(\$L__BB\d+_\d+):", line))}
    best = (0, -1)
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
    loop = lines[best[0]:best[1] + 1]
    return (sum("cp.async.bulk.tensor" in x for x in lines), sum("cp.async.bulk.tensor" in x for x in loop),
            any("mbarrier.init" in x for x in loop))


def _block_loop(sass: str) -> collections.Counter:
    """Opcode counts of the longest loop of the SASS (a label, then a branch back to it)."""
    lines = sass.splitlines()
    best = max(sass_loops(lines), key=lambda loop: loop[1] - loop[0], default=(0, 0))
    return opcode_counts(lines[best[0]:best[1] + 1])


def sweep_configs():
    """(next_n, config, name) of every candidate bench_mtp_logits.py sweeps."""
    from bench_mtp_logits import CANDIDATES, config_name
    return [(n, c, config_name(c)) for n, cs in sorted(CANDIDATES.items()) for c in cs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--next-n", type=int, nargs="*", help="only these next_n")
    ap.add_argument("--hist", action="store_true", help="with the fused history update (row 0)")
    ap.add_argument("--config", nargs="*", help="only these config names (bench_mtp_logits.config_name)")
    ap.add_argument("--group-max", type=int, default=0, help="with the top-k's group maxima at this many columns")
    a = ap.parse_args()
    print(f"triton {triton.__version__}")
    print(f"{'n':>2} {'config':>18} {'regs':>5} {'spill B':>7} {'smem B':>7} {'tma':>9} {'instr/block':>11}"
          "  "
          + " ".join(f"{o:>5}" for o in OPS))
    for n, cfg, name in sweep_configs():
        if (a.next_n and n not in a.next_n) or (a.config and name not in a.config):
            continue
        c = compile_counts(n, cfg, hist=a.hist, group_max=a.group_max)
        print(f"{n:>2} {name:>18} {str(c['regs']):>5} {str(c['spill']):>7} {c['smem']:>7} {c['tma']:>9} "
              f"{c['instr']:>11}  "
              + " ".join(f"{c['ops'][o]:>5}" for o in OPS) + c["log"])


if __name__ == "__main__":
    main()
