"""Triton twin of `paged_indexer_logits_ref`: paged FP8 indexer logits with the per-block max fused.

One program per (request, chunk of CHUNK blocks). For each block it loads the [T, D] fp8 key tile once
(TMA descriptor), multiplies it with the [H, D] query tile of every next_n row on the tensor cores
(`dot(k, q^T)`: T on the MMA's M axis, so the head sum stays inside a thread quad), applies ReLU, the
per-head weights, the head sum and the per-token scale, and stores the T logits and their max. Triton's
pipeliner prefetches the next tile (hand prefetching measured 4-9% slower on Triton 3.6, NOTES.md run 2).

With a HistoryUpdate (SPIN's step, row-0 MTP policy) the epilogue also applies the EMA update of the
block's history from row 0's scores, still in registers (history_triton.ema_tile): the update costs its
V / D bytes only, never a second pass over the logits. Without fill_tail, blocks past each request's
longest row are not written, logits nor block max (as the production kernel leaves them), so the cost
follows the lengths, not W; inside the blocks it scores, columns past a row's length still get -inf.

Cache bytes: pages P bytes apart (P = T * (D + 4) = 8448 contiguous, or padded: DeepSeek-V4's 8640 /
8704), each T*D fp8 key bytes then T fp32 scales; the padding is never read. Where P is a whole number RB
of D-byte rows (66 for contiguous T=64, D=128; 68 for 8704) the keys are a 2D fp8 array [rows, D] and rows
[b*RB, b*RB + T) are block b's keys (the layout the H200 runs measured). Otherwise (8640 = 67.5 rows) a 3D
descriptor [num_blocks, T, D] with strides [P, D, 1] loads the tile. Block b's scales start at byte
b*P + T*D. TMA needs 16-byte-multiple strides and a 16-byte-aligned base (checked in the launcher).
"""
from __future__ import annotations

import torch

from ..checks import check_tensor
from ..layout import FP8_DTYPE, PAGE_ALIGN_BYTES, SCALE_BYTES, page_stride_bytes
from .history import HistoryUpdate, update_history_ref
from .indexer_logits import block_max_ref, check_paged_indexer_args, paged_indexer_logits_ref

try:  # the package imports this module only for CUDA tensors; without triton the reference is used
    import triton
    import triton.language as tl

    from .history_triton import _history_args, _no_history, ema_tile, row_constants, update_history_triton
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
                                fill_tail: bool = True, history: HistoryUpdate | None = None,
                                chunk: int | None = None) -> torch.Tensor:
    """Paged indexer logits, same arguments and meaning as `paged_indexer_logits_ref`.

    q_fp8: float8_e4m3fn [B, next_n, H, D]; kv_cache: uint8 [num_blocks, T, 1, D + 4] (pages contiguous or
    padded to a 16-byte-multiple stride, its data pointer 16-byte aligned);
    weights: float32 [B*next_n, H]; seq_lens: int32 [B, next_n]; block_table: int32 [B, W].
    out: optional float32 [B*next_n, W*T] to write into; block_max_out: optional float32 [B*next_n, W],
    receives the max of each block's valid logits (-inf for a block with none).
    fill_tail: write -inf past each row's length (False: leave the logits and block maxima of blocks past
    the request's longest row unwritten; columns past a row's length inside its scored blocks are -inf). history: also apply SPIN's EMA update (ops/history.py), fused into
    the epilogue when only row 0 updates, else by the standalone update kernel after the logits.
    chunk: blocks per program (default from the grid size, `_pick_chunk`).
    The FP8 MMA accumulates with Hopper's reduced-precision adder, ~2-3e-4 relative error against fp32 math
    over D = 128 (as the production kernel). Shapes the kernel does not take (next_n not in {1, 2, 4}, H or
    D not powers of two, D < 32) are computed by the reference into the same buffers.
    returns out: float32 [B*next_n, W*T].
    """
    check_paged_indexer_args(q_fp8, kv_cache, weights, seq_lens, block_table, validate)
    batch, next_n, heads, dim = q_fp8.shape
    tokens, width = kv_cache.shape[1], block_table.shape[1]
    rows = batch * next_n
    dev = q_fp8.device
    if out is None:
        out = torch.empty(rows, width * tokens, dtype=torch.float32, device=dev)
    check_tensor("out", out, dtype=torch.float32, shape=(rows, width * tokens), shape_names="[B*next_n, W*T]",
                 device=dev, device_of="q_fp8")
    if out.stride(1) != 1:
        raise ValueError(f"out: expected unit column stride, got strides {out.stride()}")
    if block_max_out is None:
        block_max_out = torch.empty(rows, width, dtype=torch.float32, device=dev)
    check_tensor("block_max_out", block_max_out, dtype=torch.float32, shape=(rows, width),
                 shape_names="[B*next_n, W]", device=dev, device_of="q_fp8")
    if batch == 0 or width == 0:
        return out
    if not _kernel_supports(next_n, heads, dim, tokens):
        # Shapes the MMA tiles cannot take (next_n 3, D < 32, non-powers of two): the reference, same outputs.
        out.copy_(paged_indexer_logits_ref(q_fp8, kv_cache, weights, seq_lens, block_table, validate=False))
        block_max_out.copy_(block_max_ref(out, tokens))
        if history is not None:
            update_history_ref(history, out.view(batch, next_n, -1), block_table, seq_lens)
        return out
    k_arg, scales_f32, page_bytes, rows_per_block = _cache_args(kv_cache, tokens, dim)
    q = q_fp8 if q_fp8.is_contiguous() else q_fp8.contiguous()
    w = weights if weights.is_contiguous() else weights.contiguous()
    lens = seq_lens if seq_lens.is_contiguous() else seq_lens.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    chunk = chunk or _pick_chunk(batch, width)
    fused = history is not None and history.rows == 1
    hist = _history_args(history, out) if fused else _no_history(out)
    grid = (batch, triton.cdiv(width, chunk))
    _paged_indexer_logits_kernel[grid](
        q, k_arg, scales_f32, w, lens, block_table, out, block_max_out,
        width, block_table.stride(0), out.stride(0), block_max_out.stride(0), chunk, kv_cache.shape[0], *hist,
        NEXT_N=next_n, H=heads, D=dim, T=tokens, PAGE_BYTES=page_bytes, RB=rows_per_block, SPLIT=next_n >= 2,
        FILL_TAIL=fill_tail,
        HIST=fused, HAS_SEEN=fused and history.last_seen is not None, num_warps=4, num_stages=3)
    if history is not None and not fused:
        update_history_triton(history, out.view(batch, next_n, -1), block_table, seq_lens)
    return out


def _cache_args(kv_cache: torch.Tensor, tokens: int, dim: int):
    """(key descriptor, fp32 view of the cache bytes, page stride P in bytes, RB) for the kernel. RB = P / D
    rows per page when P is a whole number of D-byte rows (a 2D descriptor, block b's keys at row b*RB),
    else 0 (a 3D descriptor [num_blocks, T, D] with strides [P, D, 1]). Raises ValueError naming kv_cache
    where TMA cannot take the layout."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    num_blocks = kv_cache.shape[0]
    page_bytes = page_stride_bytes(kv_cache)
    if page_bytes % PAGE_ALIGN_BYTES or kv_cache.data_ptr() % PAGE_ALIGN_BYTES:
        raise ValueError(f"kv_cache: expected a page stride and data pointer that are multiples of "
                         f"{PAGE_ALIGN_BYTES} bytes (TMA), got stride {page_bytes}, pointer offset "
                         f"{kv_cache.data_ptr() % PAGE_ALIGN_BYTES}")
    # Every byte from the first page's start to the last page's scales: the padding after the last page
    # may not exist (a view into a tighter allocation), and no load reaches past the last scale.
    span = max((num_blocks - 1) * page_bytes + tokens * (dim + SCALE_BYTES), 0)
    flat = torch.as_strided(kv_cache, (span,), (1,))
    scales_f32 = flat.view(torch.float32)  # block b's scales at [(b*P + T*D) / 4, + T)
    keys = flat.view(FP8_DTYPE)
    if page_bytes % dim == 0:
        rows_per_block = page_bytes // dim
        keys2d = keys[: span // dim * dim].view(span // dim, dim)  # [rows, D]; block b's keys at row b*RB
        desc = TensorDescriptor(base=keys2d, shape=list(keys2d.shape), strides=[dim, 1], block_shape=[tokens, dim])
        return desc, scales_f32, page_bytes, rows_per_block
    keys3d = torch.as_strided(keys, (num_blocks, tokens, dim), (page_bytes, dim, 1))
    desc = TensorDescriptor(base=keys3d, shape=[num_blocks, tokens, dim], strides=[page_bytes, dim, 1],
                            block_shape=[1, tokens, dim])
    return desc, scales_f32, page_bytes, 0


if triton is not None:
    @triton.jit
    def _score_row(k, q, w, scale):
        """One next_n row: k [T, D] fp8, q [H, D] fp8, w [H] -> logits float32 [T] (the key tile is shared)."""
        s = tl.maximum(tl.dot(k, tl.trans(q)), 0.0)  # [T, H]: k[t] . q[h]; T on the MMA M axis
        return tl.sum(s * w[None, :], axis=1) * scale

    @triton.jit
    def _store_row(logit, row_len, out_ptr, out_stride, bmax_ptr, bmax_stride, row64, blk, T: tl.constexpr):
        cols = blk * T + tl.arange(0, T)
        logit = tl.where(cols < row_len, logit, float("-inf"))
        tl.store(out_ptr + row64 * out_stride + cols, logit)
        tl.store(bmax_ptr + row64 * bmax_stride + blk, tl.max(logit, axis=0))
        return logit

    @triton.jit
    def _paged_indexer_logits_kernel(q_ptr, k_arg, scale_ptr, w_ptr, lens_ptr, table_ptr, out_ptr, bmax_ptr,
                                     width, stride_table, out_stride, bmax_stride, chunk, num_cache_blocks,
                                     v_ptr, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride, clock_ptr,
                                     slot_ptr, kept_ptr, kept_stride, hlens_ptr, upd_ptr, alpha, window, trash, lo,
                                     hi, NEXT_N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                                     PAGE_BYTES: tl.constexpr, RB: tl.constexpr, SPLIT: tl.constexpr,
                                     FILL_TAIL: tl.constexpr, HIST: tl.constexpr, HAS_SEEN: tl.constexpr):
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
        r64 = row0.to(tl.int64)
        # MMA tiles need >= 16 columns: H < 16 is padded with zero-weight heads (relu(0) * 0 adds nothing).
        HP: tl.constexpr = 16 if H < 16 else H
        offs_hp = tl.arange(0, HP)
        offs_d = tl.arange(0, D)
        qb = q_ptr + r64 * H * D + offs_hp[:, None] * D + offs_d[None, :]
        q0 = tl.load(qb, mask=offs_hp[:, None] < H, other=0.0)
        w0 = tl.load(w_ptr + row0 * H + offs_hp, mask=offs_hp < H, other=0.0)
        q1 = q0
        q2 = q0
        q3 = q0
        w1 = w0
        w2 = w0
        w3 = w0
        if NEXT_N >= 2:
            q1 = tl.load(qb + H * D, mask=offs_hp[:, None] < H, other=0.0)
            w1 = tl.load(w_ptr + (row0 + 1) * H + offs_hp, mask=offs_hp < H, other=0.0)
        if NEXT_N >= 4:
            q2 = tl.load(qb + 2 * H * D, mask=offs_hp[:, None] < H, other=0.0)
            w2 = tl.load(w_ptr + (row0 + 2) * H + offs_hp, mask=offs_hp < H, other=0.0)
            q3 = tl.load(qb + 3 * H * D, mask=offs_hp[:, None] < H, other=0.0)
            w3 = tl.load(w_ptr + (row0 + 3) * H + offs_hp, mask=offs_hp < H, other=0.0)
        len0 = tl.load(lens_ptr + row0)
        kept_row = kept_ptr + b.to(tl.int64) * kept_stride
        if HIST:  # a request that does not update (guarded) reads and writes no history: the dense loop
            upd0, qpos0, slot0, clock = row_constants(upd_ptr, hlens_ptr, slot_ptr, clock_ptr, row0, b, HAS_SEEN)
        SCALE_OFF: tl.constexpr = T * D // 4  # scales follow the T*D key bytes of a block, in fp32 units
        # Pages are PAGE_BYTES apart (padded on DeepSeek-V4). A constexpr (fixed for a run, like T and D): the
        # compiler sees the scales' 16-byte alignment, as it did with the contiguous page size.
        PAGE_F32: tl.constexpr = PAGE_BYTES // 4
        for blk in range(blk0, blk_end):
            # Ids are clamped into the cache: with validate=False a bad table gives wrong logits, never a read
            # outside the cache (the key tile's TMA load is bounds-checked; the scales' pointer load is not).
            phys = tl.minimum(tl.maximum(tl.load(ids + blk), 0), num_cache_blocks - 1)
            if HIST:  # the history's reads first, so their latency hides under the key load and the MMA
                # (masked, not under a branch; the row's constants were loaded once, above the loop)
                on = (tl.zeros([1], tl.int32) + upd0.to(tl.int32)) != 0  # [1]: a tensor mask (the interpreter)
                kb = tl.load(kept_row + blk + tl.zeros([1], tl.int32), mask=on, other=-1)
                pv = tl.where(on & (phys < trash), tl.zeros([1], tl.int64) + phys, trash)  # as load_vertical
                old_v = tl.load(v_ptr + pv[:, None] * T + offs_t[None, :], mask=tl.broadcast_to(on[:, None], [1, T]),
                                other=0.0)
            sc = tl.load(scale_ptr + phys.to(tl.int64) * PAGE_F32 + SCALE_OFF + offs_t)
            if RB > 0:  # pages a whole number RB of D-byte rows apart: block phys starts at row phys * RB
                k = k_arg.load([phys * RB, 0])  # [T, D] fp8 through the TMA descriptor
            else:  # other padded strides (8640 = 67.5 rows): the 3D descriptor's page index
                k = tl.reshape(k_arg.load([phys, 0, 0]), (T, D))
            # One [T, H] MMA per next_n row (9% faster than one wide MMA + reshape, NOTES.md run 2).
            logit0 = _store_row(_score_row(k, q0, w0, sc), len0, out_ptr, out_stride, bmax_ptr, bmax_stride, r64,
                                blk, T)
            if NEXT_N >= 2:
                _store_row(_score_row(k, q1, w1, sc), tl.load(lens_ptr + row0 + 1), out_ptr, out_stride, bmax_ptr,
                           bmax_stride, r64 + 1, blk, T)
            if NEXT_N >= 4:
                _store_row(_score_row(k, q2, w2, sc), tl.load(lens_ptr + row0 + 2), out_ptr, out_stride, bmax_ptr,
                           bmax_stride, r64 + 2, blk, T)
                _store_row(_score_row(k, q3, w3, sc), tl.load(lens_ptr + row0 + 3), out_ptr, out_stride, bmax_ptr,
                           bmax_stride, r64 + 3, blk, T)
            if HIST:  # row 0's scores are still in registers: SPIN's EMA update of this block
                if upd0:
                    ema_tile(logit0[None, :], (blk * T + offs_t < len0)[None, :], pv, old_v.to(tl.float32), kb, upd0,
                             qpos0, slot0, clock, v_ptr, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride,
                             alpha, window, lo, hi, T, HAS_SEEN)
        if FILL_TAIL:  # blocks of this chunk past the longest row: -inf logits and block max, no key reads
            neg = tl.full([NEXT_N, T], float("-inf"), tl.float32)
            for blk in range(tl.maximum(blk_end, blk0), chunk_end):
                tl.store(out_ptr + rows64[:, None] * out_stride + blk * T + offs_t[None, :], neg)
                tl.store(bmax_ptr + rows64 * bmax_stride + blk, tl.full([NEXT_N], float("-inf"), tl.float32))
