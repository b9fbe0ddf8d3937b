"""The SparseAttnIndexer subclass that vLLM builds in place of its own (via register_oot), and SPIN's op.

    SpinSparseAttnIndexer.forward(hidden_states, q_quant, k, weights)
        SPIN off, FP4 cache, CP, v4.1 candidates, SM100 (MX scales)  -> vLLM's own forward, untouched
        otherwise -> torch.ops.spin_indexer.sparse_attn_indexer (opaque to torch.compile; a splitting op
                     like vllm::sparse_attn_indexer, see vllm.py), whose body:
            1. vLLM's own path with the decode rows hidden (K-cache insert, buffer clear, prefill rows),
            2. SPIN on the decode rows (SpinVllmRuntime), or vLLM's decode path when SPIN cannot.

Imports vLLM: only imported by spin_indexer.integrations.vllm after its version check.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Optional

import torch
from vllm.config import CUDAGraphMode, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

from ..predictor.config import Grain
from .settings import SpinVllmSettings, load_settings
from .vllm_history import attach_history
from .vllm_hooks import install_v32_hook
from .vllm_runtime import SpinVllmRuntime

logger = logging.getLogger("spin_indexer.vllm")

OP_NAME = "spin_indexer::sparse_attn_indexer"
_LAYERS: "weakref.WeakValueDictionary[str, SpinSparseAttnIndexer]" = weakref.WeakValueDictionary()
_RUNTIME_ATTR = "_spin_vllm_runtime"  # set on the model's shared top-k buffer: one runtime per model


def _op_impl(hidden_states: torch.Tensor, layer_name: str, kv_cache: torch.Tensor, q_quant: torch.Tensor,
             k: Optional[torch.Tensor], weights: torch.Tensor, topk_indices_buffer: torch.Tensor) -> None:
    layer = _LAYERS[layer_name]
    # Write into the buffer the op was given: under torch.compile's functionalization it is a stand-in that
    # is copied back to the layer's buffer afterwards, so writing the layer's own buffer would be undone.
    own = layer.topk_indices_buffer
    layer.topk_indices_buffer = topk_indices_buffer
    try:
        layer._spin_forward_eager(hidden_states, q_quant, k, weights)
    finally:
        layer.topk_indices_buffer = own


def _register_op() -> None:
    if hasattr(torch.ops, "spin_indexer") and hasattr(torch.ops.spin_indexer, "sparse_attn_indexer"):
        return
    impl = _op_impl
    try:  # vLLM's breakable CUDA graphs run such ops eagerly between graph segments
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture
        impl = eager_break_during_capture(_op_impl)
    except ImportError:
        pass

    # The K-cache insert inside also writes kv_cache; like vllm::sparse_attn_indexer it is not declared
    # mutated (declaring it would make functionalization copy the whole cache).
    @torch.library.custom_op(OP_NAME, mutates_args=("topk_indices_buffer",))
    def sparse_attn_indexer(hidden_states: torch.Tensor, layer_name: str, kv_cache: torch.Tensor,
                            q_quant: torch.Tensor, k: Optional[torch.Tensor], weights: torch.Tensor,
                            topk_indices_buffer: torch.Tensor) -> None:
        impl(hidden_states, layer_name, kv_cache, q_quant, k, weights, topk_indices_buffer)

    @sparse_attn_indexer.register_fake
    def _(hidden_states, layer_name, kv_cache, q_quant, k, weights, topk_indices_buffer) -> None:
        return None


class SpinSparseAttnIndexer(SparseAttnIndexer):
    """vLLM's SparseAttnIndexer with SPIN on decode rows. Same constructor; see the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spin_runtime: SpinVllmRuntime | None = None
        self.spin_layer = -1
        self.spin_reason = ""
        self.spin_entry = "SparseAttnIndexer.forward"  # where vLLM called SPIN from (for the log)
        self._spin_attach()

    def dispatch_forward(self, compile_native: bool = False):
        self._vllm_forward = super().dispatch_forward(compile_native)
        return self._spin_forward

    # -- construction --------------------------------------------------------------------------------
    def _spin_attach(self) -> None:
        vllm_config = get_current_vllm_config()
        settings = load_settings(getattr(vllm_config, "additional_config", None))
        reason = _unsupported(self, settings)
        if reason:
            self.spin_reason = reason
            if settings.enable:
                logger.info("SPIN off for %s: %s", self.k_cache.prefix, reason)
            return
        spec = getattr(vllm_config, "speculative_config", None)
        next_n = 1 + int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 1
        max_batch = int(vllm_config.scheduler_config.max_num_seqs)
        # Layers of one model share its top-k buffer (a drafter has its own): the runtime lives on it, so
        # it lives exactly as long as the model.
        runtime = getattr(self.topk_indices_buffer, _RUNTIME_ATTR, None)
        if runtime is None:
            runtime = SpinVllmRuntime(settings, self.topk_tokens, next_n, max_batch, self.max_model_len)
            setattr(self.topk_indices_buffer, _RUNTIME_ATTR, runtime)
        self.spin_runtime = runtime
        self.spin_layer = runtime.add_layer(self.k_cache.prefix)
        # The per-block history as KV-cache layers of its own (vllm_history.py): vLLM sizes and allocates it. Under
        # block grain (the default, SpinVllmSettings.vertical_grain) there is no per-token table: the runtime
        # allocates the block maxima itself at the first step (2 B a block a layer, 1/64 of a page of fp16 values).
        config = settings.spin_config(self.topk_tokens)
        if config.grain is Grain.SLOT:
            runtime.history_caches += attach_history(self.k_cache.prefix, self.spin_layer, config.state_dtype)
        _LAYERS[self.k_cache.prefix] = self
        # DeepSeek-V3.2 / GLM-5 on CUDA never call this layer's forward: hook the function they call.
        install_v32_hook(_LAYERS.get)

    # -- forward -------------------------------------------------------------------------------------
    def _spin_forward(self, hidden_states, q_quant, k, weights):
        if self.spin_runtime is None or isinstance(q_quant, tuple):
            return self._vllm_forward(hidden_states, q_quant, k, weights)
        torch.ops.spin_indexer.sparse_attn_indexer(hidden_states, self.k_cache.prefix, self.k_cache.kv_cache,
                                                    q_quant, k, weights, self.topk_indices_buffer)
        return self.topk_indices_buffer

    def _spin_forward_eager(self, hidden_states, q_quant, k, weights, delegate=None) -> None:
        """One layer's step. delegate(hidden_states, q_quant, k, weights): vLLM's own indexer for this call
        site (default: the layer's dispatched forward; the V3.2 CUDA hook passes vLLM's function with the
        arguments it was called with)."""
        delegate = delegate or self._vllm_forward
        runtime, prefix = self.spin_runtime, self.k_cache.prefix
        ctx = get_forward_context()
        attn = ctx.attn_metadata
        meta = attn.get(prefix) if isinstance(attn, dict) else None
        if meta is None:  # profiling / dummy run: vLLM reserves its workspaces, SPIN its per-server state
            delegate(hidden_states, q_quant, k, weights)
            if self.spin_layer == 0:
                runtime.reserve(hidden_states.device)
            return
        if self.spin_layer == 0:
            # Python here under FULL graph mode means the step is being captured (a replay runs no Python):
            # nothing data-dependent may decide, or the graph would freeze the dummy batch's choice.
            capturing = _capturing(ctx)
            batch = runtime.decode_support(meta, q_quant, weights, capturing=capturing)
            reason = runtime.begin_step(meta, None if isinstance(batch, str) else batch, self.k_cache.kv_cache)
            if isinstance(batch, str) and not reason.startswith("indexer cache"):
                reason = batch
            runtime.log_once(self.spin_entry, capturing, reason)
            spin = not reason
        else:  # later layers follow the first layer's decision for this step's metadata
            spin = runtime.planned_for(meta)
            batch = runtime.step_batch
        if not spin:
            delegate(hidden_states, q_quant, k, weights)
            return
        if runtime.settings.shadow:  # vLLM's dense indexer decides; SPIN predicts beside it and is measured
            delegate(hidden_states, q_quant, k, weights)
            runtime.shadow_layer(self.spin_layer, batch, self.k_cache.kv_cache, q_quant, weights,
                                 self.topk_indices_buffer)
            return
        # vLLM's own path for everything but the decode rows: K insert, buffer clear, prefill rows.
        attn[prefix] = dataclasses.replace(meta, num_decodes=0, decode=None)
        try:
            delegate(hidden_states, q_quant, k, weights)
        finally:
            attn[prefix] = meta
        if not runtime.run_layer(self.spin_layer, batch, self.k_cache.kv_cache, q_quant, weights,
                                 self.topk_indices_buffer):
            delegate(hidden_states, q_quant, k, weights)


def _capturing(ctx) -> bool:
    """Whether this step is being recorded into a CUDA graph (FULL mode, or a stream capture)."""
    if getattr(ctx, "cudagraph_runtime_mode", None) == CUDAGraphMode.FULL:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _unsupported(layer: SparseAttnIndexer, settings: SpinVllmSettings) -> str:
    """Why SPIN cannot run on `layer` ('' if it can); host-side, at construction."""
    if not settings.enable:
        return "not enabled (SPIN_ENABLE=1 or additional_config={'spin': {'enable': true}})"
    if getattr(layer, "use_fp4_cache", False):
        return "MXFP4 indexer cache"
    if getattr(layer, "candidate_blocks", None) is not None:
        return "two-level candidate blocks (DeepSeek-V4.1)"
    if getattr(layer, "dcp_world_size", 1) > 1 or getattr(layer, "use_pcp", False):
        return "context parallelism"
    try:
        from vllm.utils.deep_gemm import mqa_logits_use_mx_scales
        if mqa_logits_use_mx_scales():
            return "SM100 stores UE8M0 key scales, not the fp32 scales SPIN's kernels read"
    except ImportError:
        pass
    from vllm.platforms import current_platform
    if not (current_platform.is_cuda() or current_platform.is_cpu()):
        return f"platform {type(current_platform).__name__} (CUDA, and CPU for tests, only)"
    return ""
