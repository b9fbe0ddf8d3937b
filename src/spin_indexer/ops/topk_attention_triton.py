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

Split over the selection (flash-decoding): with few (row, KV head) programs for the GPU, each program's chain of
K / KB dependent gathers is the time (96 x 3 = 288 programs at 96 x 32K, 8 chunks each). `splits_for` cuts each
(row, KV head)'s K positions into up to K / KB splits so that about SPLIT_TARGET_PROGRAMS programs gather at
once; every split writes its float32 (max, sum, weighted values) and a second launch merges them (the online
softmax's rescaling, in split order). One split is the single-launch kernel above, unchanged.
Prediction (not yet measured on the H200): 96 x 32K, K = 512: 2304 programs of one chunk each, ~10-20 us + the
merge (~3 us: 96 x 9 x 8 x 66 floats) against 89 us.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the package only imports this module where triton exists
    triton = None

KB = 128  # selected tokens per chunk (the dots' N and K dims); 64 before the scores moved to the tensor cores
GQ = 16  # query heads per program, padded: the smallest M of tl.dot
NUM_WARPS = 4
NUM_STAGES = 1  # no pipelining of the chunk loop (run 55)
SPLIT_TARGET_PROGRAMS = 2048  # (row, KV head, split) programs gathering at once: ~15 of 4 warps per SM
# 16-bit q / keys: the scores q . k on the tensor cores (products of two bf16 / fp16 values are exact in float32,
# accumulated in float32: the ieee dot's result up to summation order) instead of float32 FMAs; the weighted sum
# of the values stays an ieee float32 dot (the probabilities are float32). Run 173 (H100, 32 x 32K, K = 512, bf16):
# 30.9 us -> 19.1 at KB = 64, 14.6 at KB = 128 (the float32 FMAs, not the gathers, were the time); same max error
QK_MMA = True


def splits_for(rows: int, kv_heads: int, k: int) -> int:
    """Splits of each (row, KV head)'s K selected positions: enough for ~SPLIT_TARGET_PROGRAMS programs, at most
    one per KB-position chunk (1: the single-launch kernel)."""
    chunks = -(-k // KB)
    return max(1, min(chunks, -(-SPLIT_TARGET_PROGRAMS // max(rows * kv_heads, 1))))


def topk_attention_triton(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                          topk: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """Same contract as topk_attention_ref (arguments checked by the caller, ops.topk_attention).
    splits: of each row's K positions (default `splits_for`; 1 = one launch, no merge)."""
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
    chunks = -(-k // KB)
    splits = min(max(1, splits or splits_for(b * n, hkv, k)), chunks)
    per = -(-chunks // splits) * KB  # positions per split, a whole number of chunks
    splits = -(-k // per)  # no empty split
    gp, dp = max(GQ, triton.next_power_of_2(groups)), max(16, triton.next_power_of_2(d))
    if splits == 1:
        part_acc = part_ml = out  # unused pointers
    else:
        part_acc = torch.empty(b * n * hkv * splits * gp * dp, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b * n * hkv * splits * 2 * gp, dtype=torch.float32, device=q.device)
    _topk_attention_kernel[(b * n, hkv, splits)](
        q, keys, vals, topk, out, part_acc, part_ml, n, k, per, keys.shape[1], keys.stride(0), keys.stride(1),
        keys.stride(2), keys.stride(3), vals.stride(0), vals.stride(1), vals.stride(2), vals.stride(3), d ** -0.5,
        G=groups, GP=gp, D=d, DP=dp, KB=KB, SPLIT=splits > 1,
        QK16=QK_MMA and q.dtype in (torch.bfloat16, torch.float16) and keys.dtype == q.dtype,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if splits > 1:
        _merge_splits_kernel[(b * n, hkv)](part_acc, part_ml, out, splits, G=groups, GP=gp, D=d, DP=dp,
                                           num_warps=NUM_WARPS)
    return out


if triton is not None:
    @triton.jit
    def _topk_attention_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, acc_ptr, ml_ptr, n, num_sel, per, num_pos,
                               ks_b, ks_p, ks_h, ks_d, vs_b, vs_p, vs_h, vs_d, scale, G: tl.constexpr,
                               GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, KB: tl.constexpr,
                               SPLIT: tl.constexpr, QK16: tl.constexpr):
        """Program (row, h, split): query heads h * G ... h * G + G - 1 of row = b * N + j over KV head h and
        the selected positions [split * per, split * per + per); SPLIT: store the split's (max, sum, weighted
        values) for _merge_splits_kernel, else the output."""
        row = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        b = row // n
        g = tl.arange(0, GP)
        dd = tl.arange(0, DP)
        hq = tl.num_programs(1) * G
        q_off = (row.to(tl.int64) * hq + h * G + g)[:, None] * D + dd[None, :]
        q_ok = (g < G)[:, None] & (dd < D)[None, :]
        qv = tl.load(q_ptr + q_off, mask=q_ok, other=0.0)  # [GP, DP]
        if not QK16:
            qv = qv.to(tl.float32)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        k_base = k_ptr + b.to(tl.int64) * ks_b + h * ks_h
        v_base = v_ptr + b.to(tl.int64) * vs_b + h * vs_h
        lo = sp * per
        hi = tl.minimum(lo + per, num_sel)
        for c in range(lo, hi, KB):
            s_i = c + tl.arange(0, KB)
            pos = tl.load(idx_ptr + row.to(tl.int64) * num_sel + s_i, mask=s_i < hi, other=-1)
            ok = (pos >= 0) & (pos < num_pos)  # padding, or outside the cache: never read
            p64 = tl.maximum(pos, 0).to(tl.int64)
            kv_ok = ok[:, None] & (dd < D)[None, :]
            kt = tl.load(k_base + p64[:, None] * ks_p + dd[None, :] * ks_d, mask=kv_ok, other=0.0)
            vt = tl.load(v_base + p64[:, None] * vs_p + dd[None, :] * vs_d, mask=kv_ok, other=0.0).to(tl.float32)
            if QK16:
                s = tl.dot(qv, tl.trans(kt), out_dtype=tl.float32) * scale  # [GP, KB]
            else:
                s = tl.dot(qv, tl.trans(kt.to(tl.float32)), input_precision="ieee") * scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: every weight is 0
            alpha = tl.exp(m - m_use)
            p = tl.exp(s - m_use[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
            m = m_new
        if SPLIT:
            part = (row.to(tl.int64) * tl.num_programs(1) + h) * tl.num_programs(2) + sp
            tl.store(acc_ptr + part * GP * DP + g[:, None] * DP + dd[None, :], acc)
            tl.store(ml_ptr + part * 2 * GP + g, m)
            tl.store(ml_ptr + part * 2 * GP + GP + g, l)
        else:
            res = acc / l[:, None]  # 0 / 0 = NaN for a row with no selected position, as the reference
            tl.store(out_ptr + q_off, res.to(out_ptr.dtype.element_ty), mask=q_ok)

    @triton.jit
    def _merge_splits_kernel(acc_ptr, ml_ptr, out_ptr, splits, G: tl.constexpr, GP: tl.constexpr,
                             D: tl.constexpr, DP: tl.constexpr):
        """Program (row, h): merges the splits' (max m, sum l, weighted values acc) of query heads h * G ... of
        row: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s. A split with nothing selected
        (m = -inf, l = acc = 0) adds nothing; a row with nothing selected at all gets NaN (-inf - -inf), as the
        reference."""
        row = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, GP)
        dd = tl.arange(0, DP)
        first = (row.to(tl.int64) * tl.num_programs(1) + h) * splits
        big_m = tl.full([GP], float("-inf"), tl.float32)
        for sp in range(0, splits):
            big_m = tl.maximum(big_m, tl.load(ml_ptr + (first + sp) * 2 * GP + g))
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        for sp in range(0, splits):
            w = tl.exp(tl.load(ml_ptr + (first + sp) * 2 * GP + g) - big_m)
            l += tl.load(ml_ptr + (first + sp) * 2 * GP + GP + g) * w
            acc += tl.load(acc_ptr + (first + sp) * GP * DP + g[:, None] * DP + dd[None, :]) * w[:, None]
        hq = tl.num_programs(1) * G
        q_off = (row.to(tl.int64) * hq + h * G + g)[:, None] * D + dd[None, :]
        q_ok = (g < G)[:, None] & (dd < D)[None, :]
        tl.store(out_ptr + q_off, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=q_ok)
