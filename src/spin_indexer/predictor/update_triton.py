"""Triton twin of the slot-level EMA update in `update.update_history`.

One launch per updating row j (next_n <= 8 launches), so rows fold in strictly in order, as in the
torch version; inside a launch every (request, kept block) program owns distinct V cells (positions)
and distinct D cells (offsets q_j - i), so there are no races. Work is O(kept slots): each program
reads T compact logits and reads + writes T cells of V and of D.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


# Kept blocks per program: 8 measured best on the H200 (32 made it 4.5x slower, run 5); SPIN_EMA_BLOCKS overrides.
BLOCKS_PER_PROGRAM = int(os.environ.get("SPIN_EMA_BLOCKS", "8"))


@triton.jit
def _ema_update_kernel(v_ptr, d_ptr, logits_ptr, kept_ptr, slot_ptr, clen_ptr, qpos_ptr, upd_ptr, row_stride,
                       logits_stride, width, next_n, j, alpha, lo, hi, T: tl.constexpr, BLOCKS: tl.constexpr):
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    m = chunk * BLOCKS + tl.arange(0, BLOCKS)  # compact block index
    kb = tl.load(kept_ptr + b * width + m, mask=m < width, other=-1).to(tl.int64)
    row = b * next_n + j
    upd = tl.load(upd_ptr + row).to(tl.int32)
    clen = tl.load(clen_ptr + row).to(tl.int64)
    q = tl.load(qpos_ptr + row).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    t = tl.arange(0, T)
    cols = m.to(tl.int64)[:, None] * T + t[None, :]  # compact columns [BLOCKS, T]
    pos = kb[:, None] * T + t[None, :]
    live = (kb[:, None] >= 0) & (cols < clen) & ((cols * 0 + upd) > 0)
    obs = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + cols, mask=live, other=float("-inf"))
    live = live & (obs > float("-inf"))
    base = slot * row_stride
    old_v = tl.load(v_ptr + base + pos, mask=live, other=0.0).to(tl.float32)
    new_v = tl.where(old_v > float("-inf"), alpha * obs + (1.0 - alpha) * old_v, obs)
    new_v = tl.minimum(tl.maximum(new_v, lo), hi)
    tl.store(v_ptr + base + pos, new_v.to(v_ptr.dtype.element_ty), mask=live)
    off = q - pos
    old_d = tl.load(d_ptr + base + off, mask=live, other=0.0).to(tl.float32)
    new_d = tl.where(old_d > float("-inf"), alpha * obs + (1.0 - alpha) * old_d, obs)
    new_d = tl.minimum(tl.maximum(new_d, lo), hi)
    tl.store(d_ptr + base + off, new_d.to(d_ptr.dtype.element_ty), mask=live)


def ema_update_triton(vertical: torch.Tensor, diagonal: torch.Tensor, slot_ids: torch.Tensor, logits: torch.Tensor,
                      kept_blocks: torch.Tensor, compact_lens: torch.Tensor, query_pos: torch.Tensor,
                      update_rows: torch.Tensor, alpha: float, tokens_per_block: int,
                      blocks_per_program: int | None = None) -> None:
    """In place: update.update_history with kept_blocks int32 [B, W] in place of positions (logits float32 [B, N, X])."""
    blocks_per_program = blocks_per_program or BLOCKS_PER_PROGRAM
    batch, next_n, cols = logits.shape
    width = kept_blocks.shape[1]
    if batch == 0 or width == 0:
        return
    finfo = torch.finfo(vertical.dtype)
    flat = logits.reshape(batch * next_n, cols)
    kept = kept_blocks.contiguous()
    clen = compact_lens.reshape(-1).contiguous()
    qpos = query_pos.reshape(-1).contiguous()
    upd = update_rows.reshape(-1).to(torch.int8).contiguous()
    grid = (batch, triton.cdiv(width, blocks_per_program))
    for j in range(next_n):
        _ema_update_kernel[grid](vertical, diagonal, flat, kept, slot_ids.contiguous(), clen, qpos, upd,
                                 vertical.stride(0), flat.stride(0), width, next_n, j, float(alpha),
                                 float(finfo.min), float(finfo.max), T=tokens_per_block, BLOCKS=blocks_per_program)
