"""Registers, spills and SASS op counts of the exact top-k's kernels (ops/topk_triton.py), without a GPU.

Compiles each kernel of the chain (`_threshold_kernel` with and without the hint and the EMA update,
`_gather_kernel`, `_chunk_sort_kernel`, `_rank_kernel`, `_select_set_kernel`) for sm_90a with the local triton at the production
shapes (k = 2048: CAP = 4096; the group size of 64K / 128K / 512K columns, 8192 group maxima), under the
launcher's num_warps / maxnreg, runs the ptxas that ships with triton with -v and counts SASS ops: BAR (CTA
barriers: a reduction or a scan across warps), SHFL, global loads/stores/atomics, local (spill) traffic.
The fast path must not spill; the rank and set-select kernels also hold the overflow merge (`_merge_overflow`, a
CAP-key sort in registers, rare) whose spills are expected under the register cap: `inner` counts the local
loads/stores inside innermost loops (the merge's streaming loop), `spill` all of them.
The counts are indicative: run it with the GPU host's triton (3.6 on the H200 runs) to match it, e.g. a wheel
unpacked into /tmp/t36: `PYTHONPATH=/tmp/t36:src python benchmarks/topk_registers.py`.

    PYTHONPATH=src TRITON_DEFAULT_FP_FUSION=1 python benchmarks/topk_registers.py
    PYTHONPATH=src TRITON_DEFAULT_FP_FUSION=1 python benchmarks/topk_registers.py --groups 8 64
"""
from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402

from plan_registers import _inner_loop_spills, compile_sm90, ptxas_counts  # noqa: E402
from spin_indexer.ops import history_triton as H  # noqa: E402
from spin_indexer.ops import history_block_triton as HB  # noqa: E402
from spin_indexer.ops import topk_triton as T  # noqa: E402

PTR = {"s_ptr": "*fp32", "len_ptr": "*i32", "thresh_ptr": "*i32", "live_ptr": "*i32", "nlive_ptr": "*i32",
       "count_ptr": "*i32", "out_ptr": "*i32", "x_ptr": "*fp32", "cand_ptr": "*i64", "kept_ptr": "*i32",
       "cnt_ptr": "*i32", "lst_ptr": "*i32", "stats_ptr": "*i32", "tau_ptr": "*i32", "hint_ptr": "*i32",
       # the EMA update's, in the threshold + update launch
       "table_ptr": "*i32", "v_ptr": "*fp16", "bm_ptr": "*fp32", "vb_ptr": "*fp16", "d_ptr": "*fp16", "seen_ptr": "*i32",
       "clock_ptr": "*i32", "slot_ptr": "*i64", "lens_ptr": "*i32", "upd_ptr": "*i8",
       "alpha": "fp32", "lo": "fp32", "hi": "fp32"}
# what the launcher's tensors give triton's specialization: 16-byte aligned base pointers and row strides
DIV16 = set(PTR) | {"stride_s", "stride_x", "kept_stride"}
OPS = ("BAR", "SHFL", "LDG", "STG", "ATOMG", "LDL", "STL")


def compile_counts(fn, consts: dict, warps: int, maxnreg: int | None = None) -> dict:
    k = compile_sm90(fn, consts, lambda name: PTR.get(name, "i32"), "topk_registers.py", div16=DIV16,
                     num_warps=warps, maxnreg=maxnreg or None)
    c = ptxas_counts(k)
    ops = {o: len(re.findall(rf"\b{o}(\.[A-Z0-9_.]+)?\b", c["sass"])) for o in OPS}
    instr = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", c["sass"], flags=re.M))
    spill = None if c["spill_st"] is None else c["spill_st"] + c["spill_ld"]
    return dict(regs=c["regs"], spill=spill, inner=_inner_loop_spills(c["sass"]), ops=ops, instr=instr,
                smem=k.metadata.shared, log="" if c["regs"] is not None else c["log"][-300:])


def configs(group: int, k: int = 2048):
    """(name, kernel, constexprs, warps, maxnreg) of every launch of the chain at this group size."""
    k_pow = triton.next_power_of_2(max(k, 16))
    cap = 2 * k_pow
    sb = min(triton.next_power_of_2(4 * k), T.THRESHOLD_TILE_MAX)  # 8192 group maxima at production shapes
    even = True
    chunk = min(T.SORT_CHUNK, cap)
    hint = dict(HINT_R=T.TAU_HINT_RADIUS, HINT_STEPS=(2 * T.TAU_HINT_RADIUS).bit_length())
    warps = T.threshold_warps(sb)  # the launcher's choice
    return [("threshold", T._threshold_kernel, dict(G=group, SB=sb, CAP=cap, HINT=False, **hint), warps, None),
            ("threshold, tau_hint", T._threshold_kernel, dict(G=group, SB=sb, CAP=cap, HINT=True, **hint),
             warps, None),
            ("threshold + EMA update", T._threshold_update_kernel,
             dict(G=group, SB=sb, CAP=cap, HINT=False, **hint, T=64, HAS_SEEN=True, NP=1, BLOCK_GRAIN=False,
                  **H.tile_meta()), warps, None),
            ("threshold + block-grain update", T._threshold_update_kernel,
             dict(G=group, SB=sb, CAP=cap, HINT=False, **hint, T=64, HAS_SEEN=True, NP=1, BLOCK_GRAIN=True,
                  **HB.block_tile_meta(T.IN_TOPK_BLOCKS, diagonal=T.IN_TOPK_BLOCKS)), warps, None),
            ("gather", T._gather_kernel, dict(G=group, LB=max(16, T.GATHER_VALUES // group), CAP=cap, EVEN=even), 4,
             None),
            ("chunk sort", T._chunk_sort_kernel, dict(CAP=cap, CH=chunk), 4, None),
            ("rank", T._rank_kernel, dict(K_POW=k_pow, CAP=cap, CH=chunk, LOG_CH=chunk.bit_length() - 1,
                                          BI=T.RANK_BI, MAP=True), 4, T.RANK_MAXNREG),
            ("set select (sorted=False)", T._select_set_kernel,
             dict(K_POW=k_pow, CAP=cap, MAP=True),
             T.set_select_warps(cap), None)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, nargs="*", default=[8, 16, 64],
                    help="group sizes G (8: 64K columns, 16: 128K, 64: 512K at k = 2048)")
    a = ap.parse_args()
    print(f"triton {triton.__version__}, k = 2048, sm_90a")
    print(f"{'kernel':<34} {'G':>3} {'warps':>5} {'maxnreg':>7} {'regs':>5} {'spill B':>7} {'inner':>5} "
          f"{'instr':>6} {'smem':>6}  " + " ".join(f"{o:>5}" for o in OPS))
    seen = set()
    for g in a.groups:
        for name, fn, consts, warps, cap in configs(g):
            key = (name, tuple(sorted(consts.items())))
            if key in seen:
                continue
            seen.add(key)
            c = compile_counts(fn, consts, warps, cap)
            print(f"{name:<34} {g:>3} {warps:>5} {str(cap or '-'):>7} {str(c['regs']):>5} {str(c['spill']):>7} "
                  f"{c['inner']:>5} {c['instr']:>6} {c['smem']:>6}  "
                  + " ".join(f"{c['ops'][o]:>5}" for o in OPS) + c["log"])


if __name__ == "__main__":
    main()
