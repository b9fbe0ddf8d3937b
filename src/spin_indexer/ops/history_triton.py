"""Triton twin of `history.update_history_ref`, and the per-block EMA step the logits kernel's epilogue shares.

`ema_block` updates one kept block for one query row from its T scores (already in registers): V and its
block max through the physical block id, D at the row's offsets inside the diagonal window, last_seen.
The standalone kernel (replay, and after the DeepGEMM backend) runs it over compact logits: one program
per (request, BLOCKS compact blocks), one launch per updating row so rows fold in strictly in order
(row j+1's diagonal offsets overlap row j's at block edges). It can write the compact block maxima too,
the one pass over the logits that both need.

Bytes per kept token: 4 (logits) + 2 + 2 (V read + written) + 4 more for D inside the window; per kept
block 2 B of block max (and 4 of last_seen). No two programs of a launch write the same V cell (one
program per physical block of a request; two requests that share a block by design race benignly: each
cell ends with one of their updates) or the same D cell (distinct positions of a request).
"""
from __future__ import annotations

import torch

from ..checks import check_tensor
from .history import HistoryUpdate

try:  # the package imports this module only for CUDA tensors; without triton the reference is used
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

BLOCKS_PER_PROGRAM = 8  # compact blocks per program (the H200 best for this access pattern, run 5)


def update_history_triton(history: HistoryUpdate | None, logits: torch.Tensor, compact_table: torch.Tensor,
                          compact_lens: torch.Tensor, block_max_out: torch.Tensor | None = None) -> None:
    """Same as update_history_ref (history may be None when only block_max_out is wanted).

    logits: float32 [B, N, X]; compact_table: int32 [B, W]; compact_lens: int32 [B, N];
    block_max_out: optional float32 [B*N, >= X/T], entry [r, m] = max of row r's valid logits in compact
    block m (written for the blocks below the row's compact length; the rest are left as they are)."""
    batch, next_n, cols = logits.shape
    t = 64 if history is None else history.vertical.shape[1]
    blocks = cols // t
    if block_max_out is not None:
        check_tensor("block_max_out", block_max_out, dtype=torch.float32, ndim=2, device=logits.device,
                     device_of="logits")
    if batch == 0 or blocks == 0 or (history is None and block_max_out is None):
        return
    if logits.stride(2) != 1:
        logits = logits.contiguous()
    grid = (batch, triton.cdiv(blocks, BLOCKS_PER_PROGRAM))
    bmax = block_max_out if block_max_out is not None else logits  # dummy pointer when unused
    h = history
    rows = 1 if h is None else h.rows
    for j in range(max(rows, 1)):
        _update_history_kernel[grid](
            logits, logits.stride(0), logits.stride(1), compact_table, compact_table.stride(0), compact_lens,
            bmax, bmax.stride(0),
            *(_history_args(h, logits) if h is not None else _no_history(logits)),
            next_n, blocks, j,
            T=t, BLOCKS=BLOCKS_PER_PROGRAM, HIST=h is not None, HAS_SEEN=h is not None and h.last_seen is not None,
            BMAX=(block_max_out is not None) and j == 0, num_warps=4)


def _history_args(h: HistoryUpdate, like: torch.Tensor):
    """The history arguments every kernel that updates takes, in order (see ema_block)."""
    finfo = torch.finfo(h.vertical.dtype)
    seen = h.last_seen if h.last_seen is not None else h.block_max
    return (h.vertical, h.block_max, h.block_max.stride(0), h.diagonal, h.diagonal.stride(0), seen,
            seen.stride(0) if seen.dim() else 0, h.clock, h.slot_ids, h.kept_blocks, h.kept_blocks.stride(0),
            h.seq_lens, h.update_rows, float(h.alpha), int(h.window), h.trash_block, float(finfo.min), float(finfo.max))


def _no_history(like: torch.Tensor):
    z = like
    return (z, z, 0, z, 0, z, 0, z, z, z, 0, z, z, 0.0, 0, 0, 0.0, 0.0)


if triton is not None:
    @triton.jit
    def ema_block(obs, live, phys, kb, row, v_ptr, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride,
                  clock_ptr, slot_ptr, kept_ptr, kept_stride, lens_ptr, upd_ptr, alpha, window, trash, lo, hi,
                  b, T: tl.constexpr, HAS_SEEN: tl.constexpr):
        """EMA update of one block for one query row. obs: float32 [T] scores of the block's slots; live:
        bool [T] columns inside the row's compact length; phys: physical block id; kb: logical block id;
        row: b * N + j. Writes V, its block max, D inside the window and last_seen."""
        upd = tl.load(upd_ptr + row).to(tl.int32) != 0
        # Scalar conditions go through a where: `block & scalar` of int1 yields an int32 mask in the
        # interpreter (Triton 3.9), which tl.store rejects.
        live = tl.where(upd & (kb >= 0), live & (obs > float("-inf")) & (obs < float("inf")), False)
        inside = (phys >= 0) & (phys < trash)
        phys = tl.where(inside, phys, trash).to(tl.int64)
        offs = tl.arange(0, T)
        if tl.sum(live.to(tl.int32), axis=0) > 0:
            v_cells = v_ptr + phys * T + offs
            old = tl.load(v_cells).to(tl.float32)
            new = tl.where(old > float("-inf"), alpha * obs + (1.0 - alpha) * old, obs)
            new = tl.minimum(tl.maximum(new, lo), hi)
            v = tl.where(live, new, old)
            tl.store(v_cells, v.to(v_ptr.dtype.element_ty), mask=live)
            tl.store(vb_ptr + phys * vb_stride, tl.max(v, axis=0).to(vb_ptr.dtype.element_ty))
            if HAS_SEEN:
                tl.store(seen_ptr + phys * seen_stride, tl.load(clock_ptr))
            q = tl.load(lens_ptr + row).to(tl.int64) - 1
            off = q - (kb.to(tl.int64) * T + offs)
            in_window = live & (off >= 0) & (off < window)
            slot = tl.load(slot_ptr + b).to(tl.int64)
            d_cells = d_ptr + slot * d_stride + tl.where(in_window, off, 0)
            old_d = tl.load(d_cells, mask=in_window, other=0.0).to(tl.float32)
            new_d = tl.where(old_d > float("-inf"), alpha * obs + (1.0 - alpha) * old_d, obs)
            new_d = tl.minimum(tl.maximum(new_d, lo), hi)
            tl.store(d_cells, new_d.to(d_ptr.dtype.element_ty), mask=in_window)

    @triton.jit
    def _update_history_kernel(x_ptr, x_stride_b, x_stride_n, table_ptr, table_stride, clen_ptr, bmax_ptr,
                               bmax_stride, v_ptr, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride,
                               clock_ptr, slot_ptr, kept_ptr, kept_stride, lens_ptr, upd_ptr, alpha, window, trash,
                               lo, hi, next_n, num_blocks, j, T: tl.constexpr, BLOCKS: tl.constexpr,
                               HIST: tl.constexpr, HAS_SEEN: tl.constexpr, BMAX: tl.constexpr):
        b = tl.program_id(0)
        m0 = tl.program_id(1) * BLOCKS
        offs = tl.arange(0, T)
        b64 = b.to(tl.int64)
        for m in range(m0, tl.minimum(m0 + BLOCKS, num_blocks)):
            cols = m * T + offs
            if BMAX:  # the compact block max of every row (first launch only)
                for r in range(0, next_n):
                    clen = tl.load(clen_ptr + b * next_n + r)
                    x = tl.load(x_ptr + b64 * x_stride_b + r * x_stride_n + cols, mask=cols < clen,
                                other=float("-inf"))
                    tl.store(bmax_ptr + (b64 * next_n + r) * bmax_stride + m, tl.max(x, axis=0), mask=m * T < clen)
            if HIST:
                row = b * next_n + j
                clen = tl.load(clen_ptr + row)
                if m * T < clen:
                    live = cols < clen
                    obs = tl.load(x_ptr + b64 * x_stride_b + j * x_stride_n + cols, mask=live, other=float("-inf"))
                    phys = tl.load(table_ptr + b64 * table_stride + m)
                    kb = tl.load(kept_ptr + b64 * kept_stride + m)
                    ema_block(obs, live, phys, kb, row, v_ptr, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr,
                              seen_stride, clock_ptr, slot_ptr, kept_ptr, kept_stride, lens_ptr, upd_ptr, alpha,
                              window, trash, lo, hi, b, T, HAS_SEEN)
