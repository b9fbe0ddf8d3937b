"""SpinVllmRuntime: one SpinIndexer per model inside vLLM, driven by vLLM's indexer metadata.

Per step the model's first SPIN layer decides whether SPIN handles the decode rows (`decode_support`),
runs the RequestTracker (rows -> state slots), resets fresh slots and calls SpinIndexer.plan(); every
layer then calls SpinIndexer.run() and writes its top-k into vLLM's top-k buffer. Whatever SPIN does not
handle stays with vLLM (the caller delegates); tokens written in such steps still reach the tracker.

Cache view: vLLM binds each layer's indexer cache as uint8 [num_blocks, T, D + 4], possibly a strided
view into a larger allocation. The ops want [num_blocks, T, 1, D + 4] with contiguous pages, or padded
pages (block stride a multiple of 16 bytes above T * (D + 4), as DeepSeek-V4's 8640 / 8704-byte pages);
when the block stride is r whole blocks, the storage is viewed as r-times more contiguous blocks and block
ids are scaled by r (block 3 with r = 2 -> block 6).

Memory (vllm_memory.py): the per-server state (per-slot tables, step workspace, tracker) is built at vLLM's
profile run, which counts it; the per-block history lives in vLLM's KV cache (vllm_history.py).
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from ..layout import FP8_DTYPE, PAGE_ALIGN_BYTES, SCALE_BYTES, TOKENS_PER_BLOCK
from ..predictor.config import MtpPolicy
from .request_tracker import RequestTracker
from .settings import SpinVllmSettings
from .shadow import ShadowStats
from .shadow_export import ShadowPublisher
from .vllm_memory import attach_history, build_state, state_bytes

logger = logging.getLogger("spin_indexer.vllm")


@dataclasses.dataclass
class DecodeBatch:
    """The decode rows of one step, in SpinIndexer's terms (B requests, N rows each)."""

    block_table: torch.Tensor  # int32 [B, W] physical ids
    seq_lens: torch.Tensor  # int32 [B, N]
    num_rows: int  # B * N


class SpinVllmRuntime:
    """Shared by the SPIN layers of one model (one top-k buffer): layer registry, tracker, SpinIndexer.

    settings: SpinVllmSettings; topk: the model's index_topk; next_n: 1 + speculative tokens;
    max_batch: vLLM's max_num_seqs; max_model_len: in indexer entries (tokens, or compressed entries).
    """

    def __init__(self, settings: SpinVllmSettings, topk: int, next_n: int, max_batch: int, max_model_len: int):
        self.settings, self.topk, self.next_n = settings, topk, next_n
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.layer_names: list[str] = []
        self.indexer = None  # SpinIndexer, built at the first SPIN step (needs the cache's device and T)
        self.tracker: RequestTracker | None = None
        self.delegate_short = True  # steps whose longest context is <= top-k go to vLLM (SPIN would keep all)
        self.last_fresh: torch.Tensor | None = None  # bool [B] of the last plan (for tests and stats)
        self.last_slots: torch.Tensor | None = None
        self.last_accepted: torch.Tensor | None = None  # int32 [B] accepted drafts of each row's last step
        self._step_meta = None  # the metadata object the current plan was made for
        self.step_batch: DecodeBatch | None = None  # its decode rows
        self._block_scale = 1
        self._logged: set = set()
        self.shadow: ShadowStats | None = None  # shadow mode's counters (settings.shadow), built with the indexer
        self.publisher: ShadowPublisher | None = None  # publishes them for vLLM's stat logging
        self.history_caches: list = []  # SpinHistoryCache regions vLLM allocates (vllm_history.py)
        self.history_in_kv_cache = False  # whether the SpinState's per-block history lives in them
        self.history_reason = ""  # why not, when it does not
        self.reserved_at_profile = False  # the per-server state was built at vLLM's profile run
        self._history_ready = False  # the per-block history is attached (vLLM's or SPIN's own)

    def add_layer(self, name: str) -> int:
        """Index of layer `name` in execution order (registration order)."""
        if name not in self.layer_names:
            self.layer_names.append(name)
        return self.layer_names.index(name)

    # -- per step ------------------------------------------------------------------------------------
    def decode_support(self, meta, q_quant, weights, capturing: bool = False) -> DecodeBatch | str:
        """The decode rows if SPIN can handle them, else a short reason. Reads host-side fields only, and
        when `capturing` (a CUDA graph records this step) only the structural ones that every replay of the
        graph shares (row counts, flags, shapes): never the lengths, which at capture are vLLM's dummies."""
        dec = getattr(meta, "decode", None)
        if getattr(meta, "num_decodes", 0) <= 0 or dec is None:
            return "no decode rows"
        if dec.requires_padding or getattr(dec, "global_seq_lens", None) is not None:
            return "ragged decode or decode context parallelism"
        if getattr(dec, "indices", None) is not None:
            return "varlen decode indices"
        batch = dec.decode_lens.shape[0]
        tokens = meta.num_decode_tokens
        if batch == 0 or tokens % batch or tokens // batch != self.next_n:
            return f"decode rows per request {tokens}/{batch}, expected next_n = {self.next_n}"
        if batch > self.max_batch:
            return f"decode batch {batch} > max_batch {self.max_batch}"
        if self.delegate_short and not capturing and meta.max_seq_len <= self.topk:
            return "every context <= top-k"
        if q_quant.dtype != FP8_DTYPE or weights.dtype != torch.float32:
            return f"q dtype {q_quant.dtype} / weights dtype {weights.dtype}"
        seq_lens = dec.seq_lens[:batch]
        if seq_lens.dim() == 1:
            seq_lens = seq_lens[:, None]
        if seq_lens.shape[1] == 1 and self.next_n > 1:  # per-row lengths L - N + j + 1, as vLLM's top-k does
            offs = torch.arange(self.next_n, dtype=torch.int32, device=seq_lens.device)
            seq_lens = (seq_lens - self.next_n + 1 + offs).clamp_min(0)
        if seq_lens.shape[1] != self.next_n:
            return f"seq_lens shape {list(dec.seq_lens.shape)}"
        table = dec.block_table[:batch]
        if table.dtype != torch.int32:
            table = table.to(torch.int32)
        return DecodeBatch(table, seq_lens.to(torch.int32).contiguous(), batch * self.next_n)

    def begin_step(self, meta, batch: DecodeBatch | None, kv_cache: torch.Tensor) -> str:
        """First SPIN layer of a step: track requests, plan. Returns "" when SPIN handles this step's decode
        rows, else why not (the caller hands the step to vLLM). The per-server state is built at vLLM's
        profile run (reserve) or else here, and the per-block history attached here, at the first step with
        metadata whatever the decision: vLLM's eager warm-up step (dummy lengths, handed back) runs before a
        FULL graph capture, and allocated or filled inside a capture, the state's initial fills would be
        recorded and replayed."""
        self._step_meta, self.step_batch = None, None
        view, why = cache_view_or_reason(kv_cache)
        if view is None:
            return why
        kv, scale = view
        self._ensure(kv, None if batch is None else batch.block_table, scale)
        if batch is None:
            self.tracker.forget_writes(meta.slot_mapping.to(self.tracker.device))
            return "no decode batch"
        if batch.block_table.shape[1] > self.indexer.max_blocks:
            self.tracker.forget_writes(meta.slot_mapping)
            return f"block table width {batch.block_table.shape[1]} > {self.indexer.max_blocks}"
        slots, fresh, accepted = self.tracker.assign(batch.block_table, batch.seq_lens, meta.slot_mapping)
        reset_slots_(self.indexer.state, torch.where(fresh, slots, self.tracker.trash_slot))
        table = batch.block_table if scale == 1 else batch.block_table * scale
        row_local = self.indexer.config.mtp is MtpPolicy.ROW_LOCAL and self.next_n > 1
        self.indexer.plan(table, batch.seq_lens, slots, num_accepted=accepted if row_local else None,
                          validate=False)
        self.last_slots, self.last_fresh, self.last_accepted = slots, fresh, accepted
        self._step_meta, self.step_batch, self._block_scale = meta, batch, scale
        return ""

    def log_once(self, entry: str, capturing: bool, reason: str) -> None:
        """Say once per distinct situation what is active (entry point, graph capture) or why a step was
        handed back to vLLM."""
        key = (entry, capturing, reason)
        if key in self._logged or len(self._logged) >= 64:  # reasons carry numbers: bound the log
            return
        self._logged.add(key)
        mode = "while capturing a CUDA graph" if capturing else "eagerly"
        if reason:
            logger.info("spin-indexer: a step via %s (%s) went to vLLM's indexer: %s", entry, mode, reason)
        else:
            history = "in vLLM's KV cache" if self.history_in_kv_cache else f"SPIN's own ({self.history_reason})"
            state = "reserved at vLLM's profile run" if self.reserved_at_profile else "built at the first step"
            logger.info("spin-indexer: SPIN %s on decode rows via %s (%s): %d layers, policy %s, sparsity %.2f, "
                        "next_n %d (mtp %s), top-k %d; block history %s; per-server state %s",
                        "in shadow mode (dense decides)" if self.settings.shadow else "active", entry, mode,
                        len(self.layer_names), self.settings.policy, self.settings.sparsity, self.next_n,
                        self.settings.mtp, self.topk, history, state)

    def planned_for(self, meta) -> bool:
        return self._step_meta is not None and self._step_meta is meta

    def run_layer(self, layer: int, batch: DecodeBatch, kv_cache: torch.Tensor, q_quant: torch.Tensor,
                  weights: torch.Tensor, out: torch.Tensor) -> bool:
        """Top-k of the decode rows of `layer` into out[:B*N, :K]; False if this layer cannot (caller
        delegates)."""
        view = cache_view(kv_cache)
        if view is None or view[1] != self._block_scale or layer >= self.indexer.num_layers:
            return False
        kv, _ = view
        rows = batch.num_rows
        heads, dim = q_quant.shape[-2:]
        q = q_quant[:rows].reshape(rows // self.next_n, self.next_n, heads, dim)
        topk = self.indexer.run(layer, q, kv, weights[:rows].contiguous())
        out[:rows, : self.topk] = topk
        return True

    def shadow_layer(self, layer: int, batch: DecodeBatch, kv_cache: torch.Tensor, q_quant: torch.Tensor,
                     weights: torch.Tensor, dense: torch.Tensor) -> bool:
        """Shadow mode: vLLM's dense top-k (dense[:B*N, :K], already written, deciding) against SPIN's plan
        for `layer`; SPIN scores its kept blocks and updates its history as if it decided, and writes nothing
        that attention reads. False if this layer cannot (nothing recorded)."""
        view = cache_view(kv_cache)
        if view is None or view[1] != self._block_scale or layer >= self.indexer.num_layers:
            return False
        rows = batch.num_rows
        heads, dim = q_quant.shape[-2:]
        q = q_quant[:rows].reshape(rows // self.next_n, self.next_n, heads, dim)
        self.indexer.run(layer, q, view[0], weights[:rows].contiguous())
        plan = self.indexer.block_plan
        self.shadow.record(layer, dense[:rows], plan.keep_mask, plan.num_kept, plan.num_blocks, batch.seq_lens,
                           self.topk, self.indexer.config.tokens_per_block)
        return True

    def reserve(self, device, tokens: int = TOKENS_PER_BLOCK) -> None:
        """Build the per-server state (vllm_memory.build_state) now: called from vLLM's profile run (the dummy
        forward without attention metadata), so that vLLM's memory profile counts it. Idempotent; never inside
        a CUDA graph capture."""
        if self.indexer is not None or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return
        self._build(torch.device(device), tokens, 0)
        self.reserved_at_profile = True
        sizes = state_bytes(self.indexer, self.tracker)
        logger.info("spin-indexer: reserved SPIN's per-server state at vLLM's profile run (counted by its memory "
                    "profile): %.3f GiB (per-slot tables %.3f, step workspace %.3f, tracker %.4f GiB)",
                    (sizes["per_slot"] + sizes["workspace"] + sizes["tracker"]) / 2**30, sizes["per_slot"] / 2**30,
                    sizes["workspace"] / 2**30, sizes["tracker"] / 2**30)

    def _build(self, device, tokens: int, width: int) -> None:
        self.indexer, self.tracker = build_state(self.settings, self.topk, len(self.layer_names), self.max_batch,
                                                 self.max_model_len, self.next_n, tokens, device, width)
        self.shadow = ShadowStats(len(self.layer_names), device) if self.settings.shadow else None
        if self.shadow is not None:  # vLLM's stat logging reads what it publishes (vllm_stats.py)
            if self.publisher is not None:
                self.publisher.stop()
            self.publisher = ShadowPublisher(self.shadow, f"{id(self):x}")
            self.publisher.start()
        self._history_ready = False

    def _ensure(self, kv: torch.Tensor, block_table: torch.Tensor | None, scale: int = 1) -> None:
        if self._history_ready:
            return
        width = 0 if block_table is None else block_table.shape[1]
        ix = self.indexer
        same_device = ix is not None and torch.empty(0, device=ix.device).device == kv.device
        if not same_device or ix.config.tokens_per_block != kv.shape[1] or width > ix.max_blocks:
            if ix is not None:
                logger.warning("spin-indexer: the state reserved at the profile run does not fit the bound cache (T %d, "
                               "%s, width %d): rebuilt, outside vLLM's memory profile", kv.shape[1], kv.device, width)
            self._build(kv.device, kv.shape[1], width)
            self.reserved_at_profile = False
        history, why = None, "no history caches registered"
        if self.indexer.state.vertical is None:  # block grain: no per-token table to page
            why = "block grain: the block maxima alone, 2 B a block a layer"
        elif scale != 1:
            why = f"key cache block ids scaled by {scale}"
        elif self.history_caches:
            from .vllm_history import bound_history
            history, why = bound_history(self.history_caches, len(self.layer_names), kv.shape[1], kv.shape[0])
        attach_history(self.indexer, history, kv.shape[0])
        self._history_ready = True
        self.history_in_kv_cache, self.history_reason = history is not None, "" if history is not None else why
        page = kv.shape[1] * kv.shape[3]
        if kv.shape[0] > 1 and kv.stride(0) != page:
            logger.info("spin-indexer: the indexer cache pages are padded (%d bytes apart for %d bytes of keys and "
                        "scales, DeepSeek-V4's aligned layout): SPIN's kernels read them in place with that "
                        "page stride", kv.stride(0), page)
        if history is not None:
            logger.info("spin-indexer: SPIN's block history lives in vLLM's KV cache (%d regions of %d blocks)",
                        len(self.history_caches), kv.shape[0])
        else:
            logger.info("spin-indexer: SPIN's block history (%.3f GiB) is allocated outside vLLM's KV cache and "
                        "memory profile: %s", state_bytes(self.indexer, self.tracker)["per_block"] / 2**30, why)
        if not self.reserved_at_profile:
            logger.info("spin-indexer: SPIN's per-server state was built at the first step (no profile run seen), "
                        "outside vLLM's memory profile")


def cache_view(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(contiguous uint8 [blocks, T, 1, D + 4] view, block-id scale r) of vLLM's indexer cache, or None
    (see cache_view_or_reason)."""
    return cache_view_or_reason(kv_cache)[0]


def cache_view_or_reason(kv_cache: torch.Tensor) -> tuple[tuple[torch.Tensor, int] | None, str]:
    """((view, r), "") or (None, why not) for vLLM's indexer cache.

    kv_cache: uint8 [num_blocks, T, D + 4] (vLLM's binding) or [num_blocks, T, 1, D + 4]; rows inside a
    block must be contiguous; the block stride must be a whole number r of pages (T * (D + 4) bytes), or a
    multiple of 16 bytes above one page: DeepSeek-V4 pads each page to a 576-byte (fp8_ds_mla) or 512-byte
    multiple, 8640 or 8704 bytes for a 64 x 132 = 8448-byte page. Such a cache is handed to the ops as it is
    (r = 1, stride(0) = the padded stride): they read each page's 8448 bytes and never the padding.
    Other strides are reported (and the step handed back) instead of misread.
    """
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() not in (3, 4) or kv_cache.shape[-1] <= SCALE_BYTES:
        return None, f"indexer cache {kv_cache.dtype} {list(kv_cache.shape)} is not uint8 [blocks, T, D + 4]"
    if kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1:
            return None, f"indexer cache shape {list(kv_cache.shape)}: expected one head"
        kv_cache = kv_cache.squeeze(2)
    num_blocks, tokens, row = kv_cache.shape
    page = tokens * row
    if num_blocks == 0 or kv_cache.stride(2) != 1 or (tokens > 1 and kv_cache.stride(1) != row):
        return None, f"indexer cache strides {kv_cache.stride()}: rows inside a block are not contiguous"
    stride = kv_cache.stride(0) if num_blocks > 1 else page
    if stride % page:
        if stride < page or stride % PAGE_ALIGN_BYTES:
            return None, (f"indexer cache pages are {stride} bytes apart for a {page}-byte page: SPIN's kernels "
                          f"need whole pages apart or a multiple of {PAGE_ALIGN_BYTES} bytes above one page")
        # padded pages (DeepSeek-V4): the ops take the page stride, block ids stay vLLM's
        return (torch.as_strided(kv_cache, (num_blocks, tokens, 1, row), (stride, row, row, 1)), 1), ""
    scale = stride // page
    blocks = (num_blocks - 1) * scale + 1
    view = torch.as_strided(kv_cache, (blocks, tokens, 1, row), (page, row, row, 1))
    return (view, scale), ""


def reset_slots_(state, slots: torch.Tensor) -> None:
    """SpinState.reset for a tensor of slots, on the device (no host sync). slots: int64 [n]; repeats are
    fine (callers send non-fresh rows to the trash slot)."""
    state.reset_rows_(slots)
