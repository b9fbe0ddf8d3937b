"""Adaptive per-layer, per-request budgets with a miss-rate target (beyond the paper).

The paper fixes one sparsity for every layer and request. Here each (layer, request) pair holds a level
into a small fixed menu of sparsities (shapes stay static: only the budget *values* move). Every
`audit_every` steps (staggered across layers and requests so no step pays for all of them) a layer scores
every block of that request; the would-be plan at the current level is still computed, so the audit
measures the real miss of the prediction against the dense top-k of that very step:
    miss > target                                   -> one level down (denser), immediately
    miss <= target * raise_below for `patience` audits in a row -> one level up (sparser)
Each audited sample is held to the target, so the controller aims at a high quantile (p99-like) of the
miss, not its mean.

Probes (free, every step): exploration blocks are a uniform sample of the blocks the prediction skipped,
so the share of the top-k they catch, scaled by skipped / explored, estimates the miss of this step
without extra scoring. An estimate above the target schedules an audit of that (layer, request) for the
next step: after a sudden attention shift the layer is re-observed densely one step later instead of
waiting up to `audit_every` steps (with random exploration only). Everything runs on the device
without host syncs.
"""
from __future__ import annotations

import dataclasses

import torch

from ..checks import check_bool, check_choice, check_float, check_int, check_sequence
from .miss import miss_per_row, topk_in_blocks


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
    """target_miss: per-audit miss ceiling (the p99 target); menu: ascending sparsities to move between;
    audit_every: steps between audits of one (layer, request); raise_below, patience: when to go sparser;
    probe: audit next step when the exploration sample suggests a miss above target (off by default: on
    synthetic traces it spent more budget on audits than it saved, see results/beyond).
    controller: "step" moves one menu level per audit by the rule above; "curve" measures at each audit
    the miss the prediction would have at *every* menu level (one prefix count over the predicted block
    order), keeps a decaying maximum per level (q = max(miss, decay * q)) and picks the sparsest level
    whose q is within the target.
    Start conservative (SpinConfig.sparsity 0.1-0.2) and let the controller climb: a p99 target is
    broken by the steps spent too sparse before the first audits, not by those spent too dense."""

    target_miss: float = 0.1
    menu: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
    audit_every: int = 8
    raise_below: float = 0.5
    patience: int = 1
    probe: bool = False
    controller: str = "step"
    decay: float = 0.7

    def __post_init__(self):
        # Types first (TypeError naming the field), then ranges (ValueError); stored as exact float / int,
        # and the menu as a tuple so the frozen config stays hashable.
        def menu_item(name, value):
            return check_float(name, value, low=0, high=1, high_open=True)

        def put(name, value):
            object.__setattr__(self, name, value)  # frozen: the checked value replaces the given one

        put("target_miss", check_float("AdaptiveConfig.target_miss", self.target_miss, low=0, high=1))
        put("menu", check_sequence("AdaptiveConfig.menu", self.menu, menu_item))
        if not self.menu or list(self.menu) != sorted(set(self.menu)):
            raise ValueError(f"AdaptiveConfig.menu: expected strictly ascending sparsities in [0, 1), got {self.menu}")
        put("audit_every", check_int("AdaptiveConfig.audit_every", self.audit_every, low=2))
        put("raise_below", check_float("AdaptiveConfig.raise_below", self.raise_below, low=0, high=1))
        put("patience", check_int("AdaptiveConfig.patience", self.patience, low=1))
        check_bool("AdaptiveConfig.probe", self.probe)
        check_choice("AdaptiveConfig.controller", self.controller, ("step", "curve"))
        put("decay", check_float("AdaptiveConfig.decay", self.decay, low=0, high=1))

    def start_level(self, sparsity: float) -> int:
        """Menu index closest to the configured starting sparsity."""
        return min(range(len(self.menu)), key=lambda i: abs(self.menu[i] - sparsity))


def audit_mask(step: torch.Tensor, slot_ids: torch.Tensor, layer: int, every: int) -> torch.Tensor:
    """bool [B]: requests whose `layer` is audited this step (staggered by layer and slot)."""
    return (step.long() + slot_ids + layer) % every == 0


def prediction_miss(topk: torch.Tensor, predicted: torch.Tensor, next_n: int, tokens_per_block: int) -> torch.Tensor:
    """Miss float32 [B] of a would-be block set: fraction of the (dense) top-k outside it, worst row.

    topk: int32 [B*next_n, K] positions (-1 padded); predicted: bool [B, W] would-be kept blocks.
    """
    return miss_per_row(predicted, topk, next_n, tokens_per_block).view(predicted.shape[0], next_n).amax(dim=1)


def probe_miss(topk: torch.Tensor, explored: torch.Tensor, predicted: torch.Tensor, valid: torch.Tensor,
               next_n: int, tokens_per_block: int) -> torch.Tensor:
    """Estimated miss float32 [B] of the prediction from the exploration sample, worst row.

    topk: int32 [B*next_n, K] this step's positions; explored: bool [B, W] stage-2 blocks (a uniform
    sample of the blocks the prediction alone would skip); predicted: bool [B, W] stage-1 blocks;
    valid: bool [B, W]. 0 where nothing was explored.
    """
    batch = explored.shape[0]
    inside, live = topk_in_blocks(explored, topk, next_n, tokens_per_block)
    hits = inside.sum(dim=-1).float().view(batch, next_n)  # [B, N]
    live = live.view(batch, next_n, -1)
    sampled = explored.sum(dim=1, keepdim=True).float()
    unpredicted = (valid & ~predicted).sum(dim=1, keepdim=True).float()  # explored blocks included
    est = hits * unpredicted / sampled.clamp_min(1) / live.sum(dim=-1).clamp_min(1).float()
    return torch.where(sampled > 0, est, 0.0).amax(dim=1)


def curve_miss(topk: torch.Tensor, pred_rank: torch.Tensor, budgets: torch.Tensor, next_n: int,
               tokens_per_block: int) -> torch.Tensor:
    """Miss float32 [B, I] the prediction would have with each budget: share of the (dense) top-k whose
    block ranks at or past the budget in the predicted order (worst row).

    topk: int32 [B*next_n, K]; pred_rank: int64 [B, W] rank of each block in the predicted keep order
    (forced blocks first); budgets: int64 [B, I] predicted (non-exploration) blocks per menu level.
    """
    batch = pred_rank.shape[0]
    pos = topk.long().view(batch, next_n, -1)
    valid = pos >= 0
    blocks = (pos.clamp_min(0) // tokens_per_block).view(batch, -1)
    rank = torch.gather(pred_rank, 1, blocks).view(batch, next_n, -1, 1)  # [B, N, K, 1]
    outside = (rank >= budgets[:, None, None, :]) & valid[..., None]  # [B, N, K, I]
    miss = outside.sum(dim=2).float() / valid.sum(dim=-1, keepdim=True).clamp_min(1).float()
    return miss.amax(dim=1)


def update_curve_(level: torch.Tensor, curve: torch.Tensor, slot_ids: torch.Tensor, audited: torch.Tensor,
                  miss: torch.Tensor, cfg: AdaptiveConfig) -> None:
    """In place on one layer's level int32 [S] and curve float32 [S, I], for audited requests only."""
    old = curve[slot_ids]
    new = torch.maximum(miss, cfg.decay * old)
    new = torch.where(audited[:, None], new, old)
    curve[slot_ids] = new
    ok = new <= cfg.target_miss  # [B, I]
    idx = torch.arange(ok.shape[1], device=ok.device)
    best = torch.where(ok, idx, 0).amax(dim=1)  # sparsest level within target (0 when none is)
    level[slot_ids] = torch.where(audited, best, level[slot_ids].long()).to(level.dtype)


def update_levels_(level: torch.Tensor, calm: torch.Tensor, slot_ids: torch.Tensor, audited: torch.Tensor,
                   miss: torch.Tensor, cfg: AdaptiveConfig) -> None:
    """In place on one layer's level/calm int32 [S] rows, for the audited requests only."""
    lv, cm = level[slot_ids], calm[slot_ids]
    over = miss > cfg.target_miss
    quiet = miss <= cfg.target_miss * cfg.raise_below
    cm_new = torch.where(quiet, cm + 1, torch.zeros_like(cm))
    up = quiet & (cm_new >= cfg.patience)
    lv_new = torch.where(over, lv - 1, torch.where(up, lv + 1, lv)).clamp(0, len(cfg.menu) - 1)
    cm_new = torch.where(up, torch.zeros_like(cm_new), cm_new)
    level[slot_ids] = torch.where(audited, lv_new, lv).to(level.dtype)
    calm[slot_ids] = torch.where(audited, cm_new, cm).to(calm.dtype)
