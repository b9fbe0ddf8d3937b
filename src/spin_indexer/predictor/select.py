"""Block selection: budget, always-keep blocks, exploration, top-m -> keep mask [B, W].

Order of work per request b (all on device, fixed shapes):
  1. forced blocks (the newest block(s) of every query row, and blocks never scored for this layer) get
     priority +inf;
  2. stage 1 keeps the k1 = max(forced, m - e) best blocks by predicted score (per prediction row;
     rows are OR-ed: the row-local union);
  3. stage 2 (exploration) keeps e' = min(e, m - k1) more blocks among the valid, not yet kept ones,
     ranked by the exploration policy: a counter-based hash (random), steps since last scored
     (block_age), or that age times the block's predicted-score percentile (staleness).
Only blocks with a finite stage-1 key are kept in stage 1, so A0 can leave budget unused.
"""
from __future__ import annotations

import math

import torch

from .config import Exploration

_MASK31 = 0x7FFFFFFF


def budget_blocks(num_blocks: torch.Tensor, sparsity, topk: int, tokens_per_block: int,
                  keep_all: torch.Tensor) -> torch.Tensor:
    """Kept-block budget int64 [B]: ceil((1 - s) * n) = n - floor(s * n).

    sparsity: a float or float [B]. Computed in float64 with a nudge so that 0.3 * 10 gives 3. Raised to
    cover K tokens plus the partial newest block (so the top-k stays full) and capped at n; requests
    with context <= K (keep_all) keep everything.
    """
    skipped = torch.floor(num_blocks.double() * sparsity + 1e-9).long()
    cover = -(-topk // tokens_per_block) + 1
    budget = torch.minimum(num_blocks, torch.clamp(num_blocks - skipped, min=cover))
    return torch.where(keep_all, num_blocks, budget)


def budget_of(num_blocks: int, sparsity: float, topk: int, tokens_per_block: int) -> int:
    """budget_blocks for one request of num_blocks > topk tokens' worth, as a host int (a launch-size hint)."""
    skipped = math.floor(num_blocks * float(sparsity) + 1e-9)  # python floats are float64, as budget_blocks
    return min(num_blocks, max(num_blocks - skipped, -(-topk // tokens_per_block) + 1))


def explore_blocks(budget: torch.Tensor, gamma: float, policy: Exploration, keep_all: torch.Tensor) -> torch.Tensor:
    """Exploration share int64 [B] of the budget: round(gamma * m), 0 without exploration or for keep_all."""
    if policy is Exploration.NONE:
        return torch.zeros_like(budget)
    return torch.where(keep_all, 0, torch.floor(budget.double() * gamma + 0.5).long())


def step_hash(seed: int, slot_ids: torch.Tensor, step: torch.Tensor, width: int) -> torch.Tensor:
    """int64 [B, width] hash of (seed, slot, step, block), computed once per step and shared by all layers.

    Counter-based (no generator state): identical on CPU and GPU and safe in a CUDA graph. Every
    intermediate stays below 2**58, so int64 never overflows.
    """
    blocks = torch.arange(width, device=slot_ids.device, dtype=torch.int64)[None, :]
    h = torch.full_like(blocks, (seed * 0x9E3779B1) & _MASK31).expand(slot_ids.shape[0], -1)
    for part in (slot_ids.long()[:, None], step.long()[:, None], blocks):
        h = _mix(h ^ (part & _MASK31))
    return h


def layer_hash(h: torch.Tensor, layer: int) -> torch.Tensor:
    """int64 hash in [0, 2**31) of step_hash(...) and a layer: one mixing round per layer."""
    return _mix(h ^ ((layer * 0x9E3779B1 + 0x7F4A7C15) & _MASK31))


def _mix(h: torch.Tensor) -> torch.Tensor:
    h = (h * 0x45D9F3B) & _MASK31
    h = h ^ (h >> 15)
    return (h * 0x2C1B3C6D & _MASK31) ^ (h >> 13)


def uniform_hash(seed: int, layer: int, slot_ids: torch.Tensor, step: torch.Tensor, width: int) -> torch.Tensor:
    """Reproducible uniforms float32 [B, width] in [0, 1) from (seed, layer, slot, step, block)."""
    return layer_hash(step_hash(seed, slot_ids, step, width), layer).to(torch.float32) / float(2**31)


def rank_of(key: torch.Tensor) -> torch.Tensor:
    """Rank int64 of each entry along the last dim when sorted descending (ties: lower index first)."""
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(key.shape[-1], device=key.device).expand_as(order))
    return ranks


def select_blocks(scores: torch.Tensor, valid: torch.Tensor, forced: torch.Tensor, budget: torch.Tensor,
                  explore: torch.Tensor, policy: Exploration, uniforms: torch.Tensor,
                  age: torch.Tensor, return_explored: bool = False, hashes: torch.Tensor | None = None,
                  max_explore: int | None = None):
    """Keep mask bool [B, W] (and, with return_explored, the stage-2 blocks bool [B, W] too).

    scores: float32 [B, P, W] block scores per prediction row; valid: bool [B, W] (block < n_blocks);
    forced: bool [B, W] (subset of valid); budget: int64 [B] kept-block budget m (<= n_blocks);
    explore: int64 [B] exploration share e of the budget; uniforms: float32 [B, W] in [0, 1);
    age: int64 [B, W] steps since the block was last scored.
    hashes, max_explore: optional int64 [B, W] hashes in [0, 2**31) behind `uniforms`, and a static bound
    on `explore`: random exploration then takes a top-(max_explore) of unique integer keys instead of a
    full sort over W (same blocks: both order by hash, ties to the lower block).
    """
    forced_count = forced.sum(dim=-1)
    stage1 = torch.maximum(forced_count, budget - explore)  # k1
    key = torch.where(forced[:, None, :], float("inf"), torch.where(valid[:, None, :], scores, float("-inf")))
    keep1 = ((rank_of(key) < stage1[:, None, None]) & (key > float("-inf"))).any(dim=1)
    keep1 |= forced
    if policy is Exploration.NONE:
        return (keep1, torch.zeros_like(keep1)) if return_explored else keep1
    extra = torch.clamp(torch.minimum(explore, budget - stage1), min=0)
    candidates = valid & ~keep1
    if policy is Exploration.RANDOM:
        key2 = uniforms
    else:
        age_f = age.to(torch.float32) + uniforms * 1e-3  # hash breaks ties between equal ages
        if policy is Exploration.BLOCK_AGE:
            key2 = age_f
        else:  # STALENESS: old and once-important first
            best = torch.where(valid, scores.amax(dim=1), float("-inf"))
            n_valid = valid.sum(dim=-1, keepdim=True).clamp_min(1)
            percentile = 1.0 - rank_of(best).to(torch.float32) / n_valid
            key2 = (age_f + 1.0) * percentile.clamp_min(0.0)
    width = valid.shape[-1]
    if policy is Exploration.RANDOM and hashes is not None and max_explore is not None and width > 0:
        # Unique keys: hash first, then the lower block; non-candidates below every candidate.
        blocks = torch.arange(width, device=valid.device)
        key = torch.where(candidates, hashes * (width + 1) + (width - blocks), -1)
        top = torch.topk(key, k=max(1, min(width, max_explore)), dim=-1).indices  # [B, E], best first
        chosen = torch.arange(top.shape[1], device=valid.device)[None, :] < extra[:, None]
        keep2 = torch.zeros_like(candidates).scatter_(1, top, chosen) & candidates
        return (keep1 | keep2, keep2) if return_explored else keep1 | keep2
    key2 = torch.where(candidates, key2, -1.0)
    keep2 = (rank_of(key2) < extra[:, None]) & candidates
    return (keep1 | keep2, keep2) if return_explored else keep1 | keep2
