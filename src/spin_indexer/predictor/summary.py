"""Summary mix (beyond the paper, issue #18): this layer's history mixed with this step's query scored against
each block's sub-block mean keys (ops.block_summary_scores; docs/current_step_selection.md).

The two live on different scales, so each is standardized over the request's valid blocks before mixing:
    score = (1 - w) * z(history) + w * z(summary),   z(x) = (x - mean) / std
two row reductions and no sort (in simulation, as good as mixing percentiles: results/fidelity/
cpu-v2-head-4k-k512/coarse/zmix4k). A block without history (-inf: never scored) keeps the row's lowest z in
that term, so the mix never invents importance from a missing observation; such blocks are kept anyway
(plan.forced_blocks).
"""
from __future__ import annotations

import torch


def standardized(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """float32 like scores [..., W]: (x - mean) / std over each row's valid, finite entries; the others at the
    row's lowest z (0 for a row with none); a row whose entries are all equal at 0."""
    seen = valid & torch.isfinite(scores)
    n = seen.sum(dim=-1, keepdim=True).clamp_min(1)
    x = torch.where(seen, scores, 0.0)
    mean = x.sum(dim=-1, keepdim=True) / n
    var = (torch.where(seen, x - mean, 0.0) ** 2).sum(dim=-1, keepdim=True) / n
    z = torch.where(seen, (x - mean) / var.sqrt().clamp_min(1e-12), float("inf"))
    low = z.amin(dim=-1, keepdim=True)
    low = torch.where(torch.isfinite(low), low, 0.0)
    return torch.where(seen, z, low)


def summary_scores(history: torch.Tensor, summary: torch.Tensor, valid: torch.Tensor, weight: float) -> torch.Tensor:
    """history: float32 [B, P, W] block scores from this layer's V/D; summary: float32 [B, W] this step's
    summary scores (ops.block_summary_scores); valid: bool [B, W]. returns float32 [B, P, W], -inf where invalid."""
    valid_p = valid[:, None, :].expand_as(history)
    own = standardized(history, valid_p)
    now = standardized(summary, valid)[:, None, :]
    return torch.where(valid_p, (1.0 - weight) * own + weight * now, float("-inf"))


def mixing_requests(seq_lens: torch.Tensor, below: int) -> torch.Tensor:
    """bool [B]: the requests that take the mix under SpinConfig.summary_below = `below` (their longest row
    shorter than it; every request for 0). seq_lens: int32 [B, N]."""
    if below == 0 or seq_lens.shape[0] == 0:
        return torch.ones(seq_lens.shape[0], dtype=torch.bool, device=seq_lens.device)
    return seq_lens.amax(dim=1) < below
