"""The summary mix (beyond the paper, issue #18): standardized scores, the mix, and SpinIndexer selecting a
layer at run() time by this step's query against each block's sub-block mean keys (ops.block_summary_scores)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import T, make_paged_inputs
from spin_indexer import ops
from spin_indexer.eval.quality import parse_config
from spin_indexer.indexer import SpinIndexer
from spin_indexer.ops.indexer_logits import paged_indexer_logits_ref
from spin_indexer.predictor import SpinConfig
from spin_indexer.predictor.summary import standardized, summary_scores


def test_standardized_rows():
    inf = float("inf")
    x = torch.tensor([[1.0, 2.0, 3.0, 9.0, -inf], [5.0, 5.0, 5.0, 5.0, 5.0], [-inf, -inf, 1.0, 2.0, 3.0]])
    valid = torch.tensor([[True, True, True, False, True], [True] * 5, [False, True, True, True, True]])
    z = standardized(x, valid)
    s = math.sqrt(2 / 3)
    # row 0: 1, 2, 3 standardized; the invalid 9 and the never-seen -inf at the row's lowest z
    assert z[0].tolist() == pytest.approx([-1 / s, 0.0, 1 / s, -1 / s, -1 / s])
    assert z[1].tolist() == [0.0] * 5  # all equal: 0, no division by zero
    assert z[2].tolist() == pytest.approx([-1 / s, -1 / s, -1 / s, 0.0, 1 / s])
    assert standardized(torch.full((1, 3), -inf), torch.ones(1, 3, dtype=torch.bool)).tolist() == [[0.0] * 3]


def test_the_mix_follows_its_weight():
    valid = torch.tensor([[True, True, True, True, False]])
    history = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0]]])
    summary = torch.tensor([[1.0, 2.0, 3.0, 40.0, 0.0]])
    by_history = summary_scores(history, summary, valid, 0.0)[0, 0, :4]
    by_summary = summary_scores(history, summary, valid, 1.0)[0, 0, :4]
    assert by_history.argsort(descending=True).tolist() == [0, 1, 2, 3]
    assert by_summary.argsort(descending=True).tolist() == [3, 2, 1, 0]
    assert torch.isneginf(summary_scores(history, summary, valid, 0.5)[0, 0, 4])


def _step(idx, x, slots, layers=1):
    idx.plan(x.block_table, x.seq_lens, slots)
    return [idx.run(layer, x.q_fp8, x.kv_cache, x.weights) for layer in range(layers)]


def cached_scores(x, parts: int) -> torch.Tensor:
    """float32 [B, W]: what run() scores the blocks with: every full block (of row 0) summarized into a fresh
    summary cache, then scored with this step's query."""
    full = (x.seq_lens[:, 0] // T).clamp(max=x.block_table.shape[1]).to(torch.int32)
    summaries = torch.zeros(x.kv_cache.shape[0], parts, 1, x.kv_cache.shape[3], dtype=torch.uint8)
    ops.write_block_summaries(x.kv_cache, summaries, x.block_table, torch.zeros_like(full), full)
    return ops.paged_summary_scores(x.q_fp8, summaries, x.weights, x.block_table, full)


def test_summary_weight_one_keeps_the_best_summarized_blocks(gen):
    """After a step that scored every block, summary = 1 keeps, besides the forced blocks (the newest),
    exactly the blocks whose summary scores are highest: every kept unforced block outscores every skipped one."""
    x = make_paged_inputs((24 * T,), 1, 4, 32, gen, extra_width=0)
    cfg = SpinConfig(sparsity=0.5, topk=64, exploration="none", gamma=0.0, summary=1.0, summary_parts=4)
    idx = SpinIndexer(cfg, num_layers=1, max_batch=1, max_blocks=24, num_cache_blocks=x.kv_cache.shape[0],
                      head_dim=32)
    slots = torch.tensor([idx.state.allocate()], dtype=torch.int32)
    _step(idx, x, slots)  # no history yet: every block is kept (and so observed)
    _step(idx, x, slots)
    keep = idx.block_plan.keep_mask[0, :24]
    assert 0 < int(keep.sum()) < 24
    score = cached_scores(x, 4)[0]
    newest = torch.arange(24) == 23  # forced: the request's last block
    kept, skipped = score[keep & ~newest], score[~keep]
    assert kept.min() >= skipped.max()


def test_summary_replay_needs_the_recorded_summaries_and_validates(gen):
    cfg = SpinConfig(sparsity=0.5, topk=64, summary=0.5)
    idx = SpinIndexer(cfg, num_layers=1, max_batch=1, max_blocks=8)
    slots = torch.tensor([idx.state.allocate()], dtype=torch.int32)
    lens = torch.tensor([[8 * T]], dtype=torch.int32)
    idx.plan(torch.arange(8, dtype=torch.int32)[None], lens, slots)
    with pytest.raises(ValueError, match="summary: expected the block summary scores"):
        idx.run_from_scores(0, torch.randn(1, 8 * T))
    with pytest.raises(ValueError, match="summary: expected shape"):
        idx.run_from_scores(0, torch.randn(1, 8 * T), torch.randn(1, 7))
    with pytest.raises(TypeError, match="summary"):
        idx.run_from_scores(0, torch.randn(1, 8 * T), torch.randn(1, 8, dtype=torch.float64))
    plain = SpinIndexer(SpinConfig(sparsity=0.5, topk=64), num_layers=1, max_batch=1, max_blocks=8)
    plain.plan(torch.arange(8, dtype=torch.int32)[None], lens,
               torch.tensor([plain.state.allocate()], dtype=torch.int32))
    with pytest.raises(ValueError, match="summary: expected the block summary scores exactly when"):
        plain.run_from_scores(0, torch.randn(1, 8 * T), torch.randn(1, 8))
    with pytest.raises(ValueError, match="SpinConfig.summary"):
        SpinConfig(summary=1.5)
    with pytest.raises(ValueError, match="SpinConfig.summary_parts"):
        SpinConfig(summary_parts=3)
    assert parse_config("spin-0.4-sum0.7").spin_config(512, 0).summary == 0.7
    cfg = parse_config("spin-0.4-sum0.8x16-noexp").spin_config(512, 0)
    assert (cfg.summary, cfg.summary_parts, cfg.gamma, cfg.summary_below) == (0.8, 16, 0.0, 0)
    cfg = parse_config("spin-0.4-sum0.5x4b16k").spin_config(512, 0)
    assert (cfg.summary, cfg.summary_parts, cfg.gamma, cfg.summary_below) == (0.5, 4, 0.05, 16384)
    assert parse_config("spin-0.3-sum0.5b32k-noexp").spin_config(512, 0).summary_below == 32768
    cfg = parse_config("spin-0.4-sum0.8x16b6k-quiet-profile").spin_config(512, 0)  # spin-layers-mix's form
    assert (cfg.summary, cfg.summary_below, cfg.gamma, cfg.summary_explores) == (0.8, 6144, 0.05, False)
    assert parse_config("spin-0.4-sum0.8x16b6k").spin_config(512, 0).summary_explores
    with pytest.raises(ValueError, match="expected one of"):  # -quiet qualifies the mix: not without it
        parse_config("spin-0.4-quiet")
    with pytest.raises(ValueError, match="summary sub-blocks: expected a divisor"):
        parse_config("spin-0.4-sum0.8x3")
    with pytest.raises(ValueError, match="sum<w>"):  # the form is refused: weights above 1 do not parse
        parse_config("spin-0.4-sum1.5")


def test_a_refused_replay_leaves_the_layer_to_run(gen):
    """run_from_scores under the summary mix without summaries is refused without consuming the layer: run()
    then selects it."""
    x = make_paged_inputs((8 * T,), 1, 4, 32, gen, extra_width=0)
    idx = SpinIndexer(SpinConfig(sparsity=0.5, topk=64, summary=0.5), num_layers=1, max_batch=1, max_blocks=8,
                      num_cache_blocks=x.kv_cache.shape[0], head_dim=32)
    slots = torch.tensor([idx.state.allocate()], dtype=torch.int32)
    idx.plan(x.block_table, x.seq_lens, slots)
    vertical = idx.state.vertical.clone()
    with pytest.raises(ValueError, match="summary"):
        idx.run_from_scores(0, torch.randn(1, 8 * T))
    assert torch.equal(idx.state.vertical, vertical)
    assert idx.run(0, x.q_fp8, x.kv_cache, x.weights).shape == (1, 64)


@pytest.mark.parametrize("next_n", [1, 3])
def test_replay_with_recorded_summaries_equals_live_run(gen, next_n):
    """run_from_scores given the logits and the block summary scores run() computes (from its summary cache) makes
    the same plans and the same top-k as run() over several steps (two requests, a partial last block): replay
    and the live step share the mix."""
    lens = (20 * T + 5, 13 * T)
    x = make_paged_inputs(lens, next_n, 4, 32, gen, extra_width=1)
    cfg = SpinConfig(sparsity=0.4, topk=64, exploration="none", gamma=0.0, summary=0.6, summary_parts=8)
    live, replayed = (SpinIndexer(cfg, num_layers=2, max_batch=2, max_blocks=x.block_table.shape[1], next_n=next_n,
                                  num_cache_blocks=x.kv_cache.shape[0], topk_sorted=True, head_dim=32)
                      for _ in range(2))
    slots = [torch.tensor([i.state.allocate() for _ in lens], dtype=torch.int32) for i in (live, replayed)]
    for step in range(3):
        weights = x.weights * (1.0 + 0.3 * step)  # the query weights change a little between steps
        scores = paged_indexer_logits_ref(x.q_fp8, x.kv_cache, weights, x.seq_lens, x.block_table)
        summary = cached_scores(dataclasses.replace(x, weights=weights), 8)
        live.plan(x.block_table, x.seq_lens, slots[0])
        replayed.plan(x.block_table, x.seq_lens, slots[1])
        for layer in range(2):
            a = live.run(layer, x.q_fp8, x.kv_cache, weights)
            keep_a = live.block_plan.keep_mask.clone()
            b = replayed.run_from_scores(layer, scores, summary)
            assert torch.equal(keep_a, replayed.block_plan.keep_mask)
            if step:
                assert not bool(keep_a[:, :13].all())  # the mix skipped something: the test compares choices
            assert torch.equal(a.sort(dim=1).values, b.sort(dim=1).values)


def test_summary_state_sizes_resets_and_checks_the_cache(gen):
    """SpinState holds the summary cache only with summary > 0 (S x (D + 4) / T bytes a token a layer more), a
    reallocated slot rewrites its blocks (its counter back at 0), and run() refuses a key cache of another D."""
    x = make_paged_inputs((5 * T,), 1, 4, 32, gen, extra_width=0)
    plain = SpinIndexer(SpinConfig(sparsity=0.5, topk=64, vertical_grain="slot"), num_layers=2, max_batch=1,
                        max_blocks=5)
    idx = SpinIndexer(SpinConfig(sparsity=0.5, topk=64, summary=0.5, summary_parts=8), num_layers=2, max_batch=1,
                      max_blocks=5, num_cache_blocks=x.kv_cache.shape[0] + 4, head_dim=32)
    assert plain.state.summaries is None
    assert idx.state.summaries.shape == (2, x.kv_cache.shape[0] + 4, 8, 1, 36)
    assert idx.state.bytes_per_token() == pytest.approx(plain.state.bytes_per_token() + 8 * 36 / T)
    slot = idx.state.allocate()
    slots = torch.tensor([slot], dtype=torch.int32)
    _step(idx, x, slots, layers=2)
    assert idx.state.summarized[:, slot].tolist() == [5, 5]
    written = idx.state.summaries.clone()
    idx.state.free(slot)
    assert idx.state.allocate() == slot and idx.state.summarized[:, slot].tolist() == [0, 0]
    assert torch.equal(idx.state.summaries, written)  # rows are rewritten when needed, never cleared
    wide = make_paged_inputs((5 * T,), 1, 4, 64, gen, extra_width=0)
    idx.plan(wide.block_table, wide.seq_lens, slots)
    with pytest.raises(ValueError, match="kv_cache: expected D \\+ 4 = 36"):
        idx.run(0, wide.q_fp8, wide.kv_cache, wide.weights)


@pytest.mark.interpreter
@pytest.mark.parametrize("next_n,mtp,below", [(1, "row0", 0), (2, "row-local", 0), (1, "row0", 14 * T)])
def test_fused_step_equals_the_torch_path(gen, next_n, mtp, below, monkeypatch, triton_device):
    """SpinIndexer with the fused planner (plan_triton: plan() resets and advances, run(layer) selects with the
    summary mix in one launch, the summary cache written and scored by ops) returns the top-k of the torch path
    (Extensions.select) and leaves the same history, summary cache and counters, over three steps of two layers
    with random exploration (its hash reads the step from the fused plan's stash); with summary_below, the long
    request selects in plan() and the two short ones in run(). Off CUDA the planner is forced here (the
    interpreter); every other op runs its reference on both sides."""
    if triton_device == "cuda":  # CPU tensors take no Triton launch there; the device's own comparison of the
        pytest.skip("fused step against the CPU is tests/indexer/test_spin_cuda.py (summary-mix cases)")
    from spin_indexer.indexer import spin as spin_module
    from spin_indexer.predictor import plan_triton
    lens = (20 * T + 5, 13 * T, 3 * T + 1)
    x = make_paged_inputs(lens, next_n, 4, 32, gen, extra_width=1)
    cfg = SpinConfig(sparsity=0.4, topk=64, gamma=0.2, summary=0.6, summary_parts=8, mtp=mtp, summary_below=below)
    # max_blocks past the table's width: the workspace's [:B, :W] slices are not contiguous
    pair = [SpinIndexer(cfg, num_layers=2, max_batch=4, max_blocks=x.block_table.shape[1] + 3, next_n=next_n,
                        num_cache_blocks=x.kv_cache.shape[0], topk_sorted=True, head_dim=32) for _ in range(2)]
    slots = [torch.tensor([i.state.allocate() for _ in lens], dtype=torch.int32) for i in pair]
    real = spin_module.triton_twin

    def fused_planner(module, name, t):
        return getattr(plan_triton, name) if name == "plan_step_triton" else real(module, name, t)

    for step in range(3):
        weights = x.weights * (1.0 + 0.3 * step)
        outs = []
        for idx, s, fused in zip(pair, slots, (False, True)):
            with monkeypatch.context() as m:
                if fused:
                    m.setattr(spin_module, "triton_twin", fused_planner)
                idx.plan(x.block_table, x.seq_lens, s)
                assert (idx._step.meta is None) == fused  # the fused path ran (no torch step metadata)
                outs.append([(idx.run(layer, x.q_fp8, x.kv_cache, weights), idx.block_plan.keep_mask.clone())
                             for layer in range(2)])
        for (a, keep_a), (b, keep_b) in zip(*outs):
            assert torch.equal(keep_a, keep_b)
            assert torch.equal(a, b)
        if step:
            assert not bool(outs[0][0][1][:, :13].all())  # the mix skipped blocks: the test compares choices
    for name in ("vertical", "block_max", "diagonal", "step", "seen_len", "clock", "summaries", "summarized"):
        assert torch.equal(getattr(pair[0].state, name), getattr(pair[1].state, name)), name


def test_requests_past_summary_below_select_from_the_history_alone(gen):
    """SpinConfig.summary_below: a request whose longest row holds at least that many tokens selects as the paper's
    predictor does (the same plans and top-k as summary = 0, step after step) and neither writes nor scores the
    summary cache (its extent stays 0); a shorter request in the same batch takes the mix (as with
    summary_below = 0)."""
    lens = (20 * T + 5, 9 * T + 3)
    x = make_paged_inputs(lens, 1, 4, 32, gen, extra_width=1)
    base = SpinConfig(sparsity=0.5, topk=64, exploration="none", gamma=0.0, summary_parts=8, vertical_grain="slot")
    cfgs = [dataclasses.replace(base, summary=1.0, summary_below=10 * T), base, dataclasses.replace(base, summary=1.0)]
    idx = [SpinIndexer(c, num_layers=2, max_batch=2, max_blocks=x.block_table.shape[1], topk_sorted=True,
                       num_cache_blocks=x.kv_cache.shape[0], head_dim=32) for c in cfgs]
    slots = [torch.tensor([i.state.allocate() for _ in lens], dtype=torch.int32) for i in idx]
    mixed_something = False
    for step in range(3):
        weights = torch.randn(x.weights.shape, generator=gen)  # the query moves: history and mix disagree
        for i, s in zip(idx, slots):
            i.plan(x.block_table, x.seq_lens, s)
        for layer in range(2):
            below, paper, mix = (i.run(layer, x.q_fp8, x.kv_cache, weights) for i in idx)
            assert torch.equal(below[0], paper[0])  # the long request: the history alone
            assert torch.equal(below[1], mix[1])  # the short one: the mix
            keeps = [i.block_plan.keep_mask for i in idx]
            mixed_something |= not torch.equal(keeps[2][1], keeps[1][1])
    assert mixed_something  # the mix chose differently from the history for the short request: a real check
    assert idx[0].state.summarized[:, int(slots[0][0])].tolist() == [0, 0]
    assert idx[0].state.summarized[:, int(slots[0][1])].tolist() == [9, 9]


def test_requests_that_mix_explore_only_when_told(gen):
    """SpinConfig.summary_explores=False: a request that takes the mix plans as with no exploration at all, while a
    request past summary_below (the history alone) still gives gamma of its budget to random skipped blocks, as
    with summary_explores=True. Both differences must show (each configuration really explores)."""
    lens = (20 * T + 5, 9 * T + 3)
    x = make_paged_inputs(lens, 1, 4, 32, gen, extra_width=1)
    base = SpinConfig(sparsity=0.5, topk=64, gamma=0.25, summary=0.7, summary_parts=8, summary_below=10 * T,
                      vertical_grain="slot")
    cfgs = [dataclasses.replace(base, summary_explores=False), base,
            dataclasses.replace(base, exploration="none", gamma=0.0)]
    idx = [SpinIndexer(c, num_layers=2, max_batch=2, max_blocks=x.block_table.shape[1], topk_sorted=True,
                       num_cache_blocks=x.kv_cache.shape[0], head_dim=32) for c in cfgs]
    slots = [torch.tensor([i.state.allocate() for _ in lens], dtype=torch.int32) for i in idx]
    long_explored = short_explored = False
    for step in range(4):
        weights = torch.randn(x.weights.shape, generator=gen)
        for i, s in zip(idx, slots):
            i.plan(x.block_table, x.seq_lens, s)
        for layer in range(2):
            told, explores, none = (i.run(layer, x.q_fp8, x.kv_cache, weights) for i in idx)
            keeps = [i.block_plan.keep_mask for i in idx]
            assert torch.equal(keeps[0][0], keeps[1][0]) and torch.equal(told[0], explores[0])  # long: explores
            assert torch.equal(keeps[0][1], keeps[2][1]) and torch.equal(told[1], none[1])  # short: does not
            long_explored |= not torch.equal(keeps[1][0], keeps[2][0])
            short_explored |= not torch.equal(keeps[1][1], keeps[2][1])
    assert long_explored and short_explored
