"""The per-step speed guard (SpinConfig.dense_batch_below): when a step's cached tokens (sum over requests
of the longest row) are below the threshold, every request is guarded (every block kept, no history, keep_all
requests included), on the device; at or above it, nothing changes. The fused plan kernel agrees with the torch path bit for bit."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from spin_indexer.indexer import SpinIndexer
from spin_indexer.predictor import SpinConfig
from test_plan_triton import BASE, T, _run

LENS = (37 * T + 5, 20 * T, 100, 0)  # a step of 3473 cached tokens (keep_all and padding requests included)


def _guarded(cfg, lens):
    width = max(-(-x // T) for x in lens) + 1
    idx = SpinIndexer(cfg, num_layers=2, max_batch=len(lens), max_blocks=width,
                      num_cache_blocks=len(lens) * width)
    slots = torch.tensor([idx.state.allocate() for _ in lens])
    table = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width)
    idx.plan(table, torch.tensor(lens, dtype=torch.int32)[:, None], slots)
    return idx.plans(0).guarded.tolist(), idx.workspace.update_rows[:len(lens), 0].tolist()


def test_small_step_guards_every_request_and_a_large_one_none():
    total = sum(LENS)
    below = SpinConfig(vertical_grain="slot", sparsity=0.5, topk=128, dense_batch_below=total + 1)
    guarded, updates = _guarded(below, LENS)
    assert guarded == [True, True, True, True]  # keep_all (<= K) and padding requests too: a small step
    assert updates == [False, False, False, False]  # keeps no history at all
    at = dataclasses.replace(below, dense_batch_below=total)
    guarded, updates = _guarded(at, LENS)
    assert guarded == [False, False, False, False] and updates[:3] == [True, True, True]
    assert dataclasses.replace(below, dense_batch_below="auto").guard_batch_tokens > 0


def test_auto_guards_a_one_row_step_at_low_sparsity():
    """"auto" raises the per-step threshold for one query row at low sparsity (where the H200 grid measured SPIN
    below the dense step): below 256K tokens at s <= 0.2, below 128K at s <= 0.3; not at 0.4, not for two rows,
    not for a set threshold."""
    from spin_indexer.predictor.config import AUTO_DENSE_BATCH_TOKENS
    lens = (70000,)  # above AUTO_DENSE_BATCH_TOKENS, below the one-row threshold
    low = SpinConfig(vertical_grain="slot", sparsity=0.2, topk=128, dense_batch_below="auto")
    assert AUTO_DENSE_BATCH_TOKENS < lens[0] < low.guard_batch_tokens_for(1) == 1 << 18
    assert dataclasses.replace(low, sparsity=0.1).guard_batch_tokens_for(1) == 1 << 18
    assert dataclasses.replace(low, sparsity=0.3).guard_batch_tokens_for(1) == 1 << 17
    assert dataclasses.replace(low, sparsity=0.4).guard_batch_tokens_for(1) == AUTO_DENSE_BATCH_TOKENS
    assert low.guard_batch_tokens_for(2) == AUTO_DENSE_BATCH_TOKENS
    assert _guarded(low, (300000,))[0] == [False]  # 256K and above: SPIN wins at s = 0.2 (runs 68-69)
    assert dataclasses.replace(low, dense_batch_below=1000).guard_batch_tokens_for(1) == 1000
    assert _guarded(low, lens)[0] == [True]
    assert _guarded(dataclasses.replace(low, sparsity=0.3), lens)[0] == [True]
    assert _guarded(dataclasses.replace(low, sparsity=0.3), (140000,))[0] == [False]  # 128K and above: SPIN's
    assert _guarded(dataclasses.replace(low, sparsity=0.4), lens)[0] == [False]
    assert _guarded(low, lens + lens)[0] == [False, False]


@pytest.mark.interpreter
@pytest.mark.parametrize("sparsity", [0.2, 0.3, 0.4])
def test_fused_plan_matches_torch_with_the_one_row_guard(sparsity, gen, triton_device):
    """The kernel takes the same per-step threshold as the torch path for a one-row step (guarded at 0.2 and
    0.3, not at 0.4)."""
    cfg = dataclasses.replace(BASE, sparsity=sparsity, dense_below=0, dense_batch_below="auto")
    _run(cfg, (70000,), 1, gen, triton_device, steps=1, layers=1)


@pytest.mark.parametrize("threshold", [0, sum(LENS), sum(LENS) + 1, 10**9])
def test_fused_plan_matches_torch_with_the_step_guard(threshold, gen, triton_device):
    cfg = dataclasses.replace(BASE, dense_below=0, dense_batch_below=threshold)
    _run(cfg, LENS, 1, gen, triton_device, steps=2)


@pytest.mark.parametrize("next_n", [1, 2])
def test_a_guarded_step_equals_the_dense_step_and_keeps_no_history(next_n, gen):
    """Guarded by the lengths (the SPIN path over every block) and guarded by the table's shape alone (the
    dense kernels, SpinIndexer._run_dense): both return the dense step's top-k and write no history."""
    from conftest import make_paged_inputs
    from spin_indexer.indexer import DenseIndexer

    k = 64
    x = make_paged_inputs((5 * T + 3, 9 * T, 40), next_n, 8, 32, gen)
    batch, width = x.block_table.shape
    dense = DenseIndexer(k, next_n)
    dense.plan(x.block_table, x.seq_lens)
    want = [dense.run(layer, x.q_fp8, x.kv_cache, x.weights).clone() for layer in range(2)]
    for threshold in (int(x.seq_lens.amax(dim=1).sum()) + 1, batch * width * T + 1):
        cfg = SpinConfig(vertical_grain="slot", sparsity=0.5, topk=k, dense_batch_below=threshold)
        idx = SpinIndexer(cfg, num_layers=2, max_batch=batch, max_blocks=width, next_n=next_n,
                          num_cache_blocks=x.kv_cache.shape[0])
        assert idx._guarded_by_shape(batch, width) == (threshold > batch * width * T)
        slots = torch.tensor([idx.state.allocate() for _ in range(batch)])
        before = idx.state.vertical.clone(), idx.state.diagonal.clone()
        for step in range(2):
            idx.plan(x.block_table, x.seq_lens, slots)
            for layer in range(2):
                got = idx.run(layer, x.q_fp8, x.kv_cache, x.weights)
                assert torch.equal(got, want[layer]), (threshold, step, layer)
                assert idx.block_plan.guarded[:2].all()
        # (the trash block P and the trash offset are scratch: kernels may write there)
        assert torch.equal(idx.state.vertical[:, :-1], before[0][:, :-1])
        assert torch.equal(idx.state.diagonal[..., :-1], before[1][..., :-1])


def test_a_shape_guarded_plan_selects_nothing_and_leaves_the_state():
    """One query row at sparsity 0.3 under "auto", on a table of fewer than 256K tokens: the
    table's shape guards the step, so plan() runs none of its kernels: every block kept (the table itself as
    the compact table), the counters (step, seen_len, clock) and the history untouched."""
    cfg = SpinConfig(vertical_grain="slot", sparsity=0.3, topk=64, dense_batch_below="auto")
    width = 40
    idx = SpinIndexer(cfg, num_layers=2, max_batch=2, max_blocks=width, num_cache_blocks=2 * width)
    assert idx._guarded_by_shape(1, width)
    slot = idx.state.allocate()
    table = torch.arange(width, dtype=torch.int32)[None]
    idx.state.vertical.normal_()
    idx.state.block_max.normal_()
    before = {k: getattr(idx.state, k).clone() for k in ("step", "seen_len", "clock", "vertical", "diagonal",
                                                          "block_max")}
    for length in (10 * T + 3, 11 * T):
        idx.plan(table, torch.tensor([[length]], dtype=torch.int32), torch.tensor([slot]))
        plan = idx.plans(1)
        blocks = -(-length // T)
        assert plan.num_kept.tolist() == plan.num_blocks.tolist() == [blocks]
        assert plan.guarded.tolist() == [True] and plan.sparsity().tolist() == [0.0]
        assert torch.equal(plan.compact_block_table, table) and plan.compact_seq_lens.tolist() == [[length]]
        assert plan.keep_mask[0, :blocks].all() and not plan.keep_mask[0, blocks:].any()
    for k, v in before.items():
        assert torch.equal(getattr(idx.state, k), v), k
