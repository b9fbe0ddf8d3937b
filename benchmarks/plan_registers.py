"""Register and spill counts of the fused planner's select kernel (predictor/plan_triton.py), without a GPU.

Compiles `_plan_select_kernel` for sm_90a with the local triton (compile only: no device needed), runs the
ptxas that ships with triton with -v, and disassembles the cubin to tell where the spills are: the
`inner loops` column counts local loads/stores inside the innermost loops of the SASS (the bisection and
lane-bisection loops of the register path, run ~20-40 times per program), the rest run once or once per
prediction row. The counts are indicative: the local triton may differ from the one on the GPU host, so
check with that one too (a triton 3.6 wheel unpacked into /tmp/t36: `PYTHONPATH=/tmp/t36:src`): run 17's H = 1
tile of the multiway select (reverted after run 18) spilled 125 KB and took 254 s in ptxas under 3.6, nothing
under 3.9.

    PYTHONPATH=src python benchmarks/plan_registers.py                 # the register path's default configs
    PYTHONPATH=src python benchmarks/plan_registers.py --sb 8192 --warps 8 --maxnreg 0 --rows 4 --slot
    PYTHONPATH=src python benchmarks/plan_registers.py --part 2 --sb 256 2048   # the summary mix's select
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sass_tools import innermost, sass_loops, triton_tool  # noqa: E402

from spin_indexer.predictor import SpinConfig  # noqa: E402
from spin_indexer.predictor import plan_triton as P  # noqa: E402

PTR = {"table_ptr": "*i32", "lens_ptr": "*i32", "slot_ptr": "*i64", "stash_ptr": "*i32", "vert_ptr": "*fp16",
       "bmax_ptr": "*fp16", "diag_ptr": "*fp16", "scr_ptr": "*fp32", "flg_ptr": "*i8", "kept_ptr": "*i32",
       "ctab_ptr": "*i32", "nkept_ptr": "*i32", "clen_ptr": "*i32", "step_ptr": "*i32", "seen_ptr": "*i32",
       "clock_ptr": "*i32", "sum_ptr": "*fp32", "full_ptr": "*i32", "summarized_ptr": "*i32", "w_hist": "fp32",
       "w_sum": "fp32", "layer_sparsity_ptr": "*fp64"}


def ptxas_counts(kernel) -> dict:
    """ptxas -v for sm_90a and nvdisasm of a compiled triton kernel (shared by logits_registers.py and
    update_registers.py): regs, spill_st / spill_ld bytes (None when ptxas printed none), its log and the SASS."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([triton_tool("ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o", cubin],
                           capture_output=True, text=True)
        sass = subprocess.run([triton_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    return dict(regs=int(regs.group(1)) if regs else None, spill_st=int(spill.group(1)) if spill else None,
                spill_ld=int(spill.group(2)) if spill else None, log=r.stderr, sass=sass)


def compile_sm90(fn, consts: dict, arg_type, script: str, div16=(), **options):
    """triton kernel `fn` compiled for sm_90a without a GPU (shared by the *_registers.py scripts): consts its
    constexprs by name (one it lacks stops the run, naming `script` to update), arg_type(name) the triton type
    of every other argument ("*fp32", "i32", ...), div16 the arguments the launch's tensors make 16-aligned
    (triton's specialization), options triton.compile's (num_warps, maxnreg, ...; None values dropped)."""
    missing = set(consts) - set(fn.arg_names)
    if missing:
        raise SystemExit(f"{fn.__name__} has no constexpr {sorted(missing)}: update benchmarks/{script}")
    sig = {name: "constexpr" if name in consts else arg_type(name) for name in fn.arg_names}
    cidx = {(fn.arg_names.index(name),): value for name, value in consts.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in div16}
    return triton.compile(ASTSource(fn, sig, constexprs=cidx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={k: v for k, v in options.items() if v is not None})


def compile_counts(sb: int, warps: int, maxnreg: int | None, rows: int = 1, slot: bool = False,
                   explore: bool = True, combine: int = 0, sbs: int = 64, reg: bool = True, part: int = 0,
                   profile: bool = False) -> dict:
    """part: 0 the paper's plan() launch (every layer, every request), 1 the same with summary_below (only the
    requests that do not mix), 2 the summary mix's per-layer launch in run() (select_layer_triton)."""
    fn = P._plan_select_kernel
    # the launcher's choice of the window path for this rule (fp16 state: 2-byte cells)
    rule = SpinConfig(sparsity=0.4, topk=2048, reduce="mean" if slot else "max",
                      combine={v: k for k, v in P._COMBINE.items()}[combine])
    cfg = dict(T=64, TP=64, NP=rows, SB=sb, SBS=sbs, SLOT=slot, COMBINE=combine, MEAN=slot, EXPLORE=explore,
               REG=reg, FINISH=part != 2, SUMMARY=part == 2, CACHED=part == 2, PART=part,
               WIN_ROWS=P._window_path_rows(rule, warps, reg, part == 2, 2), PROFILE=profile)
    def arg_type(name):
        return PTR.get(name, "i64" if name in ("sparsity_bits", "gamma_bits", "summary_below") else "i32")

    # specialized as a launch on a table of W % 16 == 0 columns is (aligned tensors, W and its row stride)
    div16 = [name for name in fn.arg_names if name.endswith("_ptr")] + ["width", "stride_tb"]
    c = ptxas_counts(compile_sm90(fn, cfg, arg_type, "plan_registers.py", div16=div16, num_warps=warps,
                                  enable_fp_fusion=False, maxnreg=maxnreg or None))
    return dict(regs=c["regs"], spill_st=c["spill_st"], spill_ld=c["spill_ld"], inner=_inner_loop_spills(c["sass"]),
                log=c["log"] if c["regs"] is None else "")


def _inner_loop_spills(sass: str) -> int:
    """LDL/STL inside loops that contain no other loop (a label, then a branch back to it)."""
    lines = sass.splitlines()
    return sum(1 for a, b in innermost(sass_loops(lines)) for l in lines[a:b] if re.search(r"\b(LDL|STL)\b", l))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sb", type=int, nargs="*", help="register tile widths (blocks)")
    ap.add_argument("--warps", type=int, help="warps (default: the launcher's choice for the tile)")
    ap.add_argument("--maxnreg", type=int, help="register cap (default: the launcher's; 0 = none)")
    ap.add_argument("--rows", type=int, default=1, help="NP: prediction rows (next_n, a power of two)")
    ap.add_argument("--slot", action="store_true", help="a per-slot rule (reduce=mean)")
    ap.add_argument("--no-explore", action="store_true")
    ap.add_argument("--profile", action="store_true", help="a SpinConfig.sparsity_profile (PROFILE)")
    ap.add_argument("--part", type=int, default=0, choices=(0, 1, 2),
                    help="0: plan()'s launch; 1: with summary_below; 2: the summary mix's launch in run() (its "
                         "launcher's defaults: 16-block score tiles, no register cap)")
    ap.add_argument("--sbs", type=int, help="blocks a score tile (default: the launcher's, 64; 16 for part 2)")
    a = ap.parse_args()
    print(f"{'SB':>6} {'warps':>5} {'maxnreg':>7} {'regs':>5} {'spill st/ld B':>14} {'inner loops':>11}")
    for sb in a.sb or [2048, 8192, 16384]:
        warps = a.warps or P._register_warps(sb)
        default_cap = None if a.part == 2 else P._register_maxnreg(warps)
        cap = default_cap if a.maxnreg is None else (a.maxnreg or None)
        c = compile_counts(sb, warps, cap, rows=a.rows, slot=a.slot, explore=not a.no_explore, part=a.part,
                           sbs=a.sbs or (16 if a.part == 2 else 64), profile=a.profile)
        print(f"{sb:>6} {warps:>5} {str(cap):>7} {str(c['regs']):>5} {c['spill_st']:>6}/{c['spill_ld']:<7} "
              f"{c['inner']:>11}" + (f"  {c['log'][-300:]}" if c["log"] else ""))


if __name__ == "__main__":
    main()
