"""Register and spill counts of SPIN's EMA update pass (`_update_history_kernel`, ops/history_triton.py), of the
pipelined pass (`_update_pass_kernel`: registers, SASS instructions and block-wide barriers of its tile loop) and of
the maxima pass (`_row_maxima_kernel`, ops/maxima_triton.py: DeepGEMM's step and the dense top-k), without a GPU.

Compiles the kernel for sm_90a with the local triton (compile only), runs the ptxas that ships with triton
with -v and counts the SASS's global loads/stores and local (spill) traffic. 65536 registers per SM: a
program of 4 warps at R registers per thread leaves floor(65536 / (128 R)) programs resident (R <= 128: 4,
<= 64: 8), which is what keeps enough bytes in flight for a memory-bound pass. The production launch is
BLOCKS_PER_PROGRAM x NUM_WARPS under MAX_REGISTERS, with the block max and the group maxima (G = 16 at 128K)
of the DeepGEMM path; each config prints with the cap and without it (what ptxas picks).
The counts are indicative: run it with the GPU host's triton (3.6 on the H200 runs) to match it, e.g. a wheel
unpacked into /tmp/t36: `PYTHONPATH=/tmp/t36:src python benchmarks/update_registers.py`.

    PYTHONPATH=src python benchmarks/update_registers.py                    # production, and BLOCKS 16 / no GMAX
    PYTHONPATH=src python benchmarks/update_registers.py --blocks 32 --warps 4 --group 32 --seen --rows 2
"""
from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402

from plan_registers import compile_sm90, ptxas_counts  # noqa: E402
from sass_tools import sass_loops  # noqa: E402
from spin_indexer.ops import history_triton as U  # noqa: E402
from spin_indexer.ops import maxima_triton as MX  # noqa: E402

PTR = {"x_ptr": "*fp32", "table_ptr": "*i32", "clen_ptr": "*i32", "bmax_ptr": "*fp32", "gmax_ptr": "*fp32",
       "v_ptr": "*fp16", "vb_ptr": "*fp16", "d_ptr": "*fp16", "seen_ptr": "*i32", "clock_ptr": "*i32",
       "slot_ptr": "*i64", "kept_ptr": "*i32", "lens_ptr": "*i32", "upd_ptr": "*i1"}
FLOATS = ("alpha", "lo", "hi")
# what the launcher's tensors give triton's specialization: 16-byte aligned base pointers, and the strides
# and sizes that are multiples of 16 at production shapes (W = X / T blocks)
DIV16 = set(PTR) | {"x_stride_b", "x_stride_n", "table_stride", "bmax_stride", "gmax_stride", "kept_stride",
                    "num_blocks"}
OPS = ("LDG", "STG", "LDL", "STL", "BAR")
PASS_OPS = ("LDGSTS", "STG", "BAR.SYNC", "SHFL")


def compile_counts(blocks: int, warps: int, group: int | None = 16, rows: int = 1, seen: bool = False,
                   bmax: bool = True, maxnreg: int | None = None) -> dict:
    fn = U._update_history_kernel
    cfg = dict(T=64, BLOCKS=blocks, HAS_SEEN=seen, BMAX=bmax, NP=triton.next_power_of_2(rows),
               GMAX=group is not None, G=group or 64, DB=min(U.DIAGONAL_BLOCKS, blocks))
    k = compile_sm90(fn, cfg, lambda name: PTR.get(name, "fp32" if name in FLOATS else "i32"), "update_registers.py",
                     div16=DIV16, num_warps=warps, enable_fp_fusion=True,  # the launch's default
                     maxnreg=maxnreg or None)
    c = ptxas_counts(k)
    ops = {o: len(re.findall(rf"\b{o}(\.[A-Z0-9.]+)?\b", c["sass"])) for o in OPS}
    return dict(regs=c["regs"], spill=None if c["spill_st"] is None else c["spill_st"] + c["spill_ld"], ops=ops,
                log="" if c["regs"] is not None else c["log"][-300:])


def pass_counts(seen: bool = False) -> dict:
    """The pipelined update pass (`_update_pass_kernel`: SpinIndexer's side stream from PIPELINED_MIN_BLOCKS) at its
    production tile, stages and warps, uncapped as launched: registers, spills, SASS instructions, and the
    instructions and block-wide barriers of its tile loop (the SASS between the loop's label and its branch back,
    the diagonal window's sub-tile loop included), where a barrier makes a tile's four warps wait for each other."""
    fn = U._update_pass_kernel
    cfg = dict(T=64, HAS_SEEN=seen, NP=1, STAGES=U.PIPELINED_STAGES, **U.tile_meta())
    k = compile_sm90(fn, cfg, lambda name: PTR.get(name, "fp32" if name in FLOATS else "i32"), "update_registers.py",
                     div16=DIV16 - {"bmax_ptr", "gmax_ptr", "bmax_stride", "gmax_stride"}, num_warps=U.NUM_WARPS,
                     enable_fp_fusion=True)
    c = ptxas_counts(k)
    lines = c["sass"].splitlines()
    instr = [i for i, line in enumerate(lines) if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    # the tile loop: the longest loop (a label, then a branch back to it) holding the pipeline's cp.async
    # (LDGSTS)
    loop = max((x for x in sass_loops(lines) if "LDGSTS" in "\n".join(lines[x[0]:x[1]])),
               key=lambda x: x[1] - x[0], default=(0, 0))
    body = [lines[i] for i in instr if loop[0] < i <= loop[1]]
    count = lambda text, op: len(re.findall(rf"\b{re.escape(op)}\b", text))  # noqa: E731
    return dict(regs=c["regs"], spill=None if c["spill_st"] is None else c["spill_st"] + c["spill_ld"],
                instrs=len(instr), loop=len(body), ops={o: count("\n".join(body), o) for o in PASS_OPS})


def maxima_counts(group: int, bmax: bool, maxnreg: int | None) -> dict:
    """The maxima pass at its production tile (MX.TILE_UNITS x T) and warps, columns a multiple of T."""
    cfg = dict(T=64, G=group, TB=MX.TILE_UNITS, GMAX=True, BMAX=bmax, EVEN=True)
    k = compile_sm90(MX._row_maxima_kernel, cfg,
                     lambda name: "*i32" if name == "len_ptr" else ("*fp32" if name.endswith("_ptr") else "i32"),
                     "update_registers.py", div16={"x_ptr", "len_ptr", "gmax_ptr", "bmax_ptr", "stride_x",
                                                   "stride_g", "stride_b", "cols"},
                     num_warps=MX.NUM_WARPS, maxnreg=maxnreg or None)
    c = ptxas_counts(k)
    ops = {o: len(re.findall(rf"\b{o}(\.[A-Z0-9.]+)?\b", c["sass"])) for o in OPS}
    return dict(regs=c["regs"], spill=None if c["spill_st"] is None else c["spill_st"] + c["spill_ld"], ops=ops,
                log="" if c["regs"] is not None else c["log"][-300:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="*", help="blocks per program (default: production and 16)")
    ap.add_argument("--warps", type=int, default=U.NUM_WARPS)
    ap.add_argument("--group", type=int, default=16, help="G of the group maxima (0: no group max)")
    ap.add_argument("--rows", type=int, default=1, help="next_n of the launch")
    ap.add_argument("--seen", action="store_true", help="with last_seen")
    ap.add_argument("--maxnreg", type=int, nargs="*",
                    help="register caps (default: the launcher's MAX_REGISTERS and none; 0 = none)")
    a = ap.parse_args()
    print(f"triton {triton.__version__}")
    print(f"{'BLOCKS':>6} {'warps':>5} {'GMAX':>5} {'maxnreg':>7} {'regs':>5} {'spill B':>7} {'progs/SM':>8}  "
          + " ".join(f"{o:>4}" for o in OPS))
    groups = [a.group or None] if a.group != 16 else [16, None]
    caps = a.maxnreg if a.maxnreg is not None else sorted({U.MAX_REGISTERS, 0}, reverse=True)
    for blocks in a.blocks or [U.BLOCKS_PER_PROGRAM, 16]:
        for g in groups:
            for cap in caps:
                c = compile_counts(blocks, a.warps, group=g, rows=a.rows, seen=a.seen, maxnreg=cap or None)
                # registers are allocated per warp in units of 256 (8 per thread); 64 warps per SM at most
                progs = min(64 // a.warps, 65536 // (32 * a.warps * (-(-c["regs"] // 8) * 8))) if c["regs"] else 0
                print(f"{blocks:>6} {a.warps:>5} {str(g or '-'):>5} {str(cap or '-'):>7} {str(c['regs']):>5} "
                      f"{str(c['spill']):>7} {progs:>8}  " + " ".join(f"{c['ops'][o]:>4}" for o in OPS) + c["log"])
    c = pass_counts(a.seen)
    print(f"\npipelined pass ({U.BLOCKS_PER_PROGRAM} x 64 tile, {U.PIPELINED_STAGES} stages, {U.NUM_WARPS} warps, "
          f"uncapped): {c['regs']} registers, spill {c['spill']} B, {c['instrs']} SASS instructions; tile loop "
          f"{c['loop']}: " + ", ".join(f"{o} {n}" for o, n in c["ops"].items()))
    print(f"\nmaxima pass ({MX.TILE_UNITS} x 64 tile, {MX.NUM_WARPS} warps; BMAX: the block max too)")
    print(f"{'G':>6} {'BMAX':>5} {'maxnreg':>7} {'regs':>5} {'spill B':>7}  " + " ".join(f"{o:>4}" for o in OPS))
    for g in (8, 16):
        for bmax in (True, False):
            for cap in sorted({MX.MAX_REGISTERS, 0}, reverse=True):
                c = maxima_counts(g, bmax, cap or None)
                print(f"{g:>6} {str(bmax):>5} {str(cap or '-'):>7} {str(c['regs']):>5} {str(c['spill']):>7}  "
                      + " ".join(f"{c['ops'][o]:>4}" for o in OPS) + c["log"])


if __name__ == "__main__":
    main()
