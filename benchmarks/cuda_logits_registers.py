"""Registers, spills and SASS of the CUDA logits kernel (ops/csrc/paged_logits_sm90.cu) per instantiation
(next_n 1-4, with and without block maxima), without a GPU: nvcc compiles the source for sm_90a as the library does,
ptxas reports registers and spills, cuobjdump disassembles.

What it prints per kernel: registers, spill bytes (stores / loads), and the block loop of each math warpgroup (the
innermost backward branch around QGMMA: SPW blocks an iteration): its instruction count and the epilogue's
instructions (FFMA, FMNMX, FMUL, FADD, SHFL), and whether a spill sits inside it. This is the count to make before a
device call on the epilogue (run 113: the epilogue's issue rate bounds next_n 3-4), e.g. runs 147-148.

    python benchmarks/cuda_logits_registers.py                           # the library's build
    python benchmarks/cuda_logits_registers.py SPIN_LOGITS_ABS_SUM=1     # a probe build's switches (NAME=VALUE)
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from spin_indexer.ops.indexer_logits_cuda import NVCC_FLAGS, SOURCE, nvcc_path  # noqa: E402

EPILOGUE_OPS = ("FFMA", "FMNMX", "FMUL", "FADD", "SHFL")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def cuobjdump_path(nvcc: str) -> str | None:
    """cuobjdump beside nvcc, else on PATH, else the one triton ships; None if there is none."""
    beside = os.path.join(os.path.dirname(nvcc), "cuobjdump")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("cuobjdump")
    if found:
        return found
    shipped = glob.glob(os.path.join(os.path.dirname(sys.executable), "..", "lib", "python3*", "site-packages",
                                     "triton", "backends", "nvidia", "bin", "cuobjdump"))
    try:
        import triton
        shipped.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    return next((p for p in shipped if os.access(p, os.X_OK)), None)


def kernel_name(mangled: str) -> str:
    """'next_n=<n> maxima=<yes|no>' for a paged_logits_kernel instantiation, else the mangled name."""
    m = re.search(r"paged_logits_kernelILi(\d)ELb([01])E", mangled)
    return f"next_n={m.group(1)} maxima={'yes' if m.group(2) == '1' else 'no'}" if m else mangled


def block_loops(sass: str) -> list[tuple[int, int, list[str]]]:
    """The innermost loops around QGMMA: (first, last address, opcodes), one per compiled copy of the block loop."""
    ins = [(int(a, 16), op, rest) for a, op, rest in INSTRUCTION.findall(sass)]
    loops = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            body = [o for a, o, _ in ins if lo <= a <= addr]
            if any(o.startswith("QGMMA") for o in body):
                loops.append((lo, addr, body))
    # innermost (no other loop inside), and not a range from inside a loop to an out-of-line path after it (ptxas
    # places the mbarrier waits' retry paths at the function's end, branching back into the loop)
    inner = [x for x in loops if not any(y is not x and x[0] <= y[0] and y[1] <= x[1] for y in loops)]
    return [x for x in inner if not any(y[0] < x[0] <= y[1] < x[1] for y in loops)]


def counts(defines: tuple[str, ...] = ()) -> list[dict]:
    """Per kernel instantiation: name, registers, spill (stores/loads bytes), loops [(instructions, {op: count},
    spill inside)]. Raises RuntimeError when nvcc or cuobjdump is missing or nvcc fails."""
    nvcc = nvcc_path()
    cuobjdump = cuobjdump_path(nvcc) if nvcc else None
    if nvcc is None or cuobjdump is None:
        raise RuntimeError("nvcc and cuobjdump are needed (CUDA_HOME, PATH, or triton's bundled cuobjdump)")
    flags = [f for f in NVCC_FLAGS if f not in ("-shared", "-Xcompiler", "-fPIC")]
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        proc = subprocess.run([nvcc, *flags, "-cubin", "-Xptxas", "-v", *(f"-D{d}" for d in defines), "-o", cubin,
                               str(SOURCE)], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"nvcc failed:\n{proc.stderr[-2000:]}")
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    info, current = {}, None
    for line in proc.stderr.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?", line)
        if m:
            current = kernel_name(m.group(1))
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            info.setdefault(current, {})["spill"] = f"{m.group(1)}/{m.group(2)}"
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            info.setdefault(current, {})["registers"] = int(m.group(1))
    out = []
    for part in sass.split("Function : ")[1:]:
        name = kernel_name(part.split("\n", 1)[0].strip())
        spills = [int(a, 16) for a, op, _ in INSTRUCTION.findall(part) if op.startswith(("STL", "LDL"))]
        loops = [(len(body), collections.Counter(o.split(".")[0] for o in body),
                  any(lo <= a <= hi for a in spills)) for lo, hi, body in block_loops(part)]
        out.append(dict(name=name, **info.get(name, {}), loops=loops))
    return sorted(out, key=lambda r: r["name"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("defines", nargs="*", help="build switches NAME=VALUE (the probe builds'; none: the library's)")
    args = p.parse_args(argv)
    for row in counts(tuple(args.defines)):
        print(f"{row['name']}: {row.get('registers')} registers, spill {row.get('spill')} (stores/loads bytes)")
        for size, ops, spill in row["loops"]:
            print(f"    block loop: {size} instructions, QGMMA {ops['QGMMA']}, "
                  + ", ".join(f"{op} {ops[op]}" for op in EPILOGUE_OPS) + (" (a spill inside)" if spill else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
