"""Differential: our layer vs vLLM's own sparse_attn_indexer decode path (torch fallbacks), on hand-built
vLLM decode metadata. At sparsity 0 the top-k sets and the -1 padding must match; at sparsity s the
positions must be valid, inside the kept blocks, and be the exact top-k of the kept blocks."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm not installed: these tests run in their own CI step (.ci/vllm_step.sh)")

import torch  # noqa: E402

import vllm_harness as vh  # noqa: E402

pytestmark = pytest.mark.vllm
MAX_MODEL_LEN = 4096
WIDTH = MAX_MODEL_LEN // vh.T




CASES = [  # (top-k, next_n, lengths): < top-k, partial last block, exact multiple of T, one token
    pytest.param(512, 1, [100, 700, 1000, 513, 64, 1], id="k512-n1"),
    pytest.param(512, 2, [100, 700, 1000, 514, 65, 2], id="k512-n2"),
    pytest.param(2048, 1, [3000, 2049, 128, 4094, 2047], id="k2048-n1"),
    pytest.param(2048, 2, [3001, 2050, 130, 4000], id="k2048-n2"),
]


@pytest.mark.parametrize("topk,next_n,lens", CASES)
@pytest.mark.parametrize("stride_blocks", [1, 2], ids=["contiguous-cache", "strided-cache"])
def test_sparsity_zero_matches_vllm(topk, next_n, lens, stride_blocks, gen):
    num_blocks = sum(-(-(L + 4) // vh.T) for L in lens) + 5
    kv = vh.make_cache(num_blocks, gen, stride_blocks)
    cfg = vh.vllm_config({"enable": True, "sparsity": 0.0})
    if next_n > 1:
        cfg.speculative_config = type("Spec", (), {"num_speculative_tokens": next_n - 1})()
    layers, buffer = vh.build_layers(cfg, [kv], topk, MAX_MODEL_LEN)
    layer = layers[0]
    assert layer.spin_runtime is not None, layer.spin_reason
    for step_no in range(2):  # the second step runs with history (still s = 0: every block kept)
        tables = vh.random_tables([L + 4 for L in lens], num_blocks, gen)
        step = vh.make_step([L + step_no * next_n for L in lens], tables, next_n, WIDTH, gen,
                            seq_lens_2d=(step_no == 0))
        got = vh.run_layer(cfg, layers, layer, step)
        want = vh.reference(cfg, layer, step, buffer)
        rows = len(lens) * next_n
        assert layer.spin_runtime.planned_for(step.meta), "SPIN did not handle the decode rows"
        assert bool((got[rows:] == 7).all()) and bool((want[rows:] == 7).all()), "rows past the batch touched"
        vh.assert_same_topk(got[:rows], want[:rows], vh.dense_logits(layer, step), topk)


def test_short_batch_delegates_and_spin_keep_all_matches(gen):
    """Every context <= top-k: the step goes to vLLM; with delegation off SPIN keeps all, same answer."""
    lens, topk = [100, 511, 512, 3], 512
    kv = vh.make_cache(30, gen)
    cfg = vh.vllm_config({"enable": True, "sparsity": 0.5})
    layers, buffer = vh.build_layers(cfg, [kv], topk, MAX_MODEL_LEN)
    layer = layers[0]
    step = vh.make_step(lens, vh.random_tables(lens, 30, gen), 1, WIDTH, gen)
    want = vh.reference(cfg, layer, step, buffer)
    got = vh.run_layer(cfg, layers, layer, step)
    assert not layer.spin_runtime.planned_for(step.meta)
    assert torch.equal(got, want)
    layer.spin_runtime.delegate_short = False
    got = vh.run_layer(cfg, layers, layer, step)
    assert layer.spin_runtime.planned_for(step.meta)
    vh.assert_same_topk(got[:4], want[:4], vh.dense_logits(layer, step), topk)


@pytest.mark.parametrize("next_n", [1, 2])
def test_sparse_positions_valid_inside_kept_blocks_and_exact(next_n, gen):
    """s = 0.5 over several steps and two layers: every position is valid and in a kept block, and the
    top-k is exactly the dense top-k restricted to the kept blocks (the column -> position remap)."""
    topk, lens0 = 512, [4000, 2600, 1500, 300]
    num_blocks = sum(-(-(L + 8) // vh.T) for L in lens0) + 4
    kvs = [vh.make_cache(num_blocks, gen, 2), vh.make_cache(num_blocks, gen, 2)]  # vLLM: one layout for all
    cfg = vh.vllm_config({"enable": True, "sparsity": 0.5})
    if next_n > 1:
        cfg.speculative_config = type("Spec", (), {"num_speculative_tokens": next_n - 1})()
    layers, buffer = vh.build_layers(cfg, kvs, topk, MAX_MODEL_LEN)
    tables = vh.random_tables([L + 8 for L in lens0], num_blocks, gen)
    skipped = 0
    for s in range(4):
        step = vh.make_step([L + s * next_n for L in lens0], tables, next_n, WIDTH, gen)
        for layer in layers:
            got = vh.run_layer(cfg, layers, layer, step)
            plan = layer.spin_runtime.indexer.block_plan
            logits = vh.dense_logits(layer, step)
            rows = len(lens0) * next_n
            keep_tokens = plan.token_mask().repeat_interleave(next_n, dim=0)  # [B*N, W*T]
            for r in range(rows):
                row = got[r, :topk]
                pos = row[row >= 0].long()
                length = int(step.seq_lens.view(-1)[r])
                assert bool(((pos >= 0) & (pos < length)).all()), f"row {r}: position outside [0, {length})"
                assert bool(keep_tokens[r, pos].all()), f"row {r}: position in a skipped block"
                assert len(set(pos.tolist())) == pos.numel()
            masked = torch.where(keep_tokens, logits, float("-inf"))
            vh.assert_same_topk(got[:rows], vh.finite_topk(masked, topk), masked, topk)
            skipped += int((~plan.keep_mask & (torch.arange(WIDTH)[None] < plan.num_blocks[:, None].long())).sum())
    assert skipped > 0, "s = 0.5 never skipped a block: SPIN did not run sparsely"


def test_sparsity_profile_moves_budget_between_layers_inside_vllm(tmp_path, gen):
    """SPIN_SPARSITY_PROFILE through vLLM's config: layer 0 at 0.5 x 1.5, layer 1 at 0.5 x 0.5 skip the blocks
    their budgets say (more in layer 0 than in 1), and every row's top-k is still the exact top-k of its kept
    blocks."""
    import json

    topk, lens0 = 512, [4000, 2600, 3500]
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"profiles": {"0.5": [1.5, 0.5]}}))
    num_blocks = sum(-(-(L + 8) // vh.T) for L in lens0) + 4
    kvs = [vh.make_cache(num_blocks, gen, 2), vh.make_cache(num_blocks, gen, 2)]
    cfg = vh.vllm_config({"enable": True, "sparsity": 0.5, "sparsity_profile": str(profile)})
    layers, buffer = vh.build_layers(cfg, kvs, topk, MAX_MODEL_LEN)
    tables = vh.random_tables([L + 8 for L in lens0], num_blocks, gen)
    skipped = [0, 0]
    for s in range(3):
        step = vh.make_step([L + s for L in lens0], tables, 1, WIDTH, gen)
        for i, layer in enumerate(layers):
            got = vh.run_layer(cfg, layers, layer, step)
            plan = layer.spin_runtime.indexer.block_plan
            masked = torch.where(plan.token_mask(), vh.dense_logits(layer, step), float("-inf"))
            vh.assert_same_topk(got[:len(lens0)], vh.finite_topk(masked, topk), masked, topk)
            valid = torch.arange(WIDTH)[None] < plan.num_blocks[:, None].long()
            skipped[i] += int((~plan.keep_mask & valid).sum())
    assert layers[0].spin_runtime.indexer.config.sparsity_profile == (1.5, 0.5)
    assert skipped[0] > 2 * skipped[1] > 0, skipped


def test_op_under_torch_compile_matches_eager(gen):
    """torch.compile(fullgraph=True) traces the layer's op as one opaque node (fake impl, declared
    mutation of the top-k buffer) and the compiled call writes what the eager call writes."""
    topk, lens = 512, [1500, 900, 300]
    kv = vh.make_cache(60, gen)
    cfg = vh.vllm_config({"enable": True, "sparsity": 0.0})
    layers, buffer = vh.build_layers(cfg, [kv], topk, MAX_MODEL_LEN)
    layer = layers[0]
    step = vh.make_step(lens, vh.random_tables(lens, 60, gen), 1, WIDTH, gen)
    eager = vh.run_layer(cfg, layers, layer, step)

    def call(hidden, q, w, buf):
        torch.ops.spin_indexer.sparse_attn_indexer(hidden, layer.k_cache.prefix, layer.k_cache.kv_cache, q, None, w,
                                                   buf)
        return buf

    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    buffer.fill_(7)
    hidden = torch.empty(step.q.shape[0], 8)
    attn = {layer.k_cache.prefix: step.meta}
    with vh.set_current_vllm_config(cfg), vh.set_forward_context(attn, cfg):
        out = compiled(hidden, step.q, step.weights, buffer)
    assert torch.equal(out, eager) and torch.equal(buffer, eager)


def test_padded_rows_and_mixed_prefill_batch(gen):
    """CUDA-graph padding rows (length 0) come back all -1 like vLLM's; in a mixed step vLLM's own forward
    sees the prefill part with the decode rows hidden, and SPIN writes only the decode rows."""
    import dataclasses

    topk, lens = 512, [1500, 0, 900, 0]
    kv = vh.make_cache(60, gen)
    cfg = vh.vllm_config({"enable": True, "sparsity": 0.0})
    layers, buffer = vh.build_layers(cfg, [kv], topk, MAX_MODEL_LEN)
    layer = layers[0]
    step = vh.make_step(lens, vh.random_tables(lens, 60, gen), 1, WIDTH, gen)
    got = vh.run_layer(cfg, layers, layer, step)
    want = vh.reference(cfg, layer, step, buffer)
    assert layer.spin_runtime.planned_for(step.meta)
    vh.assert_same_topk(got[:4], want[:4], vh.dense_logits(layer, step), topk)
    assert bool((got[[1, 3], :topk] == -1).all())

    # a mixed step: 2 decode rows, then 3 prefill tokens that vLLM's own path scores (here: a marker)
    seen = []

    def vllm_forward(hidden, q, k, w):
        meta = vh.get_forward_context().attn_metadata[layer.k_cache.prefix]
        seen.append(meta)
        layer.topk_indices_buffer[: hidden.shape[0]] = -1
        if meta.num_prefills:
            layer.topk_indices_buffer[meta.num_decode_tokens: hidden.shape[0], :topk] = 4242
        return layer.topk_indices_buffer

    layer._vllm_forward = vllm_forward
    step = vh.make_step([1500, 900], vh.random_tables([1500, 900], 60, gen), 1, WIDTH, gen)
    prefill = object()
    meta = dataclasses.replace(step.meta, num_prefills=1, num_prefill_tokens=3, prefill=prefill,
                               slot_mapping=torch.cat([step.meta.slot_mapping, torch.tensor([5, 6, 7])]))
    mixed = vh.Step(meta, torch.cat([step.q, step.q[:1].repeat(3, 1, 1)]),
                    torch.cat([step.weights, step.weights[:1].repeat(3, 1)]), step.seq_lens, step.block_table)
    got = vh.run_layer(cfg, layers, layer, mixed)
    assert len(seen) == 1 and seen[0].num_decodes == 0 and seen[0].decode is None
    assert seen[0].prefill is prefill and seen[0].num_decode_tokens == 2 and seen[0].num_prefill_tokens == 3
    assert bool((got[2:5, :topk] == 4242).all()), "SPIN touched the prefill rows"
    want = vh.reference(cfg, layer, step, buffer)
    vh.assert_same_topk(got[:2], want[:2], vh.dense_logits(layer, step), topk)
