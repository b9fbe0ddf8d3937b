"""vLLM's real CUDA paths, run on the CPU: the DeepSeek-V3.2 / GLM-5 CUDA attention (which calls the module-level
sparse_attn_indexer function, never the layer's forward) and FULL CUDA-graph capture with vLLM's dummy lengths.
Each test compares against vLLM's own function on the same step."""
from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm", reason="vllm not installed: these tests run in their own CI step (.ci/vllm_step.sh)")

import torch  # noqa: E402

import vllm_harness as vh  # noqa: E402

pytestmark = pytest.mark.vllm
MAX_MODEL_LEN = 4096
WIDTH = MAX_MODEL_LEN // vh.T




def _v32_attention_self(layer, buffer):
    """The attributes DeepseekV32Attention._sparse_indexer_and_attn reads, around our indexer layer (the
    real method runs unchanged; building a whole MLA layer needs CUDA kernels)."""
    indexer = types.SimpleNamespace(
        k_cache=layer.k_cache, quant_block_size=128, scale_fmt="ue8m0", topk_tokens=layer.topk_tokens,
        head_dim=vh.D, max_model_len=layer.max_model_len, max_total_seq_len=layer.max_total_seq_len,
        indexer_op=types.SimpleNamespace(topk_backend="torch"))
    parallel = types.SimpleNamespace(decode_context_parallel_size=1, cp_kv_cache_interleave_size=1)
    return types.SimpleNamespace(
        indexer=indexer, skip_topk=False, use_pcp=False, pcp_shard_decode_requests=False,
        _dense_mha_metadata_layer_name="", dcp_manager=None, _vllm_config=types.SimpleNamespace(
            parallel_config=parallel), topk_indices_buffer=buffer, layer_name="model.layers.0.self_attn.attn",
        impl=types.SimpleNamespace(record_logical_topk_ready=lambda: None))


def _call_v32_attention(cfg, fake, step):
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention

    rows = step.q.shape[0]
    fake.topk_indices_buffer[:rows] = -1  # vLLM's fused norm/rope kernel clears it (skip_topk_buffer_clear)
    attn = {fake.indexer.k_cache.prefix: step.meta}
    output = torch.empty(rows, 4)
    e = torch.empty(rows, 1)
    with vh.set_current_vllm_config(cfg), vh.set_forward_context(attn, cfg):
        DeepseekV32Attention._sparse_indexer_and_attn(fake, torch.zeros(rows, dtype=torch.long), e, e, e, step.q,
                                                      None, step.weights, None, None, e, e, output)
    return fake.topk_indices_buffer.clone()


@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_v32_cuda_attention_reaches_spin(sparsity, monkeypatch, gen):
    """vLLM's CUDA DeepSeek-V3.2 attention method (vllm.models.deepseek_v32.attention, used by
    deepseek_v32.nvidia) reaches SPIN through its module-level call; at s = 0 its top-k equals vLLM's own
    function's, at s = 0.5 blocks are skipped and every position is in a kept block."""
    import vllm.models.deepseek_v32.attention as v32
    import vllm.models.deepseek_v32.nvidia.model as nvidia

    from spin_indexer.integrations import vllm_hooks

    # the nvidia model builds exactly this attention class, and the method calls the hooked global by name
    assert nvidia.DeepseekV32Attention is v32.DeepseekV32Attention
    assert "sparse_attn_indexer" in v32.DeepseekV32Attention._sparse_indexer_and_attn.__wrapped__.__code__.co_names
    monkeypatch.setattr(v32, "get_attention_context", lambda name: (None, None, None, None))  # the MLA part
    monkeypatch.setattr(v32, "sparse_attn_indexer", v32.sparse_attn_indexer)  # restored after the test

    topk, lens = 512, [1500, 700, 2600, 300]
    num_blocks = 90
    kv = vh.make_cache(num_blocks, gen)
    cfg = vh.vllm_config({"enable": True, "sparsity": sparsity, "policy": "explore-none"})
    layers, buffer = vh.build_layers(cfg, [kv], topk, MAX_MODEL_LEN)
    layer = layers[0]
    assert vllm_hooks.is_v32_hook_installed(), "building a SPIN layer must hook the V3.2 CUDA call"
    calls = []
    run_layer = layer.spin_runtime.run_layer
    monkeypatch.setattr(layer.spin_runtime, "run_layer", lambda *a: calls.append(1) or run_layer(*a))
    fake = _v32_attention_self(layer, buffer)
    tables = vh.random_tables([L + 8 for L in lens], num_blocks, gen)
    skipped = 0
    for s in range(3):
        step = vh.make_step([L + s for L in lens], tables, 1, WIDTH, gen)
        got = _call_v32_attention(cfg, fake, step)
        assert calls, "the V3.2 CUDA attention did not reach SPIN"
        assert layer.spin_runtime.planned_for(step.meta)
        assert layer.spin_entry.startswith("deepseek_v32 CUDA")
        original = v32.sparse_attn_indexer._spin_original
        want_buf = torch.full_like(buffer, -1)
        with vh.set_current_vllm_config(cfg), vh.set_forward_context({layer.k_cache.prefix: step.meta}, cfg):
            original(torch.empty(len(lens), 8), layer.k_cache.prefix, kv, step.q, None, None, step.weights, 128,
                     "ue8m0", topk, vh.D, MAX_MODEL_LEN, layer.max_total_seq_len, want_buf,
                     skip_k_cache_insert=True, use_pcp=False, pcp_shard_decode_requests=False,
                     dense_mha_metadata_layer_name="", skip_topk_buffer_clear=True, topk_backend="torch")
        logits = vh.dense_logits(layer, step)
        rows = len(lens)
        if sparsity == 0.0:
            vh.assert_same_topk(got[:rows], want_buf[:rows], logits, topk)
        else:
            plan = layer.spin_runtime.indexer.block_plan
            keep = plan.token_mask()
            for r in range(rows):
                pos = got[r][got[r] >= 0].long()
                assert bool(keep[r, pos].all()), f"row {r}: position in a skipped block"
            skipped += int((plan.num_blocks - plan.num_kept).sum())
    if sparsity > 0:
        assert skipped > 0


def test_v32_cuda_attention_spin_off_is_vllms_function(monkeypatch, gen):
    """SPIN off: the hooked name is vLLM's own function (the plugin installs nothing)."""
    import vllm.models.deepseek_v32.attention as v32

    from spin_indexer.integrations import vllm_hooks

    monkeypatch.setattr(v32, "sparse_attn_indexer", v32.sparse_attn_indexer)
    vllm_hooks.uninstall_v32_hook()
    cfg = vh.vllm_config(None)
    vh.build_layers(cfg, [vh.make_cache(20, gen)], 512, MAX_MODEL_LEN)
    assert not vllm_hooks.is_v32_hook_installed()


@pytest.mark.parametrize("next_n", [1, 2])
def test_full_graph_capture_with_dummy_lengths_takes_spin(next_n, gen):
    """vLLM captures FULL graphs (its default FULL_AND_PIECEWISE mode, for pure-decode batches) with dummy
    seq_lens equal to the query length. The captured step must be SPIN's, or no replay ever runs SPIN: under
    FULL mode no length-dependent choice is made on the host. The capture-time result equals vLLM's."""
    from vllm.config import CUDAGraphMode

    topk, batch = 512, 4
    kv = vh.make_cache(40, gen)
    cfg = vh.vllm_config({"enable": True, "sparsity": 0.4})
    if next_n > 1:
        cfg.speculative_config = type("Spec", (), {"num_speculative_tokens": next_n - 1})()
    layers, buffer = vh.build_layers(cfg, [kv, vh.make_cache(40, gen)], topk, MAX_MODEL_LEN)
    runtime = layers[0].spin_runtime
    dummy = vh.make_step([next_n] * batch, [[0]] * batch, next_n, WIDTH, gen)  # vLLM's dummy: L = query length
    eager = vh.run_layer(cfg, layers, layers[0], dummy)
    assert not runtime.planned_for(dummy.meta), "eager short step: handed to vLLM (SPIN would keep all)"
    outs = [vh.run_layer(cfg, layers, layer, dummy, mode=CUDAGraphMode.FULL) for layer in layers]
    assert runtime.planned_for(dummy.meta), "the captured step is the dense path: replays never run SPIN"
    rows = batch * next_n
    for out in outs:  # every token of a short context (any order), -1 padded, as vLLM's
        assert torch.equal(out[:rows].sort(dim=1).values, eager[:rows].sort(dim=1).values)


def test_what_is_active_is_logged_once(monkeypatch, caplog, gen):
    """One line says what is active (entry point, graph mode, layers, policy, sparsity, MTP, shadow or live,
    where the block history lives, when the state was built), once per situation however many steps run."""
    import logging

    from vllm.config import CUDAGraphMode

    caplog.set_level(logging.INFO, logger="spin_indexer.vllm")
    cfg = vh.vllm_config({"enable": True, "sparsity": 0.4, "mtp": "row-local"})
    cfg.speculative_config = type("Spec", (), {"num_speculative_tokens": 1})()
    layers, _ = vh.build_layers(cfg, [vh.make_cache(40, gen)], 512, MAX_MODEL_LEN)
    for s in range(3):
        vh.run_layer(cfg, layers, layers[0], vh.make_step([1500 + 2 * s], [list(range(24))], 2, WIDTH, gen))
    vh.run_layer(cfg, layers, layers[0], vh.make_step([2] * 2, [[0]] * 2, 2, WIDTH, gen), mode=CUDAGraphMode.FULL)
    said = [r.getMessage() for r in caplog.records if "on decode rows via" in r.getMessage()]
    assert len(said) == 2, said
    assert "SPIN active on decode rows via SparseAttnIndexer.forward (eagerly): 1 layers, policy spin-default, " \
           "sparsity 0.40, next_n 2 (mtp row-local), top-k 512; block history SPIN's own" in said[0], said[0]
    assert "per-server state built at the first step" in said[0]
    assert "(while capturing a CUDA graph)" in said[1]
