"""Triton twin of `topk_positions_ref`: the exact top-k SET per row, positions ascending, no sort.

Two paths, both without host sync or data-dependent shapes (CUDA-graph safe), picked from static shapes:
rows longer than CAP (or any row with seg > 0) take the three-launch multi-program path of
`topk_select_parts` (every pass over the columns spread over R x ceil(C / SEG) programs; see its docstring
for bytes and predicted times); shorter rows (or seg = 0) take the one-program-per-row kernel below, which
streams a row at only ~3-5 GB/s on the H200 (128K columns, k = 2048: 330-380 us for one row).

The one-program path: one launch, one program per row. Keys are the fp32 bits made
monotone as uint32 (`_ukey`, the order of `order_keys`: -0.0 folded into +0.0, NaN by its bits).
  a. Threshold tau, a lower bound of the k-th largest key. With block maxima and nb = ceil(len / T) >= 4k
     blocks: the lower edge of the 16-bit bucket holding the k-th largest block max (two 256-bin histogram
     passes over the nb maxima). Exact because the k best blocks each hold their max, so >= k elements are
     >= tau: every top-k element is >= tau and sits in a block whose max is >= tau. The blocks with max
     >= tau are listed (in column order) in scratch. Without usable maxima and len > CAP, the same two
     passes run over the row itself; otherwise tau = 0 (every element is a candidate).
  b. Collect: the listed blocks (or the whole row) are read once, in column order; elements >= tau are
     appended, in column order (cumsum compaction), to a per-row buffer of CAP (key, column) pairs.
  c. count <= CAP: radix select (4 passes of 8 bits, tl.histogram) over the buffer gives the exact k-th
     largest key t* and the number of ties to take; the selected columns (keys > t*, then the first ties in
     column order, i.e. ties to the lower column) are written in column order, mapped through kept_blocks,
     then -1 up to k.
  d. count > CAP (massive ties, flat rows): the same radix select and write stream the row from global
     memory instead of the buffer (slow, exact).
Bytes per row (normal case, prune path): 3 x 4 B x nb of block maxima + 4 B x T per listed block of logits
(about k blocks) + 8 B x count written to the buffer and re-read 5 times (L1/L2) + 4 B x k of output.
Without block maxima: 3 x 4 B x len (2 histogram passes + collect). Scratch: 12 B x CAP per row
(CAP = 2 * next_pow2(k) by default: buffer keys, buffer columns, block list).
"""
from __future__ import annotations

import torch

from .topk import check_topk_positions_args

try:  # the package imports this module only for CUDA tensors; without triton the reference is used
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# (largest CAP, streaming chunk CH, block-max chunk SB, num_warps). H200, k = 2048/4096, 128K-1M columns:
# 4096/16 warps beat 1024/4, 2048/8, 4096/8, 8192/16 (by 0-40%); the small-CAP row is untimed (keeps the
# interpreter tests light).
_BLOCK_TABLE = ((1024, 1024, 1024, 4), (1 << 62, 4096, 4096, 16))


PRUNE_MIN_BLOCKS_PER_K = 4  # block maxima prune a row of >= 4k blocks (as in topk_triton)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


SEG_CHOICES = (2048, 4096, 8192)  # columns per program of the multi-program path (untimed: first principles)
PROGRAMS_TARGET = 264  # two programs per H200 SM in the first two passes


def auto_seg(rows: int, cols: int) -> int:
    """The largest SEG that still gives about PROGRAMS_TARGET programs (fewer, longer programs when R is large)."""
    seg = SEG_CHOICES[0]
    for bigger in SEG_CHOICES[1:]:
        if rows * -(-cols // bigger) >= PROGRAMS_TARGET:
            seg = bigger
    return seg


def topk_positions_triton(logits: torch.Tensor, lengths: torch.Tensor, k: int, block_max=None, kept_blocks=None,
                          next_n: int = 1, tokens_per_block: int = 64, out=None, validate: bool = True,
                          cap: int | None = None, stats: torch.Tensor | None = None,
                          seg: int | None = None) -> torch.Tensor:
    """Same arguments and result as `topk_positions_ref` (int32 [R, k], positions ascending, -1 padded).

    cap: candidate buffer entries per row (default 2 * next_pow2(k)); tests pass a small one to reach the
    overflow path. stats: optional int32 [R] receiving each row's candidate count (CAP + 1 or more when the
    row overflowed), for tests and diagnostics. seg: columns per program of the multi-program path
    (`topk_select_parts`, a power of two in [16, 32768]); 0 = the one-program kernel; None = the one-program
    kernel when C <= CAP (every column fits the buffer), else the multi-program path with `auto_seg`.
    """
    check_topk_positions_args(logits, lengths, k, block_max, kept_blocks, next_n, tokens_per_block, out, validate)
    if seg is not None and (not isinstance(seg, int) or (seg and (seg & (seg - 1) or not 16 <= seg <= 32768))):
        raise ValueError(f"seg: expected None, 0 or a power of two in [16, 32768], got {seg!r}")
    if cap is not None and (not isinstance(cap, int) or cap < 16 or cap & (cap - 1)):
        raise ValueError(f"cap: expected a power of two >= 16, got {cap!r}")
    rows, cols = logits.shape
    dev = logits.device
    out = torch.empty(rows, k, dtype=torch.int32, device=dev) if out is None else out
    if stats is not None:
        stats = stats.view(-1)[:rows]
    if rows == 0:
        return out
    cap = cap or 2 * _next_pow2(max(k, 16))
    if seg is None:
        seg = 0 if cols <= cap else auto_seg(rows, cols)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    has_bmax, has_kb = block_max is not None, kept_blocks is not None
    if has_bmax and block_max.stride(1) != 1:
        block_max = block_max.contiguous()
    if has_kb and kept_blocks.stride(1) != 1:
        kept_blocks = kept_blocks.contiguous()
    if seg:
        from .topk_select_parts import topk_positions_multi
        return topk_positions_multi(logits, lengths, k, block_max, kept_blocks, next_n, tokens_per_block, out,
                                    cap, stats, seg)
    ch, sb, warps = next((c, s, w) for top, c, s, w in _BLOCK_TABLE if cap <= top)
    ch = max(ch, tokens_per_block)
    scratch = torch.empty(3, rows, cap, dtype=torch.int32, device=dev)  # buffer keys, buffer columns, block list
    count = torch.empty(rows, dtype=torch.int32, device=dev) if stats is None else stats
    bmax = block_max if has_bmax else logits  # dummy pointers when absent (never read)
    kept = kept_blocks if has_kb else lengths
    _topk_positions_kernel[(rows,)](
        logits, lengths, bmax, kept, out, scratch, count,
        logits.stride(0), bmax.stride(0), kept.stride(0) if has_kb else 0, k, next_n, rows * cap,
        T=tokens_per_block, CAP=cap, CH=ch, SB=sb, HAS_BMAX=has_bmax, HAS_KB=has_kb,
        PRUNE_MIN=PRUNE_MIN_BLOCKS_PER_K, num_warps=warps)
    return out


if triton is not None:
    @triton.jit
    def _ukey(x):
        """fp32 -> uint32 with the same order (-0.0 folded into +0.0; NaN ordered by its bits)."""
        x = tl.where(x == 0.0, 0.0, x)
        bits = x.to(tl.uint32, bitcast=True)
        flip = tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
        return bits ^ flip

    @triton.jit
    def _digit_hist(key, ok, prefix, SHIFT: tl.constexpr):
        """256-bin histogram of digit (key >> SHIFT) & 255 over the ok keys whose digits above SHIFT equal
        prefix's. Masked lanes go to bin 0 and are subtracted (no reliance on histogram's mask=)."""
        hit = ok & (((key ^ prefix) >> SHIFT) < 256)
        d = tl.where(hit, (key >> SHIFT) & 255, 0).to(tl.int32)
        miss = tl.sum((~hit).to(tl.int32), axis=0)
        return tl.histogram(d, 256) - tl.where(tl.arange(0, 256) == 0, miss, 0)

    @triton.jit
    def _pick_digit(hist, need):
        """Largest bin b with (count in bins >= b) >= need, and the count in bins > b."""
        bins = tl.arange(0, 256)
        ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        b = tl.max(tl.where(ge >= need, bins, -1), axis=0)
        return b, tl.sum(tl.where(bins > b, hist, 0), axis=0)

    @triton.jit
    def _coarse_threshold(ptr, n, need, SB: tl.constexpr):
        """Lower edge of the 16-bit key bucket holding the need-th largest of the n fp32 values at ptr."""
        prefix = tl.zeros([], tl.uint32)
        for p in tl.static_range(2):
            hist = tl.zeros([256], tl.int32)
            for s0 in range(0, n, SB):
                i = s0 + tl.arange(0, SB)
                key = _ukey(tl.load(ptr + i, mask=i < n, other=0.0))
                hist += _digit_hist(key, i < n, prefix, 24 - 8 * p)
            b, above = _pick_digit(hist, need)
            need -= above
            prefix = prefix | (b.to(tl.uint32) << (24 - 8 * p))
        return prefix

    @triton.jit
    def _source(x_row, key_row, col_row, i, n_row, n_buf, tau):
        """Candidates i in column order: the buffer's (key, column) for i < n_buf, or, when the buffer
        overflowed (n_buf = 0), the row's own elements >= tau for i < n_row (then n_row = length, else 0).
        The unused source's loads are fully masked (no memory traffic)."""
        from_row = n_row > 0
        x = tl.load(x_row + i, mask=i < n_row, other=0.0)
        buf_key = tl.load(key_row + i, mask=i < n_buf, other=0).to(tl.uint32, bitcast=True)
        buf_col = tl.load(col_row + i, mask=i < n_buf, other=0)
        key = tl.where(from_row, _ukey(x), buf_key)
        return key, tl.where(from_row, i, buf_col), (i < tl.maximum(n_row, n_buf)) & (key >= tau)

    @triton.jit
    def _topk_positions_kernel(x_ptr, len_ptr, bmax_ptr, kept_ptr, out_ptr, scratch_ptr, count_ptr,
                               stride_x, stride_b, stride_kb, k, next_n, plane,
                               T: tl.constexpr, CAP: tl.constexpr, CH: tl.constexpr, SB: tl.constexpr,
                               HAS_BMAX: tl.constexpr, HAS_KB: tl.constexpr,
                               PRUNE_MIN: tl.constexpr):
        r = tl.program_id(0)
        length = tl.load(len_ptr + r)
        need = tl.minimum(length, k)
        x_row = x_ptr + r.to(tl.int64) * stride_x
        key_row = scratch_ptr + r.to(tl.int64) * CAP  # scratch planes: keys, columns, block list
        col_row = key_row + plane
        live_row = col_row + plane
        nb = (length + T - 1) // T
        LB: tl.constexpr = CH // T  # blocks gathered per collect step

        # a. threshold (and, with block maxima, the list of blocks that can hold a winner)
        tau = tl.zeros([], tl.uint32)
        prune = nb < 0  # false; true below when the row has block maxima and at least PRUNE_MIN x k blocks
        if HAS_BMAX:  # (with fewer, the k-th block max is near the row's bottom and prunes little)
            prune = nb >= PRUNE_MIN * k
        n_live = nb
        if prune:
            b_row = bmax_ptr + r.to(tl.int64) * stride_b
            tau = _coarse_threshold(b_row, nb, k, SB)
            n_live = nb * 0
            for s0 in range(0, nb, SB):
                g = s0 + tl.arange(0, SB)
                li = ((g < nb) & (_ukey(tl.load(b_row + g, mask=g < nb, other=0.0)) >= tau)).to(tl.int32)
                idx = n_live + tl.cumsum(li, axis=0) - li
                tl.store(live_row + idx, g, mask=(li != 0) & (idx < CAP))
                n_live += tl.sum(li, axis=0)
        elif length > CAP:  # every element would be a candidate: bound them by the row's own histogram
            tau = _coarse_threshold(x_row, length, need, CH)
        tl.debug_barrier()  # the block list is read below by other threads

        # b. collect elements >= tau of the listed blocks (all blocks without pruning), in column order.
        # A listed block holds >= 1 candidate (its max), so more than CAP blocks means overflow anyway.
        list_overflow = prune & (n_live > CAP)
        n_read = tl.where(list_overflow, 0, n_live)
        n_listed = tl.where(prune, n_read, 0)  # (a scalar in the mask: the interpreter mistypes bool & bool)
        count = tl.zeros([], tl.int32)
        for i0 in range(0, n_read, LB):
            i = i0 + tl.arange(0, LB)
            g = tl.load(live_row + i, mask=i < n_listed, other=0)
            g = tl.where(prune, g, i)
            c = g[:, None] * T + tl.arange(0, T)[None, :]  # [LB, T] columns, row-major = column order
            ok = (i < n_read)[:, None] & (c < length)
            key = _ukey(tl.load(x_row + c, mask=ok, other=0.0))
            sel = (ok & (key >= tau)).to(tl.int32)
            per_block = tl.sum(sel, axis=1)
            slot = count + (tl.cumsum(per_block, axis=0) - per_block)[:, None] + tl.cumsum(sel, axis=1) - sel
            keep = (sel != 0) & (slot < CAP)
            tl.store(key_row + slot, key.to(tl.int32, bitcast=True), mask=keep)
            tl.store(col_row + slot, c, mask=keep)
            count += tl.sum(per_block, axis=0)
        count = tl.where(list_overflow, CAP + 1, count)
        tl.store(count_ptr + r, count)
        tl.debug_barrier()  # the buffer is read below by other threads

        # c/d. exact radix select of the need-th largest key t*, over the buffer or (overflow) the row
        from_row = count > CAP
        n_src = tl.where(from_row, length, count)
        n_row = tl.where(from_row, length, 0)
        n_buf = tl.where(from_row, 0, count)
        t_star = tl.zeros([], tl.uint32)
        rest = need
        for p in tl.static_range(4):
            hist = tl.zeros([256], tl.int32)
            for i0 in range(0, n_src, CH):
                key, _, ok = _source(x_row, key_row, col_row, i0 + tl.arange(0, CH), n_row, n_buf, tau)
                hist += _digit_hist(key, ok, t_star, 24 - 8 * p)
            b, above = _pick_digit(hist, rest)
            rest -= above
            t_star = t_star | (b.to(tl.uint32) << (24 - 8 * p))
        # rest = how many keys equal to t* are taken: the first ones in column order

        # write keys > t* and the first `rest` ties, in column order, as positions
        out_row = out_ptr + r.to(tl.int64) * k
        kept_row = kept_ptr + (r // next_n).to(tl.int64) * stride_kb
        written = tl.zeros([], tl.int32)
        ties = tl.zeros([], tl.int32)
        for i0 in range(0, n_src, CH):
            key, col, ok = _source(x_row, key_row, col_row, i0 + tl.arange(0, CH), n_row, n_buf, tau)
            eq = (ok & (key == t_star)).to(tl.int32)
            sel = (ok & (key > t_star)) | ((eq != 0) & (ties + tl.cumsum(eq, axis=0) - eq < rest))
            seli = sel.to(tl.int32)
            pos = col
            if HAS_KB:  # column c -> kept_blocks[r // next_n, c // T] * T + c % T
                pos = tl.load(kept_row + col // T, mask=sel, other=0) * T + col % T
            slot = written + tl.cumsum(seli, axis=0) - seli
            tl.store(out_row + slot, pos, mask=sel & (slot < k))
            written += tl.sum(seli, axis=0)
            ties += tl.sum(eq, axis=0)
        for j0 in range(need, k, CH):
            j = j0 + tl.arange(0, CH)
            tl.store(out_row + j, tl.full([CH], -1, tl.int32), mask=j < k)
