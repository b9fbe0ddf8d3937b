"""Where vLLM runs the indexer without calling SparseAttnIndexer.forward: the DeepSeek-V3.2 / GLM-5 CUDA model.

On CUDA, vLLM 0.33.0 resolves DeepSeek-V3.2 and GLM-5 to `vllm.models.deepseek_v32.nvidia`, whose attention
(`vllm.models.deepseek_v32.attention.DeepseekV32Attention._sparse_indexer_and_attn`) calls the module-level
Python function `sparse_attn_indexer(...)` directly, with `skip_k_cache_insert=True` (its fused norm/rope
kernel wrote the keys), `skip_topk_buffer_clear=True` (that kernel also cleared the buffer) and the layer's
`topk_backend`. The SparseAttnIndexer layer (ours, through register_oot) is built there but its forward is
never called.

The narrowest hook is that module's global name `sparse_attn_indexer`: the method looks it up at each call.
`install_v32_hook()` replaces it with `spin_v32_sparse_attn_indexer`, which has the same signature and:
  - finds SPIN's layer by the k-cache prefix (the first argument after hidden_states); no SPIN layer, SPIN
    off, the MXFP4 cache (q_scale given), context parallelism -> vLLM's function, with every argument as given;
  - otherwise runs the SPIN layer's step with vLLM's function (same arguments) as the delegate for what SPIN
    does not cover (prefill rows, steps SPIN hands back).
The method is `eager_break_during_capture` like vLLM's function, so calling our Python from it is what vLLM
does. Idempotent; `uninstall_v32_hook()` restores vLLM's function (tests).

Imports vLLM: only imported by vllm_layer (after the plugin's version check).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging

logger = logging.getLogger("spin_indexer.vllm")

V32_ATTENTION = "vllm.models.deepseek_v32.attention"
_HOOK_ATTR = "_spin_original"


def install_v32_hook(find_layer) -> bool:
    """Point V32_ATTENTION.sparse_attn_indexer at SPIN's wrapper. find_layer(prefix) -> SPIN layer or None.
    Returns False (and changes nothing) when the module or the name is missing (another vLLM)."""
    try:
        mod = importlib.import_module(V32_ATTENTION)
    except Exception as err:  # noqa: BLE001 - any import failure: the CUDA path is not there to hook
        logger.info("spin-indexer: %s not importable (%s): SPIN runs only where SparseAttnIndexer.forward runs",
                    V32_ATTENTION, err)
        return False
    current = getattr(mod, "sparse_attn_indexer", None)
    if current is None:
        return False
    if getattr(current, _HOOK_ATTR, None) is not None:
        return True
    mod.sparse_attn_indexer = _make_wrapper(current, find_layer)
    return True


def uninstall_v32_hook() -> None:
    mod = importlib.import_module(V32_ATTENTION)
    original = getattr(mod.sparse_attn_indexer, _HOOK_ATTR, None)
    if original is not None:
        mod.sparse_attn_indexer = original


def is_v32_hook_installed() -> bool:
    try:
        mod = importlib.import_module(V32_ATTENTION)
    except Exception:  # noqa: BLE001
        return False
    return getattr(getattr(mod, "sparse_attn_indexer", None), _HOOK_ATTR, None) is not None


def _make_wrapper(original, find_layer):
    sig = inspect.signature(original)
    from vllm.utils.torch_utils import _resolve_layer_name

    @functools.wraps(original)
    def spin_v32_sparse_attn_indexer(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        a = bound.arguments
        layer = find_layer(_resolve_layer_name(a["k_cache_prefix"]))
        if (layer is None or layer.spin_runtime is None or a.get("q_scale") is not None
                or a.get("use_pcp", False) or a.get("dcp_world_size", 1) > 1
                or a.get("candidate_blocks") is not None or a.get("use_fp4_cache", False)):
            return original(*args, **kwargs)

        def delegate(hidden_states, q_quant, k, weights):
            a.update(hidden_states=hidden_states, q_quant=q_quant, k=k, weights=weights)
            return original(*bound.args, **bound.kwargs)

        layer.spin_entry = "deepseek_v32 CUDA attention (module-level sparse_attn_indexer)"
        buffer = a["topk_indices_buffer"]
        own = layer.topk_indices_buffer
        layer.topk_indices_buffer = buffer  # write where vLLM's function would have written
        try:
            layer._spin_forward_eager(a["hidden_states"], a["q_quant"], a["k"], a["weights"], delegate=delegate)
        finally:
            layer.topk_indices_buffer = own
        return buffer

    setattr(spin_v32_sparse_attn_indexer, _HOOK_ATTR, original)
    return spin_v32_sparse_attn_indexer
