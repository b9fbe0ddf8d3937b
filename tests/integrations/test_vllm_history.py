"""Histories stay right across what vLLM does between steps: MTP with accepted counts inferred from seq_lens
(row-local), chunked prefill before an MTP decode, a block filled by a KV connector (no slot_mapping write),
and DeepSeek-V4's padded indexer pages (read in place with their page stride, the padding never read)."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="vllm not installed: these tests run in their own CI step (.ci/vllm_step.sh)")

import torch  # noqa: E402

import vllm_harness as vh  # noqa: E402

pytestmark = pytest.mark.vllm
MAX_MODEL_LEN = 4096
WIDTH = MAX_MODEL_LEN // vh.T


def _model(gen, num_blocks, spin, next_n=1, layers=1, max_num_seqs=4, stride_blocks=1):
    cfg = vh.vllm_config(spin, max_num_seqs=max_num_seqs)
    if next_n > 1:
        cfg.speculative_config = type("Spec", (), {"num_speculative_tokens": next_n - 1})()
    kvs = [vh.make_cache(num_blocks, gen, stride_blocks) for _ in range(layers)]
    lyrs, buffer = vh.build_layers(cfg, kvs, 512, MAX_MODEL_LEN)
    return cfg, lyrs, buffer


def _slots(blocks, lo, hi):
    return [blocks[p // vh.T] * vh.T + p % vh.T for p in range(lo, hi)]


def test_row_local_mtp_accepted_counts_from_seq_lens(gen):
    """next_n = 3, row-local: each step's num_accepted is the previous step's accepted drafts, L_now - L_prev -
    1, computed on the device; rows 0..num_accepted update the history; at s = 0 the top-k equals vLLM's."""
    next_n = 3
    cfg, layers, buffer = _model(gen, 120, {"enable": True, "sparsity": 0.0, "mtp": "row-local"}, next_n=next_n)
    layer = layers[0]
    runtime = layer.spin_runtime
    assert runtime.indexer is None or runtime.indexer.config.mtp.value == "row-local"
    blocks = [list(range(0, 50)), list(range(50, 100))]
    lens = [2000, 1200]
    accepted_seq = [(0, 0), (2, 0), (1, 2), (0, 1)]  # drafts accepted in the previous step, per request
    for s, acc in enumerate(accepted_seq):
        if s:
            lens = [L + 1 + a for L, a in zip(lens, acc)]
        step = vh.make_step(lens, blocks, next_n, WIDTH, gen)
        got = vh.run_layer(cfg, layers, layer, step)
        assert runtime.planned_for(step.meta)
        want = vh.reference(cfg, layer, step, buffer)
        rows = 2 * next_n
        vh.assert_same_topk(got[:rows], want[:rows], vh.dense_logits(layer, step), 512)
        expect = [0, 0] if s == 0 else list(acc)
        assert runtime.last_accepted.tolist() == expect, f"step {s}"
        assert runtime.last_fresh.tolist() == [s == 0, s == 0]
        upd = runtime.indexer.workspace.update_rows[:2]
        assert upd.tolist() == [[j <= a for j in range(next_n)] for a in expect]


def test_chunked_prefill_then_mtp_decode_starts_fresh(gen):
    """E's prompt is prefilled in two chunks, in steps where A decodes (next_n = 2); E's first decode gets a
    fresh slot (every block kept at s = 0.5), with 0 accepted drafts; A keeps its slot and its history."""
    cfg, layers, _ = _model(gen, 140, {"enable": True, "sparsity": 0.5, "policy": "explore-none"}, next_n=2)
    runtime = layers[0].spin_runtime
    a_blocks, e_blocks = list(range(0, 60)), list(range(60, 120))
    la, le = 3000, 2500
    step = vh.make_step([la], [a_blocks], 2, WIDTH, gen)
    vh.run_layer(cfg, layers, layers[0], step)
    slot_a = int(runtime.last_slots[0])
    for lo, hi in ((0, 1200), (1200, le - 2)):  # two prefill chunks ride with A's decodes
        la += 2
        step = vh.make_step([la], [a_blocks], 2, WIDTH, gen, extra_written=_slots(e_blocks, lo, hi))
        vh.run_layer(cfg, layers, layers[0], step)
        assert runtime.planned_for(step.meta) and runtime.last_slots.tolist() == [slot_a]
    la += 1
    step = vh.make_step([le, la], [e_blocks, a_blocks], 2, WIDTH, gen)
    vh.run_layer(cfg, layers, layers[0], step)
    plan = runtime.indexer.block_plan
    assert runtime.last_fresh.tolist() == [True, False]
    assert runtime.last_slots.tolist()[1] == slot_a
    assert runtime.last_accepted.tolist() == [0, 0]
    assert int(plan.num_kept[0]) == int(plan.num_blocks[0]), "E started with a history"
    assert int(plan.num_kept[1]) < int(plan.num_blocks[1]), "A lost its history"


def test_kv_connector_filled_blocks_do_not_inherit(gen):
    """A decodes and finishes; a KV connector (P/D disaggregation, offloading) loads request E into A's freed
    blocks: no slot_mapping write, so the block ownership still names A's slot. E's length does not continue
    A's, so E starts fresh: every block kept at its first decode although s = 0.5."""
    cfg, layers, _ = _model(gen, 120, {"enable": True, "sparsity": 0.5, "policy": "explore-none"})
    runtime = layers[0].spin_runtime
    a_blocks, b_blocks = list(range(0, 50)), list(range(50, 100))
    la, lb = 3000, 2000
    for _ in range(3):
        la, lb = la + 1, lb + 1
        vh.run_layer(cfg, layers, layers[0], vh.make_step([la, lb], [a_blocks, b_blocks], 1, WIDTH, gen))
    slot_a = int(runtime.last_slots[0])
    # A is gone; E (prompt la - 3 tokens, loaded by the connector into A's blocks) decodes beside B
    le, lb = la - 2, lb + 1
    step = vh.make_step([lb, le], [b_blocks, a_blocks], 1, WIDTH, gen)
    vh.run_layer(cfg, layers, layers[0], step)
    plan = runtime.indexer.block_plan
    assert runtime.last_fresh.tolist() == [False, True]
    assert int(runtime.last_slots[1]) != slot_a or bool(runtime.last_fresh[1])
    assert int(plan.num_kept[1]) == int(plan.num_blocks[1]), "E inherited A's history"
    assert int(plan.num_kept[0]) < int(plan.num_blocks[0]), "B lost its history"


def _v4_page_sizes():
    """{cache dtype: indexer page bytes} from vLLM's own DeepseekV4IndexerCache.get_kv_cache_spec."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache

    cfg = vh.vllm_config({"enable": True})
    pages = {}
    for dtype in ("fp8_ds_mla", "auto"):
        cfg.cache_config.cache_dtype = dtype
        cfg.cache_config.block_size = 4 * vh.T  # 256 raw tokens = 64 compressed entries a page (C4A)
        with set_current_vllm_config(cfg):
            cache = DeepseekV4IndexerCache(head_dim=vh.ROW, dtype=torch.uint8, prefix=f"v4.{dtype}.k_cache",
                                           cache_config=cfg.cache_config, compress_ratio=4)
            pages[dtype] = cache.get_kv_cache_spec(cfg).page_size_bytes
    return pages


def _padded_like(dense: torch.Tensor, page: int) -> torch.Tensor:
    """dense's pages `page` bytes apart, as vLLM binds V4's indexer cache (uint8 [num_blocks, T, D + 4]); the
    padding holds 0xFF (NaN as an fp8 key and as an fp32 scale), so reading it shows."""
    num_blocks = dense.shape[0]
    store = torch.full((num_blocks * page,), 0xFF, dtype=torch.uint8)
    kv = torch.as_strided(store, (num_blocks, vh.T, vh.ROW), (page, vh.ROW, 1))
    kv.copy_(dense)
    return kv


def test_v4_padded_indexer_page_engages_spin(caplog, gen):
    """DeepSeek-V4's indexer page is padded to a 576- or 512-byte multiple (vLLM's own spec says how much:
    8640 / 8704 B for 64 x 132 = 8448). SPIN reads it in place: at s = 0 every step's top-k equals vLLM's
    own, at s = 0.5 it equals SPIN's on the same cache unpadded; the padding (poisoned) is never read, and
    the log says once that the padded pages are read with their stride."""
    from spin_indexer.integrations.vllm_runtime import cache_view_or_reason

    pages = _v4_page_sizes()
    assert pages == {"fp8_ds_mla": 8640, "auto": 8704}, pages
    num_blocks, tables = 30, [list(range(0, 24)), list(range(24, 30))]
    for page in pages.values():
        dense = vh.make_cache(num_blocks, gen)
        kv = _padded_like(dense, page)
        view, why = cache_view_or_reason(kv)
        assert why == "" and view[1] == 1 and view[0].stride(0) == page, why
        steps = [vh.make_step([1500 + s, 900 + s], tables, 1, WIDTH, gen) for s in range(3)]
        cfg = vh.vllm_config({"enable": True, "sparsity": 0.0})
        layers, buffer = vh.build_layers(cfg, [kv], 512, MAX_MODEL_LEN)
        with caplog.at_level(logging.INFO, logger="spin_indexer.vllm"):
            caplog.clear()
            for step in steps:
                got = vh.run_layer(cfg, layers, layers[0], step)
                assert layers[0].spin_runtime.planned_for(step.meta)
                want = vh.reference(cfg, layers[0], step, buffer)
                vh.assert_same_topk(got[:2], want[:2], vh.dense_logits(layers[0], step), 512)
        said = [r.getMessage() for r in caplog.records]
        assert len([m for m in said if "padded" in m and str(page) in m]) == 1, said
        assert any("SPIN active" in m for m in said) and not any("went to vLLM" in m for m in said), said
        outs = []  # s = 0.5: the padded cache and its unpadded copy give the same top-k, step by step
        for cache in (kv, dense):
            cfg = vh.vllm_config({"enable": True, "sparsity": 0.5})
            layers, _ = vh.build_layers(cfg, [cache], 512, MAX_MODEL_LEN)
            outs.append([vh.run_layer(cfg, layers, layers[0], step)[:2] for step in steps])
            assert layers[0].spin_runtime.planned_for(steps[-1].meta)
        assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_shadow_mode_dense_decides_and_spin_is_measured(sparsity, gen):
    """Shadow mode: the top-k buffer is exactly vLLM's on every step (dense decides), while SPIN plans, scores
    and updates beside it; the per-layer miss and realized sparsity equal an independent recount from the
    dense top-k and SPIN's kept blocks."""
    from spin_indexer.integrations.shadow import BINS

    cfg, layers, buffer = _model(gen, 140, {"enable": True, "sparsity": sparsity, "shadow": True,
                                            "policy": "explore-none"}, layers=2)
    runtime = layers[0].spin_runtime
    tables = [list(range(0, 60)), list(range(60, 100)), list(range(100, 110))]
    lens = [3500, 2400, 500]  # the last is never eligible (length <= top-k)
    want_rows, want_miss, want_total, want_skipped, misses = [0, 0], [0.0, 0.0], [0, 0], [0, 0], [[], []]
    for s in range(4):
        lens = [L + 1 for L in lens]
        step = vh.make_step(lens, tables, 1, WIDTH, gen)
        for i, layer in enumerate(layers):
            got = vh.run_layer(cfg, layers, layer, step)
            assert runtime.planned_for(step.meta)
            assert torch.equal(got, vh.reference(cfg, layer, step, buffer)), "shadow mode changed the top-k"
            plan = runtime.indexer.block_plan
            keep = plan.token_mask()
            want_total[i] += int(plan.num_blocks.sum())
            want_skipped[i] += int((plan.num_blocks - plan.num_kept).sum())
            for r, L in enumerate(lens):
                pos = got[r, :512]
                pos = pos[pos >= 0].long()
                if L > 512:
                    m = float((~keep[r, pos]).sum()) / pos.numel()
                    want_rows[i] += 1
                    want_miss[i] += m
                    misses[i].append(m)
    snap = runtime.shadow.snapshot()
    for i in range(2):
        assert snap[i]["rows"] == want_rows[i]
        assert snap[i]["miss_mean"] == pytest.approx(want_miss[i] / want_rows[i], abs=1e-9)
        assert snap[i]["realized_sparsity"] == pytest.approx(want_skipped[i] / want_total[i])
        ranked = sorted(misses[i])
        assert snap[i]["miss_p99"] == pytest.approx(int(ranked[-(-99 * len(ranked) // 100) - 1] * BINS) / BINS)
        if sparsity == 0.0:
            assert snap[i]["miss_mean"] == 0 and snap[i]["realized_sparsity"] == 0
    if sparsity > 0:
        assert any(s["realized_sparsity"] > 0 for s in snap), "SPIN never skipped a block in shadow mode"
