"""Exact selection over a register tile: the Triton device functions of the fused planner's select (plan_triton.py).

Every block of a request is one lane of an [SB] tile. A score becomes a uint32 order key (_tile_key: 0 = not a
candidate, forced blocks +inf); _threshold finds the need-th largest key and how many of its ties to take,
_take turns that into the kept mask (ties to the lower block, as select.select_blocks). The hashes of the random
exploration (_mix32) are bit-identical to select._mix, and the chunked path's radix digits (_digit_hist,
_pick_digit) live here too. No launch here: plan_triton.py's kernels call these.
"""
from __future__ import annotations

try:  # imported by plan_triton only where triton is
    import triton
    import triton.language as tl

    from ..ops.topk_triton import _ukey  # fp32 -> order-preserving uint32, the top-k's own key
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    NEG_INF = tl.constexpr(float("-inf"))
    ALL_TIES = tl.constexpr(1 << 30)  # _threshold's ties when no tie is cut

    @triton.jit
    def _mix(h):
        """select._mix on int64 (every intermediate < 2**61)."""
        h = (h * 0x45D9F3B) & 0x7FFFFFFF
        h = h ^ (h >> 15)
        return ((h * 0x2C1B3C6D) & 0x7FFFFFFF) ^ (h >> 13)

    @triton.jit
    def _digit_hist(key, ok, prefix, SHIFT: tl.constexpr):
        """256-bin histogram of digit (key >> SHIFT) & 255 over the ok keys whose digits above SHIFT equal
        prefix's. Masked lanes go to bin 0 and are subtracted."""
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
    def _mix32(h):
        """_mix on uint32 lanes, bit-identical for h < 2**31: each (h * c) & MASK31 keeps only the low 31 bits
        of the product, which a wrapping 32-bit multiply gives exactly (an int64 [SB] hash costs 2 registers
        per lane and 64-bit multiplies)."""
        h = (h * 0x45D9F3B) & 0x7FFFFFFF
        h = h ^ (h >> 15)
        return ((h * 0x2C1B3C6D) & 0x7FFFFFFF) ^ (h >> 13)

    @triton.jit
    def _forced_value():
        """The float32 a forced block's score is replaced with in the register path: a NaN with payload 1
        (bits 0x7FC00001), which no score takes (arithmetic NaNs are canonical, fp16/bf16 ones widen with
        13 zero low bits), so a float tensor carries both the scores and the forced mask (a bool [SB] mask is
        32 more registers per thread at SB = 8192 / 8 warps). _tile_key keys it as +inf, as select_blocks."""
        return tl.full([], 0x7FC00001, tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def _is_forced(s):
        return s.to(tl.int32, bitcast=True) == 0x7FC00001

    @triton.jit
    def _tile_key(s, SHIFT: tl.constexpr):
        """uint32 [S] search key of scores s float32 [S] (forced blocks _forced_value(): +inf): the order key of
        _ukey >> SHIFT, and 0 on the lanes that are not candidates (-inf). SHIFT = 13 when every score is a
        16-bit float (reduce=max with no per-slot rule over an fp16/bf16 state: block maxima and diagonal
        values, +-inf): the low 13 bits of their fp32 order key are all equal within a sign (zeros, or ones
        for negatives), so the shifted key keeps the order and every distinction, and the bisection of
        _threshold runs on at most 19 bits instead of 32. Every candidate key is >= 1 (the key of -inf is
        0x007FFFFF, of any larger value above it), so 0 marks the non-candidates without a mask tensor."""
        sk = tl.where(_is_forced(s), float("inf"), s)
        return tl.where(sk > NEG_INF, _ukey(sk) >> SHIFT, 0)

    @triton.jit
    def _count_min_max(c0, lo0, hi0, c1, lo1, hi1):
        return c0 + c1, tl.minimum(lo0, lo1), tl.maximum(hi0, hi1)

    @triton.jit
    def _add2(a0, b0, a1, b1):
        return a0 + a1, b0 + b1

    @triton.jit
    def _probe(lo, hi, x, c, need):
        """One bisection update from c = count(key >= x) at a probe x: lo keeps count(key >= lo) >= need, hi
        keeps count(key > hi) < need, c == need ends the search at x; a probe outside (lo, hi] changes
        nothing (so a bad guess costs its count and no exactness)."""
        inside = (x > lo) & (x <= hi)
        nlo = tl.where(c >= need, x, lo)
        nhi = tl.where(c > need, hi, tl.where(c == need, x, x - 1))
        return tl.where(inside, nlo, lo), tl.where(inside, nhi, hi)

    @triton.jit
    def _threshold(key, need, UNIFORM: tl.constexpr = False):
        """(t uint32, ties int32) scalars such that the lanes with key > t, then the first `ties` lanes with
        key == t in lane order, are the min(need, count) largest nonzero keys, ties to the lower lane: the
        (prefix, need) the radix select of the chunked path ends with. ties = ALL_TIES (2**30) when every
        lane with key == t is taken (no tie is cut: _take then needs no lane search). key: uint32 [S], 0 =
        not a candidate (every candidate is >= 1); need: int scalar.

        t is the need-th largest candidate key, by bisection on the key value with one count per step (a
        compare per element and a block reduction, no histogram): lo keeps count(key >= lo) >= need, hi keeps
        count(key > hi) < need. It starts from [min, max] of the candidate keys (at most bit_length(max - min)
        steps: <= 19 on the shifted 16-bit-score keys, <= 31 on hashes) and stops early when a count hits need
        exactly: every key >= mid is then taken and no tie is cut, which the returned (t, ties) still say
        exactly. need >= count: t = min (all); need <= 0: t = max and no ties (none). Every count compares
        against mid >= 1 (mid > lo >= min >= 1), so the 0 lanes never count. Each block reduction is a
        dependent round of shuffles and a barrier, so the count, min and max go in one (tuple) reduction, and
        so do the counts above and at t.

        UNIFORM: the candidate keys are uniform on [1, 2**31] (exploration hashes + 1): before bisecting, the
        search probes both ends of a bracket around the expected need-th largest key (the binomial quantile
        +- 4 sigma and one mean gap) in one reduction, which narrows 31 bits to ~25 and saves ~6 steps; the
        probes are exact counts, so the result never depends on the keys being uniform."""
        cand = key != 0
        count, lo, hi = tl.reduce((cand.to(tl.int32), tl.where(cand, key, 0xFFFFFFFF), key), 0, _count_min_max)
        need = tl.maximum(tl.minimum(need.to(tl.int32), count), 0)
        lo = lo.to(tl.int64)  # unsigned min / max of uint32, widened for the scalar arithmetic
        hi = hi.to(tl.int64)
        lo = tl.where(need == 0, hi, lo)
        hi = tl.where(need >= count, lo, hi)
        if UNIFORM:
            nf = tl.maximum(count, 1).to(tl.float64)
            pf = need.to(tl.float64) / nf
            span = tl.full([], 2.0 ** 31, tl.float64)
            half = span * (4.0 * tl.sqrt(pf * (1.0 - pf) / nf) + 1.0 / nf)
            mid_f = span * (1.0 - pf)
            x1 = tl.minimum(tl.maximum(mid_f - half, 1.0), span).to(tl.int64)
            x2 = tl.minimum(tl.maximum(mid_f + half, 1.0), span).to(tl.int64) + 1
            c1, c2 = tl.reduce(((key >= x1.to(tl.uint32)).to(tl.int32), (key >= x2.to(tl.uint32)).to(tl.int32)),
                               0, _add2)
            lo, hi = _probe(lo, hi, x1, c1, need)
            lo, hi = _probe(lo, hi, x2, c2, need)
        while lo < hi:
            mid = hi - (hi - lo) // 2  # upper middle: lo < mid <= hi
            # Counting by arithmetic (the sum of the top bits of mid - 1 - key, keys <= 2**31) cut this loop from
            # 147 to 118 SASS instructions and changed nothing on the H200 (run 94: 1150.6 -> 1149.9 us a step at
            # 96 x 512K, 22.8 -> 22.6 at 1 x 128K): the select is not bound by this count. Three probes a step in
            # one reduction (half the steps) measured slower in plan() twice (run 65; run 137: 3-7% at every point).
            c = tl.sum((key >= mid.to(tl.uint32)).to(tl.int32), axis=0)
            lo, hi = _probe(lo, hi, mid, c, need)
        t = lo.to(tl.uint32)
        above, at = tl.reduce(((key > t).to(tl.int32), (key == t).to(tl.int32)), 0, _add2)
        ties = need - above
        return t, tl.where(ties >= at, ALL_TIES, ties)

    @triton.jit
    def _take(key, t, ties):
        """bool [S]: the lanes with key > t, then the first `ties` lanes with key == t in lane (block) order
        (all of them for ties = ALL_TIES); never a 0 lane (key: uint32 [S], 0 = not a candidate; t uint32,
        ties int32 scalars from _threshold: t == 0 only with no candidate, and then ties == 0).

        The cut among the ties is a lane bound L with count(key == t, lane < L) == ties, found by bisection on
        the lane index (one count per step, early exit on the first L that fits; no step when no tie is cut,
        the usual case for hashes), not by a cumsum: a [SB] scan over a strided layout (32 lanes per thread at
        SB = 8192 / 8 warps) holds ~3 registers per lane, which with the live key and kept tensors cost the
        second program per SM. The masks are recomputed from key in every step rather than kept live."""
        S: tl.constexpr = key.shape[0]
        lane = tl.arange(0, S)
        lo = tl.where(ties >= ALL_TIES, S, 0)  # no cut: every tie (S) or none (0)
        hi = tl.where((ties > 0) & (ties < ALL_TIES), S, lo)  # count(lane < hi) >= ties > count(lane < lo - 1)
        while lo < hi:
            mid = lo + (hi - lo) // 2
            c = tl.sum(((key == t) & (lane < mid)).to(tl.int32), axis=0)
            lo = tl.where(c == ties, mid, tl.where(c < ties, mid + 1, lo))
            hi = tl.where(c == ties, mid, tl.where(c < ties, hi, mid))
        return (key > t) | ((key == t) & (lane < lo))
