"""Beyond the paper, as hooks around SpinIndexer's step (the torch path; off by default). On CUDA the summary mix
alone runs the fused step instead (SpinIndexer._select_in_run, plan_triton.select_layer_triton): this is its
reference.

    adaptive  per-(layer, request) budgets from a sparsity menu, audits that score every block and measure
              the prediction's real miss (predictor/adaptive.py)
    profile   a fixed sparsity a layer (SpinConfig.sparsity_profile: the budget moved to the layers whose history
              predicts them worst, at the same mean)
    hybrid    this layer's block scores mixed with what the previous layer's indexer computed in the same
              step (predictor/hybrid.py); it needs that layer's scores, so it selects at run() time
    summary   this layer's block scores mixed with this step's query scored against each block's sub-block
              mean keys (predictor/summary.py, ops.block_summary_scores); it needs the layer's query and keys,
              so it selects at run() time too

SpinIndexer calls `select(layer, meta, out, inputs)` for each layer's plan and `after_layer(...)` once the
layer's top-k and block plan exist; the paper's step itself has no branch for either.
"""
from __future__ import annotations

import torch

from .. import ops
from ..predictor.adaptive import (audit_mask, curve_miss, prediction_miss, probe_miss, update_curve_,
                                  update_levels_)
from ..predictor.hybrid import hybrid_scores
from ..predictor.plan import layer_scores, select_layer
from ..predictor.select import budget_blocks, explore_blocks, rank_of
from ..predictor.summary import mixing_requests, summary_scores
from .block_plan import BlockPlan


class Extensions:
    """The adaptive, hybrid and summary hooks of one SpinIndexer (state: its SpinState; config: its SpinConfig)."""

    def __init__(self, config, state, next_n: int):
        self.config, self.state, self.next_n = config, state, next_n
        self.previous = None  # float32 [B, W]: the previous layer's logical block max this step (hybrid)

    @property
    def selects_per_layer(self) -> bool:
        """True when selection must wait for run(layer) (hybrid reads the previous layer of this step, summary
        the layer's query)."""
        return self.config.hybrid > 0 or self.config.summary > 0

    def begin_step(self) -> None:
        self.previous = None

    def select(self, layer: int, meta, out: BlockPlan, inputs: tuple | None = None,
               summary: torch.Tensor | None = None) -> BlockPlan:
        """Plan `layer` into `out` with the extensions' budgets and scores. The summary mix scores the blocks
        with this step's query: from `summary` (float32 [B, W]: a replay's recorded ops.block_summary_scores) or
        else from `inputs` = (q_fp8, kv_cache, weights) of run(layer), through the summary cache
        (`cached_summary_scores`). run() always passes `inputs`; run_from_scores refuses a missing `summary`
        before it gets here."""
        cfg, t = self.config, self.config.tokens_per_block
        scores = layer_scores(cfg, self.state, layer, meta)
        if cfg.hybrid > 0 and self.previous is not None:
            scores = hybrid_scores(scores, self.previous, meta.valid, cfg.hybrid)
        if cfg.summary > 0:
            if summary is None:
                summary = self.cached_summary_scores(layer, meta, *inputs)
            mixes = mixing_requests(meta.seq_lens, cfg.summary_below)  # the others keep the history's scores
            scores = torch.where(mixes[:, None, None], summary_scores(scores, summary, meta.valid, cfg.summary),
                                 scores)
        budget, explore, audit = meta.budget, meta.explore, None
        dense = meta.keep_all | meta.guarded
        if cfg.sparsity_profile:  # requests shorter than profile_from take the profile at short_profile_strength
            # float64 values exactly as the fused planner reads them (a float32 where() would round them)
            sparsity = torch.full(meta.num_blocks.shape, cfg.layer_sparsity(layer, short=True), dtype=torch.float64,
                                  device=meta.num_blocks.device)
            sparsity.masked_fill_(meta.seq_lens.amax(dim=1) >= cfg.profile_from, cfg.layer_sparsity(layer))
            budget = budget_blocks(meta.num_blocks, sparsity, cfg.topk, t, dense)
            explore = explore_blocks(budget, cfg.gamma, cfg.exploration, dense)
        if cfg.adaptive is not None:
            menu = torch.tensor(cfg.adaptive.menu, dtype=torch.float64, device=scores.device)
            sparsity = menu[self.state.level[layer, meta.slot_ids].long()]
            budget = budget_blocks(meta.num_blocks, sparsity, cfg.topk, t, dense)
            explore = explore_blocks(budget, cfg.gamma, cfg.exploration, dense)
            audit = audit_mask(meta.step, meta.slot_ids, layer, cfg.adaptive.audit_every)
            audit = (audit | self.state.audit_next[layer, meta.slot_ids]) & ~dense
        if cfg.summary > 0 and not cfg.summary_explores:  # the requests that mix give no block to exploration
            explore = torch.where(mixes, 0, explore)
        predicted, explored, forced, scores = select_layer(cfg, self.state, layer, meta, scores, budget, explore)
        keep = predicted if audit is None else predicted | (audit[:, None] & meta.valid)
        plan = BlockPlan.from_keep_mask(keep, meta.block_table, meta.seq_lens, meta.num_blocks, t, meta.guarded,
                                        out=out)
        plan.predicted_mask, plan.audit, plan.explored = predicted, audit, explored
        if cfg.adaptive is not None and cfg.adaptive.controller == "curve":
            # The predicted keep order (forced first, then by block score), for the per-level miss curve.
            key = torch.where(forced, float("inf"), torch.where(meta.valid, scores.amax(dim=1), float("-inf")))
            plan.pred_rank = rank_of(key)
        return plan

    def cached_summary_scores(self, layer: int, meta, q_fp8, kv_cache, weights) -> torch.Tensor:
        """float32 [B, W]: write the summaries of the blocks each request filled since its last step (row 0's
        blocks: its tokens are committed, drafts are not), then score every summarized block with this step's
        query (ops.update_and_score_summaries). The newest, partial block scores -inf: plan keeps it anyway. Reads
        S x (D + 4) B a block, writes as much a block that filled; no host sync."""
        state, t = self.state, self.config.tokens_per_block
        width = meta.block_table.shape[1]
        full = torch.clamp(meta.seq_lens[:, 0] // t, max=width).to(torch.int32)  # [B]
        full = torch.where(mixing_requests(meta.seq_lens, self.config.summary_below), full, 0)  # the others: none
        slots = meta.slot_ids.long()
        scores = ops.update_and_score_summaries(q_fp8, kv_cache, state.summaries[layer], weights, meta.block_table,
                                                state.summarized[layer, slots], full, validate=False)
        state.summarized[layer, slots] = full
        return scores

    def after_layer(self, layer: int, meta, plan: BlockPlan, topk: torch.Tensor, block_max: torch.Tensor) -> None:
        """Controllers and the hybrid hand-over, once `layer`'s top-k (logical positions) is known.
        block_max: float32 [B*N, W'] max of each compact block's logits."""
        cfg, t = self.config, self.config.tokens_per_block
        adaptive = cfg.adaptive
        if adaptive is not None:  # audited rows scored every block: their top-k is the dense one
            if adaptive.controller == "curve":
                menu = torch.tensor(adaptive.menu, dtype=torch.float64, device=topk.device)
                dense = (meta.keep_all | meta.guarded)[:, None]
                budgets = budget_blocks(meta.num_blocks[:, None], menu[None, :], cfg.topk, t, dense)
                budgets = budgets - explore_blocks(budgets, cfg.gamma, cfg.exploration, dense)
                miss = curve_miss(topk, plan.pred_rank, budgets, self.next_n, t)
                update_curve_(self.state.level[layer], self.state.curve[layer], meta.slot_ids, plan.audit, miss,
                              adaptive)
            else:
                miss = prediction_miss(topk, plan.predicted_mask, self.next_n, t)
                update_levels_(self.state.level[layer], self.state.calm[layer], meta.slot_ids, plan.audit, miss,
                               adaptive)
            if adaptive.probe:  # a surprise in the exploration sample: audit this layer next step
                est = probe_miss(topk, plan.explored, plan.predicted_mask & ~plan.explored, meta.valid, self.next_n, t)
                self.state.audit_next[layer, meta.slot_ids] = (est > adaptive.target_miss) & ~plan.audit
        if cfg.hybrid > 0:
            self.previous = logical_block_max(plan, block_max, self.next_n)


def logical_block_max(plan: BlockPlan, block_max: torch.Tensor, next_n: int) -> torch.Tensor:
    """float32 [B, W]: per logical block, the max score any row of the request saw; -inf if skipped."""
    batch, width = plan.kept_blocks.shape
    cols = min(width, block_max.shape[1])
    per_request = block_max.view(batch, next_n, -1)[:, :, :cols].amax(dim=1)  # [B, compact blocks]
    out = torch.full((batch, width + 1), float("-inf"), device=block_max.device)
    live = torch.arange(cols, device=block_max.device)[None, :] < plan.num_kept[:, None]
    kept = torch.where(live, plan.kept_blocks.long()[:, :cols], width)
    out.scatter_(1, kept, torch.where(live, per_request, float("-inf")))
    return out[:, :width]
