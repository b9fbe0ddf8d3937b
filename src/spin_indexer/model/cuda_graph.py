"""One decode step captured in a CUDA graph, for loops that replay it (batched quality runs, e2e benchmark).

`capture_step(step)` runs `step()` once for real on a side stream (warms the allocator and any lazy
initialisation; that call is a real decode step), then records a second call into a graph without running
it. Every replay then performs one more step on the same (static) tensors: the step must read and write
only tensors it owns or that were allocated before capture, and must not sync with the host.
"""
from __future__ import annotations

from typing import Callable

import torch


def capture_step(step: Callable[[], None]) -> "torch.cuda.CUDAGraph":
    """Run step() once (real), capture it, return the graph (replay() = one more step). CUDA only."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph
