"""SASS helpers of the *_registers.py scripts: triton's bundled CUDA tools, and loops and opcodes of nvdisasm output.
Without side effects on import (the *_registers.py scripts that compile Triton kernels drop TRITON_INTERPRET when
imported; cuda_logits_registers.py, which compiles CUDA only, imports this alone, so the test suite's interpreter
keeps running after it)."""
from __future__ import annotations

import collections
import glob
import os
import re


def triton_tool(name: str) -> str:
    """The newest of triton's bundled CUDA tools called `name` (ptxas, nvdisasm, ...), else `name` (from PATH)."""
    import triton

    found = sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name + "*")))
    # the ptxas without a suffix may be too old for the PTX of this triton: prefer the newest one
    return found[-1] if found else name


def sass_loops(lines: list[str]) -> list[tuple[int, int]]:
    """(label line, branch line) of every loop of nvdisasm SASS lines: a label, then a branch back to it."""
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", l))}
    loops = []
    for i, l in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", l)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append((labels[m.group(1)], i))
    return loops


def innermost(loops: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The loops of sass_loops that contain no other loop."""
    return [(a, b) for a, b in loops if not any(a < c and d < b for c, d in loops if (c, d) != (a, b))]


def opcode_counts(lines: list[str]) -> collections.Counter:
    """Opcodes (without modifiers) of nvdisasm SASS lines, counted."""
    return collections.Counter(m.group(1) for line in lines
                               if (m := re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)))
