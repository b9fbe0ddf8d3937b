"""ops.topk_attention: the Triton twin against the torch reference (and the reference against float64),
GQA groups that are not powers of two, padding, rows with nothing selected, argument checks."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from spin_indexer import ops
from spin_indexer.ops.topk_attention import topk_attention_ref


def make_inputs(b, n, hq, hkv, d, p, k, gen, dtype=torch.float32, pad=0.2):
    q = torch.randn(b, n, hq, d, generator=gen).to(dtype)
    keys = torch.randn(b, p, hkv, d, generator=gen).to(dtype)
    vals = torch.randn(b, p, hkv, d, generator=gen).to(dtype)
    topk = torch.stack([torch.randperm(p, generator=gen)[:k] for _ in range(b * n)]).view(b, n, k).to(torch.int32)
    topk = torch.where(torch.rand(b, n, k, generator=gen) < pad, -1, topk)
    topk[..., 0] = torch.randint(0, p, (b, n), generator=gen, dtype=torch.int32)  # at least one per row
    return q, keys, vals, topk


def test_reference_matches_float64(gen):
    q, keys, vals, topk = make_inputs(2, 3, 6, 2, 8, 40, 9, gen)
    got = topk_attention_ref(q, keys, vals, topk)
    for b in range(2):
        for j in range(3):
            sel = topk[b, j][topk[b, j] >= 0].long()
            for h in range(6):
                kv = h // 3
                logit = keys[b, sel, kv].double() @ q[b, j, h].double() / 8 ** 0.5
                want = torch.softmax(logit, 0) @ vals[b, sel, kv].double()
                torch.testing.assert_close(got[b, j, h].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("b,n,hq,hkv,d,p,k", [
    (2, 1, 9, 3, 64, 300, 70),   # SmolLM2's heads (groups of 3), K past two chunks
    (1, 4, 4, 4, 24, 50, 31),    # next_n 4, no grouping, d not a power of two, K not a chunk multiple
    (3, 2, 8, 1, 16, 33, 5),     # one KV head for all, K below a chunk
])
def test_triton_matches_the_reference(b, n, hq, hkv, d, p, k, gen, triton_device):
    q, keys, vals, topk = make_inputs(b, n, hq, hkv, d, p, k, gen)
    dev = torch.device(triton_device)
    want = topk_attention_ref(q, keys, vals, topk)
    from spin_indexer.ops.topk_attention_triton import topk_attention_triton
    got = topk_attention_triton(*(t.to(dev) for t in (q, keys, vals, topk)))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("splits", [1, 2, 3, None])
def test_split_selection_merges_to_the_reference(splits, gen, triton_device, monkeypatch):
    """K = 200 positions (4 chunks of 64: the chunk set here, the shipped one is 128) cut into 1-4 splits (None:
    splits_for's choice, 4 here), merged by the second launch: the reference's result; rows whose positions sit in
    one split only (the others all padding) and a row with nothing selected (NaN, as the reference) included."""
    from spin_indexer.ops import topk_attention_triton as tat
    from spin_indexer.ops.topk_attention_triton import splits_for, topk_attention_triton
    monkeypatch.setattr(tat, "KB", 64)
    q, keys, vals, topk = make_inputs(3, 2, 9, 3, 64, 400, 200, gen)
    topk[0, 1, 64:] = -1  # only the first chunk selected: later splits are empty
    topk[1, 0, :128] = -1  # only the last chunks
    topk[2, 1] = -1  # nothing at all
    dev = torch.device(triton_device)
    got = topk_attention_triton(*(t.to(dev) for t in (q, keys, vals, topk)), splits=splits).cpu()
    want = topk_attention_ref(q, keys, vals, topk)
    assert torch.isnan(got[2, 1]).all() and torch.isnan(want[2, 1]).all()
    keep = torch.ones(3, 2, dtype=torch.bool)
    keep[2, 1] = False
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)
    assert splits_for(6, 3, 200) == 4 and splits_for(96, 3, 512) == 8 and splits_for(2048, 1, 512) == 1


@pytest.mark.interpreter
@settings(max_examples=6, deadline=None)
@given(b=st.integers(1, 3), n=st.integers(1, 4), groups=st.sampled_from([1, 2, 3, 5]), hkv=st.integers(1, 2),
       d=st.sampled_from([8, 12, 32]), k=st.integers(1, 40), seed=st.integers(0, 2 ** 31 - 1))
def test_triton_matches_the_reference_random_shapes(b, n, groups, hkv, d, k, seed):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(seed)
    p = k + 7
    q, keys, vals, topk = make_inputs(b, n, groups * hkv, hkv, d, p, k, gen, pad=0.4)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    from spin_indexer.ops.topk_attention_triton import topk_attention_triton
    got = topk_attention_triton(*(t.to(dev) for t in (q, keys, vals, topk)))
    torch.testing.assert_close(got.cpu(), topk_attention_ref(q, keys, vals, topk), rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_triton_rows_with_nothing_selected_and_empty_shapes(gen, triton_device):
    """A row of padding only: NaN in both; an empty batch, and K = 0 (zeros: the reference's empty sum)."""
    from spin_indexer.ops.topk_attention_triton import topk_attention_triton
    q, keys, vals, topk = make_inputs(2, 2, 4, 2, 8, 20, 6, gen)
    topk[1, 0] = -1
    dev = torch.device(triton_device)
    got = topk_attention_triton(*(t.to(dev) for t in (q, keys, vals, topk))).cpu()
    want = topk_attention_ref(q, keys, vals, topk)
    assert torch.isnan(got[1, 0]).all() and torch.isnan(want[1, 0]).all()
    keep = torch.ones(2, 2, dtype=torch.bool)
    keep[1, 0] = False
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)
    empty = topk_attention_triton(q[:0].to(dev), keys[:0].to(dev), vals[:0].to(dev), topk[:0].to(dev))
    assert empty.shape == (0, 2, 4, 8)
    none = topk_attention_triton(q.to(dev), keys.to(dev), vals.to(dev), topk[:, :, :0].to(dev)).cpu()
    assert torch.equal(none, topk_attention_ref(q, keys, vals, topk[:, :, :0])) and not none.any()


@pytest.mark.interpreter
def test_positions_outside_the_cache_count_as_padding(gen, triton_device):
    """validate=False: a position >= P or < -1 reads nothing (as -1) in the reference and the kernel alike;
    validate=True refuses it by name."""
    q, keys, vals, topk = make_inputs(2, 2, 4, 2, 8, 20, 6, gen)
    bad = topk.clone()
    bad[0, 1, 2], bad[1, 0, 3], bad[1, 1, 1] = 20, 1 << 30, -7
    padded = torch.where((bad < 0) | (bad >= 20), -1, bad)
    want = topk_attention_ref(q, keys, vals, padded)
    torch.testing.assert_close(topk_attention_ref(q, keys, vals, bad), want)
    dev = torch.device(triton_device)
    got = ops.topk_attention(*(t.to(dev) for t in (q, keys, vals, bad)), validate=False)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"topk: expected positions in \[0, P = 20\)"):
        ops.topk_attention(q, keys, vals, bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bf16 caches as the proxy decodes)")
@pytest.mark.parametrize("qk_mma", [False, True])  # the scores as float32 FMAs, or on the tensor cores
def test_triton_bf16_matches_the_reference_on_cuda(qk_mma, gen, monkeypatch):
    from spin_indexer.ops import topk_attention_triton as tat
    monkeypatch.setattr(tat, "QK_MMA", qk_mma)
    q, keys, vals, topk = (t.cuda() for t in make_inputs(4, 1, 9, 3, 64, 5000, 512, gen, dtype=torch.bfloat16))
    got = ops.topk_attention(q, keys, vals, topk)
    torch.testing.assert_close(got.float(), topk_attention_ref(q, keys, vals, topk).float(), rtol=2e-2, atol=2e-2)


def test_bad_arguments_are_named(gen):
    q, keys, vals, topk = make_inputs(2, 1, 4, 2, 8, 20, 6, gen)
    with pytest.raises(ValueError, match="keys: expected shape"):
        ops.topk_attention(q, keys[:, :, :, :4], vals, topk)
    with pytest.raises(ValueError, match="keys: expected shape"):
        ops.topk_attention(q, torch.cat([keys, keys[:, :, :1]], 2), vals, topk)  # 3 KV heads for 4 query heads
    with pytest.raises(TypeError, match="vals"):
        ops.topk_attention(q, keys, vals.double(), topk)
    with pytest.raises(TypeError, match="topk"):
        ops.topk_attention(q, keys, vals, topk.long())
    with pytest.raises(ValueError, match="topk: expected shape"):
        ops.topk_attention(q, keys, vals, topk[:1])
