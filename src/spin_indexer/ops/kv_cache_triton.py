"""Triton twins of kv_cache.py's FP8 key quantization: one launch for what the torch references run as ~10
(`quantize_keys`: cast, abs, amax, clamp, log2, ceil, exp2, divide, clamp, convert) and ~20 (`quantize_and_write`:
those, then the static-shape scatter of values and scales into the paged cache).

Program p quantizes rows p * ROWS ... of keys [N, D]: each row's amax, its power-of-two scale from the float's
bits (fp8_triton.pow2_scale), the values rounded to e4m3 (fp8_triton.round_e4m3), bit for bit the references'
outputs. `quantize_and_write_triton` stores row n's D value bytes and 4 scale bytes straight into the slot
slot_mapping[n] of the cache (block slot // T, row slot % T; kv_cache.py's byte layout): a negative slot (vLLM's
-1 padding) and, with validate=False, one past the cache write nothing, so no slot mapping makes it write outside
the cache. Two rows with the same slot: one of them lands (as in the reference's scatter).
Why it matters: the decode step quantizes the indexer's queries and writes its keys in every layer; at 64 x 32K
the references' launches cost the proxy's step 2.26 ms (75 us a layer; run 170, paired: dense 11.94 -> 9.69 ms).
"""
from __future__ import annotations

import torch

from ..layout import FP8_DTYPE, FP8_MAX, SCALE_BYTES, SCALE_FLOOR

try:  # the package imports this module only for CUDA tensors (or under TRITON_INTERPRET=1 in tests)
    import triton
    import triton.language as tl

    from .fp8_triton import pow2_scale, to_e4m3
except ImportError:  # pragma: no cover
    triton = None

ELEMENTS = 2048  # key elements a program holds: 16 rows of D = 128 (16 a thread at 4 warps)


def _grid_rows(n: int, dim: int) -> tuple[int, int]:
    """(ROWS a program, programs) for n rows of dim values."""
    rows = max(1, min(ELEMENTS // triton.next_power_of_2(dim), triton.next_power_of_2(max(n, 1))))
    return rows, triton.cdiv(n, rows)


def quantize_keys_triton(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_keys on the GPU (arguments checked by the caller, ops.quantize_keys): keys [N, D] float ->
    (k_fp8 float8_e4m3fn [N, D], k_scale float32 [N])."""
    n, dim = keys.shape
    k_fp8 = torch.empty(n, dim, dtype=FP8_DTYPE, device=keys.device)
    k_scale = torch.empty(n, dtype=torch.float32, device=keys.device)
    if n:
        rows, programs = _grid_rows(n, dim)
        _quantize_kernel[(programs,)](keys, keys.stride(0), keys.stride(1), n, k_fp8, k_scale, k_scale, 0,
                                      D=dim, DP=triton.next_power_of_2(dim), ROWS=rows, T=1, CACHE=False,
                                      FP8_MAX_=FP8_MAX, FLOOR=SCALE_FLOOR, num_warps=4)
    return k_fp8, k_scale


def writes_directly(kv_cache: torch.Tensor) -> bool:
    """Whether `quantize_and_write_triton` can store into this cache: every scale 4-byte aligned (T x D and the
    page a multiple of 4 bytes, the data pointer too), as a float32 view of the cache needs."""
    _, tokens, _, row_bytes = kv_cache.shape
    dim = row_bytes - SCALE_BYTES
    return (tokens * dim) % 4 == 0 and (tokens * row_bytes) % 4 == 0 and kv_cache.data_ptr() % 4 == 0


def quantize_and_write_triton(kv_cache: torch.Tensor, keys: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """quantize_and_write on the GPU (arguments checked by the caller, ops.quantize_and_write; the cache passes
    `writes_directly`): keys [N, D] float quantized into the slots slot_mapping [N] of kv_cache uint8
    [num_blocks, T, 1, D + 4] (the caller checked the data where asked to)."""
    n, dim = keys.shape
    if n == 0:
        return
    num_blocks, tokens = kv_cache.shape[:2]
    flat = kv_cache.view(-1)
    rows, programs = _grid_rows(n, dim)
    _quantize_kernel[(programs,)](keys, keys.stride(0), keys.stride(1), n, flat.view(FP8_DTYPE),
                                  flat.view(torch.float32), slot_mapping, num_blocks * tokens,
                                  D=dim, DP=triton.next_power_of_2(dim), ROWS=rows, T=tokens, CACHE=True,
                                  FP8_MAX_=FP8_MAX, FLOOR=SCALE_FLOOR, num_warps=4)


if triton is not None:
    @triton.jit
    def store_in_slots(fp8_ptr, f32_ptr, slot, vals, scale, d, num_slots, D: tl.constexpr, T: tl.constexpr):
        """Rows' FP8 values vals [R, DP] and scales scale [R] into their cache slots slot [R] (fp8_ptr / f32_ptr: the
        cache's bytes as fp8 / float32; kv_cache.py's layout: the block's T x D values, then its T scales). A
        negative slot (padding) or one past the cache (>= num_slots) stores nothing; d: the dims [DP], D of them."""
        slot = slot.to(tl.int64)
        ok = (slot >= 0) & (slot < num_slots)
        page = (slot // T) * (T * (D + 4))  # the block's first byte
        row = slot % T
        tl.store(fp8_ptr + (page + row * D)[:, None] + d[None, :], vals, mask=ok[:, None] & (d < D)[None, :])
        tl.store(f32_ptr + (page + T * D + row * 4) // 4, scale, mask=ok)

    @triton.jit
    def _quantize_kernel(keys_ptr, stride_row, stride_col, n, fp8_ptr, f32_ptr, slot_ptr, num_slots,
                         D: tl.constexpr, DP: tl.constexpr, ROWS: tl.constexpr, T: tl.constexpr,
                         CACHE: tl.constexpr, FP8_MAX_: tl.constexpr, FLOOR: tl.constexpr):
        """Rows pid * ROWS ... of keys. CACHE: fp8_ptr / f32_ptr are the cache's bytes as fp8 / float32 and row r
        goes to slot slot_ptr[r]; else they are k_fp8 [N, D] and k_scale [N] (slot_ptr unused)."""
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        d = tl.arange(0, DP)
        live = r < n
        mask = live[:, None] & (d < D)[None, :]
        x = tl.load(keys_ptr + r.to(tl.int64)[:, None] * stride_row + d[None, :] * stride_col, mask=mask,
                    other=0.0).to(tl.float32)
        scale = pow2_scale(tl.max(tl.abs(x), axis=1), FP8_MAX_, FLOOR)  # [ROWS]
        vals = to_e4m3(x, scale[:, None], FP8_MAX_)
        if CACHE:
            slot = tl.load(slot_ptr + r, mask=live, other=-1)
            store_in_slots(fp8_ptr, f32_ptr, slot, vals, scale, d, num_slots, D, T)
        else:
            tl.store(fp8_ptr + r.to(tl.int64)[:, None] * D + d[None, :], vals, mask=mask)
            tl.store(f32_ptr + r, scale, mask=live)
