"""model/decode_triton.py: each fused decode kernel against the torch form it replaces (float32 under the
interpreter, bf16 too on CUDA), the caches' untouched rows and guard bytes, and a whole decode step with the fused
kernels against the torch forms' step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_indexer, tiny_model
from spin_indexer.indexer import SpinIndexer
from spin_indexer.layout import new_kv_cache
from spin_indexer.model import indexer_head, llama
from spin_indexer.model.decode import Caches, decode_one_step, prefill
from spin_indexer.model.indexer_head import quantize_queries
from spin_indexer.model.llama import Rope, merged_weight, rms_norm
from spin_indexer.ops import dequantize_blocks, quantize_and_write
from spin_indexer.predictor import SpinConfig

pytestmark = pytest.mark.interpreter


def _dtypes(device):
    # the interpreter rounds float32 -> bf16 toward zero (test_rope_triton): bf16 on CUDA only
    return [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_add_rms_norm_is_the_torch_form(triton_device):
    from spin_indexer.model.decode_triton import add_rms_norm
    dev = torch.device(triton_device)
    for dtype in _dtypes(triton_device):
        x = (torch.randn(3, 2, 40, generator=_gen(0)) * 4).to(dtype).to(dev)
        delta = torch.randn(3, 2, 40, generator=_gen(1)).to(dtype).to(dev)
        weight = (1 + 0.2 * torch.randn(40, generator=_gen(2))).to(dtype).to(dev)
        total, normed = add_rms_norm(x, delta, weight, 1e-5)
        assert torch.equal(total, x + delta)  # the add rounds once, as torch's
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-3)
        torch.testing.assert_close(normed, rms_norm(x + delta, weight, 1e-5), **tol)
        same, normed0 = add_rms_norm(x, None, weight, 1e-5)
        assert torch.equal(same, x)
        torch.testing.assert_close(normed0, rms_norm(x, weight, 1e-5), **tol)
    strided = torch.randn(40, 6, generator=_gen(16)).to(dev).t()  # [6, 40] with stride 6 along the 40 columns
    torch.testing.assert_close(add_rms_norm(strided, strided, torch.ones(40, device=dev), 1e-5)[1],
                               rms_norm(strided + strided, torch.ones(40, device=dev), 1e-5), rtol=1e-5, atol=1e-6)
    empty = torch.zeros(0, 40, device=dev)
    assert add_rms_norm(empty, None, torch.ones(40, device=dev), 1e-5)[1].shape == (0, 40)
    assert add_rms_norm(x, None, torch.ones(41, device=dev), 1e-5) is None  # weight of another width


def test_silu_mul_is_the_torch_form(triton_device):
    from spin_indexer.model.decode_triton import silu_mul
    dev = torch.device(triton_device)
    for dtype in _dtypes(triton_device):
        gate_up = (torch.randn(5, 2, 2 * 1100, generator=_gen(3)) * 3).to(dtype).to(dev)  # two column blocks
        g, u = gate_up.chunk(2, dim=-1)
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-3)
        torch.testing.assert_close(silu_mul(gate_up), F.silu(g) * u, **tol)
    assert silu_mul(torch.randn(2, 7, device=dev)) is None  # odd width: no gate / up halves
    strided = torch.randn(8, 3, generator=_gen(17)).to(dev).t()  # [3, 8], stride 3 along the columns
    torch.testing.assert_close(silu_mul(strided), F.silu(strided[:, :4]) * strided[:, 4:], rtol=1e-6, atol=1e-6)


def test_rope_qkv_into_cache_is_the_torch_form(triton_device):
    from spin_indexer.model.decode_triton import rope_qkv_into_cache
    dev = torch.device(triton_device)
    heads, hkv, d, b, n, p = 4, 2, 16, 3, 2, 24
    rope = Rope(d, 10000.0, 64, yarn_factor=2.0, original_max=16)
    pos = torch.tensor([[5, 6], [20, 21], [23, 24]])  # the last row's second position is past the cache
    for dtype in _dtypes(triton_device):
        qkv = torch.randn(b, n, (heads + 2 * hkv) * d, generator=_gen(4)).to(dtype)
        poison = torch.randn(b, p, hkv, d, generator=_gen(5)).to(dtype)
        k_cache, v_cache = poison.clone().to(dev), (poison * 2).to(dev)
        tables = rope.at(pos)
        q = rope_qkv_into_cache(qkv.to(dev), *(t.to(dev) for t in tables.float32), k_cache, v_cache,
                                pos.to(dev), heads)
        q_ref, k_ref, v_ref = qkv.split([heads * d, hkv * d, hkv * d], dim=-1)
        assert torch.equal(q.cpu(), tables(q_ref.reshape(b, n, heads, d)))  # rotation bit for bit
        k_want, v_want = poison.clone(), poison * 2
        k_rot = tables(k_ref.reshape(b, n, hkv, d))
        for bi in range(b):
            for j in range(n):
                if pos[bi, j] < p:
                    k_want[bi, pos[bi, j]] = k_rot[bi, j]
                    v_want[bi, pos[bi, j]] = v_ref.reshape(b, n, hkv, d)[bi, j]
        assert torch.equal(k_cache.cpu(), k_want) and torch.equal(v_cache.cpu(), v_want)  # nothing else moved
    assert rope_qkv_into_cache(qkv.to(dev), *(t.to(dev) for t in tables.float32), k_cache, v_cache,
                               pos.to(dev), heads + 1) is None  # widths that do not add up


@pytest.mark.parametrize("rope_dim", [8, 0])
def test_index_keys_into_cache_is_the_torch_form(rope_dim, triton_device):
    """The fused keys against IndexerLayer.keys + ops.quantize_and_write: the same FP8 bytes but where the
    LayerNorm's sums (another order) move a value across an FP8 rounding edge; nothing outside the slots."""
    from spin_indexer.model.decode_triton import index_keys_into_cache
    dev = torch.device(triton_device)
    layer = tiny_indexer(head_dim=16).layers[0]
    with torch.no_grad():
        layer.k_norm.weight.copy_(1 + 0.3 * torch.randn(16, generator=_gen(6)))
        layer.k_norm.bias.copy_(0.2 * torch.randn(16, generator=_gen(7)))
    rope = Rope(max(rope_dim, 2), 10000.0, 256)
    rows = 70
    raw = torch.randn(rows, 16, generator=_gen(8)) * 3
    positions = torch.randint(0, 256, (rows,), generator=_gen(9))
    slots = torch.randperm(3 * 64, generator=_gen(10))[:rows]
    slots[3], slots[11] = -1, 3 * 64 + 5  # padding; a slot past the cache
    cos, sin = (t.reshape(rows, -1)[:, :rope_dim] for t in rope.at(positions).float32)
    # the torch form: LayerNorm, float, RoPE on the first rope_dim dims
    keys = layer.k_norm(raw)
    if rope_dim:
        keys = rope.at(positions).rotate(keys[:, None], rope_dim)[:, 0]
    guard = 64 * 20  # a block's bytes either side of the cache
    poison = torch.randint(0, 256, (3 * 64 * 20 + 2 * guard,), dtype=torch.uint8, generator=_gen(11))
    want = poison.clone()
    ok = slots >= 0
    ok &= slots < 3 * 64
    quantize_and_write(want[guard:-guard].view(3, 64, 1, 20), keys[ok], slots[ok])
    got = poison.clone().to(dev)
    assert index_keys_into_cache(raw.to(dev), layer.k_norm.weight.to(dev), layer.k_norm.bias.to(dev),
                                 layer.k_norm.eps, cos.to(dev), sin.to(dev), got[guard:-guard].view(3, 64, 1, 20),
                                 slots.to(dev))
    got = got.cpu()
    assert torch.equal(got[:guard], poison[:guard]) and torch.equal(got[-guard:], poison[-guard:])
    assert (got != want).float().mean() < 0.01  # rare FP8 rounding-edge flips only
    deq_got, deq_want = (dequantize_blocks(c[guard:-guard].view(3, 64, 1, 20), torch.arange(3)) for c in (got, want))
    torch.testing.assert_close(deq_got, deq_want, rtol=0.07, atol=1e-3, equal_nan=True)  # one FP8 step (poison: NaN)
    strided = torch.randn(rows, 40)[:, 4:20]  # a column slice of a wider projection
    assert index_keys_into_cache(strided.to(dev), layer.k_norm.weight.to(dev), layer.k_norm.bias.to(dev), 1e-5,
                                 cos.to(dev), sin.to(dev), got[guard:-guard].view(3, 64, 1, 20).to(dev),
                                 slots.to(dev))
    assert not index_keys_into_cache(raw.to(dev), layer.k_norm.weight.to(dev), layer.k_norm.bias.to(dev), 1e-5,
                                     cos.to(dev), sin.to(dev), new_kv_cache(3, 12, dev), slots.to(dev))


@pytest.mark.parametrize("h", [3, 20])  # one program's heads; two programs, the second part-full
def test_index_queries_is_quantize_queries_of_queries(h, triton_device):
    from spin_indexer.model.decode_triton import index_queries
    dev = torch.device(triton_device)
    rows, d, rope_dim = 6, 16, 8
    rope = Rope(rope_dim, 10000.0, 256)
    positions = torch.randint(0, 256, (rows,), generator=_gen(12))
    q = torch.randn(rows, h, d, generator=_gen(13)) * 5
    wide = torch.randn(rows, h + 9, generator=_gen(14))  # w: a column slice of a wider projection
    w = wide[:, 7:7 + h]
    scale = h ** -0.5 * d ** -0.5
    tables = rope.at(positions)
    q_rot = tables.rotate(q, rope_dim)  # [rows, h, d]
    want_fp8, want_w = quantize_queries(q_rot[:, None], (w * scale)[:, None])
    cos, sin = (t.reshape(rows, -1) for t in tables.float32)
    got_fp8, got_w = index_queries(q.to(dev), wide.to(dev)[:, 7:7 + h], cos.to(dev), sin.to(dev), scale)
    assert torch.equal(got_fp8.cpu().view(torch.uint8), want_fp8[:, 0].view(torch.uint8))
    assert torch.equal(got_w.cpu(), want_w)
    assert index_queries(q.to(dev), w.to(dev)[:, :2], cos.to(dev), sin.to(dev), scale) is None  # [R, H-1]


def test_merged_weight_follows_its_parts():
    layer = tiny_model().layers[0]
    w = merged_weight(layer, ("wq", "wk", "wv"))
    assert torch.equal(w, torch.cat([layer.wq.weight, layer.wk.weight, layer.wv.weight]))
    assert merged_weight(layer, ("wq", "wk", "wv")) is w  # cached
    with torch.no_grad():
        layer.wk.weight.add_(1.0)  # an in-place update invalidates it
    assert torch.equal(merged_weight(layer, ("wq", "wk", "wv"))[layer.wq.weight.shape[0]:][:2],
                       layer.wk.weight[:2])


@pytest.mark.parametrize("selector", ["all-keep", "spin"])
def test_decode_step_with_fused_kernels_is_the_torch_forms_step(selector, triton_device, monkeypatch):
    """Two requests at different lengths, next_n = 2, the lightning indexer: logits, the model's caches and the
    indexer's cache after a step with every fused kernel equal the torch forms' (within the fused sums' ulps)."""
    model, indexer = tiny_model(max_len=256), tiny_indexer(max_len=256)
    dev = torch.device(triton_device)
    model, indexer = model.to(dev), indexer.to(dev)
    tokens = torch.randint(0, 97, (2, 140), generator=_gen(15)).to(dev)
    outs = []
    for fused in (False, True):
        monkeypatch.setattr(llama, "fused_kernels", lambda x, fused=fused: fused)
        monkeypatch.setattr(indexer_head, "fused_kernels", lambda x, fused=fused: fused)
        caches = Caches.allocate(model, 2, 160, indexer)
        sel = None
        if selector == "spin":
            sel = SpinIndexer(SpinConfig(sparsity=0.5, topk=8, gamma=0.0, exploration="none"), num_layers=2,
                              max_batch=2, max_blocks=4, next_n=2, device=dev)
            for r in range(2):
                caches.slot_ids[r] = sel.state.allocate()
        for r, length in enumerate((120, 131)):
            prefill(model, caches, r, tokens[r, :length], indexer, chunk=70)
        step = torch.stack([tokens[0, 120:122], tokens[1, 131:133]])
        logits = decode_one_step(model, caches, step, "lightning", k=8, indexer=indexer, selector=sel)
        outs.append((logits, caches))
    (l0, c0), (l1, c1) = outs
    torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-4)
    for i in range(2):
        torch.testing.assert_close(c1.k[i], c0.k[i], rtol=1e-5, atol=1e-5)  # the merged GEMM: its own blocking
        torch.testing.assert_close(c1.v[i], c0.v[i], rtol=1e-5, atol=1e-5)
        assert (c1.index_kv[i] != c0.index_kv[i]).float().mean() < 0.01
