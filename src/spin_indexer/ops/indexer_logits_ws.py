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
loop, are fine. Rows go in groups of two ([T, 2H] MMAs, the key tile read once for both; one [T, 4H] MMA
at next_n = 4 does not compile under the split); pages a whole number of D-byte rows (the 2D key descriptor); no
fused EMA update. Whether it is faster is for the H200 to say
(`bench_mtp_logits.py`, provider `own_ws`).

The math is the production kernel's: logits[r, t] = scale[t] * sum_h w[r, h] * relu(k[t] . q[r, h]), -inf past
each row's length; block maxima of the written logits; blocks past the request's longest row are left unwritten
(fill_tail=False) or set to -inf (fill_tail=True).
"""
from __future__ import annotations

import torch

from ..layout import page_stride_bytes
from .indexer_logits import check_paged_indexer_args
from .indexer_logits_triton import _cache_args, _kernel_supports, _pick_chunk, logits_outputs

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def supports(q_fp8: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes: those of the production kernel (next_n 1-4, H, D and T powers of
    two, D >= 32) with H >= 16 and 2 H <= 256 (a group's TMA box and MMA), pages a whole number of D-byte rows."""
    _, next_n, heads, dim = q_fp8.shape
    return (_kernel_supports(next_n, heads, dim, kv_cache.shape[1]) and heads >= 16
            and min(next_n, 2) * heads <= 256 and page_stride_bytes(kv_cache) % dim == 0)


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
        raise ValueError(f"q_fp8 / kv_cache: the warp-specialized kernel takes next_n 1-4, H and D powers of two "
                         f"(H >= 16, D >= 32, 2 H <= 256) and pages a whole number of D-byte rows; "
                         f"got q_fp8 {list(q_fp8.shape)}, kv_cache {list(kv_cache.shape)}")
    from triton.tools.tensor_descriptor import TensorDescriptor
    batch, next_n, heads, dim = q_fp8.shape
    tokens, width = kv_cache.shape[1], block_table.shape[1]
    rows = batch * next_n
    out, block_max_out = logits_outputs(q_fp8, kv_cache, block_table, out, block_max_out)
    if batch == 0 or width == 0:
        return out
    k_desc, scales_f32, page_bytes, rows_per_block = _cache_args(kv_cache, tokens, dim)
    q = q_fp8 if q_fp8.is_contiguous() else q_fp8.contiguous()
    q_desc = TensorDescriptor(base=q.view(rows * heads, dim), shape=[rows * heads, dim], strides=[dim, 1],
                              block_shape=[min(next_n, 2) * heads, dim])
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
    def _ws_group(k, q, w, sc, lens, rows64, live, out_ptr, out_stride, bmax_ptr, bmax_stride, blk, offs_t,
                  T: tl.constexpr, G: tl.constexpr, H: tl.constexpr):
        """One group of G rows of a block: k [T, D] fp8, q [G * H, D] fp8, w [G * H], sc [T], lens / rows64 / live
        [G] (live: the row exists; a padded row has weight 0 and length 0 and is not stored)."""
        s = tl.maximum(tl.dot(k, tl.trans(q)), 0.0) * w[None, :]  # [T, G * H]: relu(k[t] . q[g, h]) * w[g, h]
        x = tl.sum(tl.reshape(s, (T, G, H)), axis=2) * sc[:, None]  # [T, G]: the head sum inside a thread quad
        cols = blk * T + offs_t
        x = tl.where(cols[:, None] < lens[None, :], x, float("-inf"))
        tl.store(out_ptr + rows64[None, :] * out_stride + cols[:, None], x, mask=live[None, :])
        tl.store(bmax_ptr + rows64 * bmax_stride + blk, tl.max(x, axis=0), mask=live)

    @triton.jit
    def _ws_logits_kernel(q_desc, k_desc, scale_ptr, w_ptr, lens_ptr, table_ptr, out_ptr, bmax_ptr, width,
                          stride_table, out_stride, bmax_stride, chunk, num_cache_blocks,
                          NEXT_N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                          PAGE_BYTES: tl.constexpr, RB: tl.constexpr, FILL_TAIL: tl.constexpr,
                          STAGES: tl.constexpr, WS: tl.constexpr):
        """Program (b, c): request b's blocks [c * chunk, (c + 1) * chunk) below its longest row. Rows in groups
        of G = min(next_n, 2), one [T, G * H] MMA a group and block (tokens on M, (row, head) pairs on N: the
        head sum stays in a thread quad); next_n 3 and 4 take a second group (rows 2, 3; next_n = 3 pads row 3
        with weight 0). The 3.6 split does not compile one [T, 4H] MMA (next_n = 4 in one group)."""
        G: tl.constexpr = 1 if NEXT_N == 1 else 2
        R1: tl.constexpr = NEXT_N - G  # rows of the second group: 0, 1 or 2
        b = tl.program_id(0)
        blk0 = tl.program_id(1) * chunk
        row0 = b * NEXT_N
        g = tl.arange(0, G)
        lens0 = tl.load(lens_ptr + row0 + g)  # [G]
        rows0 = (row0 + g).to(tl.int64)
        live0 = g < G
        w0 = tl.load(w_ptr + row0 * H + tl.arange(0, G * H))  # [G * H]: column j * H + h = head h of row j
        longest = tl.max(lens0, axis=0)
        live1, lens1, rows1, w1 = live0, lens0, rows0, w0  # placeholders without a second group
        if R1 > 0:
            live1 = g < R1
            lens1 = tl.load(lens_ptr + row0 + G + g, mask=live1, other=0)
            rows1 = rows0 + G
            w1 = tl.load(w_ptr + (row0 + G) * H + tl.arange(0, G * H), mask=tl.arange(0, G * H) < R1 * H, other=0.0)
            longest = tl.maximum(longest, tl.max(lens1, axis=0))
        used = (longest + T - 1) // T
        blk_end = tl.minimum(blk0 + chunk, used)
        offs_t = tl.arange(0, T)
        ids = table_ptr + b.to(tl.int64) * stride_table
        SCALE_OFF: tl.constexpr = T * D // 4  # a block's scales follow its T * D key bytes (fp32 units)
        PAGE_F32: tl.constexpr = PAGE_BYTES // 4
        # q through its TMA descriptor before the loop: the split keeps it in shared memory for the consumers
        # (a pointer load here, staged to shared memory for the MMA, makes the 3.6 split assert). The second
        # group's tile at next_n = 3 reaches into the next request's first row (weight 0 here) or past the
        # tensor (TMA fills zeros).
        q0 = q_desc.load([row0 * H, 0])  # [G * H, D] fp8
        q1 = q0
        if R1 > 0:
            q1 = q_desc.load([(row0 + G) * H, 0])
        for blk in tl.range(blk0, blk_end, num_stages=STAGES, warp_specialize=WS):
            # ids outside the cache read block 0 (validate=False: a bad table gives wrong logits, never a read
            # outside). A select, not min / max: the 3.6 split aborts on the scalar min / max ("unsupported op
            # type", WSDataPartition)
            raw = tl.load(ids + blk)
            phys = tl.where((raw >= 0) & (raw < num_cache_blocks), raw, 0)
            k = k_desc.load([phys * RB, 0])  # [T, D] fp8, read once for both groups
            sc = tl.load(scale_ptr + phys.to(tl.int64) * PAGE_F32 + SCALE_OFF + offs_t)
            _ws_group(k, q0, w0, sc, lens0, rows0, live0, out_ptr, out_stride, bmax_ptr, bmax_stride, blk, offs_t,
                      T, G, H)
            if R1 > 0:
                _ws_group(k, q1, w1, sc, lens1, rows1, live1, out_ptr, out_stride, bmax_ptr, bmax_stride, blk,
                          offs_t, T, G, H)
        if FILL_TAIL:  # blocks of this chunk past the longest row: -inf, no key reads
            r = tl.arange(0, G)
            for blk in range(tl.maximum(blk_end, blk0), tl.minimum(blk0 + chunk, width)):
                cols = blk * T + offs_t
                for grp in tl.static_range(2):
                    if grp == 0 or R1 > 0:
                        rows = rows0 + grp * G
                        live = r < (G if grp == 0 else R1)
                        tl.store(out_ptr + rows[None, :] * out_stride + cols[:, None],
                                 tl.full([T, G], float("-inf"), tl.float32), mask=live[None, :])
                        tl.store(bmax_ptr + rows * bmax_stride + blk, tl.full([G], float("-inf"), tl.float32),
                                 mask=live)
