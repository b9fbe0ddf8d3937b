"""Triton twin of `paged_indexer_logits_ref`: paged FP8 indexer logits with the per-block max fused.

One program per (request, chunk of CHUNK blocks). For each block it loads the [T, D] fp8 key tile once
(TMA descriptor, or 16-byte pointer loads), multiplies it with the [H, D] query tile of every next_n row
on the tensor cores (`dot(k, q^T)`: T on the MMA's M axis, so the head sum stays inside a thread quad),
applies ReLU, the per-head weights, the head sum and the per-token scale, and stores the T logits and
their max. Programs whose chunk starts past the request's longest row only write -inf: the cost
follows the row lengths, not the table width W. prefetch=1/2 load the next block's scales (and ids) by
hand one iteration ahead (REFERENCE.md sec. 6); on Triton 3.6 the pipeliner alone (prefetch=0, the
default) measured 4-9% faster (benchmarks/NOTES.md).

Cache bytes, viewed as a 2D fp8 array [num_blocks * RB, D] with RB = T * (D + 4) / D rows per block
(66 for T=64, D=128): rows [b*RB, b*RB + T) of block b are its keys, the rest hold its T fp32 scales.
"""
from __future__ import annotations

import torch

from ..checks import check_tensor
from ..layout import FP8_DTYPE, SCALE_BYTES
from .indexer_logits import block_max_ref, check_paged_indexer_args, paged_indexer_logits_ref

try:  # the package imports this module only for CUDA tensors; without triton the reference is used
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Blocks per program (a runtime argument: no recompiles), from request count x table width; picked on the
# H200 (benchmarks/NOTES.md, run 2: 16 blocks best up to ~8K programs, 64 for 96 x 8192 blocks).
_TARGET_PROGRAMS = 16384


def _pick_chunk(batch: int, width: int) -> int:
    """Blocks per program: 16, halved (down to 4) while the grid has < 1K programs, doubled (up to 256)
    while it has > 16K (run 2 on the H200: 16 best at 1-8K programs, 64 at 96 x 8192 blocks; B=1 x 64K with
    16 left 64 programs for 132 SMs)."""
    def programs(c):
        return batch * -(-width // c)
    chunk = 16
    while chunk > 4 and programs(chunk) < 1024:
        chunk //= 2
    while chunk < 256 and programs(chunk) > _TARGET_PROGRAMS:
        chunk *= 2
    return chunk


def _kernel_supports(next_n: int, heads: int, dim: int, tokens: int) -> bool:
    def pow2(x):
        return x > 0 and x & (x - 1) == 0
    return next_n in (1, 2, 4) and pow2(heads) and heads >= 8 and pow2(dim) and dim >= 32 and pow2(tokens) \
        and tokens >= 16


def paged_indexer_logits_triton(q_fp8: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                                seq_lens: torch.Tensor, block_table: torch.Tensor, validate: bool = True,
                                out: torch.Tensor | None = None, block_max_out: torch.Tensor | None = None,
                                chunk: int | None = None, use_tma: bool = True, prefetch: int = 0,
                                split: bool | None = None, precise: bool = False, fuse_block_max: bool = True,
                                num_stages: int = 3, num_warps: int = 4) -> torch.Tensor:
    """Paged indexer logits, same arguments and meaning as `paged_indexer_logits_ref`.

    q_fp8: float8_e4m3fn [B, next_n, H, D]; kv_cache: uint8 [num_blocks, T, 1, D + 4] (contiguous);
    weights: float32 [B*next_n, H]; seq_lens: int32 [B, next_n]; block_table: int32 [B, W].
    out: optional float32 [B*next_n, W*T] to write into; block_max_out: optional float32 [B*next_n, W],
    receives the max of each block's valid logits (-inf for a block with none).
    chunk / use_tma / prefetch / split / num_stages / num_warps: tuning knobs (benchmarks only; prefetch 0
    = Triton's pipeliner alone, 4-9% faster on Triton 3.6 than the hand prefetch 1/2 in runs 2-3; split=None
    means one MMA per next_n row when next_n >= 2, 9% faster than one wide MMA + reshape in run 2);
    fuse_block_max=False leaves block_max_out unwritten (diagnostic: the cost of the fused max).
    precise: add the FP8 MMA partial sums in fp32 every 32 of D. Off by default, like the production
    kernel: Hopper's FP8 MMA accumulates with a reduced-precision adder, ~2-3e-4 relative error against
    fp32 math over D = 128 (measured on the H200); precise=True gives ~1e-4 at 1.5-1.7x the time.
    returns out: float32 [B*next_n, W*T], -inf at and after each row's length.
    Shapes the kernel does not take (next_n not in {1, 2, 4}, H or D not powers of two, D < 32) are
    computed by the reference into the same buffers.
    """
    check_paged_indexer_args(q_fp8, kv_cache, weights, seq_lens, block_table, validate)
    batch, next_n, heads, dim = q_fp8.shape
    tokens, width = kv_cache.shape[1], block_table.shape[1]
    rows = batch * next_n
    dev = q_fp8.device
    if out is None:
        out = torch.empty(rows, width * tokens, dtype=torch.float32, device=dev)
    check_tensor("out", out, dtype=torch.float32, shape=(rows, width * tokens), shape_names="[B*next_n, W*T]",
                 device=dev, device_of="q_fp8", contiguous=True)
    if block_max_out is None:
        block_max_out = torch.empty(rows, width, dtype=torch.float32, device=dev)
    check_tensor("block_max_out", block_max_out, dtype=torch.float32, shape=(rows, width),
                 shape_names="[B*next_n, W]", device=dev, device_of="q_fp8", contiguous=True)
    if batch == 0 or width == 0:
        return out
    if not _kernel_supports(next_n, heads, dim, tokens):
        # Shapes the MMA tiles cannot take (next_n 3, D < 32, non-powers of two): the reference, same outputs.
        out.copy_(paged_indexer_logits_ref(q_fp8, kv_cache, weights, seq_lens, block_table, validate=False))
        block_max_out.copy_(block_max_ref(out, tokens))
        return out
    if batch == 0 or width == 0:
        return out
    rows_per_block = tokens * (dim + SCALE_BYTES) // dim
    num_blocks = kv_cache.shape[0]
    flat = kv_cache.view(-1)
    keys2d = flat.view(FP8_DTYPE).view(num_blocks * rows_per_block, dim)  # [num_blocks*RB, D]
    scales_f32 = flat.view(torch.float32)  # block b's scales at [b*RB*D/4 + T*D/4, + T)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        k_arg = TensorDescriptor(base=keys2d, shape=list(keys2d.shape), strides=[dim, 1], block_shape=[tokens, dim])
    else:
        k_arg = keys2d
    q = q_fp8 if q_fp8.is_contiguous() else q_fp8.contiguous()
    w = weights if weights.is_contiguous() else weights.contiguous()
    lens = seq_lens if seq_lens.is_contiguous() else seq_lens.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    chunk = chunk or _pick_chunk(batch, width)
    if split is None:
        split = next_n >= 2
    grid = (batch, triton.cdiv(width, chunk))
    _paged_indexer_logits_kernel[grid](
        q, k_arg, scales_f32, w, lens, block_table, out, block_max_out,
        width, block_table.stride(0), chunk,
        NEXT_N=next_n, H=heads, D=dim, T=tokens, RB=rows_per_block, USE_TMA=use_tma,
        PREFETCH=int(prefetch), SPLIT=split, MNIA=min(32, dim) if precise else dim, BMAX=fuse_block_max,
        num_warps=num_warps, num_stages=num_stages)
    return out



if triton is not None:
    @triton.jit
    def _load_keys(k_arg, phys, USE_TMA: tl.constexpr, D: tl.constexpr, T: tl.constexpr, RB: tl.constexpr):
        if USE_TMA:
            k = k_arg.load([phys * RB, 0])
        else:
            rows = phys.to(tl.int64) * RB + tl.arange(0, T)
            k = tl.load(k_arg + rows[:, None] * D + tl.arange(0, D)[None, :])
        return k  # [T, D] fp8

    @triton.jit
    def _score_block(k, q, w, lens, out_ptr, bmax_ptr, rows64, blk, scale, width,
                     NEXT_N: tl.constexpr, H: tl.constexpr, T: tl.constexpr, MNIA: tl.constexpr,
                     BMAX: tl.constexpr):
        # k [T, D] fp8, q [NEXT_N*H, D] fp8, w [NEXT_N, H], lens [NEXT_N], scale [T]
        s = tl.dot(k, tl.trans(q), max_num_imprecise_acc=MNIA)  # [T, NEXT_N*H]: k[t] . q[j, h]; T on the MMA M axis
        s = tl.maximum(s, 0.0)
        if NEXT_N == 1:
            logit = tl.sum(s * w, axis=1)[:, None]  # [T, 1]
        else:
            logit = tl.sum(tl.reshape(s, [T, NEXT_N, H]) * w[None, :, :], axis=2)  # [T, NEXT_N]
        logit = logit * scale[:, None]
        cols = blk * T + tl.arange(0, T)
        logit = tl.where(cols[:, None] < lens[None, :], logit, float("-inf"))
        tl.store(out_ptr + rows64[None, :] * width * T + cols[:, None], logit)
        if BMAX:
            tl.store(bmax_ptr + rows64 * width + blk, tl.max(logit, axis=0))

    @triton.jit
    def _score_row(k, q, w, row_len, out_ptr, bmax_ptr, row64, blk, scale, width, T: tl.constexpr,
                   MNIA: tl.constexpr, BMAX: tl.constexpr):
        # one next_n row: k [T, D] fp8, q [H, D] fp8, w [H]; the key tile k is shared by the rows
        s = tl.maximum(tl.dot(k, tl.trans(q), max_num_imprecise_acc=MNIA), 0.0)  # [T, H]
        logit = tl.sum(s * w[None, :], axis=1) * scale  # [T]
        cols = blk * T + tl.arange(0, T)
        logit = tl.where(cols < row_len, logit, float("-inf"))
        tl.store(out_ptr + row64 * width * T + cols, logit)
        if BMAX:
            tl.store(bmax_ptr + row64 * width + blk, tl.max(logit, axis=0))

    @triton.jit
    def _score_block_split(k, q0, q1, q2, q3, w0, w1, w2, w3, lens_ptr, out_ptr, bmax_ptr, row0, blk, scale,
                           width, NEXT_N: tl.constexpr, T: tl.constexpr, MNIA: tl.constexpr,
                           BMAX: tl.constexpr):
        r = row0.to(tl.int64)
        _score_row(k, q0, w0, tl.load(lens_ptr + row0), out_ptr, bmax_ptr, r, blk, scale, width,
                       T, MNIA, BMAX)
        if NEXT_N >= 2:
            _score_row(k, q1, w1, tl.load(lens_ptr + row0 + 1), out_ptr, bmax_ptr, r + 1, blk, scale, width,
                           T, MNIA, BMAX)
        if NEXT_N >= 4:
            _score_row(k, q2, w2, tl.load(lens_ptr + row0 + 2), out_ptr, bmax_ptr, r + 2, blk, scale, width,
                           T, MNIA, BMAX)
            _score_row(k, q3, w3, tl.load(lens_ptr + row0 + 3), out_ptr, bmax_ptr, r + 3, blk, scale, width,
                           T, MNIA, BMAX)

    @triton.jit
    def _paged_indexer_logits_kernel(q_ptr, k_arg, scale_ptr, w_ptr, lens_ptr, table_ptr, out_ptr, bmax_ptr,
                                     width, stride_table, chunk,
                                     NEXT_N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                                     RB: tl.constexpr, USE_TMA: tl.constexpr,
                                     PREFETCH: tl.constexpr, SPLIT: tl.constexpr, MNIA: tl.constexpr,
                                     BMAX: tl.constexpr):
        b = tl.program_id(0)
        blk0 = tl.program_id(1) * chunk
        row0 = b * NEXT_N
        offs_n = tl.arange(0, NEXT_N)
        lens = tl.load(lens_ptr + row0 + offs_n)
        used = (tl.max(lens, axis=0) + T - 1) // T  # blocks the longest row touches
        blk_end = tl.minimum(blk0 + chunk, used)
        chunk_end = tl.minimum(blk0 + chunk, width)
        ids = table_ptr + b.to(tl.int64) * stride_table
        offs_t = tl.arange(0, T)
        rows64 = (row0 + offs_n).to(tl.int64)
        # SPLIT: one [T, H] MMA per next_n row instead of one [T, next_n*H] MMA and a reshape.
        # MMA tiles need >= 16 columns: H < 16 is padded with zero-weight heads (relu(0) * 0 adds nothing).
        HP: tl.constexpr = 16 if H < 16 else H
        offs_hp = tl.arange(0, HP)
        offs_d = tl.arange(0, D)
        qb = q_ptr + row0.to(tl.int64) * H * D + offs_hp[:, None] * D + offs_d[None, :]
        q0 = tl.load(qb, mask=offs_hp[:, None] < H, other=0.0)
        w0 = tl.load(w_ptr + row0 * H + offs_hp, mask=offs_hp < H, other=0.0)
        q1 = q0
        q2 = q0
        q3 = q0
        w1 = w0
        w2 = w0
        w3 = w0
        if SPLIT:
            if NEXT_N >= 2:
                q1 = tl.load(qb + H * D, mask=offs_hp[:, None] < H, other=0.0)
                w1 = tl.load(w_ptr + (row0 + 1) * H + offs_hp, mask=offs_hp < H, other=0.0)
            if NEXT_N >= 4:
                q2 = tl.load(qb + 2 * H * D, mask=offs_hp[:, None] < H, other=0.0)
                w2 = tl.load(w_ptr + (row0 + 2) * H + offs_hp, mask=offs_hp < H, other=0.0)
                q3 = tl.load(qb + 3 * H * D, mask=offs_hp[:, None] < H, other=0.0)
                w3 = tl.load(w_ptr + (row0 + 3) * H + offs_hp, mask=offs_hp < H, other=0.0)
        if NEXT_N == 1:
            q = q0
            w = w0[None, :]  # [1, HP]
        else:
            offs_qh = tl.arange(0, NEXT_N * H)
            q = tl.load(q_ptr + row0.to(tl.int64) * H * D + offs_qh[:, None] * D + offs_d[None, :])
            offs_h = tl.arange(0, H)
            w = tl.load(w_ptr + (row0 + offs_n)[:, None] * H + offs_h[None, :])  # [NEXT_N, H]
        SCALE_OFF: tl.constexpr = T * D // 4  # scales follow the T*D key bytes of a block, in fp32 units
        BLOCK_F32: tl.constexpr = RB * D // 4
        if blk0 < blk_end:
            if PREFETCH == 1:
                # Block ids two ahead, scales one ahead, carried through the loop (the key tile load is
                # then not pipelined by Triton: occupancy has to hide its latency).
                id_cur = tl.load(ids + blk0)
                id_nxt = tl.load(ids + tl.minimum(blk0 + 1, blk_end - 1))
                sc_cur = tl.load(scale_ptr + id_cur.to(tl.int64) * BLOCK_F32 + SCALE_OFF + offs_t)
                for blk in range(blk0, blk_end):
                    id_nn = tl.load(ids + tl.minimum(blk + 2, blk_end - 1))
                    sc_nxt = tl.load(scale_ptr + id_nxt.to(tl.int64) * BLOCK_F32 + SCALE_OFF + offs_t)
                    k = _load_keys(k_arg, id_cur, USE_TMA, D, T, RB)
                    if SPLIT:
                        _score_block_split(k, q0, q1, q2, q3, w0, w1, w2, w3, lens_ptr, out_ptr, bmax_ptr, row0, blk,
                                           sc_cur, width, NEXT_N, T, MNIA, BMAX)
                    else:
                        _score_block(k, q, w, lens, out_ptr, bmax_ptr, rows64, blk, sc_cur, width, NEXT_N, H, T, MNIA,
                                     BMAX)
                    id_cur = id_nxt
                    id_nxt = id_nn
                    sc_cur = sc_nxt
            elif PREFETCH == 2:
                # Block ids by affine loads (Triton pipelines them and the key tile behind them); the
                # scales one iteration ahead by hand.
                sc_cur = tl.load(scale_ptr + tl.load(ids + blk0).to(tl.int64) * BLOCK_F32 + SCALE_OFF + offs_t)
                for blk in range(blk0, blk_end):
                    phys = tl.load(ids + blk)
                    id_nxt = tl.load(ids + tl.minimum(blk + 1, blk_end - 1))
                    sc_nxt = tl.load(scale_ptr + id_nxt.to(tl.int64) * BLOCK_F32 + SCALE_OFF + offs_t)
                    k = _load_keys(k_arg, phys, USE_TMA, D, T, RB)
                    if SPLIT:
                        _score_block_split(k, q0, q1, q2, q3, w0, w1, w2, w3, lens_ptr, out_ptr, bmax_ptr, row0, blk,
                                           sc_cur, width, NEXT_N, T, MNIA, BMAX)
                    else:
                        _score_block(k, q, w, lens, out_ptr, bmax_ptr, rows64, blk, sc_cur, width, NEXT_N, H, T, MNIA,
                                     BMAX)
                    sc_cur = sc_nxt
            else:
                for blk in range(blk0, blk_end):
                    phys = tl.load(ids + blk)
                    sc = tl.load(scale_ptr + phys.to(tl.int64) * BLOCK_F32 + SCALE_OFF + offs_t)
                    k = _load_keys(k_arg, phys, USE_TMA, D, T, RB)
                    if SPLIT:
                        _score_block_split(k, q0, q1, q2, q3, w0, w1, w2, w3, lens_ptr, out_ptr, bmax_ptr, row0, blk,
                                           sc, width, NEXT_N, T, MNIA, BMAX)
                    else:
                        _score_block(k, q, w, lens, out_ptr, bmax_ptr, rows64, blk, sc, width, NEXT_N, H, T, MNIA,
                                     BMAX)
        # Blocks of this chunk past the longest row: -inf logits and block max, no key reads.
        neg = tl.full([NEXT_N, T], float("-inf"), tl.float32)
        for blk in range(tl.maximum(blk_end, blk0), chunk_end):
            tl.store(out_ptr + rows64[:, None] * width * T + blk * T + offs_t[None, :], neg)
            tl.store(bmax_ptr + rows64 * width + blk, tl.full([NEXT_N], float("-inf"), tl.float32))
