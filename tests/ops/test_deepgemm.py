"""The DeepGEMM logits backend: skipped cleanly where deep_gemm does not import (CI, the CPU), chosen only on
SM90 CUDA inputs, and equal to the reference where it runs (the H200 with the kit of ../shared/deepgemm)."""
from __future__ import annotations

import pytest
import torch

from spin_indexer.ops.topk import ascending

from conftest import make_paged_inputs
from spin_indexer import ops
from spin_indexer.ops import deepgemm


def test_backend_choice_without_deepgemm_on_cpu(monkeypatch):
    q = torch.zeros(1, 1, 64, 128).to(torch.float8_e4m3fn)
    kv = torch.zeros(2, 64, 1, 132, dtype=torch.uint8)
    assert isinstance(deepgemm.available(), bool)
    q2 = torch.zeros(1, 2, 64, 128).to(torch.float8_e4m3fn)
    assert not deepgemm.supports(q, kv) and not deepgemm.supports(q2, kv)
    assert ops.logits_backend(q, kv) == "reference" and ops.logits_backend(q2, kv) == "reference"
    monkeypatch.setenv("SPIN_INDEXER_LOGITS", "deepgemm")  # forcing cannot pick it without CUDA and deep_gemm
    assert not deepgemm.supports(q, kv)


def test_backend_choice_rules_on_sm90(monkeypatch):
    """Where DeepGEMM imports on SM90 (simulated): next_n = 2 only (the dense step and SPIN's alike), on block
    tables of >= DEEPGEMM_MIN_TABLE_TOKENS tokens (no size given: as such a table) or where the project's CUDA
    kernel cannot run on the device (indexer_logits_cuda.serves); the environment forces either way. Padded pages
    (DeepSeek-V4's 8704-byte stride) never go to DeepGEMM, even when forced."""
    from types import SimpleNamespace

    from spin_indexer.ops import indexer_logits_cuda
    served = []
    monkeypatch.setattr(indexer_logits_cuda, "serves", lambda device: served.append(str(device)) or True)
    monkeypatch.setattr(deepgemm, "_module", lambda: object())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv("SPIN_INDEXER_LOGITS", raising=False)
    kv = torch.empty(8, 64, 1, 132, dtype=torch.uint8, device="meta")
    padded = torch.empty_strided((8, 64, 1, 132), (8704, 132, 132, 1), dtype=torch.uint8, device="meta")
    big, small, dev = deepgemm.DEEPGEMM_MIN_TABLE_TOKENS, deepgemm.DEEPGEMM_MIN_TABLE_TOKENS - 64, "cuda:0"

    def q(next_n, heads=64):
        return SimpleNamespace(is_cuda=True, device="cuda:0", shape=(4, next_n, heads, 128))

    assert deepgemm.supports(q(2), kv) and deepgemm.supports(q(2), kv, big) and served == []
    assert not deepgemm.supports(q(2), kv, small) and served == ["cuda:0"]  # the CUDA kernel's, asked on q's device
    assert not deepgemm.supports(q(1), kv) and not deepgemm.supports(q(1), kv, big)
    assert deepgemm.spin_step_uses(2, dev, big) and not deepgemm.spin_step_uses(2, dev, small)
    assert not deepgemm.spin_step_uses(1, dev, big) and not deepgemm.spin_step_uses(3, dev, big)
    assert not deepgemm.supports(q(3), kv) and not deepgemm.supports(q(4), kv)
    assert not deepgemm.supports(q(2, heads=32), kv)
    assert not deepgemm.supports(q(2), padded)
    monkeypatch.setattr(indexer_logits_cuda, "serves", lambda device: False)  # no nvcc: DeepGEMM at any size
    assert deepgemm.supports(q(2), kv, small) and deepgemm.spin_step_uses(2, dev, 64)
    monkeypatch.setenv("SPIN_INDEXER_LOGITS", "deepgemm")
    monkeypatch.setattr(indexer_logits_cuda, "serves", lambda device: True)
    assert deepgemm.supports(q(1), kv, small) and not deepgemm.supports(q(1, heads=32), kv)
    assert deepgemm.spin_step_uses(1, dev, small) and deepgemm.spin_step_uses(2, dev, small)
    assert not deepgemm.supports(q(2), padded)
    monkeypatch.setenv("SPIN_INDEXER_LOGITS", "triton")
    assert not deepgemm.supports(q(2), kv, big) and not deepgemm.spin_step_uses(2, dev, big)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and deepgemm.available()), reason="needs CUDA and deep_gemm")
@pytest.mark.parametrize("next_n", [1, 2])
def test_deepgemm_matches_reference(next_n, gen):
    x = make_paged_inputs([3000, 700, 65], next_n, 64, 128, gen).to("cuda")
    want = ops.paged_indexer_logits_ref(x.q_fp8, x.kv_cache, x.weights, x.seq_lens, x.block_table)
    got = deepgemm.paged_indexer_logits_deepgemm(x.q_fp8, x.kv_cache, x.weights, x.seq_lens, x.block_table)
    live = torch.isfinite(want)
    err = (got[live] - want[live]).norm() / want[live].norm()
    assert err < 5e-3, err


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and deepgemm.available()), reason="needs CUDA and deep_gemm")
def test_spin_step_on_deepgemm_prunes_with_the_update_pass_group_maxima(gen, monkeypatch):
    """SPIN's step on the DeepGEMM backend at a top-k group finer than a block: the update pass writes the
    group maxima the top-k prunes with (no group-max launch), and the step's top-k equals the reference
    top-k of the same DeepGEMM logits (they are deterministic: recomputed here)."""
    from spin_indexer.indexer import SpinIndexer
    from spin_indexer.predictor import SpinConfig
    monkeypatch.setenv("SPIN_INDEXER_LOGITS", "deepgemm")
    x = make_paged_inputs([64 * 90 + 17, 64 * 70, 64 * 33 + 5], 1, 64, 128, gen).to("cuda")
    k = 96
    batch, width = x.block_table.shape
    assert 8 <= ops.topk_group(width * 64, k) < 64
    cfg = SpinConfig(sparsity=0.5, topk=k)
    idx = SpinIndexer(cfg, num_layers=1, max_batch=batch, max_blocks=width, device="cuda",
                      num_cache_blocks=x.kv_cache.shape[0])
    slots = torch.tensor([idx.state.allocate() for _ in range(batch)], device="cuda")
    for step in range(2):
        idx.plan(x.block_table, x.seq_lens, slots)
        plan = idx.plans(0)
        idx.workspace.group_max.fill_(float("nan"))  # poisoned: only what the update pass writes may be read
        got = idx.run(0, x.q_fp8, x.kv_cache, x.weights).clone()
        logits = deepgemm.paged_indexer_logits_deepgemm(x.q_fp8, x.kv_cache, x.weights, plan.compact_seq_lens,
                                                        plan.compact_block_table, validate=False)
        want = ops.topk_positions_ref(logits.float(), plan.compact_seq_lens.view(-1), k, kept_blocks=plan.kept_blocks,
                                       sorted=False)  # the indexer's default: the set, in no particular order
        assert torch.equal(ascending(got.cpu()), ascending(want.cpu())), step


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and deepgemm.available()), reason="needs CUDA and deep_gemm")
@pytest.mark.parametrize("next_n", [1, 2])
def test_dense_step_on_deepgemm_prunes_with_the_maxima_pass_group_maxima(next_n, gen, monkeypatch):
    """The dense step on DeepGEMM at a top-k group finer than a block: the maxima pass after the logits writes the
    group maxima beside the block maxima (dense.fuses_group_max; no group-max launch of the top-k's), into a
    poisoned buffer, and the top-k equals the reference top-k of the same DeepGEMM logits."""
    from spin_indexer.indexer.dense import dense_topk
    monkeypatch.setenv("SPIN_INDEXER_LOGITS", "deepgemm")
    x = make_paged_inputs([64 * 90 + 17, 64 * 70, 64 * 33 + 5], next_n, 64, 128, gen).to("cuda")
    k = 96
    rows, width = x.seq_lens.numel(), x.block_table.shape[1]
    group = ops.topk_group(width * 64, k)
    assert 8 <= group < 64
    block_max = torch.full((rows, width), float("nan"), device="cuda")
    group_max = torch.full((rows, -(-width * 64 // 8)), float("nan"), device="cuda")  # poisoned
    got = dense_topk(x.q_fp8, x.kv_cache, x.weights, x.seq_lens, x.block_table, k, 64, block_max,
                     group_max=group_max, sorted=False)
    live = torch.arange(-(-width * 64 // group), device="cuda")[None, :] * group < x.seq_lens.view(-1, 1)
    assert not group_max[:, :live.shape[1]][live].isnan().any()  # the pass wrote every live group
    logits = deepgemm.paged_indexer_logits_deepgemm(x.q_fp8, x.kv_cache, x.weights, x.seq_lens, x.block_table,
                                                    validate=False)
    want = ops.topk_positions_ref(logits.float(), x.seq_lens.view(-1), k, sorted=False)
    assert torch.equal(ascending(got.cpu()), ascending(want.cpu()))


def test_a_backend_the_dispatcher_does_not_know_is_refused_by_name():
    q = torch.zeros(1, 1, 64, 128).to(torch.float8_e4m3fn)
    kv = torch.zeros(2, 64, 1, 132, dtype=torch.uint8)
    w = torch.zeros(1, 64)
    lens = torch.ones(1, 1, dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend: expected one of 'deepgemm', 'cuda', 'triton', 'reference' or "
                                         "None, got 'cutlass'"):
        ops.paged_indexer_logits(q, kv, w, lens, table, backend="cutlass")
    got = ops.paged_indexer_logits(q, kv, w, lens, table, backend="reference")  # the named one runs
    assert torch.equal(got, ops.paged_indexer_logits_ref(q, kv, w, lens, table))
