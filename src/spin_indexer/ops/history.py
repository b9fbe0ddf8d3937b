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

An int8 V (SpinConfig.vertical_dtype) holds codes with one float16 scale a block: each row j's update
dequantizes the block's row (code * scale, -inf for VERTICAL_EMPTY), applies the rule above in float32
(clamped into float16's range), takes the block max from those float32 values, and requantizes the whole row
with a new scale (quantize_rows). Bytes a kept token: 1 read + 1 written instead of 2 + 2 (+ 2 B of scale a
block, in the block max's sector).
"""
from __future__ import annotations

import dataclasses

import torch

from ..layout import TOKENS_PER_BLOCK

VERTICAL_EMPTY = -128  # int8 V code of a slot with no observation (-inf in a float table)
CODE_MAX = 127  # int8 codes are symmetric: [-127, 127] * scale
FP16_MAX = float(torch.finfo(torch.float16).max)


@dataclasses.dataclass
class HistoryUpdate:
    """Where one layer's EMA update reads and writes (P cache blocks, S slots, DW window, B requests).

    vertical: [P + 1, T] float16 (row P is a trash block); block_max: [P + 1] float16 (may be strided);
    diagonal: [S, DW + 1] float16 (column DW is a trash cell); vertical_scale: float16 [P + 1] (strided like
    block_max) when vertical holds int8 codes, else None; slot_ids: int64 [B]; kept_blocks: int32
    [B, W] ascending logical ids of the compact blocks; seq_lens: int32 [B, N] the real row lengths;
    update_rows: bool [B, N]; alpha: EMA weight of the newest score; window: DW;
    last_seen: int32 [P + 1] or None; clock: int32 [1], stamped into last_seen; rows: how many leading
    rows may update (1 under the row-0 MTP policy: a kernel can then fold the update into one pass).
    """

    vertical: torch.Tensor
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
    vertical_scale: torch.Tensor | None = None

    @property
    def trash_block(self) -> int:
        return self.vertical.shape[0] - 1


def block_tokens(history: HistoryUpdate | None) -> int:
    """T of an update's blocks: its V rows' length, or the engines' page (TOKENS_PER_BLOCK) when there is no
    history (a pass that writes only the maxima)."""
    return TOKENS_PER_BLOCK if history is None else history.vertical.shape[1]


def ema_float(old: torch.Tensor, obs: torch.Tensor, alpha: float, lo: float, hi: float) -> torch.Tensor:
    """The EMA rule on float32 `old` (-inf: no history -> obs), clamped into [lo, hi], float32."""
    new = torch.where(torch.isfinite(old), alpha * obs + (1.0 - alpha) * old, obs)
    return new.clamp(lo, hi)


def ema(old: torch.Tensor, obs: torch.Tensor, alpha: float) -> torch.Tensor:
    """The EMA rule in float32, clamped into the finite range of old's dtype (no history -> obs)."""
    finfo = torch.finfo(old.dtype)
    return ema_float(old.float(), obs, alpha, finfo.min, finfo.max).to(old.dtype)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [..., T] of int8 codes [..., T] and their rows' float16 scales [...]: code * scale (exact in
    float32), -inf for VERTICAL_EMPTY."""
    return torch.where(codes == VERTICAL_EMPTY, float("-inf"), codes.float() * scale.float()[..., None])


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [..., T], float16 scales [...]) of float32 rows [..., T] (finite or -inf).

    scale = max |finite values| / 127 rounded to float16; code = floor(v * (1 / scale) + 0.5) clamped to
    [-127, 127] (0 where the scale is 0); VERTICAL_EMPTY for -inf. The Triton update does the same float32
    operations in the same order (a division, a product and a sum), so the interpreter's codes are identical."""
    finite = values > float("-inf")
    scale = (torch.where(finite, values.abs(), 0.0).amax(dim=-1) / float(CODE_MAX)).half()
    s = scale.float()
    inv = torch.where(s > 0, 1.0 / s, 0.0)
    codes = torch.floor(values * inv[..., None] + 0.5).clamp(-CODE_MAX, CODE_MAX)
    return torch.where(finite, codes, float(VERTICAL_EMPTY)).to(torch.int8), scale


def update_history_ref(h: HistoryUpdate, logits: torch.Tensor, compact_table: torch.Tensor,
                       compact_lens: torch.Tensor) -> None:
    """The update in place from compact logits.

    logits: float32 [B, N, X] (X = M*T columns, M <= W; columns past a row's compact length are ignored);
    compact_table: int32 [B, W] physical ids of the kept blocks; compact_lens: int32 [B, N] (the compact
    blocks a request uses end with its longest row, so entries past them are never read).
    """
    batch, next_n, cols = logits.shape
    t = h.vertical.shape[1]
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
    v_flat = h.vertical.view(-1)
    d_flat = h.diagonal.view(-1)  # [S, DW + 1] flat
    v_trash = trash * t
    d_trash = (h.slot_ids * (h.window + 1) + h.window)[:, None]  # each slot's trash cell
    query_pos = h.seq_lens.long() - 1
    touched = torch.zeros(batch, blocks, dtype=torch.bool, device=dev)
    for j in range(next_n):
        obs = logits[:, j]
        live = (c[None, :] < compact_lens.long()[:, j:j + 1]) & h.update_rows[:, j:j + 1] & (pos >= 0)
        live &= torch.isfinite(obs)
        touched |= live.view(batch, blocks, t).any(dim=2)
        if h.vertical_scale is not None:
            _update_rows_int8(h, phys, live.view(batch, blocks, t), obs.reshape(batch, blocks, t))
        else:
            # Fixed shape: dead lanes write the trash cell, so no two live lanes of a request collide.
            cells = torch.where(live, cell, v_trash).reshape(-1)
            v_flat[cells] = ema(v_flat[cells], obs.reshape(-1), h.alpha)
        off = query_pos[:, j:j + 1] - pos  # [B, X]
        in_window = live & (off >= 0) & (off < h.window)
        d_cells = torch.where(in_window, h.slot_ids[:, None] * (h.window + 1) + off, d_trash).reshape(-1)
        d_flat[d_cells] = ema(d_flat[d_cells], obs.reshape(-1), h.alpha)
    target = torch.where(touched, phys, trash)  # [B, M]
    if h.vertical_scale is None:  # (int8: written from the float32 rows, row by row)
        h.block_max[target.reshape(-1)] = h.vertical[target.reshape(-1)].amax(dim=1)
    if h.last_seen is not None:
        h.last_seen[target.reshape(-1)] = h.clock.to(torch.int32).expand(target.numel())


def _update_rows_int8(h: HistoryUpdate, phys: torch.Tensor, live: torch.Tensor, obs: torch.Tensor) -> None:
    """One row's update of an int8 V: every block with a live cell (phys int64 [B, M], live bool [B, M, T],
    obs float32 [B, M, T]) is dequantized, updated in float32, its max written to block_max, requantized."""
    rows = torch.where(live.any(dim=2), phys, h.trash_block)  # the others write the trash block
    old = dequantize_rows(h.vertical[rows], h.vertical_scale[rows])
    new = torch.where(live, ema_float(old, obs, h.alpha, -FP16_MAX, FP16_MAX), old)
    codes, scale = quantize_rows(new)
    h.vertical[rows] = codes
    h.vertical_scale[rows] = scale
    h.block_max[rows] = new.amax(dim=2).to(h.block_max.dtype)
