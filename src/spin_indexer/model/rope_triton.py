"""Triton twin of RotaryTables.__call__ (llama.py) and of the indexer's partial rotation: one launch per call.

The torch form of a rotation is a neg, a cat, two products and a sum (five launches; the indexer's partial form
two slices and another cat): at decode sizes those launches, not their bytes, are the cost (run 59's profile of
the proxy's step: ~22 rotation launches a layer). This kernel computes the same values in one pass: each
product and the sum rounded to x's dtype exactly as the torch ops round them (bf16: float32 products rounded to
bf16, then their float32 sum rounded; float32: no fused multiply-add, `enable_fp_fusion=False`), so the result
is bit for bit the torch form's.

One program per row of x viewed [R, H, D]: the row's cos / sin (float32, cast to x's dtype first, as the torch
form casts its tables) and its H x D values; dims past `rope_dim` are copied.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the callers use the torch form where triton is absent
    triton = None


def rotate_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor | None:
    """x [..., S, H, D] (float32 / bfloat16 / float16), cos / sin float32 [..., S, 1, rope_dim] whose leading
    dims are a suffix of x's (e.g. one position table for every request of a prefill chunk) -> rotated x (the
    first rope_dim dims rotated, the rest copied), or None where this kernel does not take the inputs (the
    caller then runs the torch form)."""
    if triton is None or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or rope_dim % 2:
        return None
    d, h = x.shape[-1], x.shape[-2]
    lead, tlead = x.shape[:-2], cos.shape[:-2]
    if cos.shape[-2:] != (1, rope_dim) or sin.shape != cos.shape or not 0 < rope_dim <= d \
            or len(tlead) > len(lead) or tuple(lead[len(lead) - len(tlead):]) != tuple(tlead):
        return None
    x = x.contiguous()
    cos, sin = cos.contiguous().float(), sin.contiguous().float()
    out = torch.empty_like(x)
    rows, table_rows = x.numel() // max(h * d, 1), cos.numel() // rope_dim
    if rows == 0:
        return out
    _rotate_kernel[(rows,)](x, cos, sin, out, table_rows, H=h, D=d, RD=rope_dim,
                            HP=triton.next_power_of_2(h), DP=triton.next_power_of_2(d), enable_fp_fusion=False)
    return out


if triton is not None:
    @triton.jit
    def partner(dd, RD: tl.constexpr):
        """The rotate-half partner of dim dd among the first RD dims: dd + RD/2 in the first half, dd - RD/2 in the
        second (past RD: dd's own, unused)."""
        half: tl.constexpr = RD // 2
        return tl.where(dd < half, dd + half, tl.where(dd < RD, dd - half, dd))

    @triton.jit
    def rotate_half(x, xp, c, s, dd, RD: tl.constexpr):
        """x with its first RD dims rotated: x * cos + (-x2, x1) * sin, given x's partner values xp (`partner`) and
        cos / sin in x's dtype; each op rounded to x's dtype as torch's elementwise kernels do (float32 math, one
        rounding per op: the kernel must run with enable_fp_fusion=False for float32)."""
        half: tl.constexpr = RD // 2
        xr = tl.where(dd < half, -xp, xp)
        a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
        b = (xr.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        y = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
        return tl.where(dd < RD, y, x)

    @triton.jit
    def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, table_rows, H: tl.constexpr, D: tl.constexpr,
                       RD: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr):
        r = tl.program_id(0)
        t = r % table_rows  # the table row of x's row (tables broadcast over x's leading dims)
        hh = tl.arange(0, HP)[:, None]
        dd = tl.arange(0, DP)[None, :]
        ok = (hh < H) & (dd < D)
        base = r.to(tl.int64) * H * D + hh * D
        x = tl.load(x_ptr + base + dd, mask=ok, other=0.0)
        xp = tl.load(x_ptr + base + partner(dd, RD), mask=ok & (dd < RD), other=0.0)
        c = tl.load(cos_ptr + t.to(tl.int64) * RD + dd, mask=dd < RD, other=0.0).to(x.dtype)
        s = tl.load(sin_ptr + t.to(tl.int64) * RD + dd, mask=dd < RD, other=0.0).to(x.dtype)
        tl.store(out_ptr + base + dd, rotate_half(x, xp, c, s, dd, RD), mask=ok)
