"""The GPU's places for programs: its SMs (`sm_count`) and how many programs of a compiled Triton kernel one SM
holds at once (`resident_programs`).

A grid of programs of equal work runs in waves of (resident programs x SMs); the last wave's size decides whether
it keeps HBM busy (indexer_logits_triton.wave_chunk). The driver knows the exact number from the kernel's
registers, threads and dynamic shared memory (cuOccupancyMaxActiveBlocksPerMultiprocessor), so nothing here
copies the SM's limits into the library.
"""
from __future__ import annotations

import ctypes
import functools

import torch


def sm_count(device: torch.device) -> int:
    """SMs of `device` (a CUDA device without an index: the current one; 4 off CUDA: the interpreter's grids stay
    small); the Triton passes size their grids by it, DeepGEMM's schedule is computed for it."""
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:  # no NVIDIA driver library (another GPU vendor's Triton): callers keep their block-count rules
        return None


def resident_programs(kernel) -> int | None:
    """Programs of `kernel` (a compiled Triton kernel, e.g. JITFunction.warmup's result, on the current device) one
    SM holds at once, or None where the CUDA driver cannot say (no libcuda, an error code)."""
    lib = _libcuda()
    if lib is None:
        return None
    kernel._init_handles()  # loads the module: `function` (the CUfunction) exists from then on
    blocks = ctypes.c_int(0)
    err = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(kernel.function), ctypes.c_int(kernel.metadata.num_warps * 32),
        ctypes.c_size_t(kernel.metadata.shared))
    return blocks.value if err == 0 and blocks.value > 0 else None
