"""Registers, spills and SASS of the CUDA logits kernel (ops/csrc/paged_logits_sm90.cu) per instantiation
(next_n 1-4, with and without block maxima), without a GPU: nvcc compiles the source for sm_90a as the library does,
ptxas reports registers and spills, triton's nvdisasm disassembles (sass_tools.py: loops and opcodes).

What it prints per kernel: registers, spill bytes (stores / loads), and the block loop of each math warpgroup (the
innermost backward branch around QGMMA: SPW blocks an iteration): its instruction count and the epilogue's
instructions (FFMA, FMNMX, FMUL, FADD, SHFL), and whether a spill sits inside it. This is the count to make before a
device call on the epilogue (run 113: the epilogue's issue rate bounds next_n 3-4), e.g. runs 147-148.

    python benchmarks/cuda_logits_registers.py                           # the library's build
    python benchmarks/cuda_logits_registers.py SPIN_LOGITS_ABS_SUM=1     # a probe build's switches (NAME=VALUE)
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sass_tools import innermost, opcode_counts, sass_loops, triton_tool  # noqa: E402
from spin_indexer.ops.cuda_build import nvcc_path  # noqa: E402
from spin_indexer.ops.indexer_logits_cuda import NVCC_FLAGS, SOURCE  # noqa: E402

EPILOGUE_OPS = ("FFMA", "FMNMX", "FMUL", "FADD", "SHFL")
# an SM90 instruction's bytes: the block loops' code, summed over the warpgroups' copies, is what each SMSP fetches
# (one warp of every math warpgroup runs there); run 182: ~64 KB (w3 at next_n = 3) stalled 25% of samples on
# instruction fetch, ~42 KB (production) 8.5%
INSTRUCTION_BYTES = 16


def kernel_name(mangled: str) -> str:
    """'next_n=<n> maxima=<yes|no>' for a paged_logits_kernel instantiation, else the mangled name."""
    m = re.search(r"paged_logits_kernelILi(\d)ELb([01])E", mangled)
    return f"next_n={m.group(1)} maxima={'yes' if m.group(2) == '1' else 'no'}" if m else mangled


def block_loops(lines: list[str]) -> list[tuple[int, int]]:
    """(label line, branch line) of each math warpgroup's block loop in one kernel's nvdisasm lines: the innermost
    loops around QGMMA, less the ranges from inside a loop to an out-of-line path after it (ptxas places the mbarrier
    waits' retry paths at the function's end, branching back into the loop)."""
    loops = sass_loops(lines)
    mma = innermost([x for x in loops if any("QGMMA" in l for l in lines[x[0]:x[1]])])
    return [x for x in mma if not any(y[0] < x[0] <= y[1] < x[1] for y in loops)]


def loop_code_bytes(row: dict) -> int:
    """The block loops' code of one kernel of `counts`, in bytes, summed over its warpgroups' copies: what each SMSP
    fetches (see INSTRUCTION_BYTES)."""
    return sum(size for size, _, _ in row["loops"]) * INSTRUCTION_BYTES


def ptxas_info(stderr: str) -> dict[str, dict]:
    """Per kernel name (kernel_name's), from `ptxas -v`'s output: registers, spill ("stores/loads" bytes) and
    serialized: True where ptxas said it serializes the kernel's wgmma instructions (C7514 / C7520: each MMA then
    waits for the previous one, the asynchronous MMA lost; a kernel without the line gets False)."""
    info, current = {}, None
    for line in stderr.splitlines():
        m = re.search(r"wgmma\.mma_async instructions are serialized.* in the function '(\w+)'", line)
        if m:
            info.setdefault(kernel_name(m.group(1)), {})["serialized"] = True
            continue
        m = re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?", line)
        if m:
            current = kernel_name(m.group(1))
            info.setdefault(current, {}).setdefault("serialized", False)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            info[current]["spill"] = f"{m.group(1)}/{m.group(2)}"
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            info[current]["registers"] = int(m.group(1))
    return info


def counts(defines: tuple[str, ...] = ()) -> list[dict]:
    """Per kernel instantiation: name, registers, spill (stores/loads bytes), serialized (ptxas_info), instructions
    (the kernel's SASS), loops [(instructions, {op: count}, spill inside)]. Raises RuntimeError when nvcc is missing
    or fails."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (PATH, CUDA_HOME)")
    flags = [f for f in NVCC_FLAGS if f not in ("-shared", "-Xcompiler", "-fPIC")]
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        proc = subprocess.run([nvcc, *flags, "-cubin", "-Xptxas", "-v", *(f"-D{d}" for d in defines), "-o", cubin,
                               str(SOURCE)], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"nvcc failed:\n{proc.stderr[-2000:]}")
        sass = subprocess.run([triton_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    info = ptxas_info(proc.stderr)
    out = []
    for part in re.split(r"^\.text\.", sass, flags=re.M)[1:]:  # one kernel's section each
        name = kernel_name(part.split(":", 1)[0])
        lines = part.splitlines()
        loops = [(sum(ops.values()), ops, ops["LDL"] + ops["STL"] > 0)
                 for a, b in block_loops(lines) for ops in [opcode_counts(lines[a:b + 1])]]
        out.append(dict(name=name, **info.get(name, {}), loops=loops, instructions=sum(opcode_counts(lines).values())))
    return sorted(out, key=lambda r: r["name"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("defines", nargs="*", help="build switches NAME=VALUE (the probe builds'; none: the library's)")
    args = p.parse_args(argv)
    for row in counts(tuple(args.defines)):
        loop_kb = loop_code_bytes(row) / 1024
        print(f"{row['name']}: {row.get('registers')} registers, spill {row.get('spill')} (stores/loads bytes), "
              f"{row['instructions']} SASS instructions, block loops {loop_kb:.0f} KB"
              + (" (MMAs serialized by ptxas)" if row.get("serialized") else ""))
        for size, ops, spill in row["loops"]:
            print(f"    block loop: {size} instructions, QGMMA {ops['QGMMA']}, "
                  + ", ".join(f"{op} {ops[op]}" for op in EPILOGUE_OPS) + (" (a spill inside)" if spill else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
