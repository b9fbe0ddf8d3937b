"""Everything SPIN allocates on a vLLM server, in two parts that vLLM's memory sizing each accounts for.

    per-server state (build_state)       SpinIndexer's per-slot tables (diagonal windows, counters), its
                                         step workspace (plan scratch [L, B, W] x 2, fp32 logits
                                         [B*N, W*T], block max, top-k [L, B*N, K]) and the RequestTracker:
                                         sized by max_num_seqs, max_model_len and the layer count only, so
                                         the runtime builds them at vLLM's profile run (the dummy forward
                                         with no attention metadata); vLLM's memory_profiling counts every
                                         tensor still held after that run (total_consumed), exactly as it
                                         counts its own indexer's workspace reserved there.
    per-block history (attach_history)   vertical EMA and block max, 2 + 2/T B per cached token per layer (block
                                         grain: the block max alone, 2/T B, allocated here at the first step):
                                         a KV-cache spec of its own (vllm_history.py), sized by vLLM's
                                         planner with the blocks; only when vLLM's layout cannot hold it
                                         (block-outer layouts, strided key caches) does SPIN allocate it
                                         here, at the first step, outside gpu_memory_utilization (logged).

No vLLM import: the memory table script (benchmarks/vllm_memory.py) sizes both on the meta device.
"""
from __future__ import annotations

import torch

from .request_tracker import RequestTracker
from .settings import SpinVllmSettings


def build_state(settings: SpinVllmSettings, topk: int, num_layers: int, max_batch: int, max_model_len: int,
                next_n: int, tokens: int, device, width: int = 0):
    """(SpinIndexer, RequestTracker), the per-server state (device "meta" sizes it without memory):
    max_batch = max_num_seqs, width = max(table width, ceil(max_model_len / T)), 2 * max_batch + 1 state
    slots (the last is the trash slot for padding rows). The per-block history is a one-block placeholder
    until attach_history()."""
    from ..indexer import SpinIndexer
    width = max(width, -(-max_model_len // tokens))
    config = settings.spin_config(topk, tokens_per_block=tokens)
    # before SpinIndexer's own check, to name the vLLM setting and the file
    config.check_profile_layers(num_layers, f"SpinVllmSettings.sparsity_profile ({settings.sparsity_profile})")
    num_slots = 2 * max_batch  # room for requests that skip a step; slot num_slots is the trash
    indexer = SpinIndexer(config, num_layers=num_layers, max_batch=max_batch, max_blocks=width, next_n=next_n,
                          device=device, max_requests=num_slots + 1, num_cache_blocks=1)
    for _ in range(num_slots + 1):  # the tracker owns slot assignment; the pool just has to agree
        indexer.state.allocate()
    return indexer, RequestTracker(num_slots, tokens, device, next_n=next_n)


def attach_history(indexer, history, num_cache_blocks: int) -> None:
    """Give the state its per-block history: `history` = (vertical, block_max) viewed in vLLM's KV cache
    (vllm_history.bound_history), or None to allocate it here for `num_cache_blocks` blocks (+ the trash)."""
    state = indexer.state
    if history is None:
        dtype, t = state.config.state_dtype, state.config.tokens_per_block
        vertical = None if state.vertical is None else torch.empty(  # None: block grain, the block maxima alone
            (state.num_layers, num_cache_blocks + 1, t), dtype=dtype, device=state.device)
        history = (vertical, torch.empty((num_cache_blocks + 1, state.num_layers), dtype=dtype, device=state.device))
    state.bind_history_(*history)


def state_bytes(indexer, tracker, history_caches=None) -> dict:
    """Bytes of every tensor SPIN holds: {"per_slot": SpinState's tensors but the per-block history,
    "per_block": the per-block history (vertical, block max, last_seen), "workspace": the step's buffers,
    "tracker": RequestTracker}; with history_caches (the SpinHistoryCache regions vLLM allocated) also
    "kv_cache_history": their bytes, and "per_block" then counts only what the state holds besides them."""
    state = indexer.state
    per_block = {id(state.vertical), id(state.block_max)}
    if state.last_seen is not None:
        per_block.add(id(state.last_seen))
    in_kv = {id(state.vertical), id(state.block_max)} if history_caches else set()

    def total(obj, keep):
        return sum(v.numel() * v.element_size() for v in vars(obj).values()
                   if isinstance(v, torch.Tensor) and keep(id(v)))
    out = {"per_slot": total(state, lambda i: i not in per_block),
           "per_block": total(state, lambda i: i in per_block and i not in in_kv),
           "workspace": total(indexer.workspace, lambda i: True), "tracker": total(tracker, lambda i: True)}
    if history_caches:
        out["kv_cache_history"] = sum(c.kv_cache.numel() * c.kv_cache.element_size() for c in history_caches)
    return out
