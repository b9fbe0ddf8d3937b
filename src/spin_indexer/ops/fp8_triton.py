"""FP8 quantization steps shared by the Triton kernels that write FP8 keys (kv_cache_triton.py: the indexer-key
cache; block_summary_triton.py: the summary cache; model/decode_triton.py: the proxy's indexer keys and queries):
bit-exact with ops.quantize_keys on the GPU and in the interpreter."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pow2_scale(amax, FP8_MAX_: tl.constexpr, FLOOR: tl.constexpr):
    """2 ** ceil(log2(max(amax, FLOOR) / FP8_MAX_)) from the float's bits (exact, as quantize_keys)."""
    x = tl.maximum(amax, FLOOR) / FP8_MAX_
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # biased exponent, rounded up
    return (exp << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(x):
    """x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, as float32 (then its fp8 conversion is
    exact). Not left to the conversion itself: the interpreter's drops the carry into the exponent (1.9375
    became 1.0, 125 became 64 on Triton 3.9), and these bits must be testable off the GPU. Adding and
    subtracting 1.5 x 2^23 spacings rounds at the spacing in the FPU's own mode (nearest, ties to even)."""
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127  # floor(log2 |x|)
    spacing = tl.maximum(exp, -6) - 3  # log2 of e4m3's spacing at |x| (fixed below 2^-6: subnormals)
    c = ((spacing + 150) << 23).to(tl.float32, bitcast=True) * 1.5  # 1.5 x 2^(spacing + 23)
    r = (tl.abs(x) + c) - c
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # x's sign


@triton.jit
def to_e4m3(x, scale, FP8_MAX_: tl.constexpr):
    """x / scale (scale: pow2_scale's, broadcast against x) clamped to +-FP8_MAX_, rounded (round_e4m3) and
    converted to float8_e4m3fn: quantize_keys' values."""
    return round_e4m3(tl.minimum(tl.maximum(x / scale, -FP8_MAX_), FP8_MAX_)).to(tl.float8e4nv)
