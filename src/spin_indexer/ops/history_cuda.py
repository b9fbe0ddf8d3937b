"""SPIN's EMA update alone (no maxima) in CUDA (csrc/update_pass.cu): the pass SpinIndexer runs on its side
stream beside the top-k, where nothing else reads the logits (the update in the top-k's launch and the passes that
also write maxima stay in Triton: history_triton). Same math and state as `history.update_history_ref`, bit for
bit (no FMA contraction in the EMA). Each half-warp takes whole 64-token blocks with vector loads, four blocks
loaded before any is updated, no shared memory and no barrier (see the source for why not Triton).

Built with nvcc on first use (cuda_build.py) for sm_80 / sm_90 (PTX beyond); `takes` answers False where nvcc, the
GPU or the build is missing, or a tensor's layout is not the kernel's, and the caller keeps the Triton pass.
Not yet the default (STEP_USES): written in session 64 while no GPU could be had, its tests and its A/B against the
Triton pass have not run; SPIN_INDEXER_UPDATE=cuda opts in, =triton opts out.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from ..dispatch import forced_update_backend
from .cuda_build import build_library
from .history import HistoryUpdate
from .maxima_triton import sm_count

SOURCE = Path(__file__).with_name("csrc") / "update_pass.cu"
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
              "-gencode=arch=compute_90,code=compute_90", "-shared", "-Xcompiler", "-fPIC")
TOKENS = 64  # T: the kernel's tokens a block
WORKERS = 16  # blocks a CTA holds at once (a half-warp each)
CTAS_PER_SM = 3  # resident CTAs of 256 threads an SM at the kernel's 64-80 registers (ptxas, sm_90)
# Whether the step takes this pass where nothing is forced: off until a GPU run checks it against the reference
# and times it against the Triton pass (benchmarks/update_overlap.py, variants spin / cudapass / tritonpass)
STEP_USES = False
ERRORS = {-4: "the launch failed", -5: "bad arguments", -6: "the inputs' device could not be made current"}


class UpdateArgs(ctypes.Structure):
    """The kernel's argument struct (csrc/update_pass.cu, UpdateArgs), field for field."""
    _fields_ = [("logits", ctypes.c_void_p), ("logits_stride_b", ctypes.c_int64), ("logits_stride_n", ctypes.c_int64),
                ("table", ctypes.c_void_p), ("table_stride", ctypes.c_int64), ("compact_lens", ctypes.c_void_p),
                ("vertical", ctypes.c_void_p), ("block_max", ctypes.c_void_p), ("block_max_stride", ctypes.c_int64),
                ("diagonal", ctypes.c_void_p), ("diagonal_stride", ctypes.c_int64),
                ("last_seen", ctypes.c_void_p), ("last_seen_stride", ctypes.c_int64), ("clock", ctypes.c_void_p),
                ("slot_ids", ctypes.c_void_p), ("kept", ctypes.c_void_p), ("kept_stride", ctypes.c_int64),
                ("seq_lens", ctypes.c_void_p), ("update_rows", ctypes.c_void_p),
                ("alpha", ctypes.c_float), ("beta", ctypes.c_float), ("lo", ctypes.c_float), ("hi", ctypes.c_float),
                ("window", ctypes.c_int64), ("trash", ctypes.c_int64),
                ("next_n", ctypes.c_int32), ("num_blocks", ctypes.c_int32), ("row", ctypes.c_int32),
                ("programs", ctypes.c_int32)]


def build(out_dir: str | os.PathLike | None = None) -> Path:
    """Compiles the pass's library (a few seconds) unless the cache holds it; returns its path (RuntimeError with
    nvcc's message when nvcc is missing or fails)."""
    return build_library(SOURCE, NVCC_FLAGS, out_dir)


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The built library with its entry point typed; None where it does not build or load."""
    try:
        lib = ctypes.CDLL(str(build()))
        fn = lib.spin_update_pass
    except (RuntimeError, OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(UpdateArgs), ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return lib


@functools.cache
def _serves(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0) and load_library() is not None


def _aligned(t: torch.Tensor, elements: int) -> bool:
    """t's rows start on `elements`-element boundaries (its pointer and every stride but the last)."""
    size = t.element_size() * elements
    return t.data_ptr() % size == 0 and all(s % elements == 0 for s in t.stride()[:-1]) and t.stride(-1) == 1


def takes(history: HistoryUpdate, logits: torch.Tensor, compact_table: torch.Tensor,
          compact_lens: torch.Tensor) -> bool:
    """Whether ops.update_history gives this update to the CUDA pass: where it `runs`, if SPIN_INDEXER_UPDATE=cuda
    or (nothing forced) STEP_USES; =triton never. A host rule on static properties (no sync)."""
    forced = forced_update_backend()
    if forced == "triton" or (forced is None and not STEP_USES):
        return False
    return runs(history, logits, compact_table, compact_lens)


def runs(history: HistoryUpdate, logits: torch.Tensor, compact_table: torch.Tensor,
         compact_lens: torch.Tensor) -> bool:
    """Whether the CUDA pass can run this update: CUDA tensors on an SM80+ GPU with the library built, T = 64 and
    the layouts the kernel addresses (V fp16 contiguous, logits float32 rows in 16-byte vectors, the ids and
    lengths int32 rows, update_rows bool)."""
    h = history
    if not (logits.is_cuda and logits.dim() == 3 and logits.dtype == torch.float32 and _aligned(logits, 4)):
        return False
    if h.vertical.dim() != 2 or h.vertical.shape[1] != TOKENS or h.vertical.dtype != torch.float16 or \
            not h.vertical.is_contiguous() or h.vertical.data_ptr() % 8 or h.vertical.shape[0] > 2 ** 31 - 1:
        return False
    lens_ok = all(t.is_contiguous() for t in (compact_lens, h.seq_lens, h.update_rows))
    ids_ok = compact_table.dtype == h.kept_blocks.dtype == compact_lens.dtype == h.seq_lens.dtype == torch.int32 and \
        compact_table.stride(-1) == 1 and h.kept_blocks.stride(-1) == 1
    state_ok = h.block_max.dtype == h.diagonal.dtype == torch.float16 and h.diagonal.stride(-1) == 1 and \
        h.update_rows.dtype == torch.bool and h.slot_ids.dtype == torch.int64 and h.clock.dtype == torch.int32 and \
        (h.last_seen is None or h.last_seen.dtype == torch.int32)
    return lens_ok and ids_ok and state_ok and _serves(logits.device)


def pass_programs(batch: int, blocks: int, device: torch.device) -> int:
    """CTAs a request: the GPU's resident CTAs shared by the requests, at most one per WORKERS blocks of the
    table's width (a static grid: a CUDA graph keeps it)."""
    return max(1, min(CTAS_PER_SM * sm_count(device) // max(batch, 1), -(-blocks // WORKERS)))


def update_history_cuda(history: HistoryUpdate, logits: torch.Tensor, compact_table: torch.Tensor,
                        compact_lens: torch.Tensor, programs: int | None = None) -> None:
    """update_history_ref(history, logits, compact_table, compact_lens) on the GPU, for inputs `runs` accepts
    (ValueError otherwise): logits float32 [B, N, X]; compact_table int32 [B, >= X / 64]; compact_lens int32 [B, N].
    One launch per updating row (history.rows), in order. programs: CTAs a request (None: pass_programs; tests
    shrink it so that each CTA loops over several rounds of blocks)."""
    if not runs(history, logits, compact_table, compact_lens):
        raise ValueError("history / logits: the CUDA update pass takes CUDA tensors on an SM80+ GPU with T = 64, V "
                         "fp16 contiguous, logits float32 rows 16-byte aligned, int32 ids and lengths (see runs)")
    batch, next_n, cols = logits.shape
    blocks = cols // TOKENS
    if batch == 0 or blocks == 0:
        return
    h = history
    programs = pass_programs(batch, blocks, logits.device) if programs is None else programs
    finfo = torch.finfo(torch.float16)
    seen = h.last_seen
    args = UpdateArgs(
        logits.data_ptr(), logits.stride(0), logits.stride(1), compact_table.data_ptr(), compact_table.stride(0),
        compact_lens.data_ptr(), h.vertical.data_ptr(), h.block_max.data_ptr(),
        h.block_max.stride(0) if h.block_max.dim() else 0, h.diagonal.data_ptr(), h.diagonal.stride(0),
        None if seen is None else seen.data_ptr(), 0 if seen is None or not seen.dim() else seen.stride(0),
        h.clock.data_ptr(), h.slot_ids.data_ptr(), h.kept_blocks.data_ptr(), h.kept_blocks.stride(0),
        h.seq_lens.data_ptr(), h.update_rows.data_ptr(), float(h.alpha), float(1.0 - h.alpha), finfo.min,
        finfo.max, int(h.window), h.trash_block, next_n, blocks, 0, programs)
    stream = torch.cuda.current_stream(logits.device).cuda_stream
    fn = load_library().spin_update_pass
    for j in range(h.rows):
        args.row = j
        rc = fn(ctypes.byref(args), batch, logits.device.index, stream)
        if rc != 0:
            raise RuntimeError(f"update_history_cuda: {ERRORS.get(rc, rc)}")
