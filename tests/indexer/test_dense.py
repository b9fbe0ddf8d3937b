"""DenseIndexer's door: constructor arguments, plan(validate=True) data checks (seq_lens ranges, block ids of
used blocks, and those ids against the kv_cache in run()), the kv_cache's T, and that a rejected call leaves
the previous plan as it was and run() unusable."""
import pytest
import torch

from conftest import make_paged_inputs
from spin_indexer.indexer import DenseIndexer
from spin_indexer.ops import paged_indexer_logits_ref, topk_ref

T = 64


def _inputs(gen):
    return make_paged_inputs((130, 70), 1, 8, 32, gen)


@pytest.mark.parametrize("bad", [0, -64, 48])
def test_tokens_per_block_must_be_a_positive_power_of_two(bad):
    with pytest.raises(ValueError, match="tokens_per_block"):
        DenseIndexer(8, tokens_per_block=bad)


@pytest.mark.parametrize("topk_sorted", [False, True])
def test_run_matches_the_dense_reference(topk_sorted, gen):
    """The default: the set in ascending positions; topk_sorted=True: best first."""
    x = _inputs(gen)
    idx = DenseIndexer(16, topk_sorted=topk_sorted)
    idx.plan(x.block_table, x.seq_lens)
    out = idx.run(0, x.q_fp8, x.kv_cache, x.weights)
    assert torch.equal(out, topk_ref(paged_indexer_logits_ref(*x.args()), x.seq_lens.view(-1), 16,
                                     sorted=topk_sorted))
    with pytest.raises(TypeError, match="topk_sorted"):
        DenseIndexer(16, topk_sorted=1)


@pytest.mark.parametrize("bad", ["length-too-long", "negative-length", "negative-block-id"])
def test_validate_checks_the_data_and_a_rejected_plan_changes_nothing(bad, gen):
    x = _inputs(gen)
    idx = DenseIndexer(16)
    idx.plan(x.block_table, x.seq_lens)
    plan_before = idx.block_plan
    table, lens = x.block_table.clone(), x.seq_lens.clone()
    if bad == "length-too-long":
        lens[1, 0] = table.shape[1] * T + 1
        name = "seq_lens"
    elif bad == "negative-length":
        lens[0, 0] = -1
        name = "seq_lens"
    else:
        table[0, 2] = -3  # block 2 of request 0 is used (length 130)
        name = "block_table"
    with pytest.raises(ValueError, match=name):
        idx.plan(table, lens)
    assert idx.block_plan is plan_before  # the previous step's plan is untouched
    assert torch.equal(idx.block_plan.compact_block_table, x.block_table)
    assert torch.equal(idx.block_plan.compact_seq_lens, x.seq_lens)
    with pytest.raises(RuntimeError, match="plan"):
        idx.run(0, x.q_fp8, x.kv_cache, x.weights)
    with pytest.raises(RuntimeError, match="plan"):
        idx.run_from_scores(0, torch.zeros(2, table.shape[1] * T))
    idx.plan(table, lens, validate=False)  # validate=False skips the data checks


def test_unused_blocks_may_hold_anything(gen):
    x = _inputs(gen)
    table = x.block_table.clone()
    table[1, 2:] = -7  # request 1 (length 70) uses blocks 0 and 1 only
    idx = DenseIndexer(16)
    idx.plan(table, x.seq_lens)
    idx.run(0, x.q_fp8, x.kv_cache, x.weights)


def test_run_checks_block_ids_against_the_cache_when_the_plan_validated(gen):
    x = _inputs(gen)
    idx = DenseIndexer(16)
    idx.plan(x.block_table, x.seq_lens)
    used_max = int(x.block_table[0, :3].max().clamp_min(x.block_table[1, :2].max()))
    small = x.kv_cache[:used_max].contiguous()  # one block short of the largest used id
    with pytest.raises(ValueError, match=r"block_table: expected block ids of used blocks in \[0, "):
        idx.run(0, x.q_fp8, small, x.weights)
    assert idx.run(0, x.q_fp8, x.kv_cache, x.weights).shape == (2, 16)  # the rejected run changed nothing
    idx.plan(x.block_table, x.seq_lens, validate=False)
    with pytest.raises(IndexError):  # unchecked (no host sync): here the reference's own indexing fails
        idx.run(0, x.q_fp8, small, x.weights)


def test_kv_cache_tokens_per_block_must_match(gen):
    x = _inputs(gen)
    idx = DenseIndexer(16, tokens_per_block=32)
    idx.plan(x.block_table, x.seq_lens // 2)
    with pytest.raises(ValueError, match="kv_cache: expected T = tokens_per_block = 32"):
        idx.run(0, x.q_fp8, x.kv_cache, x.weights)


def test_requires_grad_weights_give_a_plain_result(gen):
    x = _inputs(gen)
    idx = DenseIndexer(16)
    idx.plan(x.block_table, x.seq_lens)
    out = idx.run(0, x.q_fp8, x.kv_cache, x.weights.requires_grad_())
    assert not out.requires_grad and out.grad_fn is None


def test_group_maxima_come_from_the_logits_kernel_where_it_writes_them():
    """dense_topk's rule (fuses_group_max): the Triton kernel's epilogue at one row and groups of 8-16 (run 35: more
    rows or wider groups slowed the kernel more than the top-k's own pass costs); the CUDA kernel wherever it
    writes them (16 or 32 columns at any row count: from its block maxima's partials, after the loop); DeepGEMM's
    maxima pass at every group finer than a block (one read of its logits instead of two)."""
    from spin_indexer.indexer.dense import fuses_group_max
    assert [fuses_group_max(1, g) for g in (4, 8, 16, 32)] == [False, True, True, False]
    assert not fuses_group_max(2, 16, "triton")
    assert [fuses_group_max(192, g, "cuda") for g in (8, 16, 32, 64)] == [False, True, True, False]
    assert [fuses_group_max(rows, g, "deepgemm") for rows in (1, 192) for g in (4, 8, 32, 64)] == \
        [False, True, True, False] * 2
    assert fuses_group_max(192, 64, "deepgemm", tokens=128) and not fuses_group_max(192, 32, "deepgemm", tokens=32)
