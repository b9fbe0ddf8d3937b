"""EMA update of one layer's history from the scores the indexer actually computed.

Only scored slots (columns of the compacted logits below each row's compact length) receive an
observation; skipped slots keep their value. For each updating row j of request b, with query position
q_j = seq_lens[b, j] - 1 and observed score s at logical position i:
    V[i]       <- s                          if V[i] has no history, else alpha * s + (1 - alpha) * V[i]
    D[q_j - i] <- the same rule
Rows update in order j = 0, 1, ... (each a separate EMA step). Work is O(kept slots): tables are
addressed through flat indices, and padding lanes write their row's trash cell (the last column).
"""
from __future__ import annotations

import torch


def ema_(table: torch.Tensor, cells: torch.Tensor, obs: torch.Tensor, live: torch.Tensor, trash: torch.Tensor,
         alpha: float) -> None:
    """In place on a flat table: table[cells] <- EMA(obs) where live; dead lanes write `trash` (unchanged).

    table: 1-D, e.g. a [S, C + 1] layer table viewed flat; cells: int64 [B, X] flat cell ids;
    obs: float32 [B, X]; live: bool [B, X]; trash: int64 [B, 1] each row's trash cell.
    """
    idx = torch.where(live, cells, trash).reshape(-1)
    old = table[idx].float()
    lo, hi = torch.finfo(table.dtype).min, torch.finfo(table.dtype).max
    new = torch.where(torch.isfinite(old), alpha * obs.reshape(-1) + (1.0 - alpha) * old, obs.reshape(-1))
    table[idx] = new.clamp(lo, hi).to(table.dtype)


def update_history(vertical: torch.Tensor, diagonal: torch.Tensor, slot_ids: torch.Tensor, logits: torch.Tensor,
                   positions: torch.Tensor, compact_lens: torch.Tensor, query_pos: torch.Tensor,
                   update_rows: torch.Tensor, alpha: float) -> None:
    """EMA of V and D at the scored slots, in place.

    vertical, diagonal: [S, C + 1] this layer's tables (contiguous); slot_ids: int64 [B];
    logits: float32 [B, N, X] compact logits; positions: int64 [B, X] logical position of each compact
    column (-1 for padding); compact_lens, query_pos: int64 [B, N]; update_rows: bool [B, N].
    """
    row_len = vertical.shape[1]
    base = (slot_ids * row_len)[:, None]  # [B, 1]
    trash = base + row_len - 1
    v_flat, d_flat = vertical.view(-1), diagonal.view(-1)
    cols = torch.arange(logits.shape[2], device=logits.device)
    for j in range(logits.shape[1]):
        obs = logits[:, j]
        live = (cols[None, :] < compact_lens[:, j:j + 1]) & update_rows[:, j:j + 1] & (positions >= 0)
        live &= torch.isfinite(obs)
        ema_(v_flat, base + positions.clamp_min(0), obs, live, trash, alpha)
        ema_(d_flat, base + (query_pos[:, j:j + 1] - positions).clamp_min(0), obs, live, trash, alpha)


def mark_seen(last_seen: torch.Tensor, slot_ids: torch.Tensor, step: torch.Tensor, kept_blocks: torch.Tensor,
              update_rows: torch.Tensor) -> None:
    """last_seen[slot, block] = step for the kept blocks of requests with an updating row (O(blocks)).

    last_seen: int32 [S, W + 1] (last column = trash); step: int32 [B]; kept_blocks: int64 [B, W], -1 padded.
    """
    seen_len = last_seen.shape[1]
    any_row = update_rows.any(dim=1, keepdim=True)
    blocks = torch.where((kept_blocks >= 0) & any_row, kept_blocks, seen_len - 1)
    cells = (slot_ids * seen_len)[:, None] + blocks
    last_seen.view(-1)[cells.reshape(-1)] = step[:, None].to(torch.int32).expand_as(blocks).reshape(-1)
