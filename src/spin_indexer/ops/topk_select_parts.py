"""The multi-program path of `topk_positions_triton`: three launches, every O(columns) pass spread over
R x S programs (S = ceil(C / SEG) segments of SEG columns), only O(CAP + S) work in one program per row.

Keys are `_ukey` (fp32 bits made monotone as uint32, the order of `order_keys`); bucket = key >> 20 (12 bits:
sign, exponent, 3 mantissa bits; 4096 buckets, each 1/8 of an octave wide).
  1. `_bucket_hist_kernel` (R x S): each program histograms its segment's bucket ids (valid columns only)
     and atomically adds the non-empty bins into hist[r, 4096] (int32 adds commute: deterministic).
  2. `_collect_kernel` (R x S): every program reads its row's histogram (16 KB, L2 resident), takes the
     bucket b* of the need-th largest key (need = min(k, length)): tau = b* << 20 <= t* (the need-th largest
     key), and the candidates are the n_cand = #(key >= tau) keys. It writes its segment's columns with
     key >= tau, in column order, as int16 offsets into its own region of min(SEG, CAP) slots, and their
     count. With block maxima it loads only the logits of blocks whose max is >= tau (masked lanes move no
     data). No prefix across programs is needed: regions are per segment.
  3. `_select_kernel` (R): n_cand <= CAP: concatenates the regions in segment order (column order) into a
     CAP buffer, loads it into registers with the keys (gathered from logits), finds t* by bisection over
     the 20 bits below b* (tl.sum counts, no histogram), takes keys > t* and the first ties in column order,
     and writes them in column order through kept_blocks, then -1. n_cand > CAP (massive ties, very flat
     rows): exact radix select streaming the row in this one program (slow, as the one-program path).
     It also zeroes its histogram row, so the cached workspace is all zero again for the next call.
Bytes per row of C columns (4 B logits): pass 1 reads 4 C (+ <= 16 KB of atomics per segment, only the
non-empty bins: ~100-300 per segment); pass 2 reads the histogram (16 KB per program, L2), 4 C / 64 of
block maxima and only the candidate blocks' logits with block maxima (else 4 C), writes 2 B x n_cand;
pass 3 reads 4 B x S counts, 2 B + 4 B + 4 B x n_cand (regions, buffer, key gather) and writes 4 B x k.
Predicted on the H200 (not measured; ~3 us per launch in a graph, a program streams a few GB/s, 4 TB/s HBM):
  R = 1 x 128K, k = 2048, SEG = 2048 (64 programs): pass 1 ~3 us (8 KB per program), pass 2 ~3 us, pass 3
  ~10-15 us (4096 register-resident candidates, 20 reductions, two cumsums) -> ~20-25 us with launches.
  R = 96 x 256K, SEG = 8192 (3072 programs): pass 1 reads 100 MB -> ~30 us at ~3.5 TB/s, pass 2 ~10 us
  (candidate blocks only), pass 3 ~15 us (96 programs in parallel) -> ~55-60 us.
Scratch per row: 16 KB histogram (cached, zero between calls), 4 B x S counts, 2 B x S x min(SEG, CAP)
regions (about 2 B x C when SEG <= CAP), 4 B x CAP buffer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .topk_select_triton import _digit_hist, _pick_digit, _ukey

NUM_BUCKETS = 4096  # key >> 20


_HIST_WORKSPACE: dict = {}  # (device, stream) -> int32 histogram rows, all zero between calls


def _hist_workspace(dev: torch.device, rows: int, bins: int) -> torch.Tensor:
    """int32 [rows, bins] of zeros. The select kernel zeroes the rows it used, so a cached buffer is zero
    again when the next call on the same stream starts (stream order); it grows (torch.zeros, a memset) only
    when a larger batch comes. Keyed by stream so that two streams never share one."""
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    key = (str(dev), stream)
    ws = _HIST_WORKSPACE.get(key)
    if ws is None or ws.numel() < rows * bins:
        ws = torch.zeros(rows * bins, dtype=torch.int32, device=dev)
        _HIST_WORKSPACE[key] = ws
    return ws[:rows * bins].view(rows, bins)


def topk_positions_multi(logits, lengths, k, block_max, kept_blocks, next_n, tokens, out, cap, stats, seg):
    """The three launches (module docstring); arguments checked and made row-contiguous by the caller, R > 0."""
    rows, cols = logits.shape
    dev = logits.device
    num_seg = max(1, -(-cols // seg))
    reg = min(seg, cap)
    nb = NUM_BUCKETS
    hist = _hist_workspace(dev, rows, nb)
    regions = torch.empty(rows, num_seg, reg, dtype=torch.int16, device=dev)
    counts = torch.empty(rows, num_seg, dtype=torch.int32, device=dev)
    buf = torch.empty(rows, cap, dtype=torch.int32, device=dev)
    stats = torch.empty(rows, dtype=torch.int32, device=dev) if stats is None else stats
    has_bmax, has_kb = block_max is not None, kept_blocks is not None
    bmax = block_max if has_bmax else logits  # dummy pointers when absent (never read)
    kept = kept_blocks if has_kb else lengths
    seg_warps = 4 if seg <= 2048 else 8
    _bucket_hist_kernel[(rows, num_seg)](logits, lengths, hist, logits.stride(0), SEG=seg, NB=nb,
                                         num_warps=seg_warps)
    _collect_kernel[(rows, num_seg)](
        logits, lengths, bmax, hist, regions, counts, logits.stride(0), bmax.stride(0), k, num_seg,
        SEG=seg, REG=reg, T=tokens, NB=nb, HAS_BMAX=has_bmax, num_warps=seg_warps)
    _select_kernel[(rows,)](
        logits, lengths, kept, hist, regions, counts, buf, out, stats,
        logits.stride(0), kept.stride(0) if has_kb else 0, k, next_n, num_seg,
        SEG=seg, REG=reg, CAP=cap, T=tokens, CH=min(1024, cap), SCH=4096 if cap >= 4096 else 1024, NB=nb,
        HAS_KB=has_kb, num_warps=16 if cap >= 4096 else 8)
    return out


@triton.jit
def _bucket_threshold(hist, need, NB: tl.constexpr):
    """From a row's bucket histogram: tau = lower edge of the bucket holding the need-th largest key, and
    n_cand = the number of keys >= tau."""
    bins = tl.arange(0, NB)
    ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    b = tl.max(tl.where(ge >= need, bins, -1), axis=0)  # >= 0: ge[0] = length >= need
    n_cand = tl.sum(tl.where(bins >= b, hist, 0), axis=0)
    return b.to(tl.uint32) << 20, n_cand


@triton.jit
def _bucket_hist_kernel(x_ptr, len_ptr, hist_ptr, stride_x, SEG: tl.constexpr, NB: tl.constexpr):
    r = tl.program_id(0)
    s = tl.program_id(1)
    length = tl.load(len_ptr + r)
    if s * SEG < length:
        c = s * SEG + tl.arange(0, SEG)
        ok = c < length
        key = _ukey(tl.load(x_ptr + r.to(tl.int64) * stride_x + c, mask=ok, other=0.0))
        d = tl.where(ok, key >> 20, 0).to(tl.int32)
        miss = tl.sum((~ok).to(tl.int32), axis=0)  # masked lanes land in bin 0; take them out again
        h = tl.histogram(d, NB) - tl.where(tl.arange(0, NB) == 0, miss, 0)
        tl.atomic_add(hist_ptr + r.to(tl.int64) * NB + tl.arange(0, NB), h, mask=h != 0, sem="relaxed")


@triton.jit
def _collect_kernel(x_ptr, len_ptr, bmax_ptr, hist_ptr, reg_ptr, cnt_ptr, stride_x, stride_b, k, num_seg,
                    SEG: tl.constexpr, REG: tl.constexpr, T: tl.constexpr, NB: tl.constexpr,
                    HAS_BMAX: tl.constexpr):
    r = tl.program_id(0)
    s = tl.program_id(1)
    length = tl.load(len_ptr + r)
    count = tl.zeros([], tl.int32)
    if s * SEG < length:
        tau, _ = _bucket_threshold(tl.load(hist_ptr + r.to(tl.int64) * NB + tl.arange(0, NB)),
                                   tl.minimum(length, k), NB)
        c = s * SEG + tl.arange(0, SEG)
        ok = c < length
        if HAS_BMAX:  # a block whose max is below tau holds no candidate: do not read it
            bm = tl.load(bmax_ptr + r.to(tl.int64) * stride_b + c // T, mask=ok, other=0.0)
            ok = ok & (_ukey(bm) >= tau)
        key = _ukey(tl.load(x_ptr + r.to(tl.int64) * stride_x + c, mask=ok, other=0.0))
        sel = (ok & (key >= tau)).to(tl.int32)
        idx = tl.cumsum(sel, axis=0) - sel
        reg_row = reg_ptr + (r.to(tl.int64) * num_seg + s) * REG
        tl.store(reg_row + idx, (c - s * SEG).to(tl.int16), mask=(sel != 0) & (idx < REG))
        count = tl.sum(sel, axis=0)
    tl.store(cnt_ptr + r.to(tl.int64) * num_seg + s, count)


@triton.jit
def _select_kernel(x_ptr, len_ptr, kept_ptr, hist_ptr, reg_ptr, cnt_ptr, buf_ptr, out_ptr, stats_ptr,
                   stride_x, stride_kb, k, next_n, num_seg,
                   SEG: tl.constexpr, REG: tl.constexpr, CAP: tl.constexpr, T: tl.constexpr, CH: tl.constexpr,
                   SCH: tl.constexpr, NB: tl.constexpr, HAS_KB: tl.constexpr):
    r = tl.program_id(0)
    length = tl.load(len_ptr + r)
    need = tl.minimum(length, k)
    hist_row = hist_ptr + r.to(tl.int64) * NB
    tau, n_cand = _bucket_threshold(tl.load(hist_row + tl.arange(0, NB)), need, NB)
    tl.debug_barrier()  # every thread has read the histogram before any zeroes it
    tl.store(hist_row + tl.arange(0, NB), tl.zeros([NB], tl.int32))  # leave the workspace zeroed
    tl.store(stats_ptr + r, n_cand)
    x_row = x_ptr + r.to(tl.int64) * stride_x
    out_row = out_ptr + r.to(tl.int64) * k
    kept_row = kept_ptr + (r // next_n).to(tl.int64) * stride_kb
    if n_cand <= CAP:
        # concatenate the segments' regions in segment order: the buffer is in column order
        buf_row = buf_ptr + r.to(tl.int64) * CAP
        base = tl.zeros([], tl.int32)
        for s in range(0, (length + SEG - 1) // SEG):
            n_s = tl.load(cnt_ptr + r.to(tl.int64) * num_seg + s)
            reg_row = reg_ptr + (r.to(tl.int64) * num_seg + s) * REG
            for j0 in range(0, n_s, CH):
                j = j0 + tl.arange(0, CH)
                off = tl.load(reg_row + j, mask=j < n_s, other=0).to(tl.int32)
                tl.store(buf_row + base + j, off + s * SEG, mask=j < n_s)
            base += n_s
        tl.debug_barrier()  # the buffer is read below by other threads
        i = tl.arange(0, CAP)
        live = i < n_cand
        col = tl.load(buf_row + i, mask=live, other=0)
        key = _ukey(tl.load(x_row + col, mask=live, other=0.0))
        # t* = the need-th largest key: its top 12 bits are tau's; bisect the 20 below (counts over the
        # candidates equal counts over the row for any threshold >= tau)
        t_star = tau
        for p in tl.static_range(20):
            trial = t_star | (1 << (19 - p))
            t_star = tl.where(tl.sum((live & (key >= trial)).to(tl.int32), axis=0) >= need, trial, t_star)
        gt = live & (key > t_star)
        eq = (live & (key == t_star)).to(tl.int32)
        rest = need - tl.sum(gt.to(tl.int32), axis=0)  # ties taken: the first ones in column order
        sel = gt | ((eq != 0) & (tl.cumsum(eq, axis=0) - eq < rest))
        seli = sel.to(tl.int32)
        pos = col
        if HAS_KB:  # column c -> kept_blocks[r // next_n, c // T] * T + c % T
            pos = tl.load(kept_row + col // T, mask=sel, other=0) * T + col % T
        tl.store(out_row + tl.cumsum(seli, axis=0) - seli, pos, mask=sel)
    else:
        # overflow: exact radix select over the row's keys >= tau, streamed by this program
        t_star = tl.zeros([], tl.uint32)
        rest = need
        for p in tl.static_range(4):
            hist = tl.zeros([256], tl.int32)
            for i0 in range(0, length, SCH):
                c = i0 + tl.arange(0, SCH)
                key = _ukey(tl.load(x_row + c, mask=c < length, other=0.0))
                hist += _digit_hist(key, (c < length) & (key >= tau), t_star, 24 - 8 * p)
            b, above = _pick_digit(hist, rest)
            rest -= above
            t_star = t_star | (b.to(tl.uint32) << (24 - 8 * p))
        written = tl.zeros([], tl.int32)
        ties = tl.zeros([], tl.int32)
        for i0 in range(0, length, SCH):
            c = i0 + tl.arange(0, SCH)
            key = _ukey(tl.load(x_row + c, mask=c < length, other=0.0))
            ok = c < length
            eq = (ok & (key == t_star)).to(tl.int32)
            sel = (ok & (key > t_star)) | ((eq != 0) & (ties + tl.cumsum(eq, axis=0) - eq < rest))
            seli = sel.to(tl.int32)
            pos = c
            if HAS_KB:
                pos = tl.load(kept_row + c // T, mask=sel, other=0) * T + c % T
            slot = written + tl.cumsum(seli, axis=0) - seli
            tl.store(out_row + slot, pos, mask=sel & (slot < k))
            written += tl.sum(seli, axis=0)
            ties += tl.sum(eq, axis=0)
    for j0 in range(need, k, CH):
        j = j0 + tl.arange(0, CH)
        tl.store(out_row + j, tl.full([CH], -1, tl.int32), mask=j < k)
