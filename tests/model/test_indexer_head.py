"""The lightning-indexer head on random weights: FP8 paged-cache path vs the float reference, save/load."""
from __future__ import annotations

import pytest
import torch

from spin_indexer import ops
from spin_indexer.layout import new_kv_cache
from spin_indexer.model.indexer_head import Indexer, IndexerConfig, quantize_queries, scores_float
from spin_indexer.model.llama import Rope


def _random_head(head_dim, heads, seed):
    torch.manual_seed(seed)
    cfg = IndexerConfig(dim=48, num_layers=1, num_heads=heads, head_dim=head_dim, q_rank=24, rope_dim=head_dim // 2)
    return Indexer(cfg, max_len=400)


@pytest.mark.parametrize("head_dim,heads,length,next_n", [(64, 4, 130, 1), (64, 8, 64, 2), (32, 2, 1, 1), (16, 3, 200, 4)])
def test_fp8_cache_path_matches_float_reference(head_dim, heads, length, next_n):
    idx = _random_head(head_dim, heads, seed=length + heads)
    layer = idx.layers[0]
    h = torch.randn(1, length, 48)
    pos = torch.arange(length)
    keys = layer.keys(h, pos, idx.rope)[0]  # [L, D]
    q, w = layer.queries(h[:, -next_n:], pos[-next_n:], idx.rope)  # [1, N, H, D], [1, N, H]
    # the cache: blocks in scrambled physical order, the table maps logical -> physical
    width = -(-length // 64)
    perm = torch.randperm(width + 3)[:width].to(torch.int32)
    cache = new_kv_cache(width + 3, head_dim)
    cache.fill_(0x7F)  # poison: unwritten slots would be NaN-ish garbage
    slots = perm.long()[pos // 64] * 64 + pos % 64
    ops.quantize_and_write(cache, keys, slots)
    q_fp8, weights = quantize_queries(q, w)
    seq_lens = (length - next_n + 1 + torch.arange(next_n, dtype=torch.int32)).view(1, next_n)
    got = ops.paged_indexer_logits(q_fp8, cache, weights, seq_lens, perm.view(1, width))
    ref = scores_float(q[0].double(), w[0].double(), keys.double())  # [N, L]
    for j in range(next_n):
        n = int(seq_lens[0, j])
        assert torch.isneginf(got[j, n:]).all()
        err = (got[j, :n].double() - ref[j, :n]).abs().max()
        scale = ref[j, :n].abs().max() + 1e-6
        # e4m3 has a 3-bit mantissa: each operand is within 2^-4 relative, products of two within ~13%;
        # sums of D such terms with random signs land far below that bound
        assert err / scale < 0.08, f"row {j}: relative error {float(err / scale):.3f}"
        assert torch.isfinite(got[j, :n]).all()


def test_quantize_queries_folds_positive_scale():
    q = torch.randn(2, 3, 4, 16) * torch.logspace(-3, 3, 4)[None, None, :, None]
    w = torch.randn(2, 3, 4)
    q_fp8, weights = quantize_queries(q, w)
    assert q_fp8.dtype == torch.float8_e4m3fn and weights.shape == (6, 4)
    k = torch.randn(10, 16)
    ref = scores_float(q.reshape(6, 4, 16), w.reshape(6, 4), k)
    got = scores_float(q_fp8.float().reshape(6, 4, 16), weights, k)
    assert ((got - ref).abs().max() / ref.abs().max()) < 0.1
    # the scale is a power of two and positive: signs of weights unchanged
    assert torch.equal(torch.sign(weights), torch.sign(w.reshape(6, 4)))


def test_keys_are_normed_then_roped():
    idx = _random_head(64, 4, seed=3)
    layer = idx.layers[0]
    h = torch.randn(1, 5, 48)
    k0 = layer.keys(h, torch.zeros(5, dtype=torch.long), idx.rope)[0]
    ln = layer.k_norm(layer.wk(h))[0]
    torch.testing.assert_close(k0, ln)  # position 0: RoPE is the identity
    k7 = layer.keys(h, torch.full((5,), 7), idx.rope)[0]
    torch.testing.assert_close(k7[:, 32:], ln[:, 32:])  # the content half is not rotated
    torch.testing.assert_close(k7.norm(dim=-1), ln.norm(dim=-1), rtol=1e-5, atol=1e-5)  # rotation keeps norms
    assert not torch.allclose(k7[:, :32], ln[:, :32])


def test_save_load_roundtrip(tmp_path):
    idx = _random_head(64, 4, seed=5)
    path = tmp_path / "w.safetensors"
    idx.save(path, extra={"command": "test"})
    back = Indexer.load(path, max_len=100)
    assert back.cfg == idx.cfg
    for (name, a), (_, b) in zip(idx.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(b, a.half().float(), msg=name)
    with pytest.raises(ValueError, match="indexer_config"):
        from safetensors.torch import save_file
        save_file({"x": torch.zeros(1)}, str(tmp_path / "bad.safetensors"))
        Indexer.load(tmp_path / "bad.safetensors")


def test_config_and_argument_errors():
    with pytest.raises(ValueError, match="rope_dim"):
        IndexerConfig(head_dim=64, rope_dim=65)
    with pytest.raises(ValueError, match="num_heads"):
        IndexerConfig(num_heads=0)
    with pytest.raises(ValueError, match=r"w: expected shape"):
        quantize_queries(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 3))
    with pytest.raises(ValueError, match=r"k: expected shape"):
        scores_float(torch.randn(2, 2, 8), torch.randn(2, 2), torch.randn(5, 4))


def test_rope_matches_complex_rotation():
    rope = Rope(8, 10000.0, 50)
    x = torch.randn(3, 1, 8)
    pos = torch.tensor([0, 5, 49])
    got = rope(x, pos)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).double() / 8)
    z = torch.complex(x[..., :4].double(), x[..., 4:].double()) * torch.polar(torch.ones(3, 1, 4, dtype=torch.float64),
                                                                             pos.double()[:, None, None] * inv)
    torch.testing.assert_close(got.double(), torch.cat([z.real, z.imag], -1), rtol=1e-5, atol=1e-5)


def test_rotary_tables_gathered_once_rotate_as_the_rope():
    """Rope.at(pos) (a decode step's tables, shared by every layer) rotates q and k of any dtype bit for bit as
    Rope.forward computed from the positions; its bf16 tables are cast once, then reused."""
    rope = Rope(16, 10000.0, 300)
    pos = torch.tensor([[3, 4], [250, 251]])  # [B, S]
    tables = rope.at(pos)
    for dtype in (torch.float32, torch.bfloat16):
        for heads in (1, 4):
            x = torch.randn(2, 2, heads, 16).to(dtype)
            half = torch.cat([-x[..., 8:], x[..., :8]], dim=-1)
            cos, sin = rope.cos[pos].unsqueeze(-2).to(dtype), rope.sin[pos].unsqueeze(-2).to(dtype)
            want = x * cos + half * sin
            assert torch.equal(tables(x), want) and torch.equal(rope(x, pos), want)
    cast = tables._tables[torch.bfloat16]
    tables(torch.randn(2, 2, 3, 16).to(torch.bfloat16))
    assert tables._tables[torch.bfloat16] is cast


def test_rope_yarn_flag_picks_the_rotary_table(tmp_path):
    """rope_yarn=True follows the model's YaRN factor; False keeps plain RoPE at every length. Files saved
    before the field existed load as rope_yarn=True (how they were trained and run)."""
    cfg = IndexerConfig(dim=48, num_layers=1, num_heads=2, head_dim=32, q_rank=8, rope_dim=16)
    plain = Indexer(cfg, max_len=300, yarn_factor=1.0).rope
    follows = Indexer(cfg, max_len=300, yarn_factor=4.0).rope
    fixed = Indexer(IndexerConfig(**{**cfg.__dict__, "rope_yarn": False}), max_len=300, yarn_factor=4.0).rope
    torch.testing.assert_close(fixed.cos, plain.cos)
    torch.testing.assert_close(fixed.sin, plain.sin)
    assert not torch.allclose(follows.cos, plain.cos)
    import json

    from safetensors.torch import save_file
    old_cfg = {k: v for k, v in cfg.__dict__.items() if k != "rope_yarn"}
    idx = Indexer(cfg, max_len=10)
    save_file({k: v.contiguous() for k, v in idx.state_dict().items()}, str(tmp_path / "old.safetensors"),
              metadata={"indexer_config": json.dumps(old_cfg)})
    assert Indexer.load(tmp_path / "old.safetensors").cfg.rope_yarn is True
