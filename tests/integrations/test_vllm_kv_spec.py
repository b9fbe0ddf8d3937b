"""SPIN's per-block history as a KV-cache spec of its own: vLLM's planner sizes it (fewer blocks fit), its
allocator places it in the one backing buffer beside the indexer keys (same group: same block ids), its
bind_kv_cache hands it to the layers, and SPIN's state then lives there, stepping exactly as with its own
allocation. Everything runs vLLM 0.33.0's own functions (get_kv_cache_groups, get_kv_cache_config_from_groups,
allocate_kv_cache, bind_kv_cache_to_layers) on the CPU with its real DeepseekV32IndexerCache modules."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm not installed: these tests run in their own CI step (.ci/vllm_step.sh)")

import torch  # noqa: E402

import vllm_harness as vh  # noqa: E402

pytestmark = pytest.mark.vllm
LAYERS, TOPK, MAX_MODEL_LEN, WIDTH = 3, 512, 4096, 64  # WIDTH = vLLM's cdiv(max_model_len, T)
PAGE_KEYS, PAGE_HISTORY = vh.T * vh.ROW, vh.T * 2  # bytes per block and layer: 8448 (keys), 128 (history)


def _engine(spin: dict, available: int, layout: str = "LBHNC", bind: bool = True):
    """(cfg, SPIN layers, buffer, kv-cache config, raw kv_caches) of a LAYERS-layer model whose KV cache vLLM
    planned and allocated from `available` bytes."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache_to_layers, customize_attention_spec

    # Slot grain unless the test says otherwise: its per-token history is what vLLM's KV cache holds
    # (under block grain, the plugin's default, SPIN adds no pages there: test_block_grain_...).
    cfg = vh.vllm_config({"vertical_grain": "slot", **spin}, max_num_seqs=4)
    cfg.cache_config.block_size = vh.T
    cfg.cache_config.kv_cache_layout = layout
    buffer = torch.full((64, TOPK), 7, dtype=torch.int32)
    with set_current_vllm_config(cfg):
        caches = [DeepseekV32IndexerCache(vh.ROW, torch.uint8, f"model.layers.{i}.self_attn.indexer.k_cache",
                                          cfg.cache_config) for i in range(LAYERS)]
        layers = []
        for kc in caches:
            layer = vh.SparseAttnIndexer(kc, 128, "ue8m0", TOPK, vh.D, MAX_MODEL_LEN, 8 * MAX_MODEL_LEN, buffer)
            layer.skip_k_cache_insert = True
            layer._vllm_forward = (lambda lyr: lambda h, q, k, w: vh.vllm_path(lyr, h, q, k, w))(layer)
            layers.append(layer)
        context = cfg.compilation_config.static_forward_context
        # What GPUModelRunner.get_kv_cache_spec does: every AttentionLayerBase, its spec, customized by its backend.
        specs = {name: customize_attention_spec(m.get_attn_backend(), m.get_kv_cache_spec(cfg))
                 for name, m in context.items() if isinstance(m, AttentionLayerBase)}
        groups = get_kv_cache_groups(cfg, specs)
        kv_config = get_kv_cache_config_from_groups(cfg, groups, available)
        raw = allocate_kv_cache(kv_config, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout())
        if bind:
            bind_kv_cache_to_layers(raw, context)
    return cfg, layers, buffer, kv_config, raw, specs


def _fill_keys(layers, num_blocks, gen):
    for layer in layers:
        pages = layer.k_cache.kv_cache.reshape(num_blocks, -1)
        assert pages.data_ptr() == layer.k_cache.kv_cache.data_ptr()  # a view: keys land in vLLM's buffer
        vh.fill_blocks(pages, torch.arange(num_blocks), gen)


def test_history_is_sized_allocated_and_bound_by_vllms_kv_cache_machinery(gen):
    """The history's spec joins the indexer keys' group (one block table); vLLM's planner counts it, so
    num_blocks = available // (L x 8448 + (L + 1) x 128) instead of available // (L x 8448); its pages are in
    vLLM's backing buffer and SPIN's state tensors are views of them; the bytes per cached token per layer
    come from the allocated tensors."""
    available = 300 * (LAYERS * PAGE_KEYS + (LAYERS + 1) * PAGE_HISTORY) + 5000
    cfg, layers, buffer, kv_config, raw, specs = _engine({"enable": True, "sparsity": 0.5}, available)
    history = [n for n in specs if "spin_history" in n]
    assert len(history) == LAYERS + 1 and sum("spare" in n for n in history) == 1
    assert len(kv_config.kv_cache_groups) == 1, "history and keys must share one block table"
    # fp16 history beside uint8 keys: vLLM calls the cache mixed-precision and wants new blocks zeroed, but
    # the group's spec is no AttentionSpec, so its manager records no new block ids: nothing gets zeroed
    from vllm.v1.kv_cache_interface import AttentionSpec
    assert kv_config.needs_kv_cache_zeroing
    assert not isinstance(kv_config.kv_cache_groups[0].kv_cache_spec, AttentionSpec)
    assert set(kv_config.kv_cache_groups[0].layer_names) == set(specs)
    assert kv_config.num_blocks == 300
    without = available // (LAYERS * PAGE_KEYS)  # what the same memory gives without SPIN's spec
    assert without > kv_config.num_blocks
    n = kv_config.num_blocks
    _fill_keys(layers, n, gen)

    runtime = layers[0].spin_runtime
    lens, tables = [1500, 900], [list(range(1, 25)), list(range(100, 115))]  # block 0 is vLLM's null block
    step = vh.make_step(lens, tables, 1, WIDTH, gen)
    for layer in layers:
        vh.run_layer(cfg, layers, layer, step)
    assert runtime.history_in_kv_cache, runtime.history_reason
    state = runtime.indexer.state
    backing = next(iter(raw.values())).untyped_storage()
    lo, hi = backing.data_ptr(), backing.data_ptr() + backing.nbytes()
    for t in (state.vertical, state.block_max):
        assert t.untyped_storage().data_ptr() == lo and lo <= t.data_ptr() < hi
    assert state.num_cache_blocks == n and state.trash_block == n
    from spin_indexer.integrations.vllm_memory import state_bytes
    sizes = state_bytes(runtime.indexer, runtime.tracker, runtime.history_caches)
    assert sizes["kv_cache_history"] == (LAYERS + 1) * n * PAGE_HISTORY
    per_token_layer = sizes["kv_cache_history"] / (n * vh.T * LAYERS)
    assert per_token_layer == pytest.approx(2 * (LAYERS + 1) / LAYERS) and per_token_layer <= 4
    # The state's own tensors no longer hold the per-block history (only per-slot tables remain there).
    per_block = (state.vertical.numel() + state.block_max.numel()) * state.vertical.element_size()
    assert sizes["per_slot"] == state.nbytes() - per_block and sizes["per_block"] == 0


def test_history_in_vllms_kv_cache_steps_exactly_like_its_own_allocation(gen):
    """Several decode steps (a request growing into a new block, one finishing, a new one on reused blocks,
    prefix-shared blocks) over vLLM-allocated history give bit-identical top-k and histories to the same
    model whose history SPIN allocates itself; at sparsity 0 the top-k equals vLLM's own path."""
    available = 200 * (LAYERS * PAGE_KEYS + (LAYERS + 1) * PAGE_HISTORY)
    # Prefix caching: A and B share blocks 1-10 (a common prompt); C later reuses A's freed blocks.
    shared = list(range(1, 11))
    a, b, c = shared + list(range(20, 32)), shared + list(range(40, 46)), list(range(20, 32)) + [60, 61]
    schedule = [([1400, 1000], [a, b]), ([1401, 1001], [a, b]), ([1001, 1402], [b, a]),
                ([1410, 1002], [a, b]), ([1003, 700], [b, c]), ([1004, 701], [b, c])]
    outs, states = {}, {}
    for bound in (True, False):  # one model at a time: the op finds its layer by name
        g = torch.Generator().manual_seed(11)
        cfg, layers, buffer, kv_config, raw, _ = _engine({"enable": True, "sparsity": 0.5}, available, bind=bound)
        if bound:
            _fill_keys(layers, kv_config.num_blocks, torch.Generator().manual_seed(5))
        else:  # the same key bytes, in a cache SPIN views the usual way
            keys = torch.Generator().manual_seed(5)
            for layer in layers:
                layer.k_cache.kv_cache = vh.make_cache(kv_config.num_blocks, keys)
        outs[bound] = []
        for lens, tables in schedule:
            step = vh.make_step(lens, tables, 1, WIDTH, g)
            outs[bound].append([vh.run_layer(cfg, layers, layer, step) for layer in layers])
        assert layers[0].spin_runtime.history_in_kv_cache == bound, layers[0].spin_runtime.history_reason
        state = layers[0].spin_runtime.indexer.state
        states[bound] = (state.vertical.clone(), state.block_max.clone(), state.num_cache_blocks)
    for i in range(len(schedule)):
        for layer in range(LAYERS):
            assert torch.equal(outs[True][i][layer], outs[False][i][layer]), (i, layer)
    (v1, b1, n), (v2, b2, n2) = states[True], states[False]
    assert n == n2
    # Row 0 is the null block (layer l's trash row aliases layer l + 1's); every real block matches.
    assert torch.equal(v1[:, 1:n], v2[:, 1:n]) and torch.equal(b1[1:n], b2[1:n])
    assert torch.isfinite(b1[shared]).all(), "shared prefix blocks carry history"
    # Sparsity 0 on the vLLM-allocated history: vLLM's own top-k.
    cfg, layers, buffer, kv_config, raw, _ = _engine({"enable": True, "sparsity": 0.0}, available)
    _fill_keys(layers, kv_config.num_blocks, gen)
    step = vh.make_step([1400, 1000], [a, b], 1, WIDTH, gen)
    for layer in layers:
        got = vh.run_layer(cfg, layers, layer, step)
        want = vh.reference(cfg, layer, step, buffer)
        vh.assert_same_topk(got[:2], want[:2], vh.dense_logits(layer, step), TOPK)
    assert layers[0].spin_runtime.history_in_kv_cache


def test_block_outer_layout_falls_back_to_spins_own_history(gen, caplog):
    """A block-outer layout (every block a run of all layers' pages) cannot hold each layer's history rows
    contiguously: the runtime says why and allocates the history itself; the step still runs."""
    import logging
    caplog.set_level(logging.INFO, logger="spin_indexer.vllm")
    available = 100 * (LAYERS * PAGE_KEYS + (LAYERS + 1) * PAGE_HISTORY)
    cfg, layers, buffer, kv_config, raw, _ = _engine({"enable": True, "sparsity": 0.5}, available, layout="BLHNC")
    runtime = layers[0].spin_runtime
    for layer in layers:
        layer.k_cache.kv_cache = vh.make_cache(kv_config.num_blocks, gen)
    step = vh.make_step([1400], [list(range(1, 23))], 1, WIDTH, gen)
    for layer in layers:
        vh.run_layer(cfg, layers, layer, step)
    assert not runtime.history_in_kv_cache and "layer-outer" in runtime.history_reason
    assert any("outside vLLM's KV cache" in r.getMessage() for r in caplog.records)


def test_block_grain_adds_no_pages_to_vllms_kv_cache(gen):
    """The plugin's default grain for spin-default (block): no SPIN spec joins the planner, so the same memory
    holds as many key blocks as without SPIN; the runtime allocates the block maxima (L x 2 B a block) itself,
    says why the history is its own, and at sparsity 0 the step still gives vLLM's own top-k."""
    available = 300 * LAYERS * PAGE_KEYS + 5000
    for sparsity in (0.5, 0.0):
        cfg, layers, buffer, kv_config, raw, specs = _engine({"enable": True, "sparsity": sparsity,
                                                              "vertical_grain": "auto"}, available)
        assert not any("spin_history" in n for n in specs) and kv_config.num_blocks == 300
        _fill_keys(layers, kv_config.num_blocks, gen)
        step = vh.make_step([1400, 1000], [list(range(1, 23)), list(range(100, 116))], 1, WIDTH, gen)
        for layer in layers:
            got = vh.run_layer(cfg, layers, layer, step)
            if sparsity == 0.0:
                want = vh.reference(cfg, layer, step, buffer)
                vh.assert_same_topk(got[:2], want[:2], vh.dense_logits(layer, step), TOPK)
        runtime = layers[0].spin_runtime
        assert not runtime.history_in_kv_cache and "block grain" in runtime.history_reason
        state = runtime.indexer.state
        assert state.vertical is None and state.num_cache_blocks == 300
        assert state.block_max.numel() * state.block_max.element_size() <= LAYERS * (300 + 1) * 2
