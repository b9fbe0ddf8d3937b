"""SPIN's EMA history update from the scores the indexer computed: the torch reference.

A logits kernel that holds the scores in registers folds this update into its epilogue (Triton twin,
indexer_logits_triton.py); replay and the DeepGEMM backend run it after the logits (history_triton.py).
Either way it is O(kept slots): only scored slots receive an observation.

For each updating row j of request b, with query position q_j = seq_lens[b, j] - 1 and score s observed at
logical position i, held in physical slot (p, t) of the key cache:
    V[p, t]    <- s                          if V[p, t] has no history (-inf), else alpha * s + (1 - alpha) * V[p, t]
    D[q_j - i] <- the same rule, when q_j - i < window (the request's diagonal window)
Rows update in order j = 0, 1, ... (each a separate EMA step). Then block_max[p] = max_t V[p, t] and
last_seen[p] = clock for every block that received an observation. The EMA is computed in float32 as two
products and a sum, then clamped into the table dtype's finite range.
Block grain (SpinConfig.vertical_grain = "block", vertical None): no V; per row, block_max[p] <- the rule above
applied to the block's max observation (its live slots' largest score), so the update reads O(blocks) of block
maxima, not the logits (those only inside the diagonal window).
"""
from __future__ import annotations

import dataclasses

import torch

from ..layout import TOKENS_PER_BLOCK


@dataclasses.dataclass
class HistoryUpdate:
    """Where one layer's EMA update reads and writes (P cache blocks, S slots, DW window, B requests).

    vertical: [P + 1, T] float16 (row P is a trash block), or None: block grain (block_max is the history);
    block_max: [P + 1] float16 (may be strided);
    diagonal: [S, DW + 1] float16 (column DW is a trash cell); slot_ids: int64 [B]; kept_blocks: int32
    [B, W] ascending logical ids of the compact blocks; seq_lens: int32 [B, N] the real row lengths;
    update_rows: bool [B, N]; alpha: EMA weight of the newest score; window: DW;
    last_seen: int32 [P + 1] or None; clock: int32 [1], stamped into last_seen; rows: how many leading
    rows may update (1 under the row-0 MTP policy: a kernel can then fold the update into one pass);
    tokens: T, the tokens of a block (read where vertical, whose rows are T long, is None).
    """

    vertical: torch.Tensor | None
    block_max: torch.Tensor
    diagonal: torch.Tensor
    slot_ids: torch.Tensor
    kept_blocks: torch.Tensor
    seq_lens: torch.Tensor
    update_rows: torch.Tensor
    alpha: float
    window: int
    last_seen: torch.Tensor | None
    clock: torch.Tensor
    rows: int = 1
    tokens: int = TOKENS_PER_BLOCK

    @property
    def trash_block(self) -> int:
        return self.block_max.shape[0] - 1


def block_tokens(history: HistoryUpdate | None) -> int:
    """T of an update's blocks: its V rows' length, or the engines' page (TOKENS_PER_BLOCK) when there is no
    history (a pass that writes only the maxima)."""
    if history is None:
        return TOKENS_PER_BLOCK
    return history.tokens if history.vertical is None else history.vertical.shape[1]


def ema(old: torch.Tensor, obs: torch.Tensor, alpha: float) -> torch.Tensor:
    """The EMA rule in float32, clamped into the finite range of old's dtype (no history -> obs)."""
    lo, hi = torch.finfo(old.dtype).min, torch.finfo(old.dtype).max
    o = old.float()
    new = torch.where(torch.isfinite(o), alpha * obs + (1.0 - alpha) * o, obs)
    return new.clamp(lo, hi).to(old.dtype)


def update_history_ref(h: HistoryUpdate, logits: torch.Tensor, compact_table: torch.Tensor,
                       compact_lens: torch.Tensor) -> None:
    """The update in place from compact logits.

    logits: float32 [B, N, X] (X = M*T columns, M <= W; columns past a row's compact length are ignored);
    compact_table: int32 [B, W] physical ids of the kept blocks; compact_lens: int32 [B, N] (the compact
    blocks a request uses end with its longest row, so entries past them are never read).
    """
    batch, next_n, cols = logits.shape
    t = block_tokens(h)
    blocks = cols // t
    if batch == 0 or blocks == 0:
        return
    dev = logits.device
    trash = h.trash_block
    used = (compact_lens.long().amax(dim=1) + t - 1) // t  # [B] compact blocks in use
    live_block = torch.arange(blocks, device=dev)[None, :] < used[:, None]
    kept = torch.where(live_block, h.kept_blocks[:, :blocks].long(), -1)
    phys = compact_table[:, :blocks].long()
    phys = torch.where((kept >= 0) & (phys >= 0) & (phys < trash), phys, trash)  # [B, M]
    c = torch.arange(cols, device=dev)
    slot_t = torch.arange(t, device=dev)
    pos = torch.where(kept[:, :, None] >= 0, kept[:, :, None] * t + slot_t, -1).reshape(batch, cols)  # [B, X]
    cell = (phys[:, :, None] * t + slot_t).reshape(batch, cols)  # flat V cell of each compact column
    v_flat = h.vertical.view(-1) if h.vertical is not None else None
    d_flat = h.diagonal.view(-1)  # [S, DW + 1] flat
    v_trash = trash * t
    d_trash = (h.slot_ids * (h.window + 1) + h.window)[:, None]  # each slot's trash cell
    query_pos = h.seq_lens.long() - 1
    touched = torch.zeros(batch, blocks, dtype=torch.bool, device=dev)
    for j in range(next_n):
        obs = logits[:, j]
        live = (c[None, :] < compact_lens.long()[:, j:j + 1]) & h.update_rows[:, j:j + 1] & (pos >= 0)
        live &= torch.isfinite(obs)
        scored = live.view(batch, blocks, t).any(dim=2)
        touched |= scored
        if v_flat is None:  # block grain: the EMA of each block's max live observation
            obs_max = torch.where(live, obs, float("-inf")).view(batch, blocks, t).amax(dim=2)
            cells = torch.where(scored, phys, trash).reshape(-1)
            h.block_max[cells] = ema(h.block_max[cells], obs_max.reshape(-1), h.alpha)
        else:
            # Fixed shape: dead lanes write the trash cell, so no two live lanes of a request collide.
            cells = torch.where(live, cell, v_trash).reshape(-1)
            v_flat[cells] = ema(v_flat[cells], obs.reshape(-1), h.alpha)
        off = query_pos[:, j:j + 1] - pos  # [B, X]
        in_window = live & (off >= 0) & (off < h.window)
        d_cells = torch.where(in_window, h.slot_ids[:, None] * (h.window + 1) + off, d_trash).reshape(-1)
        d_flat[d_cells] = ema(d_flat[d_cells], obs.reshape(-1), h.alpha)
    target = torch.where(touched, phys, trash)  # [B, M]
    if v_flat is not None:
        h.block_max[target.reshape(-1)] = h.vertical[target.reshape(-1)].amax(dim=1)
    if h.last_seen is not None:
        h.last_seen[target.reshape(-1)] = h.clock.to(torch.int32).expand(target.numel())
