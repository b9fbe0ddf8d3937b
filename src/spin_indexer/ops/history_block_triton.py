"""Triton twin of `history.update_history_ref` under block grain (SpinConfig.vertical_grain = "block").

The history of a block is one value, block_max[p] (no per-slot V), so the update reads what the top-k already
needs, the compact block maxima of the logits (the logits kernel's epilogue or the maxima pass wrote them), not
the logits: for row j of request b and its compact block m below the row's compact length,
    block_max[compact_table[b, m]] <- EMA(block_max[...], block_maxima[b * N + j, m])    (a kept block, finite max)
and last_seen; the diagonal window D (per slot, as with slot grain) from the logits of the few blocks it reaches.

Bytes per kept block: 4 (its max) + 4 + 4 (physical and logical ids) + the 2-byte history entry read and written
(one 32-byte sector each way: block_max[p, l] rows hold every layer) + 4 of last_seen with age exploration: ~70 B
a block, ~1 B a kept token, against the slot-grain pass's 8 (logits 4, V read and written 2 + 2). One launch per
updating row (rows update in order; row j + 1's diagonal offsets overlap row j's at block edges): per request,
one program per BLOCKS compact blocks for block_max, and the diagonal window's blocks (the last few compact blocks
below the row's compact length) split over programs of DB blocks each, side by side.
"""
from __future__ import annotations

import torch

from .history import HistoryUpdate, block_tokens

try:  # the package imports this module only for CUDA tensors; without triton the reference is used
    import triton
    import triton.language as tl

    from .history_triton import (ema_diagonal_blocks, ema_diagonal_tile, reaches_window, row_constants,
                                 window_subtiles)
except ImportError:  # pragma: no cover
    triton = None

BLOCKS_PER_PROGRAM = 256  # compact blocks a program: one [256] tile of ids, maxima and history entries
# Compact blocks a program of the diagonal window updates (a divisor of BLOCKS_PER_PROGRAM). Each such program is
# one chain of dependent loads (ids, logits, D cells). The window (129 blocks at the default 8192 positions) was
# the job of the tile holding it, one 8-block sub-tile after another, and the pass ended with that loop: H200
# (run 162, the proxy's e2e at 96 x 32K) ~30 us a layer over all 32 sub-tiles of the tile, H100 (run 163) 10.5 /
# 13.4 us at 40% / 50% from the window's ~17 sub-tiles (history_triton.window_subtiles), and 10.3 / 12.3 us at 64 x
# 32K with a 64 x 128 head (run 165), where the block_max half moves ~70 B a kept block: ~2 MB, under a microsecond
# of bandwidth. The window's programs now run beside the tiles' (`window_programs`), one sub-tile each: under 7.5 us
# at 64 x 32K 40% (run 166, H100: out of the profile's top 12; the step's kernels 11.13 -> 10.93 ms, its ITL -0.4%).
DIAGONAL_BLOCKS = 8
NUM_WARPS = 4


def update_block_history_triton(history: HistoryUpdate, logits: torch.Tensor, block_maxima: torch.Tensor,
                                compact_table: torch.Tensor, compact_lens: torch.Tensor) -> None:
    """update_history_ref(history, logits, compact_table, compact_lens) for a block-grain history
    (history.vertical None).

    logits: float32 [B, N, X] (read only inside the diagonal window); block_maxima: float32 [B*N, >= X/T], entry
    [r, m] the max of row r's logits below its compact length in compact block m (what paged_indexer_logits'
    block_max_out holds); compact_table: int32 [B, W]; compact_lens: int32 [B, N]."""
    if history.vertical is not None:
        raise ValueError("history: expected a block-grain history (vertical None)")
    batch, next_n, cols = logits.shape
    t = block_tokens(history)
    blocks = cols // t
    if batch == 0 or blocks == 0:
        return
    if logits.stride(2) != 1:
        logits = logits.contiguous()
    meta = block_tile_meta()
    tiles = triton.cdiv(blocks, meta["BLOCKS"])
    diagonal = window_programs(int(history.window), t, blocks, meta["DB"])
    grid = (batch, tiles + diagonal)
    for j in range(history.rows):
        _update_blocks_kernel[grid](
            logits, logits.stride(0), logits.stride(1), compact_table, compact_table.stride(0), compact_lens,
            *block_history_args(history, block_maxima), next_n, blocks, j, tiles, diagonal * meta["DB"],
            T=t, **meta, HAS_SEEN=history.last_seen is not None,
            num_warps=NUM_WARPS, enable_fp_fusion=False)  # the EMA's two products and sum rounded as torch does


def window_programs(window: int, tokens: int, blocks: int, per_program: int) -> int:
    """Programs of `per_program` compact blocks that cover a row's diagonal window: the logical blocks holding
    one of the `window` positions before the query, at most ceil((window + T - 1) / T) of them (T = tokens), are
    kept blocks in logical order, so the last that many compact blocks below the row's compact length hold every
    one (and no more than the table's `blocks`). 0 without a window."""
    if window <= 0:
        return 0
    return -(-min(-(-(window + tokens - 1) // tokens), blocks) // per_program)


def block_tile_meta(blocks: int | None = None, diagonal: int | None = None) -> dict:
    """update_block_tile's tile constexprs (BLOCKS compact blocks, default BLOCKS_PER_PROGRAM; DB per diagonal
    sub-tile, default DIAGONAL_BLOCKS), read at each launch so tests can shrink them."""
    blocks = min(blocks or BLOCKS_PER_PROGRAM, BLOCKS_PER_PROGRAM)
    return dict(BLOCKS=blocks, DB=min(diagonal or DIAGONAL_BLOCKS, blocks))


def block_history_args(h: HistoryUpdate, block_maxima: torch.Tensor) -> tuple:
    """update_block_tile's arguments from bm_ptr to hi, in order: the block maxima the update reads, then the
    history it writes."""
    finfo = torch.finfo(h.block_max.dtype)
    seen = h.last_seen if h.last_seen is not None else h.block_max  # a placeholder pointer without ages
    return (block_maxima, block_maxima.stride(0), h.block_max, h.block_max.stride(0), h.diagonal,
            h.diagonal.stride(0), seen, seen.stride(0), h.clock, h.slot_ids, h.kept_blocks, h.kept_blocks.stride(0),
            h.seq_lens, h.update_rows, float(h.alpha), int(h.window), h.trash_block, float(finfo.min),
            float(finfo.max))


if triton is not None:
    @triton.jit
    def _update_blocks_kernel(x_ptr, x_stride_b, x_stride_n, table_ptr, table_stride, clen_ptr, bm_ptr, bm_stride,
                              vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride, clock_ptr, slot_ptr,
                              kept_ptr, kept_stride, lens_ptr, upd_ptr, alpha, window, trash, lo, hi, next_n,
                              num_blocks, j, tiles, window_span, T: tl.constexpr, BLOCKS: tl.constexpr,
                              DB: tl.constexpr, HAS_SEEN: tl.constexpr):
        """Program (b, p): row j's update of request b: p < tiles, block_max of compact blocks [p * BLOCKS,
        (p + 1) * BLOCKS); above, D of the DB blocks (p - tiles) * DB on from the window's first candidate, the
        row's compact length less window_span blocks (`window_programs` x DB)."""
        b, p = tl.program_id(0), tl.program_id(1)
        if p < tiles:
            update_block_tile(b, p, j, x_ptr, x_stride_b, x_stride_n, table_ptr, table_stride, clen_ptr, bm_ptr,
                              bm_stride, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride, clock_ptr,
                              slot_ptr, kept_ptr, kept_stride, lens_ptr, upd_ptr, alpha, window, trash, lo, hi,
                              next_n, num_blocks, T, BLOCKS, DB, HAS_SEEN, False)
        else:
            upd, q, slot, _ = row_constants(upd_ptr, lens_ptr, slot_ptr, clock_ptr, b * next_n + j, b, False)
            clen, lim = row_span(clen_ptr, b * next_n + j, num_blocks, T)
            first = lim - window_span + (p - tiles) * DB  # may be < 0: those blocks are masked
            ema_diagonal_blocks(x_ptr + b.to(tl.int64) * x_stride_b + j * x_stride_n,
                                kept_ptr + b.to(tl.int64) * kept_stride, first, lim, upd, clen, q, slot, d_ptr,
                                d_stride, alpha, window, lo, hi, T, DB)

    @triton.jit
    def row_span(clen_ptr, row, num_blocks, T: tl.constexpr):
        """(clen, lim): the row's compact length and the compact blocks holding its columns (at most the table's)."""
        clen = tl.load(clen_ptr + row)
        return clen, tl.minimum((clen + T - 1) // T, num_blocks)

    @triton.jit
    def update_block_tile(b, pm, j, x_ptr, x_stride_b, x_stride_n, table_ptr, table_stride, clen_ptr, bm_ptr,
                          bm_stride, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride, clock_ptr, slot_ptr,
                          kept_ptr, kept_stride, lens_ptr, upd_ptr, alpha, window, trash, lo, hi, next_n, num_blocks,
                          T: tl.constexpr, BLOCKS: tl.constexpr, DB: tl.constexpr, HAS_SEEN: tl.constexpr,
                          DIAGONAL: tl.constexpr):
        """Row j's update of request b's compact blocks [pm * BLOCKS, (pm + 1) * BLOCKS) (also run by the top-k's
        threshold launch: topk_triton's `update=`); DIAGONAL: D too, from the tile's blocks that reach the window
        (False: programs of their own update it)."""
        b64 = b.to(tl.int64)
        upd, q, slot, clock = row_constants(upd_ptr, lens_ptr, slot_ptr, clock_ptr, b * next_n + j, b, HAS_SEEN)
        clen, lim = row_span(clen_ptr, b * next_n + j, num_blocks, T)
        m = pm * BLOCKS + tl.arange(0, BLOCKS)
        on = tl.where(upd, m < lim, False)  # a row that does not update (guarded) reads and writes nothing
        kb = tl.load(kept_ptr + b64 * kept_stride + m, mask=on, other=-1)
        phys = tl.load(table_ptr + b64 * table_stride + m, mask=on, other=-1).to(tl.int64)
        obs = tl.load(bm_ptr + (b64 * next_n + j) * bm_stride + m, mask=on, other=float("-inf"))
        live = on & (kb >= 0) & (obs > float("-inf")) & (obs < float("inf"))
        # ids outside the cache update the trash block, as the reference does (nothing reads it)
        pv = tl.where((phys >= 0) & (phys < trash), phys, trash)
        old = tl.load(vb_ptr + pv * vb_stride, mask=live, other=float("-inf")).to(tl.float32)
        new = tl.where(old > float("-inf"), alpha * obs + (1.0 - alpha) * old, obs)
        new = tl.minimum(tl.maximum(new, lo), hi)
        tl.store(vb_ptr + pv * vb_stride, new.to(vb_ptr.dtype.element_ty), mask=live)
        if HAS_SEEN:
            tl.store(seen_ptr + pv * seen_stride, clock + (pv * 0).to(tl.int32), mask=live)
        if DIAGONAL and reaches_window(live, kb, q, window, T):
            s0, s1 = window_subtiles(m, on, kb, lim, q, window, pm, T, BLOCKS, DB)
            ema_diagonal_tile(x_ptr + b64 * x_stride_b + j * x_stride_n, kept_ptr + b64 * kept_stride, pm, lim, upd,
                              clen, q, slot, d_ptr, d_stride, alpha, window, lo, hi, s0, s1, T, BLOCKS, DB)
