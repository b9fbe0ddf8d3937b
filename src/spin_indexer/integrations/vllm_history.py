"""SPIN's per-block history as vLLM KV-cache layers, so that vLLM profiles, sizes and allocates it with the blocks.

Every SPIN layer registers one `SpinHistoryCache` (and every 63rd layer one spare more) in vLLM's static
forward context, the way `DeepseekV32IndexerCache` registers the indexer's key cache. Each declares the same
KV-cache spec: an `MLAAttentionSpec` of one fp16 value per token (a 64-token block = a 128-byte page), in
the full-attention group of the indexer keys, so its pages are addressed by the same block ids. vLLM counts
the pages in `get_kv_cache_config` (fewer blocks fit: the history takes its share of
`gpu_memory_utilization`), allocates them in its one backing buffer, and binds each layer's view
[num_blocks, 1, T, 1] through `bind_kv_cache`.

Identical specs land in one KVCacheTensor, laid out layer after layer (layer-outer layouts, LBHNC and
friends): L + k regions of n blocks x T fp16, one after another. `bound_history` views them, in address
order, as SpinState's tensors:
    vertical[l, p, t]  = region l, block p, token t             [L, n + 1, T], strides (n*T, T, 1)
    block_max[p, l]    = spare regions, from element T on        [n + 1, L], strides (1, n + 1)
Row n of layer l (its trash block) is row 0 of the next region: block 0 is vLLM's null block, which no
request's table holds, so nothing reads it; the last layer's trash is the first spare row, skipped by
block_max. Worked example, L = 2, n = 3, T = 4 (k = 1 spare): vertical[0] = elements 0-15 (row 3, the
trash, = 12-15 = region 1's block 0), vertical[1] = 12-27, block_max[p, l] = element 24 + 4 + l*4 + p.

What the blocks share with vLLM and what they do not: a block's history is sized, allocated and freed with
it. A block that enters a request (a reused block, a prefix-cache hit, a block a connector loaded) is reset
by SPIN at the request's first plan, so the bytes vLLM keeps or moves with a block (prefix cache, offload,
zeroing) never carry history into a request. Block-outer layouts (each block a run of every layer's pages)
cannot hold rows of T contiguous per layer: there the runtime allocates the history itself, as before.
"""
from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import KVCacheSpec, MLAAttentionSpec, SparseCacheRole

SPARE_EVERY = 63  # one spare region per 63 layers: k * n * T >= T + L * (n + 1) for every n >= 42 at L = 61


class SpinHistoryCache(torch.nn.Module, AttentionLayerBase):
    """One region of SPIN's history: n blocks x T fp16 values, allocated and bound by vLLM.

    prefix: its name in the forward context (`<indexer k_cache prefix>.spin_history[_spare]`); dtype: the
    state dtype (SpinConfig.state_dtype).
    """

    def __init__(self, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.kv_cache = torch.tensor([])
        self.prefix, self.dtype = prefix, dtype
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context and not isinstance(context[prefix], SpinHistoryCache):
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self  # a model rebuilt under the same config takes its layer's region over

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def get_kv_cache_spec(self, vllm_config) -> KVCacheSpec:
        # One value per token in the indexer's block size (T = 64: 128 B per block); replicated across TP
        # like the indexer keys; head_size_v = 0 (MLA: no separate V).
        return MLAAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=1, max_tp_shards=1,
                                head_size=1, dtype=self.dtype, cache_role=SparseCacheRole.INDEXER)

    def get_attn_backend(self):
        # The indexer's backend: same kernel block sizes as the keys, so the group splits blocks alike.
        from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
        return DeepseekV32IndexerBackend

    def forward(self):  # storage only
        ...


def attach_history(prefix: str, layer: int, dtype: torch.dtype) -> list[SpinHistoryCache]:
    """The history regions SPIN layer number `layer` (execution order) registers: its own, and a spare
    every SPARE_EVERY layers."""
    caches = [SpinHistoryCache(f"{prefix}.spin_history", dtype)]
    if layer % SPARE_EVERY == 0:
        caches.append(SpinHistoryCache(f"{prefix}.spin_history_spare", dtype))
    return caches


def bound_history(caches: list[SpinHistoryCache], num_layers: int, tokens: int, num_blocks: int):
    """((vertical [L, n + 1, T], block_max [n + 1, L]), "") viewed over the regions vLLM bound to `caches`,
    or (None, why not). num_blocks: blocks of the indexer key cache (n must equal it)."""
    views = [c.kv_cache for c in caches]
    if any(v.numel() == 0 for v in views):
        return None, "history caches not bound by vLLM (no KV-cache spec allocation)"
    spare = len(views) - num_layers
    if spare < 1:
        return None, f"{len(views)} history regions for {num_layers} layers"
    first = views[0]
    n = first.shape[0]
    for v in views:
        if v.dtype != first.dtype or tuple(v.shape) != (n, 1, tokens, 1) or not v.is_contiguous():
            return None, (f"history region {v.dtype} {list(v.shape)} strides {v.stride()}: expected contiguous "
                          f"[{n}, 1, {tokens}, 1] (a layer-outer KV-cache layout)")
        if v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None, "history regions are not in one allocation"
    if n != num_blocks:
        return None, f"history regions hold {n} blocks, the key cache {num_blocks}"
    region = n * tokens
    offsets = sorted(v.storage_offset() for v in views)
    if any(b - a != region for a, b in zip(offsets, offsets[1:])):
        return None, "history regions are not laid out one after another"
    if tokens + num_layers * (n + 1) > spare * region:
        return None, f"{spare} spare region(s) of {n} blocks cannot hold {num_layers} layers' block max"
    base = offsets[0]
    vertical = torch.as_strided(first, (num_layers, n + 1, tokens), (region, tokens, 1), base)
    block_max = torch.as_strided(first, (n + 1, num_layers), (1, n + 1), base + num_layers * region + tokens)
    return (vertical, block_max), ""


def history_bytes(caches: list[SpinHistoryCache]) -> int:
    """Bytes vLLM allocated for the history regions (0 when unbound)."""
    return sum(c.kv_cache.numel() * c.kv_cache.element_size() for c in caches)
