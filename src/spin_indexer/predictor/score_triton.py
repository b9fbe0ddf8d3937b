"""Triton twin of `score.block_scores` for the A1 pooling with max or mean reduction (the default path).

One program per (request row p, chunk of BLOCKS blocks): it reads V[slot, i] and D[slot, q - i] for the
chunk's BLOCKS x T slots (2 + 2 bytes per cached token in float16), combines them, reduces each block and
writes BLOCKS block scores. Nothing of size [B, C] is materialised, so the prediction moves ~4 B per
cached token against the indexer's 132. A0, A2 and top4 stay on the torch path.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .config import Combine, Reduce

# Blocks per program: 16 measured best on the H200 (32 made this kernel 1.6x slower, run 5).
# SPIN_SCORE_BLOCKS overrides it for benchmarking (a power of two).
BLOCKS_PER_PROGRAM = int(os.environ.get("SPIN_SCORE_BLOCKS", "16"))
_COMBINE = {Combine.MAX: 0, Combine.SUM: 1, Combine.VERTICAL: 2, Combine.DIAGONAL: 3}
_REDUCE = {Reduce.MAX: 0, Reduce.MEAN: 1}


@triton.jit
def _block_scores_kernel(v_ptr, d_ptr, slot_ptr, qpos_ptr, len_ptr, out_ptr, row_stride, num_rows_per_req,
                         num_blocks, T: tl.constexpr, BLOCKS: tl.constexpr, COMBINE: tl.constexpr,
                         REDUCE: tl.constexpr):
    row = tl.program_id(0)  # b * P + p
    chunk = tl.program_id(1)
    b = row // num_rows_per_req
    slot = tl.load(slot_ptr + b).to(tl.int64)
    q = tl.load(qpos_ptr + row).to(tl.int64)
    length = tl.load(len_ptr + row).to(tl.int64)
    blk = chunk * BLOCKS + tl.arange(0, BLOCKS)
    pos = blk.to(tl.int64)[:, None] * T + tl.arange(0, T)[None, :]  # [BLOCKS, T]
    live = (pos < length) & (blk[:, None] < num_blocks)
    base = slot * row_stride
    neg_inf = float("-inf")
    v = tl.load(v_ptr + base + pos, mask=live, other=neg_inf).to(tl.float32)
    off = q - pos
    d = tl.load(d_ptr + base + off, mask=live & (off >= 0), other=neg_inf).to(tl.float32)
    if COMBINE == 0:
        x = tl.maximum(v, d)
    elif COMBINE == 1:
        has_v = v > neg_inf
        has_d = d > neg_inf
        x = tl.where(has_v & has_d, v + d, tl.where(has_v, 2 * v, tl.where(has_d, 2 * d, neg_inf)))
    elif COMBINE == 2:
        x = v
    else:
        x = d
    if REDUCE == 0:
        score = tl.max(x, axis=1)
    else:
        finite = x > neg_inf
        count = tl.sum(finite.to(tl.float32), axis=1)
        total = tl.sum(tl.where(finite, x, 0.0), axis=1)
        score = tl.where(count > 0, total / tl.maximum(count, 1.0), neg_inf)
    tl.store(out_ptr + row.to(tl.int64) * num_blocks + blk, score, mask=blk < num_blocks)


def supports(pooling, reduce) -> bool:
    from .config import Pooling
    return pooling is Pooling.A1 and reduce in _REDUCE


def block_scores_triton(vertical: torch.Tensor, diagonal: torch.Tensor, slot_ids: torch.Tensor,
                        query_pos: torch.Tensor, lengths: torch.Tensor, num_blocks: int, combine: Combine,
                        reduce: Reduce, tokens_per_block: int, blocks_per_program: int | None = None) -> torch.Tensor:
    """A1 block scores float32 [B, P, num_blocks] straight from the state tables.

    vertical, diagonal: one layer's tables [S, C + 1] (row stride C + 1); slot_ids: int64 [B];
    query_pos, lengths: int64 [B, P]. Same values as score.block_scores(..., Pooling.A1, ...).
    """
    blocks_per_program = blocks_per_program or BLOCKS_PER_PROGRAM
    batch, rows = query_pos.shape
    out = torch.empty(batch, rows, num_blocks, dtype=torch.float32, device=vertical.device)
    if batch == 0 or num_blocks == 0:
        return out
    grid = (batch * rows, triton.cdiv(num_blocks, blocks_per_program))
    _block_scores_kernel[grid](vertical, diagonal, slot_ids.contiguous(), query_pos.contiguous(),
                               lengths.contiguous(), out, vertical.stride(0), rows, num_blocks,
                               T=tokens_per_block, BLOCKS=blocks_per_program, COMBINE=_COMBINE[combine],
                               REDUCE=_REDUCE[reduce])
    return out
