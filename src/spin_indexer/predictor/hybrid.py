"""Hybrid predictor (beyond the paper): this layer's history mixed with what the previous layer's indexer
computed in the same step (the cross-layer signal IndexCache reuses).

Scores of different layers live on different scales, so both are turned into percentiles among the
request's valid blocks before mixing:
    score = (1 - w) * pct(history) + w * pct(previous layer, same step)
A block the previous layer did not score (it skipped it) takes its own history percentile in both terms,
so the mix never invents importance for unseen blocks. Cost: two sorts over W blocks per request.
"""
from __future__ import annotations

import torch

from .select import rank_of


def percentile(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """float32 [..., W] in [0, 1]: 1 for the best valid block, falling linearly; 0 for invalid blocks."""
    key = torch.where(valid, scores, float("-inf"))
    n = valid.sum(dim=-1, keepdim=True).clamp_min(1).float()
    pct = 1.0 - rank_of(key).float() / n
    return torch.where(valid, pct, 0.0)


def hybrid_scores(history: torch.Tensor, previous: torch.Tensor, valid: torch.Tensor, weight: float) -> torch.Tensor:
    """history: float32 [B, P, W] block scores from this layer's V/D; previous: float32 [B, W] block max of
    the previous layer's logits this step (-inf where it skipped the block); valid: bool [B, W]."""
    valid_p = valid[:, None, :].expand_as(history)
    own = percentile(history, valid_p)
    seen = torch.isfinite(previous)[:, None, :]
    other = torch.where(seen, percentile(previous, valid & torch.isfinite(previous))[:, None, :], own)
    return torch.where(valid_p, (1.0 - weight) * own + weight * other, float("-inf"))
