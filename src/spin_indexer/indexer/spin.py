"""SpinIndexer: the SPIN decode step. plan() once per step, run() per layer.

    plan(block_table, seq_lens, slot_ids)        budgets, newest blocks, step counters  (all layers)
    run(layer, q_fp8, kv_cache, weights)          per layer:
        predict   block scores from this layer's V/D history         predictor/score.py
        select    budget + always-keep + exploration -> keep mask    predictor/select.py
        compact   kept blocks -> compact block table and lengths     indexer/block_plan.py
        score     paged indexer logits on the compact table          ops.paged_indexer_logits
        top-k     over compact columns, mapped back to positions     ops.topk
        update    EMA of V/D at the scored slots only                predictor/update.py
run_from_scores() replaces "score" by a gather from precomputed scores (offline replay of traces), so
replay and live decoding share every other line. No host sync, no data-dependent shape inside plan/run
(validate=False), so a whole step can be captured in a CUDA graph.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import ops
from ..checks import check_int, check_tensor, check_values_in_range
from ..layout import FP8_DTYPE
from ..predictor.config import Exploration, Pooling, Reduce, SpinConfig
from ..predictor.mtp import prediction_rows, update_rows
from ..predictor.score import block_scores
from ..predictor.adaptive import (audit_mask, curve_miss, prediction_miss, probe_miss, update_curve_,
                                  update_levels_)
from ..predictor.hybrid import hybrid_scores
from ..predictor.select import (budget_blocks, explore_blocks, layer_hash, rank_of, select_blocks,
                                step_hash)
from ..predictor.state import SpinState
from ..predictor.update import mark_seen, update_history
from ..dispatch import triton_twin
from .block_plan import BlockPlan


@dataclasses.dataclass
class _Step:
    """What plan() computed for the current step; shared by every layer's run()."""

    block_table: torch.Tensor  # int32 [B, W]
    seq_lens: torch.Tensor  # int32 [B, N]
    slot_ids: torch.Tensor  # int64 [B]
    step: torch.Tensor  # int32 [B]
    num_blocks: torch.Tensor  # int64 [B]
    valid: torch.Tensor  # bool [B, W]
    newest: torch.Tensor  # bool [B, W]: blocks holding any row's query token
    keep_all: torch.Tensor  # bool [B]: context <= K, everything is selected
    budget: torch.Tensor  # int64 [B]
    explore: torch.Tensor  # int64 [B]
    update_rows: torch.Tensor  # bool [B, N]
    hash: torch.Tensor  # int64 [B, W]: per-step exploration hash, mixed with the layer in run()
    max_explore: int  # static bound on any request's exploration count (a top-k size, never a sync)
    first_new: torch.Tensor  # int64 [B]: first block holding a query token of any row
    update_any: torch.Tensor  # bool [B]: some row of the request updates the history


class SpinIndexer:
    """SPIN's block-sparse lightning indexer for batched decode.

    config: SpinConfig; num_layers: indexer layers; max_batch: B at most; max_blocks: W at most (the
    engine's block-table width); next_n: query rows per request; max_requests: state slots (default
    max_batch). State lives in `self.state` (allocate() a slot per request, free() it when done).
    """

    def __init__(self, config: SpinConfig, num_layers: int, max_batch: int, max_blocks: int, next_n: int = 1,
                 device: torch.device | str = "cpu", max_requests: int | None = None):
        if not isinstance(config, SpinConfig):
            raise TypeError(f"config: expected a SpinConfig, got {type(config).__name__}")
        check_int("max_batch", max_batch, low=1)
        check_int("next_n", next_n, low=1, high=8)
        self.config, self.max_batch, self.next_n = config, max_batch, next_n
        self.device = torch.device(device)
        self.state = SpinState(config, num_layers, max_requests or max_batch, max_blocks, self.device)
        self._step: _Step | None = None
        self.block_plan: BlockPlan | None = None

    @property
    def num_layers(self) -> int:
        return self.state.num_layers

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, slot_ids: torch.Tensor,
             num_accepted: torch.Tensor | None = None, validate: bool = True) -> None:
        """Prepare one decode step for every layer.

        block_table: int32 [B, W] with W <= max_blocks; seq_lens: int32 [B, next_n], row j of request b
        has length L_b - next_n + j + 1 (0 for padding requests); slot_ids: int32/int64 [B] allocated,
        distinct state slots; num_accepted: int32 [B] in [0, next_n - 1] or None (see predictor/mtp.py).
        validate: check the data too (a host sync; turn off when capturing a CUDA graph).
        """
        cfg, t, dev = self.config, self.config.tokens_per_block, self.device
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=dev, device_of="SpinIndexer")
        batch, width = block_table.shape
        check_int("block_table.shape[0] (B)", batch, high=self.max_batch)
        check_int("block_table.shape[1] (W)", width, high=self.state.max_blocks)
        check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(batch, self.next_n), shape_names="[B, next_n]",
                     device=dev, device_of="SpinIndexer")
        check_tensor("slot_ids", slot_ids, dtype=(torch.int32, torch.int64), shape=(batch,), shape_names="[B]",
                     device=dev, device_of="SpinIndexer")
        if num_accepted is not None:
            check_tensor("num_accepted", num_accepted, dtype=torch.int32, shape=(batch,), shape_names="[B]",
                         device=dev, device_of="SpinIndexer")
        if validate:
            self._validate_data(seq_lens, slot_ids, num_accepted, width * t)
        lens = seq_lens.long()
        slots = slot_ids.long()
        longest = lens.amax(dim=1) if self.next_n else lens.new_zeros(batch)
        num_blocks = (longest + t - 1) // t
        blocks = torch.arange(width, device=dev)[None, :]
        valid = blocks < num_blocks[:, None]
        first_new = (lens.amin(dim=1) - 1).clamp_min(0) // t
        newest = valid & (blocks >= first_new[:, None])
        keep_all = longest <= cfg.topk
        budget = budget_blocks(num_blocks, cfg.sparsity, cfg.topk, t, keep_all)
        explore = explore_blocks(budget, cfg.gamma, cfg.exploration, keep_all)
        self.state.step.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
        step = self.state.step[slots]
        rows = update_rows(cfg.mtp, num_accepted, batch, self.next_n, dev)
        max_explore = int(cfg.gamma * width + 0.5) if cfg.exploration is not Exploration.NONE else 0
        self._step = _Step(block_table, seq_lens, slots, step, num_blocks, valid, newest, keep_all, budget, explore,
                           rows, step_hash(cfg.seed, slots, step, width), max_explore, first_new, rows.any(dim=1))
        self.block_plan = None
        self._previous_blocks = None  # the previous layer's block scores of this step (hybrid mode)

    def run(self, layer: int, q_fp8: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Top-k positions int32 [B*next_n, K] (-1 padded) for `layer`, then that layer's state update.

        q_fp8: float8_e4m3fn [B, next_n, H, D]; kv_cache: uint8 [num_blocks, T, 1, D + 4];
        weights: float32 [B*next_n, H].
        """
        st = self._current(layer)
        batch = st.block_table.shape[0]
        check_tensor("q_fp8", q_fp8, dtype=FP8_DTYPE, ndim=4, device=self.device, device_of="SpinIndexer")
        if tuple(q_fp8.shape[:2]) != (batch, self.next_n):
            raise ValueError(f"q_fp8: expected shape [B, next_n, H, D] with [B, next_n] = [{batch}, {self.next_n}] "
                             f"(from plan()), got {list(q_fp8.shape)}")
        plan = self._select(layer, st)
        # On CUDA the logits kernel writes the per-block max for free; top-k prunes with it.
        block_max = None
        if q_fp8.is_cuda:
            block_max = torch.empty(batch * self.next_n, plan.compact_block_table.shape[1], dtype=torch.float32,
                                    device=self.device)
        logits = ops.paged_indexer_logits(q_fp8, kv_cache, weights, plan.compact_seq_lens, plan.compact_block_table,
                                          validate=False, block_max_out=block_max)
        return self._finish(layer, st, plan, logits, block_max)

    def run_from_scores(self, layer: int, scores: torch.Tensor) -> torch.Tensor:
        """Replay: like run(), with the indexer scores of every logical position given.

        scores: float32 [B*next_n, W*T] (values at/after a row's length are ignored). Only the columns
        of kept blocks are read, exactly what the paged kernel would have computed.
        """
        st = self._current(layer)
        batch, width = st.block_table.shape
        t = self.config.tokens_per_block
        check_tensor("scores", scores, dtype=torch.float32, shape=(batch * self.next_n, width * t),
                     shape_names="[B*next_n, W*T]", device=self.device, device_of="SpinIndexer")
        plan = self._select(layer, st)
        blocks = width
        if not scores.is_cuda and batch > 0:
            # Off the GPU nothing is captured in a graph, so the compact columns can stop at the most
            # blocks any request kept (one host read): the gather, top-k and EMA update skip the padding.
            blocks = max(1, int(plan.num_kept.max()))
        pos = plan.positions(blocks)  # [B, M*T]
        rows = scores.view(batch, self.next_n, width * t)
        gathered = torch.gather(rows, 2, pos.clamp_min(0)[:, None, :].expand(-1, self.next_n, -1))
        cols = torch.arange(blocks * t, device=self.device)
        live = cols[None, None, :] < plan.compact_seq_lens.long()[:, :, None]
        logits = torch.where(live, gathered, float("-inf")).view(batch * self.next_n, blocks * t)
        return self._finish(layer, st, plan, logits, positions=pos)

    # -- the per-layer steps -------------------------------------------------------------------------
    def _select(self, layer: int, st: _Step) -> BlockPlan:
        cfg, t = self.config, self.config.tokens_per_block
        width = st.block_table.shape[1]
        cols = width * t
        rows = prediction_rows(cfg.mtp, self.next_n)
        lens = st.seq_lens.long()[:, rows]
        fused = triton_twin("spin_indexer.predictor.score_triton", "block_scores_triton", st.block_table)
        if fused is not None and cfg.pooling is Pooling.A1 and cfg.reduce in (Reduce.MAX, Reduce.MEAN):
            scores = fused(self.state.vertical[layer], self.state.diagonal[layer], st.slot_ids, lens - 1, lens,
                           width, cfg.combine, cfg.reduce, t)
        else:
            vertical = self.state.vertical[layer, st.slot_ids, :cols]
            diagonal = self.state.diagonal[layer, st.slot_ids, :cols]
            scores = block_scores(vertical, diagonal, lens - 1, lens, st.budget * t, cfg.pooling, cfg.reduce,
                                  cfg.combine, t)
        budget, explore, audit = st.budget, st.explore, None
        if cfg.adaptive is not None:
            menu = torch.tensor(cfg.adaptive.menu, dtype=torch.float64, device=self.device)
            sparsity = menu[self.state.level[layer, st.slot_ids].long()]
            budget = budget_blocks(st.num_blocks, sparsity, cfg.topk, t, st.keep_all)
            explore = explore_blocks(budget, cfg.gamma, cfg.exploration, st.keep_all)
            audit = audit_mask(st.step, st.slot_ids, layer, cfg.adaptive.audit_every)
            audit = (audit | self.state.audit_next[layer, st.slot_ids]) & ~st.keep_all
        if cfg.hybrid > 0 and self._previous_blocks is not None:
            scores = hybrid_scores(scores, self._previous_blocks, st.valid, cfg.hybrid)
        if cfg.pooling is Pooling.A0:
            # A0 keeps every block holding a selected slot (finite score), however many: its block count
            # follows the slot budget only indirectly. Exploration keeps its own share on top.
            budget = st.num_blocks + explore
        fused = None
        if cfg.adaptive is None and scores.shape[1] == 1 and cfg.exploration in (Exploration.NONE, Exploration.RANDOM):
            fused = triton_twin("spin_indexer.predictor.select_triton", "select_compact_triton", scores)
        if fused is not None:  # one kernel: select, compact, mark last_seen
            keep, kept, table, clen, num_kept = fused(
                scores[:, 0], self.state.last_seen[layer], st.slot_ids, st.step, st.hash, layer, st.num_blocks,
                st.first_new, st.keep_all, budget, explore, st.block_table, st.seq_lens, st.update_any,
                cfg.exploration is Exploration.RANDOM, t)
            plan = BlockPlan(keep, kept, num_kept, st.num_blocks.to(torch.int32), table, clen, t)
            plan.predicted_mask, plan.seen_marked = keep, True
            return plan
        last = self.state.last_seen[layer, st.slot_ids, :width]
        forced = st.newest | (st.valid & (last < 0)) | (st.valid & st.keep_all[:, None])
        age = st.step.long()[:, None] - last.long()
        hashes = layer_hash(st.hash, layer)
        uniforms = hashes.to(torch.float32) / float(2**31)
        predicted, explored = select_blocks(scores, st.valid, forced, budget, explore, cfg.exploration, uniforms, age,
                                            return_explored=True, hashes=hashes, max_explore=st.max_explore)
        keep = predicted if audit is None else predicted | (audit[:, None] & st.valid)
        plan = BlockPlan.from_keep_mask(keep, st.block_table, st.seq_lens, st.num_blocks, t)
        plan.predicted_mask, plan.audit, plan.explored = predicted, audit, explored
        if cfg.adaptive is not None and cfg.adaptive.controller == "curve":
            # The predicted keep order (forced first, then by block score), for the per-level miss curve.
            key = torch.where(forced, float("inf"), torch.where(st.valid, scores.amax(dim=1), float("-inf")))
            plan.pred_rank = rank_of(key)
        return plan

    def _finish(self, layer: int, st: _Step, plan: BlockPlan, logits: torch.Tensor,
                block_max: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Top-k, EMA update and bookkeeping of one layer. positions: plan.positions() matching the logits'
        width when the caller already built it (run_from_scores), else built here for the torch update."""
        cfg = self.config
        batch = st.block_table.shape[0]
        cols = ops.topk(logits, plan.compact_seq_lens.view(-1), cfg.topk, validate=False, block_max=block_max)
        # Compact column c of row (b, j) is logical position kept[b, c // T] * T + c % T: O(K) per row.
        t = cfg.tokens_per_block
        kept_rows = plan.kept_blocks.long().repeat_interleave(self.next_n, dim=0)  # [B*N, W]
        c = cols.long().clamp_min(0)
        topk = torch.where(cols >= 0, torch.gather(kept_rows, 1, c // t) * t + c % t, -1).to(torch.int32)
        rows = logits.view(batch, self.next_n, logits.shape[1])
        fused = triton_twin("spin_indexer.predictor.update_triton", "ema_update_triton", logits)
        if fused is not None:
            fused(self.state.vertical[layer], self.state.diagonal[layer], st.slot_ids, rows, plan.kept_blocks,
                  plan.compact_seq_lens, st.seq_lens - 1, st.update_rows, cfg.alpha, t)
        else:
            if positions is None:
                positions = plan.positions(rows.shape[2] // t)
            update_history(self.state.vertical[layer], self.state.diagonal[layer], st.slot_ids, rows, positions,
                           plan.compact_seq_lens.long(), st.seq_lens.long() - 1, st.update_rows, cfg.alpha)
        if not plan.seen_marked:
            mark_seen(self.state.last_seen[layer], st.slot_ids, st.step, plan.kept_blocks.long(), st.update_rows)
        if cfg.adaptive is not None:  # audited rows scored every block: their top-k is the dense one
            if cfg.adaptive.controller == "curve":
                menu = torch.tensor(cfg.adaptive.menu, dtype=torch.float64, device=self.device)
                budgets = budget_blocks(st.num_blocks[:, None], menu[None, :], cfg.topk, t, st.keep_all[:, None])
                budgets = budgets - explore_blocks(budgets, cfg.gamma, cfg.exploration, st.keep_all[:, None])
                miss = curve_miss(topk, plan.pred_rank, budgets, self.next_n, t)
                update_curve_(self.state.level[layer], self.state.curve[layer], st.slot_ids, plan.audit, miss,
                              cfg.adaptive)
            else:
                miss = prediction_miss(topk, plan.predicted_mask, self.next_n, t)
                update_levels_(self.state.level[layer], self.state.calm[layer], st.slot_ids, plan.audit, miss,
                               cfg.adaptive)
            if cfg.adaptive.probe:  # a surprise in the exploration sample: audit this layer next step
                est = probe_miss(topk, plan.explored, plan.predicted_mask & ~plan.explored, st.valid, self.next_n, t)
                self.state.audit_next[layer, st.slot_ids] = (est > cfg.adaptive.target_miss) & ~plan.audit
        if cfg.hybrid > 0:
            self._previous_blocks = self._logical_block_max(plan, logits, block_max)
        self.block_plan = plan
        return topk

    def _logical_block_max(self, plan: BlockPlan, logits: torch.Tensor, block_max: torch.Tensor | None):
        """float32 [B, W]: per logical block, the max score any row of the request saw; -inf if skipped."""
        batch, width = plan.kept_blocks.shape
        if block_max is None:
            block_max = ops.block_max(logits, self.config.tokens_per_block)
        per_request = block_max.view(batch, self.next_n, -1).amax(dim=1)[:, :width]  # [B, compact blocks]
        out = torch.full((batch, width + 1), float("-inf"), device=self.device)
        kept = plan.kept_blocks.long()[:, :per_request.shape[1]]
        out.scatter_(1, torch.where(kept >= 0, kept, width), per_request)
        return out[:, :width]

    def _current(self, layer: int) -> _Step:
        if self._step is None:
            raise RuntimeError("SpinIndexer.run: call plan() for this decode step first")
        check_int("layer", layer, low=0, high=self.num_layers - 1)
        return self._step

    def _validate_data(self, seq_lens, slot_ids, num_accepted, max_len) -> None:
        check_values_in_range("seq_lens", seq_lens, 0, max_len, "lengths (at most W*T)")
        if seq_lens.shape[1] > 1 and seq_lens.numel():
            steps = seq_lens[:, 1:] - seq_lens[:, :-1]
            check_values_in_range("seq_lens", steps, 0, 1, "row-to-row increments (row j = L - next_n + j + 1)")
        check_values_in_range("slot_ids", slot_ids, 0, self.state.max_requests - 1, "slot ids")
        ids = slot_ids.cpu().tolist()
        if len(set(ids)) != len(ids):
            raise ValueError(f"slot_ids: expected distinct slots, got {ids}")
        free = [s for s in ids if not self.state.is_allocated(s)]
        if free:
            raise ValueError(f"slot_ids: expected allocated slots (SpinState.allocate()), got free slots {free}")
        if num_accepted is not None:
            check_values_in_range("num_accepted", num_accepted, 0, self.next_n - 1, "accepted draft counts")
