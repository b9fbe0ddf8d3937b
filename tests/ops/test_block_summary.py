"""ops.block_summary_scores (the summary mix's current-step signal) against an independent float64
recomputation: sub-block mean keys of the dequantized cache, scored with every row's query, max over rows and
sub-blocks; partial last blocks, next_n 1-3, garbage past the used blocks, an empty batch, bad arguments."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import E4M3FN, T, decode_fp8, make_paged_inputs, split_cache_bytes
from spin_indexer import ops

HEADS, DIM = 4, 32


def summary_f64(inputs, parts: int) -> np.ndarray:
    q = decode_fp8(inputs.q_fp8)  # [B, N, H, D]
    batch, next_n = q.shape[:2]
    w = inputs.weights.double().numpy().reshape(batch, next_n, -1)
    values, scales = split_cache_bytes(inputs.kv_cache)
    table = inputs.block_table.numpy().astype(np.int64)
    longest = inputs.seq_lens.numpy().max(axis=1) if batch else np.zeros(0, dtype=np.int64)
    size = T // parts
    out = np.full(table.shape, -np.inf)
    for b in range(batch):
        for j in range(table.shape[1]):
            best = -np.inf
            for s in range(parts):
                first = j * T + s * size
                tokens = [p for p in range(first, first + size) if p < longest[b]]
                if not tokens:
                    continue
                blk = table[b, j]
                mean = np.mean([scales[blk, p % T] * E4M3FN[values[blk, p % T]] for p in tokens], axis=0)
                for r in range(next_n):
                    best = max(best, float(np.sum(w[b, r] * np.maximum(q[b, r] @ mean, 0.0))))
            out[b, j] = best
    return out


@pytest.mark.parametrize("next_n", [1, 3])
@pytest.mark.parametrize("parts", [1, 4, 64])
def test_matches_float64(next_n, parts, gen):
    # a partial last block (sub-blocks past the length drop out), a 1-token request, one on a block edge
    inputs = make_paged_inputs((3 * T + 21, 1, 2 * T), next_n, HEADS, DIM, gen, extra_width=2)
    got = ops.block_summary_scores(*inputs.args(), parts=parts)
    want = summary_f64(inputs, parts)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert np.array_equal(np.isneginf(got.numpy()), np.isneginf(want))  # past the used blocks: -inf
    live = np.isfinite(want)
    np.testing.assert_allclose(got.numpy()[live], want[live], rtol=1e-5, atol=1e-6)


def test_one_token_blocks_equal_the_best_row_logit(gen):
    """parts = T: every sub-block is one token, so a block's score is its best logit over the rows (the
    logits reference, independently implemented): the summary is the logits' own math on means."""
    inputs = make_paged_inputs((2 * T + 5, T), 2, HEADS, DIM, gen)
    logits = ops.paged_indexer_logits_ref(*inputs.args())  # [B*N, W*T]
    batch, width = inputs.block_table.shape
    best = ops.block_max_ref(logits).view(batch, 2, width).amax(dim=1)
    got = ops.block_summary_scores(*inputs.args(), parts=T)
    live = torch.isfinite(best)
    assert torch.equal(live, torch.isfinite(got))
    torch.testing.assert_close(got[live], best[live], rtol=1e-5, atol=1e-6)


def test_empty_batch_and_bad_parts(gen):
    empty = make_paged_inputs((), 1, HEADS, DIM, gen)
    assert ops.block_summary_scores(*empty.args()).shape == (0, empty.block_table.shape[1])
    inputs = make_paged_inputs((T,), 1, HEADS, DIM, gen)
    for bad, exc in ((3, ValueError), (0, ValueError), (2 * T, ValueError), (2.0, TypeError)):
        with pytest.raises(exc, match="parts"):
            ops.block_summary_scores(*inputs.args(), parts=bad)
    with pytest.raises(TypeError, match="weights"):
        ops.block_summary_scores(inputs.q_fp8, inputs.kv_cache, inputs.weights.double(), inputs.seq_lens,
                                 inputs.block_table)


def test_many_sub_block_counts_at_once_equal_each_alone(gen):
    from spin_indexer.ops.block_summary import block_summary_scores_many_ref

    inputs = make_paged_inputs((3 * T + 21, 1, 2 * T), 2, HEADS, DIM, gen, extra_width=2)
    many = block_summary_scores_many_ref(*inputs.args(), parts=(4, 16, 1))
    assert many.shape == (3, *inputs.block_table.shape)
    for i, parts in enumerate((4, 16, 1)):
        assert torch.equal(many[i], ops.block_summary_scores(*inputs.args(), parts=parts))
    with pytest.raises(ValueError, match="parts"):
        block_summary_scores_many_ref(*inputs.args(), parts=(4, 3))
