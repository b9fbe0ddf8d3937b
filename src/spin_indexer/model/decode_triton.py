"""Fused kernels of the proxy model's decode step (decode.py), one launch each where the torch forms run several.

At decode sizes (32-96 rows of 576 values) a step's cost is its launches, not its bytes: run 171's profile of the
32 x 32K step counted 58 launches a layer, ~2.5-3 us each whatever they move (an RMSNorm alone was 8 of them:
cast, square, mean, add, rsqrt, product, cast, product). Run 172: 631 launches a step instead of 1749, dense's
step 7.25 -> 4.59 ms at 32 x 32K (H100). Serving engines fuse these (vLLM's fused_add_rms_norm,
silu_and_mul, rotary + cache write); so does this proxy, so that its indexer is the share of the step it is in
an engine, and SPIN's gain on it is measured against a step of engine-like cost. Each kernel computes what its
torch form in llama.py / indexer_head.py computes, rounding where it rounds (x's dtype after every op);
reductions sum in another order (tested within a few ulps). CUDA only: the callers run the torch forms elsewhere,
and where a function returns None.

- `add_rms_norm`: x + delta (the residual stream), then RMSNorm of the sum: both outputs, one pass.
- `silu_mul`: SwiGLU's silu(gate) * up over the merged gate / up projection.
- `rope_qkv_into_cache`: the merged q / k / v projection rotated (q, k) and k, v stored at their cache rows.
- `index_keys_into_cache`: the indexer's keys: LayerNorm, partial RoPE in float32, FP8 quantization, the paged
  cache's bytes (ops.quantize_and_write's layout and rules).
- `index_queries`: the indexer's queries: partial RoPE in float32, FP8 per (row, head) with the scale folded
  into the head weights (indexer_head.quantize_queries).
"""
from __future__ import annotations

import torch

from ..layout import FP8_DTYPE, FP8_MAX, SCALE_FLOOR

try:
    import triton
    import triton.language as tl

    from ..ops.fp8_triton import pow2_scale, to_e4m3
    from ..ops.kv_cache_triton import store_in_slots
    from .rope_triton import partner, rotate_half
except ImportError:  # pragma: no cover - the callers use the torch forms where triton is absent
    triton = None

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# heads of one row a program quantizes: DSA's 64 x 128 query row in four programs (run 172: one program a row,
# 32 programs for 32 rows, took 6.8 us a layer, the largest of these kernels)
_HEADS_A_PROGRAM = 16


def _takes(*tensors: torch.Tensor) -> bool:
    """Whether these kernels take the tensors: triton present, float dtypes, no autograd recording (the kernels have
    no backward). The device is the callers' choice (llama.fused_kernels: CUDA; tests: the interpreter's CPU)."""
    return triton is not None and all(t.dtype in _DTYPES and not (t.requires_grad and torch.is_grad_enabled())
                                      for t in tensors)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] as rows [R, C] with unit stride along C (a view where it can be, as the kernels index them)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x, delta [..., dim] (delta None: none), weight [dim] -> (s = x + delta, rms_norm(s, weight, eps)), both in
    x's dtype, or None where the kernel does not take them."""
    if not _takes(x, weight) or (delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype)) \
            or weight.shape != (x.shape[-1],):
        return None
    dim = x.shape[-1]
    x2 = _rows(x)
    d2 = x2 if delta is None else _rows(delta)
    weight = weight.contiguous()
    total, normed = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        _add_rms_norm_kernel[(x2.shape[0],)](x2, d2, weight, total, normed, x2.stride(0), d2.stride(0), eps,
                                             DIM=dim, DP=triton.next_power_of_2(dim), ADD=delta is not None,
                                             enable_fp_fusion=False)
    return total.view(x.shape), normed.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [..., 2F] (gate then up, one GEMM's output) -> silu(gate) * up [..., F] in its dtype."""
    if not _takes(gate_up) or gate_up.shape[-1] % 2:
        return None
    f = gate_up.shape[-1] // 2
    g2 = _rows(gate_up)
    out = torch.empty(g2.shape[0], f, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(f))
    if g2.shape[0]:
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(f, block))](g2, out, g2.stride(0), F=f, BLOCK=block,
                                                               enable_fp_fusion=False)
    return out.view(*gate_up.shape[:-1], f)


def rope_qkv_into_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, pos: torch.Tensor, heads: int) -> torch.Tensor | None:
    """The step's attention inputs in one pass.

    qkv [B, N, (heads + 2 Hkv) * d] (the merged projection: q heads, then k, then v); cos / sin float32 [B, N, 1,
    d] (Rope.at of the rows' positions); k_cache / v_cache [B, P, Hkv, d] contiguous, qkv's dtype; pos int64
    [B, N] (each row's cache position). Stores rotated k and v at [b, pos[b, n]] (a position outside [0, P)
    stores nothing) and returns rotated q [B, N, heads, d], or None where the kernel does not take the inputs.
    """
    b, n, width = qkv.shape
    _, p, hkv, d = k_cache.shape
    if not _takes(qkv) or width != (heads + 2 * hkv) * d or v_cache.shape != k_cache.shape \
            or k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype or not k_cache.is_contiguous() \
            or not v_cache.is_contiguous() or k_cache.shape[0] != b or cos.shape != (b, n, 1, d) \
            or sin.shape != cos.shape or pos.shape != (b, n) or qkv.stride(-1) != 1:
        return None
    q = torch.empty(b, n, heads, d, dtype=qkv.dtype, device=qkv.device)
    if b * n:
        _rope_qkv_kernel[(b * n,)](qkv, qkv.stride(1), qkv.stride(0), cos.contiguous(), sin.contiguous(),
                                   pos.contiguous(), q, k_cache, v_cache, n, p, HQ=heads, HKV=hkv, D=d,
                                   HQP=triton.next_power_of_2(heads), HKVP=triton.next_power_of_2(hkv),
                                   DP=triton.next_power_of_2(d), enable_fp_fusion=False)
    return q


def index_keys_into_cache(keys: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                          cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                          slots: torch.Tensor) -> bool:
    """The indexer's keys into the paged cache in one pass: LayerNorm (in keys' dtype, as nn.LayerNorm), then
    float32, RoPE on the first rope_dim dims, FP8 with a power-of-two scale per token stored at slots[r]
    (ops.quantize_and_write's layout; a negative slot or one past the cache stores nothing).

    keys [R, D] (rows of the key projection, unit stride along D); ln_weight / ln_bias [D]; cos / sin float32
    [R, rope_dim]; kv_cache uint8 [num_blocks, T, 1, D + 4] with 4-byte aligned scales
    (ops.kv_cache_triton.writes_directly); slots int [R]. returns False (nothing written) where it does not take
    the inputs."""
    from ..ops.kv_cache_triton import writes_directly

    r, dim = keys.shape
    rope_dim = cos.shape[-1]
    if not _takes(keys, ln_weight, ln_bias) or keys.stride(1) != 1 or ln_weight.shape != (dim,) \
            or ln_bias.shape != (dim,) or cos.shape != (r, rope_dim) or sin.shape != cos.shape or rope_dim % 2 \
            or rope_dim > dim or kv_cache.dtype != torch.uint8 or kv_cache.shape[2:] != (1, dim + 4) \
            or not kv_cache.is_contiguous() or not writes_directly(kv_cache) or slots.shape != (r,):
        return False
    if r:
        flat = kv_cache.view(-1)
        _index_keys_kernel[(r,)](keys, keys.stride(0), ln_weight, ln_bias, eps, cos.contiguous(),
                                 sin.contiguous(), flat.view(FP8_DTYPE), flat.view(torch.float32), slots,
                                 kv_cache.shape[0] * kv_cache.shape[1], D=dim, DP=triton.next_power_of_2(dim),
                                 RD=rope_dim, T=kv_cache.shape[1], FP8_MAX_=FP8_MAX,
                                 FLOOR=SCALE_FLOOR, enable_fp_fusion=False)
    return True


def index_queries(q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  w_scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The indexer's FP8 queries and head weights in one pass: q to float32, RoPE on its first rope_dim dims, FP8
    with a power-of-two scale per (row, head) (ops.quantize_keys' rule), weights = w.float() * w_scale * scale.

    q [R, H, D] (unit stride along D, heads contiguous); w [R, H] (any row stride); cos / sin float32 [R,
    rope_dim]. returns (q_fp8 float8_e4m3fn [R, H, D], weights float32 [R, H]) or None where it does not take
    them."""
    r, h, dim = q.shape
    rope_dim = cos.shape[-1]
    if not _takes(q, w) or q.stride(2) != 1 or q.stride(1) != dim or w.shape != (r, h) or w.stride(1) != 1 \
            or cos.shape != (r, rope_dim) or sin.shape != cos.shape or rope_dim % 2 or rope_dim > dim:
        return None
    q_fp8 = torch.empty(r, h, dim, dtype=FP8_DTYPE, device=q.device)
    weights = torch.empty(r, h, dtype=torch.float32, device=q.device)
    if r:
        heads = min(triton.next_power_of_2(h), _HEADS_A_PROGRAM)
        _index_queries_kernel[(r, triton.cdiv(h, heads))](q, q.stride(0), w, w.stride(0), w_scale, cos.contiguous(),
                                                          sin.contiguous(), q_fp8, weights, H=h, HB=heads, D=dim,
                                                          DP=triton.next_power_of_2(dim), RD=rope_dim,
                                                          FP8_MAX_=FP8_MAX, FLOOR=SCALE_FLOOR,
                                                          enable_fp_fusion=False)
    return q_fp8, weights


if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, total_ptr, normed_ptr, x_stride, d_stride, eps,
                             DIM: tl.constexpr, DP: tl.constexpr, ADD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, DP)
        ok = cols < DIM
        x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
        if ADD:  # the residual add, rounded to x's dtype as torch's add
            x = (x.to(tl.float32) + tl.load(d_ptr + row * d_stride + cols, mask=ok, other=0.0).to(tl.float32)
                 ).to(x.dtype)
        x32 = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / DIM + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        normed = ((x32 * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)).to(x.dtype)
        tl.store(total_ptr + row * DIM + cols, x, mask=ok)
        tl.store(normed_ptr + row * DIM + cols, normed, mask=ok)

    @triton.jit
    def _silu_mul_kernel(g_ptr, out_ptr, g_stride, F: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < F
        g = tl.load(g_ptr + row * g_stride + cols, mask=ok, other=0.0)
        u = tl.load(g_ptr + row * g_stride + F + cols, mask=ok, other=0.0)
        g32 = g.to(tl.float32)
        silu = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)  # F.silu, rounded to the input's dtype
        tl.store(out_ptr + row * F + cols, (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)

    @triton.jit
    def _rope_qkv_kernel(qkv_ptr, row_stride, req_stride, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, n, p,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HQP: tl.constexpr,
                         HKVP: tl.constexpr, DP: tl.constexpr):
        r = tl.program_id(0)
        b = r // n
        src = qkv_ptr + b.to(tl.int64) * req_stride + (r % n).to(tl.int64) * row_stride
        dd = tl.arange(0, DP)[None, :]
        dim_ok = dd < D
        c = tl.load(cos_ptr + r.to(tl.int64) * D + dd, mask=dim_ok, other=0.0)
        s = tl.load(sin_ptr + r.to(tl.int64) * D + dd, mask=dim_ok, other=0.0)
        pd = partner(dd, D)
        # q heads: rotated into q [R, HQ, D]
        hq = tl.arange(0, HQP)[:, None]
        ok = (hq < HQ) & dim_ok
        x = tl.load(src + hq * D + dd, mask=ok, other=0.0)
        xp = tl.load(src + hq * D + pd, mask=ok, other=0.0)
        y = rotate_half(x, xp, c.to(x.dtype), s.to(x.dtype), dd, D)
        tl.store(q_ptr + r.to(tl.int64) * HQ * D + hq * D + dd, y, mask=ok)
        # k (rotated) and v at the row's cache position
        pos = tl.load(pos_ptr + r)
        hk = tl.arange(0, HKVP)[:, None]
        pos2 = tl.zeros([HKVP, DP], dtype=tl.int64) + pos  # the position at every element: a full-shape mask
        ok = (hk < HKV) & dim_ok & (pos2 >= 0) & (pos2 < p)
        dst = (b.to(tl.int64) * p + pos) * HKV * D + hk * D + dd
        k = tl.load(src + (HQ + hk) * D + dd, mask=ok, other=0.0)
        kp = tl.load(src + (HQ + hk) * D + pd, mask=ok, other=0.0)
        tl.store(k_ptr + dst, rotate_half(k, kp, c.to(k.dtype), s.to(k.dtype), dd, D), mask=ok)
        tl.store(v_ptr + dst, tl.load(src + (HQ + HKV + hk) * D + dd, mask=ok, other=0.0), mask=ok)

    @triton.jit
    def _index_keys_kernel(k_ptr, k_stride, lw_ptr, lb_ptr, eps, cos_ptr, sin_ptr, fp8_ptr, f32_ptr, slot_ptr,
                           num_slots, D: tl.constexpr, DP: tl.constexpr, RD: tl.constexpr, T: tl.constexpr,
                           FP8_MAX_: tl.constexpr, FLOOR: tl.constexpr):
        """Program r: key row r as a [1, DP] tile (the cache store takes rows)."""
        r = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, DP)
        dd = d[None, :]
        ok = dd < D
        raw = tl.load(k_ptr + r * k_stride + dd, mask=ok, other=0.0)
        x = raw.to(tl.float32)
        mean = tl.sum(x, axis=1)[:, None] / D
        xc = tl.where(ok, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1)[:, None] / D + eps)
        lw = tl.load(lw_ptr + dd, mask=ok, other=0.0).to(tl.float32)
        lb = tl.load(lb_ptr + dd, mask=ok, other=0.0).to(tl.float32)
        y = (xc * rstd * lw + lb).to(raw.dtype).to(tl.float32)  # nn.LayerNorm's output, then .float()
        if RD > 0:  # the partner dims' LayerNorm from the same row statistics (a second, gathered load)
            pd = partner(dd, RD)
            xp = tl.load(k_ptr + r * k_stride + pd, mask=ok, other=0.0).to(tl.float32)
            lwp = tl.load(lw_ptr + pd, mask=ok, other=0.0).to(tl.float32)
            lbp = tl.load(lb_ptr + pd, mask=ok, other=0.0).to(tl.float32)
            yp = ((xp - mean) * rstd * lwp + lbp).to(raw.dtype).to(tl.float32)
            c = tl.load(cos_ptr + r * RD + dd, mask=dd < RD, other=0.0)
            s = tl.load(sin_ptr + r * RD + dd, mask=dd < RD, other=0.0)
            y = rotate_half(y, yp, c, s, dd, RD)
        y = tl.where(ok, y, 0.0)
        scale = pow2_scale(tl.max(tl.abs(y), axis=1), FP8_MAX_, FLOOR)  # [1]
        slot = tl.load(slot_ptr + r + tl.arange(0, 1))  # [1]
        store_in_slots(fp8_ptr, f32_ptr, slot, to_e4m3(y, scale[:, None], FP8_MAX_), scale, d, num_slots, D, T)

    @triton.jit
    def _index_queries_kernel(q_ptr, q_stride, w_ptr, w_stride, w_scale, cos_ptr, sin_ptr, fp8_ptr, weights_ptr,
                              H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                              RD: tl.constexpr, FP8_MAX_: tl.constexpr, FLOOR: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        h1 = tl.program_id(1) * HB + tl.arange(0, HB)  # this program's heads
        hh = h1[:, None]
        dd = tl.arange(0, DP)[None, :]
        ok = (hh < H) & (dd < D)
        x = tl.load(q_ptr + r * q_stride + hh * D + dd, mask=ok, other=0.0).to(tl.float32)
        if RD > 0:
            xp = tl.load(q_ptr + r * q_stride + hh * D + partner(dd, RD), mask=ok, other=0.0).to(tl.float32)
            c = tl.load(cos_ptr + r * RD + dd, mask=dd < RD, other=0.0)
            s = tl.load(sin_ptr + r * RD + dd, mask=dd < RD, other=0.0)
            x = rotate_half(x, xp, c, s, dd, RD)
        scale = pow2_scale(tl.max(tl.abs(x), axis=1), FP8_MAX_, FLOOR)  # [HB]
        tl.store(fp8_ptr + r * H * D + hh * D + dd, to_e4m3(x, scale[:, None], FP8_MAX_), mask=ok)
        w = tl.load(w_ptr + r * w_stride + h1, mask=h1 < H, other=0.0).to(tl.float32)
        tl.store(weights_ptr + r * H + h1, (w * w_scale) * scale, mask=h1 < H)
