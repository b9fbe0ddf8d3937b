"""Row-chunked distillation (model/distill.py): the chunked target, scores and gradient equal the unchunked
ones, and the largest tensor a training step makes is O(row_chunk x S), where the old path made [B, Hq, S, S]."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from helpers import tiny_indexer, tiny_model
from spin_indexer.model.distill import (DistillConfig, attention_target, indexer_scores, kl_loss, layer_kl_backward,
                                        row_chunks, train)


class PeakTensor(TorchDispatchMode):
    """Records the largest tensor (bytes) any aten op returns while active, backward ops included."""

    def __init__(self):
        super().__init__()
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.peak_bytes = max(self.peak_bytes, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_chunked_target_and_scores_are_slices_of_the_full_ones(reduce):
    model, idx = tiny_model(max_len=128), tiny_indexer(max_len=128)
    tokens = torch.randint(0, 97, (2, 45))
    h, q, k = model.attention_inputs(tokens)[1]
    full_t, full_s = attention_target(q, k, reduce), indexer_scores(idx, 1, h)
    for rows in (slice(0, 7), slice(7, 20), slice(38, 45), slice(44, 45)):
        t, s = attention_target(q, k, reduce, rows), indexer_scores(idx, 1, h, rows)
        assert t.shape == s.shape == (2, rows.stop - rows.start, rows.stop)
        torch.testing.assert_close(t, full_t[:, rows, :rows.stop], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(s, full_s[:, rows, :rows.stop], rtol=1e-5, atol=1e-6)
        assert not full_t[:, rows, rows.stop:].any()  # what the chunk leaves out is zero anyway


def test_row_chunks_cover_or_sample_the_rows():
    assert row_chunks(10, 2, 4) == [slice(2, 6), slice(6, 10)]
    assert row_chunks(10, 0, 3) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    picked = row_chunks(64, 8, 8, rows_per_seq=20, gen=torch.Generator().manual_seed(0))
    assert len(picked) == 3 and all(c in row_chunks(64, 8, 8) for c in picked)
    assert [c.start for c in picked] == sorted(c.start for c in picked)


@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_chunked_gradient_equals_the_unchunked_one(chunk):
    """layer_kl_backward over chunks of `chunk` rows == backward of the old whole-sequence kl_loss."""
    model = tiny_model(max_len=128)
    tokens = torch.randint(0, 97, (2, 40))
    saved = model.attention_inputs(tokens)
    min_row = 6
    grads, losses = [], []
    for chunked in (False, True):
        idx = tiny_indexer(max_len=128).train().requires_grad_(True)
        idx.zero_grad()
        total = 0.0
        for i, (h, q, k) in enumerate(saved):
            if chunked:
                total += float(layer_kl_backward(idx, i, h, q, k, row_chunks(40, min_row, chunk), "max", 0.5))
            else:
                loss = kl_loss(attention_target(q, k, "max"), indexer_scores(idx, i, h.float()), min_row)
                (loss * 0.5).backward()
                total += float(loss.detach())
        losses.append(total)
        grads.append([p.grad.clone() for p in idx.parameters()])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def test_a_training_step_stays_within_o_chunk_times_s_memory():
    """The largest tensor of a whole training step (forward, targets, scores, backward, optimizer) is bounded
    by the chunk's logits [B, Hq, row_chunk, S]; the old whole-sequence target alone exceeds the bound."""
    s, chunk, batch = 256, 32, 1
    model, idx = tiny_model(max_len=s), tiny_indexer(max_len=s)
    hq = model.cfg.num_heads
    bound = batch * hq * chunk * s * 4  # float32 logits of one chunk against every key
    tokens = torch.randint(0, 97, (4 * s,))
    with PeakTensor() as new:
        train(model, idx, tokens, DistillConfig(seq_len=s, batch=batch, row_chunk=chunk, min_row=16, max_steps=1,
                                                warmup_steps=1, time_budget_s=60), log_fn=lambda *a: None)
    assert new.peak_bytes <= bound, (new.peak_bytes, bound)
    h, q, k = model.attention_inputs(tokens[:s].view(1, s))[0]
    with PeakTensor() as old:  # the pre-chunking step: one [B, Hq, S, S] map per layer
        attention_target(q, k)
    assert old.peak_bytes == batch * hq * s * s * 4 > 4 * bound
