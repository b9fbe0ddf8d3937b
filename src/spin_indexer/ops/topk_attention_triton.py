"""Triton twin of topk_attention_ref: one program per (query row, KV head) gathers that head's selected keys
and values in chunks of KB tokens and keeps an online softmax for the Hq / Hkv query heads that share them.

Bytes: each selected token's key and value rows once per (row, KV head): 2 * K * d * 2 B (bf16), e.g. 256 KB
a program at K = 512, d = 64, against the reference's gathered copies, their float32 casts and the einsums'
permuted copies (~10 launches and ~5x the bytes). FLOPs are tiny (G * K * d * 4 a program), so the scores and
the weighted sum are float32 dots on the CUDA cores (input_precision="ieee", the G query heads padded to GQ
rows), as the reference computes them (bf16 products are exact in float32; only the summation order differs).
The gather is latency-bound (K rows of 128 B scattered over the request's P tokens): at 96 x 32K, K = 512,
89 us a layer (run 55, 424 GB/s; the torch reference 333 us) with the chunk loop not pipelined; 3 stages of
pipelining took 167 us, and larger chunks 108-142.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the package only imports this module where triton exists
    triton = None

KB = 64  # selected tokens per chunk (the dots' N and K dims)
GQ = 16  # query heads per program, padded: the smallest M of tl.dot
NUM_WARPS = 4
NUM_STAGES = 1  # no pipelining of the chunk loop (run 55)


def topk_attention_triton(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                          topk: torch.Tensor) -> torch.Tensor:
    """Same contract as topk_attention_ref (arguments checked by the caller, ops.topk_attention)."""
    b, n, hq, d = q.shape
    hkv = keys.shape[2]
    groups = hq // hkv
    q, topk = q.contiguous(), topk.contiguous()
    out = torch.empty_like(q)
    k = topk.shape[2]
    if out.numel() == 0:
        return out
    if k == 0:  # no columns: the reference's einsum over an empty axis (a -1-only row instead gives NaN)
        return out.zero_()
    _topk_attention_kernel[(b * n, hkv)](
        q, keys, vals, topk, out, n, k, keys.shape[1], keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3),
        vals.stride(0), vals.stride(1), vals.stride(2), vals.stride(3), d ** -0.5,
        G=groups, GP=max(GQ, triton.next_power_of_2(groups)), D=d, DP=max(16, triton.next_power_of_2(d)), KB=KB,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


if triton is not None:
    @triton.jit
    def _topk_attention_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, n, num_sel, num_pos, ks_b, ks_p, ks_h, ks_d,
                               vs_b, vs_p, vs_h, vs_d, scale, G: tl.constexpr, GP: tl.constexpr,
                               D: tl.constexpr, DP: tl.constexpr, KB: tl.constexpr):
        """Program (row, h): query heads h * G ... h * G + G - 1 of row = b * N + j over KV head h."""
        row = tl.program_id(0)
        h = tl.program_id(1)
        b = row // n
        g = tl.arange(0, GP)
        dd = tl.arange(0, DP)
        hq = tl.num_programs(1) * G
        q_off = (row.to(tl.int64) * hq + h * G + g)[:, None] * D + dd[None, :]
        q_ok = (g < G)[:, None] & (dd < D)[None, :]
        qv = tl.load(q_ptr + q_off, mask=q_ok, other=0.0).to(tl.float32)  # [GP, DP]
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        k_base = k_ptr + b.to(tl.int64) * ks_b + h * ks_h
        v_base = v_ptr + b.to(tl.int64) * vs_b + h * vs_h
        for c in range(0, num_sel, KB):
            s_i = c + tl.arange(0, KB)
            pos = tl.load(idx_ptr + row.to(tl.int64) * num_sel + s_i, mask=s_i < num_sel, other=-1)
            ok = (pos >= 0) & (pos < num_pos)  # padding, or outside the cache: never read
            p64 = tl.maximum(pos, 0).to(tl.int64)
            kv_ok = ok[:, None] & (dd < D)[None, :]
            kt = tl.load(k_base + p64[:, None] * ks_p + dd[None, :] * ks_d, mask=kv_ok, other=0.0).to(tl.float32)
            vt = tl.load(v_base + p64[:, None] * vs_p + dd[None, :] * vs_d, mask=kv_ok, other=0.0).to(tl.float32)
            s = tl.dot(qv, tl.trans(kt), input_precision="ieee") * scale  # [GP, KB]
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: every weight is 0
            alpha = tl.exp(m - m_use)
            p = tl.exp(s - m_use[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
            m = m_new
        res = acc / l[:, None]  # 0 / 0 = NaN for a row with no selected position, as the reference
        tl.store(out_ptr + q_off, res.to(out_ptr.dtype.element_ty), mask=q_ok)
