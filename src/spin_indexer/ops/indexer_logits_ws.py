"""Experimental (issue #17, not a production path): the paged logits kernel under Triton's warp specialization.

Why: at next_n >= 2 the production kernel (indexer_logits_triton.py) runs each block's MMA, its wait and the
epilogue (ReLU, weights, head sum for next_n rows) in series inside one warpgroup, 3 programs an SM; it measures
1.31x DeepGEMM's time at next_n = 2 (run 70) while the bytes allow ~1.0x. Triton (3.6, sm_90a) can split a
loop marked `warp_specialize=True` into a producer warpgroup that issues the TMA copies and consumer warpgroups
that take turns on the MMA and epilogue (checked in the PTX: `setmaxnreg` 40 for the producer, 232 for two
consumers, each consumer's MMA of one block beside the other's epilogue: `benchmarks/logits_registers.py --ws`).
Its limits in 3.6 shape this kernel: q loaded by pointers before the loop and staged to shared memory for the
MMA makes the split assert ("capturing tensor values into warp partitions"), so q comes through a second TMA
descriptor, once, before the loop (the producer copies it, the consumers wait for it once); scalar min / max in
the loop abort it too (the id clamp is a select). The weights and lengths, register tensors defined before the
loop, are fine. At next_n = 4 the 3.6 split fails to compile (logits_registers.py --ws). Only full powers of two: next_n in {1, 2, 4}, pages a whole number of D-byte rows (the 2D key descriptor),
no fused EMA update; everything else is the production kernel's. Whether it is faster is for the H200 to say
(`bench_mtp_logits.py`, provider `own_ws`).

The math is the production kernel's: logits[r, t] = scale[t] * sum_h w[r, h] * relu(k[t] . q[r, h]), -inf past
each row's length; block maxima of the written logits; blocks past the request's longest row are left unwritten
(fill_tail=False) or set to -inf (fill_tail=True).
"""
from __future__ import annotations

import torch

from ..layout import page_stride_bytes
from .indexer_logits import check_paged_indexer_args
from .indexer_logits_triton import _cache_args, _pick_chunk

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def supports(q_fp8: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes: next_n in {1, 2, 4}, H and D powers of two with H >= 16, D >= 32
    and next_n x H <= 256 (one TMA box, one MMA), pages a whole number of D-byte rows."""
    _, next_n, heads, dim = q_fp8.shape
    def pow2(x):
        return x > 0 and x & (x - 1) == 0
    return (next_n in (1, 2, 4) and pow2(heads) and heads >= 16 and pow2(dim) and dim >= 32
            and next_n * heads <= 256 and page_stride_bytes(kv_cache) % dim == 0)


def paged_indexer_logits_ws(q_fp8: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                            seq_lens: torch.Tensor, block_table: torch.Tensor, validate: bool = True,
                            out: torch.Tensor | None = None, block_max_out: torch.Tensor | None = None,
                            fill_tail: bool = True, chunk: int | None = None, num_stages: int = 3,
                            warp_specialize: bool = True) -> torch.Tensor:
    """Paged indexer logits as `paged_indexer_logits_triton` (same arguments and outputs, no history or group
    maxima). q_fp8: float8_e4m3fn [B, next_n, H, D]; kv_cache: uint8 [num_blocks, T, 1, D + 4]; weights:
    float32 [B*next_n, H]; seq_lens: int32 [B, next_n]; block_table: int32 [B, W]; out: float32
    [B*next_n, W*T]; block_max_out: float32 [B*next_n, W]. warp_specialize=False compiles the same loop without
    the split (the A/B for the benchmark). Raises ValueError for shapes `supports` rejects.
    returns out: float32 [B*next_n, W*T]."""
    check_paged_indexer_args(q_fp8, kv_cache, weights, seq_lens, block_table, validate)
    if not supports(q_fp8, kv_cache):
        raise ValueError(f"q_fp8 / kv_cache: the warp-specialized kernel takes next_n in (1, 2, 4), H and D powers "
                         f"of two (H >= 16, D >= 32, next_n x H <= 256) and pages a whole number of D-byte rows; "
                         f"got q_fp8 {list(q_fp8.shape)}, kv_cache {list(kv_cache.shape)}")
    from triton.tools.tensor_descriptor import TensorDescriptor
    batch, next_n, heads, dim = q_fp8.shape
    tokens, width = kv_cache.shape[1], block_table.shape[1]
    rows = batch * next_n
    dev = q_fp8.device
    if out is None:
        out = torch.empty(rows, width * tokens, dtype=torch.float32, device=dev)
    if block_max_out is None:
        block_max_out = torch.empty(rows, width, dtype=torch.float32, device=dev)
    for name, t, shape in (("out", out, (rows, width * tokens)), ("block_max_out", block_max_out, (rows, width))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or t.stride(1) != 1 or t.device != dev:
            raise ValueError(f"{name}: expected float32 {list(shape)} with unit column stride on {dev}, got "
                             f"{t.dtype} {list(t.shape)} strides {t.stride()} on {t.device}")
    if batch == 0 or width == 0:
        return out
    k_desc, scales_f32, page_bytes, rows_per_block = _cache_args(kv_cache, tokens, dim)
    q = q_fp8 if q_fp8.is_contiguous() else q_fp8.contiguous()
    q_desc = TensorDescriptor(base=q.view(rows * heads, dim), shape=[rows * heads, dim], strides=[dim, 1],
                              block_shape=[next_n * heads, dim])
    w = weights if weights.is_contiguous() else weights.contiguous()
    lens = seq_lens if seq_lens.is_contiguous() else seq_lens.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    # one 12-warp program an SM (168 registers x 384 threads): long programs, <= 1024 of them by default
    chunk = chunk or _pick_chunk(batch, width, target_programs=1024)
    _ws_logits_kernel[(batch, triton.cdiv(width, chunk))](
        q_desc, k_desc, scales_f32, w, lens, block_table, out, block_max_out, width, block_table.stride(0),
        out.stride(0), block_max_out.stride(0), chunk, kv_cache.shape[0],
        NEXT_N=next_n, H=heads, D=dim, T=tokens, PAGE_BYTES=page_bytes, RB=rows_per_block, FILL_TAIL=fill_tail,
        STAGES=num_stages, WS=warp_specialize, num_warps=4)
    return out


if triton is not None:
    @triton.jit
    def _ws_logits_kernel(q_desc, k_desc, scale_ptr, w_ptr, lens_ptr, table_ptr, out_ptr, bmax_ptr, width,
                          stride_table, out_stride, bmax_stride, chunk, num_cache_blocks,
                          NEXT_N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                          PAGE_BYTES: tl.constexpr, RB: tl.constexpr, FILL_TAIL: tl.constexpr,
                          STAGES: tl.constexpr, WS: tl.constexpr):
        """Program (b, c): request b's blocks [c * chunk, (c + 1) * chunk) below its longest row, all next_n
        rows in one [T, next_n * H] MMA a block (tokens on M, (row, head) pairs on N: the head sum stays in a
        thread quad)."""
        b = tl.program_id(0)
        blk0 = tl.program_id(1) * chunk
        r = tl.arange(0, NEXT_N)
        row0 = b * NEXT_N
        lens = tl.load(lens_ptr + row0 + r)  # [NEXT_N]
        rows64 = (row0 + r).to(tl.int64)
        used = (tl.max(lens, axis=0) + T - 1) // T
        blk_end = tl.minimum(blk0 + chunk, used)
        w = tl.load(w_ptr + row0 * H + tl.arange(0, NEXT_N * H))  # [NEXT_N * H]: column g * H + h
        offs_t = tl.arange(0, T)
        ids = table_ptr + b.to(tl.int64) * stride_table
        SCALE_OFF: tl.constexpr = T * D // 4  # a block's scales follow its T * D key bytes (fp32 units)
        PAGE_F32: tl.constexpr = PAGE_BYTES // 4
        # q through its TMA descriptor before the loop: the split keeps it in shared memory for the consumers
        # (a pointer load here, staged to shared memory for the MMA, makes the 3.6 split assert)
        q = q_desc.load([row0 * H, 0])  # [NEXT_N * H, D] fp8
        for blk in tl.range(blk0, blk_end, num_stages=STAGES, warp_specialize=WS):
            # ids outside the cache read block 0 (validate=False: a bad table gives wrong logits, never a read
            # outside). A select, not min / max: the 3.6 split aborts on the scalar min / max ("unsupported op
            # type", WSDataPartition)
            raw = tl.load(ids + blk)
            phys = tl.where((raw >= 0) & (raw < num_cache_blocks), raw, 0)
            k = k_desc.load([phys * RB, 0])  # [T, D] fp8
            sc = tl.load(scale_ptr + phys.to(tl.int64) * PAGE_F32 + SCALE_OFF + offs_t)
            s = tl.maximum(tl.dot(k, tl.trans(q)), 0.0) * w[None, :]  # [T, NEXT_N * H]
            x = tl.sum(tl.reshape(s, (T, NEXT_N, H)), axis=2) * sc[:, None]  # [T, NEXT_N]
            cols = blk * T + offs_t
            x = tl.where(cols[:, None] < lens[None, :], x, float("-inf"))
            tl.store(out_ptr + rows64[None, :] * out_stride + cols[:, None], x)
            tl.store(bmax_ptr + rows64 * bmax_stride + blk, tl.max(x, axis=0))
        if FILL_TAIL:  # blocks of this chunk past the longest row: -inf, no key reads
            neg = tl.full([T, NEXT_N], float("-inf"), tl.float32)
            for blk in range(tl.maximum(blk_end, blk0), tl.minimum(blk0 + chunk, width)):
                cols = blk * T + offs_t
                tl.store(out_ptr + rows64[None, :] * out_stride + cols[:, None], neg)
                tl.store(bmax_ptr + rows64 * bmax_stride + blk, tl.full([NEXT_N], float("-inf"), tl.float32))
