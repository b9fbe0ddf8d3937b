"""Sparse decoding on a tiny random Llama: every mode against a plain forward, top-k attention against a
float64 reference, SpinIndexer/DenseIndexer selection against all-keep, input errors."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_indexer, tiny_model
from spin_indexer.indexer import DenseIndexer, SpinIndexer
from spin_indexer.model.decode import MODES, Caches, attend_topk, decode_one_step, generate, prefill
from spin_indexer.predictor import SpinConfig


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_len=512)


@pytest.fixture(scope="module")
def indexer():
    return tiny_indexer(max_len=512)


@pytest.mark.parametrize("mode", MODES)
def test_decode_with_k_covering_everything_equals_dense_forward(model, indexer, mode):
    tokens = torch.randint(0, 97, (2, 150))
    ref = model.forward_dense(tokens)  # [2, 150, V]
    caches = Caches.allocate(model, 2, 160, indexer if mode == "lightning" else None)
    for r, length in enumerate((120, 131)):  # different lengths per request, one crosses a block edge
        logits = prefill(model, caches, r, tokens[r, :length], indexer, chunk=50)
        torch.testing.assert_close(logits, ref[r, length - 1], rtol=1e-4, atol=1e-4)
    # requests are at different lengths: request 0 at 120, request 1 at 131
    step = torch.stack([tokens[0, 120:122], tokens[1, 131:133]])  # next_n = 2
    out = decode_one_step(model, caches, step, mode, k=4096, indexer=indexer)
    torch.testing.assert_close(out[0], ref[0, 120:122], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], ref[1, 131:133], rtol=1e-4, atol=1e-4)
    assert caches.lengths.tolist() == [122, 133]


def test_attend_topk_matches_float64_reference():
    b, n, hq, hkv, d, p, k = 2, 3, 4, 2, 8, 40, 7
    q, keys, vals = torch.randn(b, n, hq, d), torch.randn(b, p, hkv, d), torch.randn(b, p, hkv, d)
    topk = torch.stack([torch.randperm(p)[:k] for _ in range(b * n)]).view(b, n, k).to(torch.int32)
    topk[0, 1, 4:] = -1  # padding
    got = attend_topk(q, keys, vals, topk)
    for bi in range(b):
        for j in range(n):
            sel = topk[bi, j][topk[bi, j] >= 0].long()
            for h in range(hq):
                kv = h // (hq // hkv)
                logit = (keys[bi, sel, kv].double() @ q[bi, j, h].double()) / d ** 0.5
                want = torch.softmax(logit, 0) @ vals[bi, sel, kv].double()
                torch.testing.assert_close(got[bi, j, h].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["oracle", "lightning"])
def test_small_k_changes_output_but_stays_finite(model, indexer, mode):
    tokens = torch.randint(0, 97, (1, 200))
    outs = {}
    for k in (8, 4096):
        caches = Caches.allocate(model, 1, 210, indexer if mode == "lightning" else None)
        prefill(model, caches, 0, tokens[0, :199], indexer)
        outs[k] = decode_one_step(model, caches, tokens[:, 199:200], mode, k=k, indexer=indexer)
    assert torch.isfinite(outs[8]).all()
    assert not torch.allclose(outs[8], outs[4096], atol=1e-3)


@pytest.mark.parametrize("mode", ["oracle", "lightning"])
def test_dense_indexer_selector_equals_all_keep(model, indexer, mode):
    tokens = torch.randint(0, 97, (1, 180))
    k = 16
    seen = []
    results = []
    for selector in (None, DenseIndexer(topk=k)):
        caches = Caches.allocate(model, 1, 200, indexer if mode == "lightning" else None)
        prefill(model, caches, 0, tokens[0, :170], indexer)
        observer = (lambda layer, s, t, _: seen.append(t.clone())) if selector is None else None
        results.append(torch.stack([decode_one_step(model, caches, tokens[:, p:p + 1], mode, k, indexer, selector,
                                                    observer) for p in range(170, 175)]))
    torch.testing.assert_close(results[0], results[1])
    assert len(seen) == 5 * model.cfg.num_layers and all(t.shape == (1, k) for t in seen)


@pytest.mark.parametrize("mode", ["oracle", "lightning"])
def test_spin_selector_at_zero_sparsity_equals_all_keep_and_sparse_differs(model, indexer, mode):
    tokens = torch.randint(0, 97, (1, 460))
    k = 64
    outs = []
    for sparsity in (None, 0.0, 0.6):
        selector = None
        if sparsity is not None:
            selector = SpinIndexer(SpinConfig(sparsity=sparsity, topk=k, gamma=0.0, exploration="none"),
                                   num_layers=model.cfg.num_layers, max_batch=1, max_blocks=8)
        caches = Caches.allocate(model, 1, 480, indexer if mode == "lightning" else None)
        if selector is not None:
            caches.slot_ids[0] = selector.state.allocate()
        prefill(model, caches, 0, tokens[0, :440], indexer)
        outs.append(torch.stack([decode_one_step(model, caches, tokens[:, p:p + 1], mode, k, indexer, selector)
                                 for p in range(440, 452)]))
        if sparsity == 0.6:
            assert float(selector.block_plan.sparsity().max()) > 0.2
    torch.testing.assert_close(outs[0], outs[1])
    assert torch.isfinite(outs[2]).all()


def test_generate_greedy_matches_dense_argmax(model):
    prompt = torch.randint(0, 97, (30,))
    out = generate(model, prompt, 5, mode="dense")
    seq = prompt.clone()
    for _ in range(5):
        nxt = model.forward_dense(seq[None])[0, -1].argmax()
        seq = torch.cat([seq, nxt.view(1)])
    assert out.tolist() == seq[30:].tolist()
    assert generate(model, prompt, 0, mode="dense").numel() == 0


def test_errors(model, indexer):
    caches = Caches.allocate(model, 1, 64)
    with pytest.raises(ValueError, match="mode"):
        decode_one_step(model, caches, torch.zeros(1, 1, dtype=torch.int64), "sparse")
    with pytest.raises(ValueError, match="indexer"):
        decode_one_step(model, caches, torch.zeros(1, 1, dtype=torch.int64), "lightning")
    with pytest.raises(TypeError, match="tokens"):
        decode_one_step(model, caches, torch.zeros(1, 1, dtype=torch.int32), "dense")
    with pytest.raises(ValueError, match="tokens"):
        decode_one_step(model, caches, torch.zeros(2, 1, dtype=torch.int64), "dense")
    with pytest.raises(ValueError, match="len\\(tokens\\)"):
        prefill(model, caches, 0, torch.zeros(65, dtype=torch.int64))
    with pytest.raises(ValueError, match="max_len"):
        Caches.allocate(model, 1, 10_000)


def test_generate_with_spin_selector_reuses_slots(model, indexer):
    prompt = torch.randint(0, 97, (300,))
    selector = SpinIndexer(SpinConfig(sparsity=0.0, topk=32), num_layers=model.cfg.num_layers, max_batch=1,
                           max_blocks=8, max_requests=1)
    want = generate(model, prompt, 4, "lightning", 32, indexer)
    for _ in range(2):  # one state slot: the second call only works if the first freed it
        assert generate(model, prompt, 4, "lightning", 32, indexer, selector).tolist() == want.tolist()


def test_verify_step_accepts_a_prefix_and_rolls_back(model):
    from spin_indexer.model.decode import verify_step

    prompt = torch.randint(0, 97, (100,))
    greedy = generate(model, prompt, 4, mode="dense")  # the model's own continuation g0 g1 g2 g3
    for wrong_at, accepted in ((None, 2), (1, 0), (2, 1)):
        caches = Caches.allocate(model, 1, 120)
        prefill(model, caches, 0, prompt)
        rows = greedy[:3].clone()  # row 0 = g0 (emitted), drafts g1, g2
        if wrong_at is not None:
            rows[wrong_at] = (rows[wrong_at] + 1) % 97
        out, acc = verify_step(model, caches, rows.view(1, 3), "dense", 16)
        assert int(acc) == accepted
        assert int(caches.lengths[0]) == 100 + 1 + accepted  # row 0 and the accepted drafts stay cached
        assert torch.equal(out[:accepted + 1], greedy[1:accepted + 2])  # the tokens it emits are greedy's
