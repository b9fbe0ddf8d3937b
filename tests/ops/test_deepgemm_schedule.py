"""DeepGEMM's SM schedule for every layer at once (ops/deepgemm_schedule.py): the torch reference against a
scalar transcription of the rule, the Triton twin against the reference, and on the H200 the table against
DeepGEMM's own `get_paged_mqa_logits_metadata`, bit for bit, and DeepGEMM's logits with it."""
from __future__ import annotations

import pytest
import torch

from conftest import make_paged_inputs
from spin_indexer import ops
from spin_indexer.indexer.spin import SpinIndexer
from spin_indexer.ops import deepgemm
from spin_indexer.ops.deepgemm_schedule import SPLIT_KV, row_atoms, schedule, schedule_ref, schedule_triton
from spin_indexer.predictor.config import SpinConfig


def schedule_loop(lens: list[list[int]], num_sms: int) -> list[list[int]]:
    """One layer's table, one SM at a time with a linear search (the rule in the module docstring)."""
    batch, next_n = len(lens), len(lens[0]) if lens else 1
    atoms = row_atoms(next_n)
    segs = [-(-row[-1] // SPLIT_KV) for row in lens]
    prefix, acc = [], 0
    for n in segs:
        acc += n
        prefix.append(acc)
    total = acc * atoms
    per_sm, extra = divmod(total, num_sms)
    table = []
    for s in range(num_sms):
        start = s * per_sm + max(0, s - (num_sms - extra))
        q = 0
        while q < batch and prefix[q] * atoms <= start:
            q += 1
        before = prefix[q - 1] if q > 0 else 0
        own = (prefix[q] - before) if q < batch else 0
        offset = start - before * atoms
        table.append([q * atoms + (offset // own if own else 0), offset % own if own else 0])
    table.append([batch * atoms, 0])
    return table


def random_lens(gen: torch.Generator, layers: int, batch: int, next_n: int, high: int) -> torch.Tensor:
    """int32 [L, B, next_n] lengths in [0, high), rows of a request ascending by one (as decode rows are)."""
    last = torch.randint(0, high, (layers, batch, 1), generator=gen)
    rows = (last - next_n + 1 + torch.arange(next_n)).clamp(min=0)
    return rows.to(torch.int32)


@pytest.mark.parametrize("batch,next_n,num_sms,high", [
    (1, 1, 132, 5000), (3, 1, 132, 300), (96, 1, 132, 131072), (32, 1, 132, 70000), (64, 2, 132, 9000),
    (5, 2, 7, 2000), (40, 3, 16, 3000), (33, 4, 132, 600), (200, 1, 1, 1000), (2, 1, 132, 1)])
def test_reference_equals_the_scalar_rule(batch, next_n, num_sms, high, gen):
    lens = random_lens(gen, 3, batch, next_n, high)
    got = schedule_ref(lens, num_sms)
    assert got.dtype == torch.int32 and got.shape == (3, num_sms + 1, 2)
    for layer in range(3):
        assert got[layer].tolist() == schedule_loop(lens[layer].tolist(), num_sms), f"layer {layer}"


def test_reference_edge_cases():
    zeros = torch.zeros(2, 32, 1, dtype=torch.int32)  # every request empty, B a multiple of 32
    assert schedule_ref(zeros, 132).tolist() == [schedule_loop(zeros[0].tolist(), 132)] * 2
    empty = torch.zeros(2, 0, 2, dtype=torch.int32)  # no request: every SM points past the end
    assert schedule_ref(empty, 8)[:, :8].abs().sum() == 0 and schedule_ref(empty, 8)[:, 8].tolist() == [[0, 0]] * 2
    exact = torch.full((1, 4, 1), 256 * 33, dtype=torch.int32)  # 132 segments over 132 SMs: one each
    assert schedule_ref(exact, 132)[0, :132].tolist() == [[s // 33, s % 33] for s in range(132)]


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="context_lens"):
        schedule_ref(torch.zeros(4, 1, dtype=torch.int32), 132)
    with pytest.raises((TypeError, ValueError), match="context_lens"):
        schedule(torch.zeros(1, 4, 1, dtype=torch.int64), 132)
    with pytest.raises(ValueError, match="num_sms"):
        schedule(torch.zeros(1, 4, 1, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="out"):
        schedule(torch.zeros(1, 4, 1, dtype=torch.int32), 132, out=torch.zeros(1, 132, 2, dtype=torch.int32))


@pytest.mark.parametrize("batch,next_n,num_sms,high", [
    (1, 1, 132, 5000), (96, 1, 132, 131072), (64, 2, 132, 9000), (70, 1, 7, 4000), (33, 4, 132, 600),
    (0, 1, 132, 10), (32, 1, 132, 1)])
def test_triton_twin_equals_the_reference(batch, next_n, num_sms, high, gen, triton_device):
    wide = random_lens(gen, 4, batch + 3, next_n, high).to(triton_device)
    lens = wide[:, :batch]  # a leading slice of a wider buffer, as the workspace passes it
    out = torch.full((4, num_sms + 1, 2), -7, dtype=torch.int32, device=triton_device)  # poisoned
    got = schedule_triton(lens, num_sms, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.cpu(), schedule_ref(lens.cpu(), num_sms))


def test_spin_indexer_keeps_no_schedule_without_deepgemm():
    idx = SpinIndexer(SpinConfig(sparsity=0.5, topk=64), num_layers=2, max_batch=2, max_blocks=4)
    assert deepgemm.schedule_sms(idx.device) == 0 and idx.workspace.deepgemm_schedule is None


needs_deepgemm = pytest.mark.skipif(not (torch.cuda.is_available() and deepgemm.available()),
                                    reason="needs CUDA and deep_gemm")


@pytest.mark.gpu
@needs_deepgemm
@pytest.mark.parametrize("next_n", [1, 2])
def test_schedule_equals_deepgemm_metadata(next_n, gen):
    dg = deepgemm._module()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, high in [(1, 3000), (7, 300), (32, 70000), (96, 131072), (128, 5000), (3, 1)]:
        lens = random_lens(gen, 2, batch, next_n, high).cuda()
        ours = schedule(lens, sms)
        for layer in range(2):
            want = dg.get_paged_mqa_logits_metadata(lens[layer].contiguous(), 64, sms)
            assert torch.equal(ours[layer], want), (batch, high, layer)


@pytest.mark.gpu
@needs_deepgemm
@pytest.mark.parametrize("next_n", [1, 2])
def test_deepgemm_logits_with_our_schedule(next_n, gen):
    x = make_paged_inputs([3000, 700, 65], next_n, 64, 128, gen).to("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = schedule(x.seq_lens[None].contiguous(), sms)[0]
    want = ops.paged_indexer_logits_ref(x.q_fp8, x.kv_cache, x.weights, x.seq_lens, x.block_table)
    got = deepgemm.paged_indexer_logits_deepgemm(x.q_fp8, x.kv_cache, x.weights, x.seq_lens, x.block_table,
                                                 schedule=table)
    live = torch.isfinite(want)
    assert ((got[live] - want[live]).norm() / want[live].norm()) < 1e-3


@pytest.mark.gpu
@needs_deepgemm
@pytest.mark.parametrize("next_n", [1, 2])
def test_spin_step_with_plan_schedules_equals_deepgemm_own(next_n, gen, monkeypatch):
    """SpinIndexer on DeepGEMM (forced) with plan()'s per-layer schedules gives, step after step, the top-k and
    the history of the same step where DeepGEMM computes each layer's schedule itself."""
    monkeypatch.setenv("SPIN_INDEXER_LOGITS", "deepgemm")
    x = make_paged_inputs((10 * 64 + 5, 30 * 64, 2 * 64 + 1, 17 * 64), next_n, 64, 128, gen, garbage=False).to("cuda")
    cfg = SpinConfig(sparsity=0.5, topk=256, vertical_grain="slot")  # compares V too
    pair = []
    for own_schedule in (True, False):
        idx = SpinIndexer(cfg, num_layers=3, max_batch=4, max_blocks=x.block_table.shape[1], next_n=next_n,
                          device="cuda", num_cache_blocks=x.kv_cache.shape[0])
        assert idx.workspace.deepgemm_schedule is not None
        if not own_schedule:
            idx.workspace.deepgemm_schedule = None  # run() then lets DeepGEMM compute it
        slots = torch.tensor([idx.state.allocate() for _ in range(4)], dtype=torch.int32, device="cuda")
        pair.append((idx, slots))
    for step in range(3):
        w = torch.randn(x.weights.shape, generator=gen).cuda()
        outs = []
        for idx, slots in pair:
            idx.plan(x.block_table, x.seq_lens, slots)
            outs.append([idx.run(layer, x.q_fp8, x.kv_cache, w).clone() for layer in range(3)])
        assert all(torch.equal(a, b) for a, b in zip(*outs)), step
    assert torch.equal(pair[0][0].state.vertical, pair[1][0].state.vertical)
