"""SpinIndexer: the SPIN decode step. plan() once per step, run() per layer.

    plan(block_table, seq_lens, slot_ids)      every layer's plan, from each layer's own history:
        predict   block scores from the paged vertical history and the diagonal window
        select    budget + forced blocks + exploration -> kept blocks
        compact   kept blocks -> compact block table and row lengths                 (predictor/plan*.py)
    run(layer, q_fp8, kv_cache, weights)       per layer:
        score     paged indexer logits on the compact table, the EMA update of this
                  layer's history and the block maxima done where the scores are     (ops, predictor/update*)
        top-k     over the compact columns, written as logical positions             (ops.topk_positions)

On CUDA with the paper's step (A1 pooling, random or no exploration) plan() is two kernels (three where
DeepGEMM can serve the logits: every layer's SM schedule for it in one launch) and run() the logits kernel
(Triton: the block and group maxima the top-k prunes with written in its epilogue; DeepGEMM: logits only,
then a pass for the maxima) and the top-k's three launches (four below SET_SELECT_MIN_ROWS rows or with
topk_sorted: ops/topk_triton.py), with the EMA update beside
the top-k: up to UPDATE_IN_TOPK_BLOCKS table blocks its programs run in the top-k's first launch, above it on a
low-priority side stream (the top-k then on a high-priority one); under block grain (SpinConfig.vertical_grain =
"block", the default rule's) the update reads the block maxima, O(blocks), not the logits, in the same two places
(BLOCK_GRAIN_IN_TOPK); no host sync and no data-dependent shape
(validate=False): a whole step captures in one CUDA graph. With overlap_update=False the update runs in
series, fused into the Triton kernel's epilogue or into DeepGEMM's maxima pass.
With the summary mix (SpinConfig.summary > 0) a layer selects the requests that mix (shorter than summary_below,
or all) with its own query: plan() is the reset launch and the select launch of the other requests (which also
advances every request's counters), and run(layer) adds two launches before the logits (the summary
cache's write and score, ops.update_and_score_summaries; the select, plan_triton.select_layer_triton:
`_select_in_run`).
A table too small for SPIN to pay (B x W x T below the per-step guard's threshold, so plan() guards every
request) runs the dense step's kernels on the full table instead (`_run_dense`), and plan() launches none of its
kernels for it (`_dense_plan`). Everything else
(A0/A2 pooling, age-based exploration, the adaptive and hybrid extensions, the CPU) runs the torch reference
of the same step. run_from_scores() replaces "score" by a gather from precomputed scores (offline replay
of traces), so replay and live decoding share every other line.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from .. import ops
from ..checks import allocation_error, check_device, check_int, check_tensor
from ..layout import FP8_DTYPE, HEAD_DIM, SCALE_BYTES
from ..ops import deepgemm, deepgemm_schedule
from ..ops.indexer_logits import check_paged_indexer_args
from ..predictor import plan as plan_ref
from ..predictor.config import MtpPolicy, SpinConfig
from ..predictor.select import budget_of
from ..predictor.state import SpinState
from ..dispatch import triton_twin
from .block_plan import BlockPlan
from .dense import dense_topk
from .extensions import Extensions
from .step_checks import check_ids_fit_cache, check_lengths_and_blocks, check_rows_and_slots
from .workspace import Workspace


# Table blocks (B x W) up to which the EMA update's programs run in the top-k's threshold launch instead of on a
# side stream (SpinIndexer.update_in_topk). H200, run 36 (benchmarks/results/run36_update_in_topk), SPIN step at
# s = 0.5 / 0.2 in the threshold launch vs on the side stream (DeepGEMM): 1 x 128K 35.3 / 37.8 vs 36.2 / 38.8 us,
# 1 x 1M (16384 blocks) 70.1 / 82.2 vs 72.8 / 83.9, 8 x 128K 56.8 / 68.5 vs 57.9 / 69.3, 8 x 64K 44.7 / 52.3 vs
# 45.9 / 53.2; but 32 x 128K (65536 blocks) 127.8 / 170.3 vs 125.0 / 167.2 and 8 x 1M 234.1 / 318.1 vs
# 206.1 / 290.6 (the update's programs, at the threshold's 8-16 warps and 127 registers, outlast its rows').
UPDATE_IN_TOPK_BLOCKS = 16384
# Whether block grain's update rides there too (ops.topk_positions(history=) with the block maxima; tested). With
# programs of 256 blocks it made the step slower (run 161, H100, 1 x 128K s = 0.3: 40.4 us against slot grain's
# 33.7); with 32 (topk_triton.IN_TOPK_BLOCKS) faster than both slot grain and block grain's side stream (run 162,
# H200, s = 0.3, dense / SPIN paired: 1 x 128K 1.052x / 1.046x / 1.034x, 1 x 64K 1.063x / 1.044x / 1.030x, 8 x 128K
# 1.259x / 1.229x / 1.220x).
BLOCK_GRAIN_IN_TOPK = True


@dataclasses.dataclass
class _Step:
    """What plan() fixed for the current step; shared by every layer's run()."""

    block_table: torch.Tensor  # int32 [B, W]
    seq_lens: torch.Tensor  # int32 [B, N]
    slot_ids: torch.Tensor  # int64 [B]
    clock: torch.Tensor  # int32 [1]
    plans: list  # BlockPlan per layer (views into the workspace); None until selected (hybrid)
    meta: object = None  # predictor.plan.StepMeta on the torch path, None on the fused path
    done: set = dataclasses.field(default_factory=set)  # layers already run this step
    epoch: int = 0  # SpinState.epoch at plan(): unchanged = no slot was allocated or freed since
    generations: list = dataclasses.field(default_factory=list)  # SpinState.generations() at plan()
    max_block_id: int | None = None  # largest block id of a used block (validated plans only, else None)
    scheduled: bool = False  # plan() wrote every layer's DeepGEMM schedule (workspace.deepgemm_schedule)
    select_in_run: bool = False  # the fused summary mix: each run(layer) selects the requests that mix


class SpinIndexer:
    """SPIN's block-sparse lightning indexer for batched decode.

    config: SpinConfig; num_layers: indexer layers; max_batch: B at most; max_blocks: W at most (the
    engine's block-table width); next_n: query rows per request; max_requests: state slots (default
    max_batch); num_cache_blocks: physical blocks of the key cache the history sits beside (default
    max_requests * max_blocks, enough when every request owns its blocks); overlap_update: on CUDA, run the
    EMA update beside the top-k (in its first launch up to UPDATE_IN_TOPK_BLOCKS table blocks, else on a
    side stream, `_forked`; False: in series, fused into the logits kernel's epilogue or the pass that
    writes the maxima); tau_hint: each layer's top-k starts its threshold
    search from the row's key of the previous step (workspace.tau_hint; any value gives the same top-k, a row
    whose key moved costs one count more). Off by default: at most 0.1-2.3 us a layer with every hint hitting
    (run 23) and ~55% of hints hit on the proxy model's decoding (benchmarks/NOTES.md); rows are matched by
    their index in the batch, so a reordered batch only misses. topk_sorted: run() returns each row's top-k
    best first (True) or, by default, the same set in no particular order (it may differ between runs): what the
    engines' sparse attention reads, and on CUDA from SET_SELECT_MIN_ROWS rows one select launch instead of the
    top-k's sort and rank (the eval pins True: its committed numbers keep their attention's summation order).
    head_dim: D of the key cache, which sizes the summary cache of SpinConfig.summary > 0 (unused otherwise).
    State lives in `self.state` (allocate() a slot per request, free() it when done); plans of the last
    step in `self.plans(layer)`, the last run layer's in `self.block_plan`.
    """

    def __init__(self, config: SpinConfig, num_layers: int, max_batch: int, max_blocks: int, next_n: int = 1,
                 device: torch.device | str = "cpu", max_requests: int | None = None,
                 num_cache_blocks: int | None = None, overlap_update: bool = True, tau_hint: bool = False,
                 topk_sorted: bool = False, head_dim: int = HEAD_DIM):
        if not isinstance(config, SpinConfig):
            raise TypeError(f"config: expected a SpinConfig, got {type(config).__name__}")
        check_int("num_layers", num_layers, low=1)
        check_int("max_batch", max_batch, low=1)
        check_int("max_blocks", max_blocks, low=1)
        check_int("next_n", next_n, low=1, high=8)
        config.check_profile_layers(num_layers)
        if max_requests is not None:
            check_int("max_requests", max_requests, low=1)
        if num_cache_blocks is not None:
            check_int("num_cache_blocks", num_cache_blocks, low=1)
        for name, flag in (("overlap_update", overlap_update), ("tau_hint", tau_hint), ("topk_sorted", topk_sorted)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
        self.tau_hint, self.topk_sorted = tau_hint, topk_sorted
        self.config, self.max_batch, self.max_blocks, self.next_n = config, max_batch, max_blocks, next_n
        self.device = check_device("device", device)
        t = config.tokens_per_block
        slots = max_requests or max_batch
        sms = deepgemm.schedule_sms(self.device)  # > 0: plan() writes every layer's DeepGEMM schedule
        self.state = SpinState(config, num_layers, slots, num_cache_blocks or slots * max_blocks, max_blocks * t,
                               self.device, head_dim)
        try:
            self.workspace = Workspace(num_layers, max_batch, max_blocks, next_n, t, config.topk, self.device, sms,
                                       config.summary > 0, [(config.layer_sparsity(i),
                                                             config.layer_sparsity(i, short=True))
                                                            for i in range(num_layers)])
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            need = Workspace.bytes_needed(num_layers, max_batch, max_blocks, next_n, t, config.topk, sms,
                                          config.summary > 0)
            raise allocation_error("SpinIndexer workspace", need, self.device,
                                   f"num_layers={num_layers}, max_batch={max_batch}, max_blocks={max_blocks}, "
                                   f"next_n={next_n}") from exc
        self.extensions = (Extensions(config, self.state, next_n)
                           if (config.adaptive or config.hybrid or config.summary or config.sparsity_profile)
                           else None)
        # Extensions that read every layer's scores after it runs (adaptive audits, the hybrid hand-over): they
        # keep the torch path of plan(), the EMA update in series and the logits' tail filled. The summary mix
        # alone reads only the layer's query before it runs: the fused step covers it.
        self._layer_hooks = config.adaptive is not None or config.hybrid > 0
        # The stream the EMA update runs on (`_forked`); None (in series, on the caller's stream) off
        # CUDA or with overlap_update=False.
        self._update_stream = self._topk_stream = None
        if overlap_update and self.device.type == "cuda":
            # the top-k chain on a stream of the highest priority: the block scheduler gives its CTAs the SMs
            # as the update's CTAs finish (at equal priority the update's 3072 programs, launched first, held
            # every SM until they were done: run 20 measured the two in series)
            # (torch maps a priority past the device's range to its end: -8 is the highest, 0 the default/lowest)
            self._update_stream = torch.cuda.Stream(self.device, priority=0)
            self._topk_stream = torch.cuda.Stream(self.device, priority=-8)
        self._step: _Step | None = None
        self.block_plan: BlockPlan | None = None

    @property
    def num_layers(self) -> int:
        return self.state.num_layers

    def plans(self, layer: int) -> BlockPlan:
        """The block plan of `layer` for the current step."""
        st = self._current(layer)
        if st.plans[layer] is None or (st.select_in_run and layer not in st.done):
            raise RuntimeError(f"SpinIndexer.plans: layer {layer} is selected when it runs (hybrid or summary mode)")
        return st.plans[layer]

    # -- plan ------------------------------------------------------------------------------------------
    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, slot_ids: torch.Tensor,
             num_accepted: torch.Tensor | None = None, validate: bool = True) -> None:
        """Plan one decode step for every layer.

        block_table: int32 [B, W] with W <= max_blocks, physical ids < num_cache_blocks; seq_lens: int32
        [B, next_n], row j of request b has length L_b - next_n + j + 1 (0 for padding requests);
        slot_ids: int32/int64 [B] allocated, distinct state slots; num_accepted: int32 [B] in
        [0, next_n - 1] or None (see predictor/mtp.py).
        validate: check the data too (a host sync; turn off when capturing a CUDA graph). Skipped with
        validate=False: length ranges (a length past W*T reads as W*T: plan.step_lengths) and row
        increments, slot ids allocated and distinct, block ids of the
        used blocks inside the cache (kernels clamp them into the trash block instead of reading outside),
        and in every run() of the step the check of those block ids against kv_cache.shape[0]. Shape, dtype
        and device checks always run. A rejected call changes no state and leaves run() unusable until the
        next plan().
        """
        dev = self.device
        self._step = None  # a rejected plan must not leave the previous step runnable
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=dev, device_of="SpinIndexer")
        batch, width = block_table.shape
        check_int("block_table.shape[0] (B)", batch, high=self.max_batch)
        check_int("block_table.shape[1] (W)", width, high=self.max_blocks)
        check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(batch, self.next_n), shape_names="[B, next_n]",
                     device=dev, device_of="SpinIndexer")
        check_tensor("slot_ids", slot_ids, dtype=(torch.int32, torch.int64), shape=(batch,), shape_names="[B]",
                     device=dev, device_of="SpinIndexer")
        if num_accepted is not None:
            check_tensor("num_accepted", num_accepted, dtype=torch.int32, shape=(batch,), shape_names="[B]",
                         device=dev, device_of="SpinIndexer")
        max_block_id = None
        if validate:
            max_block_id = check_lengths_and_blocks(block_table, seq_lens, self.config.tokens_per_block,
                                                    self.state.num_cache_blocks - 1,
                                                    "block ids of used blocks (the cache's blocks)")
            check_rows_and_slots(self.state, seq_lens, slot_ids, num_accepted, self.next_n)
        with torch.no_grad():  # weights/q requiring grad must never attach a graph to the state
            self._plan(block_table, seq_lens, slot_ids, num_accepted)
        self._step.epoch, self._step.generations = self.state.epoch, self.state.generations()
        self._step.max_block_id = max_block_id

    def _plan(self, block_table, seq_lens, slot_ids, num_accepted) -> None:
        cfg, (batch, width) = self.config, block_table.shape
        ws, slots = self.workspace, slot_ids.long()
        if self._guarded_by_shape(batch, width):
            self._step = _Step(block_table, seq_lens, slots, self.state.clock,
                               [self._dense_plan(block_table, seq_lens)] * self.num_layers)
            return
        plans = [self._workspace_plan(layer, batch, width) for layer in range(self.num_layers)]
        fused = self._fused_plan(block_table)
        if fused is not None:
            fused(cfg, self.state, ws, block_table, seq_lens, slots, num_accepted)
            # the state's clock itself (plan() alone advances it): no copy. The summary mix: the requests that mix
            # are selected in run(layer), with its query (_select_in_run); plan() selected the others
            self._step = _Step(block_table, seq_lens, slots, self.state.clock, plans,
                               scheduled=cfg.summary == 0 and self._schedule_layers(batch, width),
                               select_in_run=cfg.summary > 0)
            return
        seq_lens = plan_ref.step_lengths(seq_lens, width, cfg.tokens_per_block)
        meta = plan_ref.step_meta(cfg, self.state, block_table, seq_lens, slots, num_accepted)
        plan_ref.reset_entered_(self.state, meta)
        ws.num_blocks[:batch] = meta.num_blocks.to(torch.int32)
        ws.guarded[:batch] = meta.guarded
        ws.update_rows[:batch] = meta.update_rows
        if self.extensions is not None:
            self.extensions.begin_step()
        for layer in range(self.num_layers):
            if self.extensions is not None:
                if self.extensions.selects_per_layer:
                    plans[layer] = None  # selected in run(layer), after the previous layer's scores exist
                else:
                    plans[layer] = self.extensions.select(layer, meta, plans[layer])
                continue
            keep = plan_ref.select_layer(cfg, self.state, layer, meta)[0]
            BlockPlan.from_keep_mask(keep, block_table, seq_lens, meta.num_blocks, cfg.tokens_per_block, meta.guarded,
                                     out=plans[layer])
        plan_ref.finish_step_(self.state, meta)
        self._step = _Step(block_table, seq_lens, slots, meta.clock, plans, meta,
                           scheduled=self._schedule_layers(batch, width))

    def _schedule_layers(self, batch: int, width: int) -> bool:
        """Every layer's DeepGEMM SM schedule from its compact lengths, in one launch (DeepGEMM's own metadata
        call would be one launch per layer); run() hands it to DeepGEMM for the layers planned here. False
        (nothing written) where run() will not call DeepGEMM on this table (static shapes: a graph agrees)."""
        ws = self.workspace
        # ws.deepgemm_schedule exists only where DeepGEMM can serve (deepgemm.schedule_sms); SPIN's step goes to
        # it at next_n = 2 on large tables or where the CUDA kernel cannot run (deepgemm.spin_step_uses, the rule
        # run() applies); shapes it does not cover (padded pages) leave it unused
        if ws.deepgemm_schedule is None or self._guarded_by_shape(batch, width) or \
                not deepgemm.spin_step_uses(self.next_n, self.device, batch * width * self.config.tokens_per_block):
            return False
        deepgemm_schedule.schedule(ws.compact_lens[:, :batch], ws.deepgemm_schedule.shape[1] - 1,
                                   out=ws.deepgemm_schedule)
        return True

    # -- run -------------------------------------------------------------------------------------------
    def run(self, layer: int, q_fp8: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Top-k positions int32 [B*next_n, K] for `layer` (the set in no particular order, or best first with
        topk_sorted; -1 padded), then that layer's update.

        q_fp8: float8_e4m3fn [B, next_n, H, D]; kv_cache: uint8 [num_blocks, T, 1, D + 4] with num_blocks <=
        num_cache_blocks; weights: float32 [B*next_n, H]. The result is a view of the workspace, valid until
        this layer runs again.
        When the step's plan() validated, the block ids of the used blocks are also checked against
        kv_cache.shape[0] (a host int plan() kept: no device read here); plan(validate=False) skips that
        check. Always raised: run() before plan() or after a rejected plan(), a layer run twice in a step, a
        slot of slot_ids freed or re-allocated since plan() (`_check_owners`), bad shapes, dtypes, devices.
        A rejected call changes no state (the layer may still run this step).
        """
        st = self._current(layer)
        batch, width = st.block_table.shape
        check_tensor("q_fp8", q_fp8, dtype=FP8_DTYPE, ndim=4, device=self.device, device_of="SpinIndexer")
        if tuple(q_fp8.shape[:2]) != (batch, self.next_n):
            raise ValueError(f"q_fp8: expected shape [B, next_n, H, D] with [B, next_n] = [{batch}, {self.next_n}] "
                             f"(from plan()), got {list(q_fp8.shape)}")
        check_tensor("kv_cache", kv_cache, dtype=torch.uint8, ndim=4, device=self.device, device_of="SpinIndexer")
        if kv_cache.shape[0] > self.state.num_cache_blocks:
            raise ValueError(f"kv_cache: expected at most num_cache_blocks = {self.state.num_cache_blocks} blocks "
                             f"(the SpinState size), got {kv_cache.shape[0]}")
        if kv_cache.shape[1] != self.config.tokens_per_block:
            raise ValueError(f"kv_cache: expected T = SpinConfig.tokens_per_block = {self.config.tokens_per_block} "
                             f"tokens per block, got shape {list(kv_cache.shape)}")
        if self.state.summaries is not None and kv_cache.shape[3] != self.state.head_dim + SCALE_BYTES:
            raise ValueError(f"kv_cache: expected D + 4 = {self.state.head_dim + SCALE_BYTES} bytes a row (the "
                             f"summary cache's head_dim, SpinIndexer(head_dim=)), got shape {list(kv_cache.shape)}")
        # every remaining argument check before the layer counts as run (free: shapes, dtypes, devices)
        check_paged_indexer_args(q_fp8, kv_cache, weights, st.seq_lens, st.block_table, validate=False)
        check_ids_fit_cache(st.max_block_id, kv_cache)
        self._check_owners(st)
        with torch.no_grad():  # weights/q requiring grad must never attach a graph to the state
            return self._run(layer, st, q_fp8, kv_cache, weights)

    def _run(self, layer: int, st: _Step, q_fp8, kv_cache, weights) -> torch.Tensor:
        batch, width = st.block_table.shape
        late = st.plans[layer] is None  # hybrid: selected now, after plan() wrote the schedules
        plan = self._plan_of(layer, st, (q_fp8, kv_cache, weights))
        schedule = None if late or not st.scheduled else self._schedule_of(layer, plan)
        rows, cols = batch * self.next_n, width * self.config.tokens_per_block
        if self._guarded_by_shape(batch, width):
            return self._run_dense(layer, st, plan, q_fp8, kv_cache, weights)
        # DeepGEMM allocates its own logits: handing it the workspace would cost a copy of every logit.
        backend = ops.logits_backend(q_fp8, kv_cache, block_table=st.block_table)
        out = None if backend == "deepgemm" else self.workspace.packed("logits", rows, cols)
        block_max = self.workspace.packed("block_max", rows, width)
        history = self._history_args(layer, st, plan)
        # The top-k prunes at G columns (topk_group of the buffer's width). Finer than a block, the logits op
        # writes those maxima (DeepGEMM's update pass reads the logits anyway; elsewhere one pass, as the top-k's
        # own would be): the top-k's group-max launch cost ~10 us at 96 x 128K. A group chosen from the kept
        # budget's columns instead (finer at s = 0.4-0.5: fewer candidates past the threshold, run 126) cost the
        # step 1-5% at 96 x 128K / 512K, paired (run 128), for +1% in the 32K e2e (run 127): not taken.
        active = budget_of(width, self.config.layer_sparsity(layer), self.config.topk, self.config.tokens_per_block)
        group = ops.topk_group(cols, self.config.topk)
        group_max = None
        if self.workspace.GROUP_MIN <= group < self.config.tokens_per_block:
            group_max = self.workspace.packed("group_max", rows, -(-cols // group))
        # The EMA update runs beside the top-k wherever it can: at a few rows inside the top-k's first launch
        # (`update_in_topk`), else on a side stream (`_forked`); in series with extensions (they read the
        # maxima in order), off CUDA, and with overlap_update=False, where the Triton kernel fuses it into its
        # epilogue. The maxima the top-k prunes with come from the logits kernel (the Triton kernel's epilogue, the
        # CUDA kernel's block maxima and its group maxima of 16 or 32 columns); DeepGEMM writes logits only, so
        # there (and for the CUDA kernel's 8-column groups) a pass before the top-k writes them.
        side = self._update_stream if not self._layer_hooks and backend != "reference" else None
        in_topk = side is not None and self.update_in_topk(batch, width, history)
        # The CUDA kernel writes the block maxima (into the workspace, not a scratch of its own, whether or not
        # the pass below rewrites them)
        maxima_fused = side is None or (backend != "deepgemm" and (
            group_max is None or ops.writes_group_max(backend, group)))
        logits = ops.paged_indexer_logits(q_fp8, kv_cache, weights, plan.compact_seq_lens, plan.compact_block_table,
                                          validate=False, out=out,
                                          block_max_out=block_max if maxima_fused or backend == "cuda" else None,
                                          fill_tail=self._layer_hooks,
                                          history=history if side is None else None,
                                          group_max_out=group_max if maxima_fused else None, group=group,
                                          deepgemm_schedule=schedule, active_width=active, backend=backend)
        if side is None:
            return self._topk(layer, st, plan, logits, block_max, group_max, group=group)
        rows3 = logits.view(batch, self.next_n, logits.shape[1])  # not -1: ambiguous for an empty batch

        def write_maxima():  # the pass behind DeepGEMM (and the CUDA kernel's 8-column groups), before the top-k
            if not maxima_fused:
                ops.update_history(None, rows3, plan.compact_block_table, plan.compact_seq_lens,
                                   block_max_out=block_max, group_max_out=group_max, group=group)
        if in_topk:
            write_maxima()
            return self._topk(layer, st, plan, logits, block_max, group_max, history, group=group)
        # Block grain: the update reads the block maxima, so they are written before the streams fork.
        block_grain = history.vertical is None
        if block_grain:
            write_maxima()
        # The top-k's launches first, then the update's: the top-k's programs (its threshold's take a whole SM)
        # are then dispatched before the update's thousands fill the GPU (H200, run 74: 96 x 1M s = 0.4 2367 ->
        # 2334 us, 96 x 512K 1198 -> 1193, 32 x 128K 141.6 -> 140.6; never slower by more than 0.2 us).
        main = torch.cuda.current_stream(self.device)
        with self._forked(self._topk_stream):
            if not block_grain:
                write_maxima()
            positions = self._topk(layer, st, plan, logits, block_max, group_max, group=group)
        with self._forked(side):
            ops.update_history(history, rows3, plan.compact_block_table, plan.compact_seq_lens,
                               block_max_in=block_max if block_grain else None)
        main.wait_stream(self._topk_stream)
        main.wait_stream(side)
        return positions

    @staticmethod
    def update_in_topk(batch: int, width: int, history: ops.HistoryUpdate) -> bool:
        """Whether the EMA update runs inside the top-k's threshold launch (ops.topk_positions(history=))
        rather than on the side stream: for a table of at most UPDATE_IN_TOPK_BLOCKS blocks (B x W; the
        threshold launch is one program per row on a GPU left mostly idle, the update's programs fill it,
        and the step forks and joins no stream) with one updating row per request (row 0: one launch's work);
        under block grain only with BLOCK_GRAIN_IN_TOPK."""
        return (batch * width <= UPDATE_IN_TOPK_BLOCKS and history.rows == 1
                and (history.vertical is not None or BLOCK_GRAIN_IN_TOPK))

    @contextlib.contextmanager
    def _forked(self, side):
        """Runs the block's launches on stream `side`, after everything already on the caller's (the EMA update
        on the low-priority stream, the maxima and the top-k on the high-priority one; run() joins both).

        Why: the top-k chain is latency-bound (at 96 x 128K four launches take ~57 us for 25 MB of logits) and
        the update pass moves ~50 MB in ~30 us: in series they cost their sum, side by side about the longer
        chain. Nothing the top-k reads is written by the update (V, its block max, D and last_seen are read by
        the next step's plan()); the logits they share are written before the fork. run() makes the
        caller's stream wait for both streams before it returns, so everything later there (the next
        layer's logits reusing the buffers, plan()) comes after the update; a captured CUDA graph records the
        fork and the join."""
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            yield

    def deepgemm_schedule(self, layer: int) -> torch.Tensor | None:
        """int32 [num_sms + 1, 2]: the DeepGEMM SM schedule plan() wrote for `layer` this step (its compact
        lengths), or None where plan() wrote none (DeepGEMM absent or not serving this table)."""
        st = self._current(layer)
        late = self.extensions is not None and self.extensions.selects_per_layer  # selected after plan()
        return None if late or not st.scheduled or st.plans[layer] is None else self._schedule_of(layer, st.plans[layer])

    def _schedule_of(self, layer: int, plan: BlockPlan) -> torch.Tensor | None:
        """plan()'s DeepGEMM schedule of `layer` when it was computed from this plan's lengths (a plan selected
        in plan() into the workspace, not one an extension built elsewhere), else None."""
        ws = self.workspace
        if ws.deepgemm_schedule is None or plan.compact_seq_lens.data_ptr() != ws.compact_lens[layer].data_ptr():
            return None
        return ws.deepgemm_schedule[layer]

    def _guarded_by_shape(self, batch: int, width: int) -> bool:
        """True when the table's shape alone guards the whole step: B x W x T tokens at most, fewer than the
        per-step guard's threshold, so plan() guarded every request whatever its length (a host decision
        on static shapes: a captured graph keeps it)."""
        tokens = batch * width * self.config.tokens_per_block
        return not self._layer_hooks and tokens < self.config.guard_batch_tokens_for(batch * self.next_n)

    def _run_dense(self, layer: int, st: _Step, plan: BlockPlan, q_fp8, kv_cache, weights) -> torch.Tensor:
        """The dense step's kernels on the full table (every block kept, no history: what plan() decided for
        every request, launching nothing of its own), so a guarded step costs the dense step."""
        batch, width = st.block_table.shape
        rows, cols = batch * self.next_n, width * self.config.tokens_per_block
        ws = self.workspace
        out = dense_topk(q_fp8, kv_cache, weights, st.seq_lens, st.block_table, self.config.topk,
                         self.config.tokens_per_block, ws.packed("block_max", rows, width),
                         logits_out=ws.packed("logits", rows, cols),
                         out=ws.topk[layer, :rows], group_max=ws.group_max, sorted=self.topk_sorted)
        self.block_plan = plan
        return out

    def run_from_scores(self, layer: int, scores: torch.Tensor, summary: torch.Tensor | None = None) -> torch.Tensor:
        """Replay: like run(), with the indexer scores of every logical position given.

        scores: float32 [B*next_n, W*T] (values at/after a row's length are ignored). Only the columns
        of kept blocks are read, exactly what the paged kernel would have computed.
        summary: float32 [B, W], the layer's block summary scores at SpinConfig.summary_parts, as traces record
        them (ops.block_summary_scores: float means of the valid tokens; run() scores its fp8 summary cache of
        full blocks instead): required when SpinConfig.summary > 0, refused otherwise.
        """
        st = self._current(layer)
        batch, width = st.block_table.shape
        t = self.config.tokens_per_block
        check_tensor("scores", scores, dtype=torch.float32, shape=(batch * self.next_n, width * t),
                     shape_names="[B*next_n, W*T]", device=self.device, device_of="SpinIndexer")
        if (summary is None) != (self.config.summary == 0):
            raise ValueError(f"summary: expected the block summary scores exactly when SpinConfig.summary > 0 "
                             f"(it is {self.config.summary:g}), got {'none' if summary is None else 'a tensor'}")
        if summary is not None:
            check_tensor("summary", summary, dtype=torch.float32, shape=(batch, width), shape_names="[B, W]",
                         device=self.device, device_of="SpinIndexer")
        self._check_owners(st)
        with torch.no_grad():
            return self._run_from_scores(layer, st, scores, summary)

    def _run_from_scores(self, layer: int, st: _Step, scores: torch.Tensor, summary=None) -> torch.Tensor:
        batch, width = st.block_table.shape
        t = self.config.tokens_per_block
        plan = self._plan_of(layer, st, summary=summary)
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
        block_max = ops.block_max(logits, t)
        self._update(layer, st, plan, logits)
        return self._topk(layer, st, plan, logits, block_max)

    # -- the per-layer steps -------------------------------------------------------------------------
    def _plan_of(self, layer: int, st: _Step, inputs: tuple | None = None, summary=None) -> BlockPlan:
        """The layer's plan; a layer that selects at run time (hybrid, summary) selects now, given run()'s
        (q_fp8, kv_cache, weights) as `inputs` or a replay's block summary scores as `summary`."""
        if layer in st.done:
            raise RuntimeError(f"SpinIndexer.run: layer {layer} already ran this step; call plan() for the next step")
        plan = st.plans[layer]
        if plan is None:  # hybrid / summary on the torch path: selected now, after the previous layer's scores or q
            out = self._workspace_plan(layer, *st.block_table.shape)
            plan = st.plans[layer] = self.extensions.select(layer, st.meta, out, inputs, summary)
        elif st.select_in_run:  # the fused summary mix: the requests that mix select now, with this layer's q
            self._select_in_run(layer, st, inputs, summary)
        st.done.add(layer)
        return plan

    def _select_in_run(self, layer: int, st: _Step, inputs: tuple | None, summary: torch.Tensor | None) -> None:
        """The fused step's selection of `layer` for the requests that take the summary mix (shorter than
        SpinConfig.summary_below, or all), into the layer's workspace plan: the summary cache takes the blocks
        each of them filled since this layer last ran and scores this step's query (one launch,
        ops.update_and_score_summaries; plan() wrote each request's range, ws.summary_first / full_blocks, empty
        for the others), then one select launch mixes those scores with the layer's history, selects, compacts and
        records the cache's new extent (plan_triton.select_layer_triton); plan() selected the other requests. A
        replay passes its recorded `summary` instead of `inputs`."""
        from ..predictor.plan_triton import select_layer_triton
        ws, state = self.workspace, self.state
        batch, width = st.block_table.shape
        cached = summary is None  # a replay's recorded scores leave the summary cache alone
        if cached:
            q_fp8, kv_cache, weights = inputs
            summary = ops.update_and_score_summaries(q_fp8, kv_cache, state.summaries[layer], weights, st.block_table,
                                                     ws.summary_first[layer, :batch], ws.full_blocks[:batch],
                                                     validate=False, out=ws.packed("summary_scores", batch, width))
        select_layer_triton(self.config, state, ws, layer, st.block_table, st.seq_lens, st.slot_ids, summary,
                            cached=cached)

    def _dense_plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor) -> BlockPlan:
        """The plan of a step the table's shape guards (`_guarded_by_shape`): every block of every request
        kept, nothing selected, no history read or written: plan() launches none of its kernels, only the
        one that writes the block counts and the flags (`plan.dense_plan_`, one Triton launch on CUDA). The
        state's counters do not advance either: the blocks that enter a request meanwhile are reset when it is
        next planned, and read as never scored, as after a guarded step."""
        ws, t = self.workspace, self.config.tokens_per_block
        batch, width = block_table.shape
        num_blocks = ws.num_blocks[:batch]
        # update_rows False: replay (run_from_scores) updates no history either
        write = (triton_twin("spin_indexer.predictor.plan_triton", "dense_plan_triton", seq_lens)
                 or plan_ref.dense_plan_)
        write(seq_lens, t, num_blocks, ws.guarded[:batch], ws.update_rows[:batch], width)
        return BlockPlan(ws.block_ids[:width].expand(batch, width), num_blocks, num_blocks, block_table, seq_lens,
                         t, ws.guarded[:batch])

    def _workspace_plan(self, layer: int, batch: int, width: int) -> BlockPlan:
        """Layer `layer`'s plan as views of the workspace's leading [:B, :W] slices."""
        ws = self.workspace
        return BlockPlan(ws.kept_blocks[layer, :batch, :width], ws.num_kept[layer, :batch], ws.num_blocks[:batch],
                         ws.compact_table[layer, :batch, :width], ws.compact_lens[layer, :batch],
                         self.config.tokens_per_block, ws.guarded[:batch])

    def _history_args(self, layer: int, st: _Step, plan: BlockPlan) -> ops.HistoryUpdate:
        """Where this layer's EMA update reads and writes (the logits op folds it into its epilogue where the
        kernel can; replay hands it to `_update`)."""
        cfg, batch = self.config, st.block_table.shape[0]
        vertical = self.state.vertical[layer] if self.state.vertical is not None else None  # None: block grain
        return ops.HistoryUpdate(vertical, self.state.block_max[:, layer],
                                 self.state.diagonal[layer], st.slot_ids, plan.kept_blocks, st.seq_lens,
                                 self.workspace.update_rows[:batch], cfg.alpha, self.state.window,
                                 self.state.last_seen[:, layer] if self.state.last_seen is not None else None,
                                 st.clock, 1 if cfg.mtp is MtpPolicy.ROW0 else self.next_n, cfg.tokens_per_block)

    def _update(self, layer: int, st: _Step, plan: BlockPlan, logits: torch.Tensor) -> None:
        """The EMA update from compact logits float32 [B*N, X] (replay; the live path folds it into the logits)."""
        batch = st.block_table.shape[0]
        rows = logits.view(batch, self.next_n, logits.shape[1])  # not -1: ambiguous for an empty batch
        ops.update_history(self._history_args(layer, st, plan), rows, plan.compact_block_table, plan.compact_seq_lens)

    def _topk(self, layer: int, st: _Step, plan: BlockPlan, logits: torch.Tensor,
              block_max: torch.Tensor, group_max: torch.Tensor | None = None,
              history: ops.HistoryUpdate | None = None, group: int | None = None) -> torch.Tensor:
        """The top-k over compact logits, written as logical positions (history: its EMA update too, inside
        the top-k's launches)."""
        rows = logits.shape[0]
        out = self.workspace.topk[layer, :rows]
        ops.topk_positions(logits, plan.compact_seq_lens.view(-1), self.config.topk, block_max=block_max,
                           kept_blocks=plan.kept_blocks, next_n=self.next_n,
                           tokens_per_block=self.config.tokens_per_block, out=out, validate=False,
                           group_max=group_max, tau_hint=self.workspace.tau_hint[layer, :rows] if self.tau_hint else None,
                           history=history, compact_table=None if history is None else plan.compact_block_table,
                           sorted=self.topk_sorted, group=group)
        if self.extensions is not None:
            self.extensions.after_layer(layer, st.meta, plan, out, block_max)
        self.block_plan = plan
        return out

    def _fused_plan(self, block_table: torch.Tensor):
        """The fused planning launcher when it covers this config on this device, else None."""
        if self._layer_hooks:
            return None
        fn = triton_twin("spin_indexer.predictor.plan_triton", "plan_step_triton", block_table)
        if fn is None:
            return None
        from ..predictor.plan_triton import supports
        return fn if supports(self.config, block_table.shape[1]) else None

    def _current(self, layer: int) -> _Step:
        if self._step is None:
            raise RuntimeError("SpinIndexer.run: call plan() for this decode step first")
        check_int("layer", layer, low=0, high=self.num_layers - 1)
        return self._step

    def _check_owners(self, st: _Step) -> None:
        """Refuse to run a step whose slots changed owner since plan(): the plan and the history update
        belong to the old owner. No device work unless a slot was allocated or freed mid-step (then one host
        read of slot_ids, to tell the step's slots from the others)."""
        if self.state.epoch == st.epoch:
            return
        now = self.state.generations()
        changed = {s for s, (a, b) in enumerate(zip(st.generations, now)) if a != b}
        hit = sorted(changed.intersection(st.slot_ids.cpu().tolist()))
        if hit:
            raise RuntimeError(f"slot_ids: slots {hit} were freed or re-allocated since plan(); call plan() for "
                               f"this decode step again")
        st.epoch, st.generations = self.state.epoch, now  # only other slots changed: nothing to refuse
