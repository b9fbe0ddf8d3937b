"""Slot scores from the vertical and diagonal histories, and their pooling to KV-block scores.

Reading of the paper's variants (REFERENCE.md sec. 3):
  A1 (default, with reduce=max "A1-Max"): predict every slot i as combine(V[i], D[q - i]), then pool each
     64-slot block with `reduce`; the selector keeps the top-m blocks, so the block count is exact.
  A2: pool V and the query-aligned D to blocks *separately*, then combine the two block scores: a block
     where the vertical peak and the diagonal peak sit on different slots scores as if they coincided.
  A0: rank slots by their prediction and select the best m*T slots; every block holding a selected slot
     is kept (SpinIndexer lifts the block budget for A0), so the block count follows the slot budget only
     indirectly: spread-out slots touch more than m blocks, clustered ones fewer. Its block score is the
     block max, -inf for blocks with no selected slot.
All functions are pure, batched, and free of host syncs. -inf marks "no information".
"""
from __future__ import annotations

import torch

from .config import Combine, Pooling, Reduce

NEG_INF = float("-inf")


def gather_diagonal(diagonal: torch.Tensor, query_pos: torch.Tensor, num_cols: int) -> torch.Tensor:
    """D aligned to logical positions: out[b, p, i] = diagonal[b, query_pos[b, p] - i] for i <= q, else -inf.

    diagonal: [B, C'] (C' >= num_cols); query_pos: int64 [B, P]. returns float32 [B, P, num_cols].
    Example: q = 130 -> position 130 reads offset 0, position 0 reads offset 130, positions > 130 are -inf.
    """
    cols = torch.arange(num_cols, device=diagonal.device)
    offsets = query_pos[:, :, None] - cols[None, None, :]  # [B, P, C]
    valid = offsets >= 0
    rows = diagonal.float()[:, None, :].expand(-1, query_pos.shape[1], -1)
    gathered = torch.gather(rows, 2, offsets.clamp_min(0))
    return torch.where(valid, gathered, NEG_INF)


def combine(vertical: torch.Tensor, diagonal: torch.Tensor, how: Combine) -> torch.Tensor:
    """Merge the two estimates of the same slot score (shapes broadcast; -inf = missing)."""
    if how is Combine.VERTICAL:
        return vertical.expand_as(torch.broadcast_tensors(vertical, diagonal)[0]).float()
    if how is Combine.DIAGONAL:
        return diagonal.expand_as(torch.broadcast_tensors(vertical, diagonal)[0]).float()
    v, d = torch.broadcast_tensors(vertical.float(), diagonal.float())
    if how is Combine.MAX:
        return torch.maximum(v, d)
    has_v, has_d = torch.isfinite(v), torch.isfinite(d)
    both = torch.where(has_v & has_d, v + d, NEG_INF)
    # One estimate missing: count the other twice so scales stay comparable across slots.
    return torch.where(has_v & has_d, both, torch.where(has_v, 2 * v, torch.where(has_d, 2 * d, NEG_INF)))


def pool_blocks(x: torch.Tensor, tokens_per_block: int, how: Reduce) -> torch.Tensor:
    """Pool [..., W*T] slot scores to [..., W] block scores, ignoring -inf slots (-inf if none is finite)."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // tokens_per_block, tokens_per_block)  # [..., W, T]
    if how is Reduce.MAX:
        return blocks.amax(dim=-1)
    if how is Reduce.TOP4:
        blocks = blocks.topk(min(4, tokens_per_block), dim=-1).values
    finite = torch.isfinite(blocks)
    count = finite.sum(dim=-1)
    total = torch.where(finite, blocks, 0.0).sum(dim=-1)
    return torch.where(count > 0, total / count.clamp_min(1), NEG_INF)


def slot_predictions(vertical: torch.Tensor, diagonal: torch.Tensor, query_pos: torch.Tensor,
                     lengths: torch.Tensor, how: Combine) -> torch.Tensor:
    """Predicted slot scores float32 [B, P, C] for P query rows; -inf at/after each row's length.

    vertical, diagonal: [B, C] history rows of the batch's slots; query_pos, lengths: int64 [B, P].
    """
    num_cols = vertical.shape[1]
    d = gather_diagonal(diagonal, query_pos, num_cols)
    pred = combine(vertical[:, None, :], d, how)
    cols = torch.arange(num_cols, device=vertical.device)
    return torch.where(cols[None, None, :] < lengths[:, :, None], pred, NEG_INF)


def block_scores(vertical: torch.Tensor, diagonal: torch.Tensor, query_pos: torch.Tensor, lengths: torch.Tensor,
                 budget_slots: torch.Tensor, pooling: Pooling, reduce: Reduce, how: Combine,
                 tokens_per_block: int) -> torch.Tensor:
    """Block scores float32 [B, P, W] for the selector (higher = keep first).

    vertical, diagonal: [B, C] history rows of the batch's slots (C = W*T); query_pos, lengths: int64
    [B, P]; budget_slots: int64 [B], the A0 slot budget m*T (unused by A1/A2).
    """
    if pooling is Pooling.A2:
        num_cols = vertical.shape[1]
        cols = torch.arange(num_cols, device=vertical.device)
        live = cols[None, None, :] < lengths[:, :, None]
        v = torch.where(live, vertical.float()[:, None, :], NEG_INF)
        d = torch.where(live, gather_diagonal(diagonal, query_pos, num_cols), NEG_INF)
        return combine(pool_blocks(v, tokens_per_block, reduce), pool_blocks(d, tokens_per_block, reduce), how)
    pred = slot_predictions(vertical, diagonal, query_pos, lengths, how)
    if pooling is Pooling.A1:
        return pool_blocks(pred, tokens_per_block, reduce)
    # A0: threshold at the budget_slots-th best prediction of each row.
    ordered = pred.sort(dim=-1, descending=True).values
    kth = (budget_slots[:, None, None] - 1).clamp(0, pred.shape[-1] - 1).expand(-1, pred.shape[1], 1)
    threshold = torch.gather(ordered, 2, kth)
    selected = (pred >= threshold) & torch.isfinite(pred)
    best = pool_blocks(torch.where(selected, pred, NEG_INF), tokens_per_block, Reduce.MAX)
    return best
