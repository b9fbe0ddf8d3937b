"""Triton twins of the summary cache's two ops (block_summary.py has the references and the layout).

write_block_summaries_triton: grid (B, G). Program (b, g) walks request b's blocks first[b] + g, + G, ... below
stop[b]: it reads the block's T x D fp8 keys and T scales (T x 132 B), averages each of the S sub-blocks in
float32, quantizes each mean as ops.quantize_keys does (a power-of-two scale, computed from the float's bits so it
is exact), and writes S x (D + 4) bytes. In decoding one block fills per request every T / next_n steps, so
most steps write nothing; a request's first step writes all its full blocks once (one pass over its keys).

paged_summary_scores_triton: grid (B, cdiv(W, J x TILES)) with J = max(1, 64 / S) blocks a tile, so one MMA
scores J x S = 64 summary rows against a query row's heads: [64, D] x [D, H] per row, ReLU, weights, the head sum,
the max over the rows, then over each block's S rows. A program scores TILES tiles (SCORE_TILES, 1) with its query
rows loaded once. Bytes: S x (D + 4) a block, S / T of the logits' key bytes.

update_and_score_summaries_triton: the two in one launch (the decode step's form): program (b, g) of the score grid
first writes the summaries of its own J blocks that are in [first[b], stop[b]) (usually none, one when a block
filled), then, after a barrier (its writes are visible to its own threads), scores its J blocks as above.
"""
from __future__ import annotations

import torch

from ..layout import FP8_DTYPE, FP8_MAX, SCALE_BYTES, SCALE_FLOOR
from .block_summary import check_summary_score_args, check_write_args

try:  # the package imports this module only for CUDA tensors (or under TRITON_INTERPRET=1 in tests)
    import triton
    import triton.language as tl

    from .fp8_triton import pow2_scale, to_e4m3
except ImportError:  # pragma: no cover
    triton = None

WRITE_PROGRAMS = 8  # G: programs a request; a first step's whole prompt is written G blocks at a time
ROWS_A_PROGRAM = 64  # J x S summary rows a scoring program's MMA covers (a tile)
# Tiles a scoring program (module docstring); score_tiles= overrides it (benchmarks). 1: run 130 (H100, the same
# call) timed 1 / 2 / 4 / 8 tiles: 51.6 / 48.9 / 51.6 / 56.0 us at 96 x 128K, S = 4, and 2.6 / 3.3 / 5.4 / 9.3 us at
# 1 x 128K: fewer, longer programs cost more at small batch and save nothing at large B (the query rows a tile
# re-reads come from L2, not DRAM: the 2.2 TB/s of run 129 was not the query's bytes).
SCORE_TILES = 1


def write_block_summaries_triton(kv_cache: torch.Tensor, summaries: torch.Tensor, block_table: torch.Tensor,
                                 first: torch.Tensor, stop: torch.Tensor, validate: bool = True) -> None:
    """write_block_summaries_ref's semantics (and checks). kv_cache: contiguous pages (no padded page stride:
    V4's padded pages are not supported here yet), D a multiple of 4."""
    parts = check_write_args(kv_cache, summaries, block_table, first, stop, validate, contiguous=True)
    num_blocks, tokens, _, row = kv_cache.shape
    batch, width = block_table.shape
    if batch == 0 or width == 0 or num_blocks == 0:
        return
    dim = _key_dim(kv_cache)
    _write_kernel[(batch, WRITE_PROGRAMS)](
        kv_cache.view(-1).view(FP8_DTYPE), kv_cache.view(-1).view(torch.float32), summaries.view(-1),
        summaries.view(-1).view(torch.float32), block_table.contiguous(),
        first.contiguous(), stop.contiguous(), width, num_blocks, T=tokens, S=parts, D=dim, G=WRITE_PROGRAMS,
        FP8_MAX_=FP8_MAX, FLOOR=SCALE_FLOOR, num_warps=4)


def _key_dim(kv_cache: torch.Tensor) -> int:
    """D of a key cache the Triton kernels read (fp32 scales at aligned offsets: D a multiple of 4)."""
    dim = kv_cache.shape[3] - SCALE_BYTES
    if dim % SCALE_BYTES:
        raise ValueError(f"kv_cache: the Triton kernel needs D a multiple of 4 (fp32 scales at aligned offsets), "
                         f"got D = {dim}")
    return dim


def paged_summary_scores_triton(q_fp8: torch.Tensor, summaries: torch.Tensor, weights: torch.Tensor,
                                block_table: torch.Tensor, num_summarized: torch.Tensor, validate: bool = True,
                                out: torch.Tensor | None = None, score_tiles: int = SCORE_TILES) -> torch.Tensor:
    """paged_summary_scores_ref's semantics (and checks, `out` included)."""
    check_summary_score_args(q_fp8, summaries, weights, block_table, num_summarized, validate, out)
    return _score(q_fp8, summaries, weights, block_table, num_summarized, out, tiles=score_tiles)


def update_and_score_summaries_triton(q_fp8: torch.Tensor, kv_cache: torch.Tensor, summaries: torch.Tensor,
                                      weights: torch.Tensor, block_table: torch.Tensor, first: torch.Tensor,
                                      stop: torch.Tensor, validate: bool = True,
                                      out: torch.Tensor | None = None,
                                      score_tiles: int = SCORE_TILES) -> torch.Tensor:
    """update_and_score_summaries_ref's semantics (and checks) in one launch (module docstring)."""
    check_write_args(kv_cache, summaries, block_table, first, stop, validate, contiguous=True)
    check_summary_score_args(q_fp8, summaries, weights, block_table, stop, validate, out)
    return _score(q_fp8, summaries, weights, block_table, stop, out, kv_cache, first, tiles=score_tiles)


def _score(q_fp8, summaries, weights, block_table, num_summarized, out, kv_cache=None, first=None,
           tiles: int = SCORE_TILES) -> torch.Tensor:
    """The score launch (checked arguments); with kv_cache and first, each program writes its blocks in
    [first, num_summarized) first."""
    if not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"score_tiles: expected an int >= 1, got {tiles!r}")
    batch, next_n, heads, dim = q_fp8.shape
    num_blocks, parts = summaries.shape[:2]
    width = block_table.shape[1]
    if out is None:
        out = torch.empty(batch, width, dtype=torch.float32, device=q_fp8.device)
    if batch == 0 or width == 0:
        return out
    if num_blocks == 0:
        return out.fill_(float("-inf"))
    if dim < 16 or dim & (dim - 1) or ROWS_A_PROGRAM % parts:
        raise ValueError(f"q_fp8: the Triton kernel needs D a power of two >= 16 and S dividing 64, got D = {dim}, "
                         f"S = {parts}")
    write = kv_cache is not None
    if write:
        _key_dim(kv_cache)
        keys, key_scales, key_blocks = (kv_cache.view(-1).view(FP8_DTYPE), kv_cache.view(-1).view(torch.float32),
                                        kv_cache.shape[0])
        first = first.contiguous()
    else:  # placeholder pointers, never read
        keys, key_scales, key_blocks, first = q_fp8, weights, 1, num_summarized
    per_tile = max(1, ROWS_A_PROGRAM // parts)
    tiles = min(tiles, triton.cdiv(width, per_tile))  # no program longer than a request's table
    grid = (batch, triton.cdiv(width, per_tile * tiles))
    _score_kernel[grid](
        q_fp8.contiguous(), summaries.view(-1).view(FP8_DTYPE), summaries.view(-1).view(torch.float32),
        weights.contiguous(), block_table.contiguous(), num_summarized.contiguous(), out, out.stride(0), width,
        num_blocks, keys, key_scales, summaries.view(-1), first, key_blocks,
        NEXT_N=next_n, H=heads, HP=max(16, triton.next_power_of_2(heads)), D=dim, S=parts, J=per_tile, TILES=tiles,
        T=kv_cache.shape[1] if write else ROWS_A_PROGRAM, WRITE=write, FP8_MAX_=FP8_MAX, FLOOR=SCALE_FLOOR,
        num_warps=4)
    return out


if triton is not None:
    @triton.jit
    def _write_block(keys_ptr, key_scale_ptr, out_ptr, out_scale_ptr, phys, T: tl.constexpr, S: tl.constexpr,
                     D: tl.constexpr, FP8_MAX_: tl.constexpr, FLOOR: tl.constexpr):
        """Write the S sub-block means of key block `phys` (an int64 id inside the cache) as quantized rows."""
        PAGE: tl.constexpr = T * (D + 4)  # bytes a key page
        SPAGE: tl.constexpr = S * (D + 4)  # bytes a summary page
        t = tl.arange(0, T)
        d = tl.arange(0, D)
        s = tl.arange(0, S)
        base = phys * PAGE
        k = tl.load(keys_ptr + base + t[:, None] * D + d[None, :]).to(tl.float32)  # [T, D]
        sc = tl.load(key_scale_ptr + (base + T * D) // 4 + t)  # [T]
        means = tl.sum(tl.reshape(k * sc[:, None], (S, T // S, D)), axis=1) / (T // S)  # [S, D]
        scale = pow2_scale(tl.max(tl.abs(means), axis=1), FP8_MAX_, FLOOR)  # [S]
        vals = to_e4m3(means, scale[:, None], FP8_MAX_)
        sbase = phys * SPAGE
        tl.store(out_ptr + sbase + s[:, None] * D + d[None, :], vals.to(tl.uint8, bitcast=True))
        tl.store(out_scale_ptr + (sbase + S * D) // 4 + s, scale)

    @triton.jit
    def _write_kernel(keys_ptr, key_scale_ptr, out_ptr, out_scale_ptr, table_ptr, first_ptr, stop_ptr, width,
                      num_blocks, T: tl.constexpr, S: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                      FP8_MAX_: tl.constexpr, FLOOR: tl.constexpr):
        b = tl.program_id(0)
        g = tl.program_id(1)
        lo = tl.maximum(tl.load(first_ptr + b), 0)
        hi = tl.minimum(tl.load(stop_ptr + b), width)
        for j in range(lo + g, hi, G):
            phys = tl.minimum(tl.maximum(tl.load(table_ptr + b.to(tl.int64) * width + j), 0), num_blocks - 1)
            _write_block(keys_ptr, key_scale_ptr, out_ptr, out_scale_ptr, phys.to(tl.int64), T, S, D, FP8_MAX_, FLOOR)

    @triton.jit
    def _score_kernel(q_ptr, sum_ptr, sum_scale_ptr, w_ptr, table_ptr, count_ptr, out_ptr, stride_out, width,
                      num_blocks,
                      keys_ptr, key_scale_ptr, sum_bytes_ptr, first_ptr, key_blocks,
                      NEXT_N: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
                      J: tl.constexpr, TILES: tl.constexpr, T: tl.constexpr, WRITE: tl.constexpr,
                      FP8_MAX_: tl.constexpr, FLOOR: tl.constexpr):
        b = tl.program_id(0)
        # programs in reverse launch order: a request's newest blocks, the ones a decode step fills and writes here,
        # are in its last program's range, which the first programs dispatched then take: their write overlaps the
        # other programs' scoring instead of extending the launch's tail (H200 run 129, in order, 96 x 128K, S = 4:
        # the fused launch 72.7 us against 46.3 for the scores alone and 11.0 for the write alone)
        J0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * (J * TILES)  # this program's first block
        C: tl.constexpr = J * S  # summary rows a tile
        SPAGE: tl.constexpr = S * (D + 4)
        count = tl.minimum(tl.load(count_ptr + b), width)
        if WRITE:  # this program's blocks that filled since they were last written (update_and_score_summaries)
            lo = tl.maximum(tl.maximum(tl.load(first_ptr + b), 0), J0)
            for j in range(lo, tl.minimum(count, J0 + J * TILES)):
                raw_j = tl.load(table_ptr + b.to(tl.int64) * width + j)
                phys_j = tl.minimum(tl.maximum(raw_j, 0), key_blocks - 1).to(tl.int64)
                _write_block(keys_ptr, key_scale_ptr, sum_bytes_ptr, sum_scale_ptr, phys_j, T, S, D, FP8_MAX_,
                             FLOOR)
            tl.debug_barrier()  # the rows just written are read below by other threads of this program
        c = tl.arange(0, C)
        d = tl.arange(0, D)
        h = tl.arange(0, HP)
        jj = tl.arange(0, J)
        # the query rows once a program (NEXT_N = 1, the decode step's usual case; more rows reload from L2 a tile)
        q0 = tl.load(q_ptr + (b.to(tl.int64) * NEXT_N * H + h[:, None]) * D + d[None, :], mask=(h < H)[:, None],
                     other=0.0)  # [HP, D]
        w0 = tl.load(w_ptr + b.to(tl.int64) * NEXT_N * H + h, mask=h < H, other=0.0)  # [HP]
        for t in range(TILES):
            j0 = J0 + t * J
            best = tl.full([C], float("-inf"), tl.float32)
            if j0 < count:  # no MMA for a tile with nothing summarized (a request that does not mix: count 0)
                blk = j0 + c // S  # [C] logical block of each row
                live = blk < count
                raw = tl.load(table_ptr + b.to(tl.int64) * width + blk, mask=blk < width, other=0)
                phys = tl.minimum(tl.maximum(raw, 0), num_blocks - 1).to(tl.int64)
                k = tl.load(sum_ptr + phys[:, None] * SPAGE + (c % S)[:, None] * D + d[None, :], mask=live[:, None],
                            other=0.0)  # [C, D] fp8
                sc = tl.load(sum_scale_ptr + (phys * SPAGE + S * D) // 4 + c % S, mask=live, other=0.0)  # [C]
                x = tl.maximum(tl.dot(k, tl.trans(q0)), 0.0) * w0[None, :]  # [C, HP]
                best = tl.sum(x, axis=1) * sc
                for n in tl.static_range(1, NEXT_N):
                    row = b.to(tl.int64) * NEXT_N + n
                    q = tl.load(q_ptr + (row * H + h[:, None]) * D + d[None, :], mask=(h < H)[:, None],
                                other=0.0)  # [HP, D]
                    w = tl.load(w_ptr + row * H + h, mask=h < H, other=0.0)  # [HP]
                    x = tl.maximum(tl.dot(k, tl.trans(q)), 0.0) * w[None, :]  # [C, HP]
                    best = tl.maximum(best, tl.sum(x, axis=1) * sc)
            score = tl.max(tl.reshape(best, (J, S)), axis=1)  # [J]
            score = tl.where(j0 + jj < count, score, float("-inf"))
            tl.store(out_ptr + b.to(tl.int64) * stride_out + j0 + jj, score, mask=j0 + jj < width)
