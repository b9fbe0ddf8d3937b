"""Decode attention over each query row's selected tokens only (the sparse attention a DSA indexer feeds):
the torch reference. GQA: query head h reads KV head h // (Hq / Hkv).

For query row (b, n) and head h, with S = the positions topk[b, n] holds in [0, P) (-1 is padding):
    out[b, n, h] = softmax_S(q[b, n, h] . keys[b, s, h_kv] / sqrt(d)) @ vals[b, S, h_kv]
in float32 from the cache's values, returned in q's dtype (a row of padding only: NaN, softmax over nothing;
K = 0: zeros, an empty sum). A position outside [0, P) counts as padding (validate=True refuses it first): no
value of topk makes a kernel read outside the cache. The Triton twin (topk_attention_triton.py) streams the
selected keys and values once per KV head.
"""
from __future__ import annotations

import torch

from ..checks import check_tensor


def check_topk_attention_args(q, keys, vals, topk, validate: bool = True) -> None:
    """Shapes, dtypes and devices (ValueError / TypeError naming the argument); with validate also the
    positions' range (a host sync)."""
    check_tensor("q", q, ndim=4)
    b, n, hq, d = q.shape
    check_tensor("keys", keys, dtype=q.dtype, ndim=4, device=q.device, device_of="q")
    if keys.shape[0] != b or keys.shape[3] != d or keys.shape[2] < 1 or hq % keys.shape[2]:
        raise ValueError(f"keys: expected shape [B, P, Hkv, d] = [{b}, P, a divisor of {hq}, {d}] for q "
                         f"{list(q.shape)}, got {list(keys.shape)}")
    check_tensor("vals", vals, dtype=q.dtype, shape=tuple(keys.shape), shape_names="[B, P, Hkv, d] (as keys)",
                 device=q.device, device_of="q")
    check_tensor("topk", topk, dtype=torch.int32, ndim=3, device=q.device, device_of="q")
    if tuple(topk.shape[:2]) != (b, n):
        raise ValueError(f"topk: expected shape [B, N, K] with [B, N] = [{b}, {n}], got {list(topk.shape)}")
    if validate and topk.numel():
        lo, hi = int(topk.min()), int(topk.max())
        if lo < -1 or hi >= keys.shape[1]:
            raise ValueError(f"topk: expected positions in [0, P = {keys.shape[1]}) or -1 (padding), got values "
                             f"in [{lo}, {hi}]")


def topk_attention_ref(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """q: [B, N, Hq, d]; keys, vals: [B, P, Hkv, d] (q's dtype); topk: int32 [B, N, K] positions < P, -1 =
    padding. returns [B, N, Hq, d] in q's dtype."""
    b, n, hq, d = q.shape
    hkv = keys.shape[2]
    pad = (topk < 0) | (topk >= keys.shape[1])  # padding, and positions outside the cache
    idx = torch.where(pad, 0, topk).long()  # gathers position 0 there, masked below
    rows = torch.arange(b, device=q.device)[:, None, None]
    k_sel = keys[rows, idx].float()  # [B, N, K, Hkv, d]
    v_sel = vals[rows, idx].float()
    qg = q.view(b, n, hkv, hq // hkv, d).float()
    logits = torch.einsum("bnhgd,bnkhd->bnhgk", qg, k_sel) * d ** -0.5
    logits = logits.masked_fill(pad[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bnhgk,bnkhd->bnhgd", probs, v_sel)
    return out.reshape(b, n, hq, d).to(q.dtype)
