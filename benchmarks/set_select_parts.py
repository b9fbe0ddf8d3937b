"""Where the set select's time goes (ops/topk_triton._select_set_kernel), on the GPU: the kernel and copies of
its two halves timed alone, beside the sorted chain's sort + rank, on the buffers the threshold and gather
leave for random rows.

    PYTHONPATH=src:benchmarks python benchmarks/set_select_parts.py [--rows 1,96] [--cols 65536,131072]

Parts (one launch of `rows` programs each; 20 launches in one CUDA graph, per launch):
  production   _select_set_kernel as the step runs it
  search       the digit search alone (the same loops, no emit)
  emit-live    the in-order emit alone over the live groups (bound = the smallest key: every candidate)
  emit-regs    an emit from the candidate keys held in registers (buffer order, one scan, no global loads)
  sort+rank    the sorted chain's chunk sort and rank launches
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from harness import DEVICE
from spin_indexer.ops import topk_triton as T
from spin_indexer.ops.topk import topk_group


@triton.jit
def _parts_kernel(x_ptr, len_ptr, count_ptr, cand_ptr, live_ptr, nlive_ptr, thresh_ptr, out_ptr, stride_x, k,
                  CAP: tl.constexpr, G: tl.constexpr, E: tl.constexpr, SEARCH: tl.constexpr, EMIT: tl.constexpr):
    r = tl.program_id(0)
    MIN_KEY: tl.constexpr = -9223372036854775807 - 1
    n = tl.load(count_ptr + r)
    length = tl.load(len_ptr + r)
    xrow = x_ptr + r.to(tl.int64) * stride_x
    i = tl.arange(0, CAP)
    held = i < n
    ukey = tl.load(cand_ptr + r.to(tl.int64) * CAP + i, mask=held, other=0) ^ MIN_KEY
    bound = tl.zeros([], tl.int64)
    if SEARCH:
        need = k + n * 0
        go = n > k
        shift = 48 + n * 0
        hi_mask = tl.zeros([], tl.int64)
        while go:
            lo = n * 0
            above = n * 0
            at = n * 0
            for t in range(9):
                last = t == 8
                q = tl.where(last, 1, 16384 >> (2 * t))
                base = tl.where(last, lo - 1, lo)
                c1, c2, c3 = T._prefix_levels(ukey, held, bound, hi_mask, shift, base, q)
                above = c2
                at = c1 - c2
                step = tl.where(c3 >= need, 3 * q, tl.where(c2 >= need, 2 * q, tl.where(c1 >= need, q, 0)))
                lo = tl.where(last, lo, lo + step)
            need -= above
            bound = bound | (lo.to(tl.int64) << shift)
            go = at > need
            hi_mask = hi_mask | (tl.full([], 0xFFFF, tl.int64) << shift)
            shift -= 16
    first = bound ^ MIN_KEY
    obase = out_ptr + r.to(tl.int64) * k
    if EMIT == 1:
        tau = tl.load(thresh_ptr + r).to(tl.uint32, bitcast=True)
        total = tl.load(nlive_ptr + r) * G
        taken = n * 0
        for e0 in range(0, total, E):
            e = e0 + tl.arange(0, E)
            g = tl.load(live_ptr + r.to(tl.int64) * CAP + e // G, mask=e < total, other=0)
            c = g * G + e % G
            ok = (e < total) & (c < length)
            u = T._ukey(tl.load(xrow + c, mask=ok, other=0.0))
            take = ok & (u >= tau) & (T._sort_key(u, c) >= first)
            t = take.to(tl.int32)
            slot = taken + tl.cumsum(t, axis=0) - t
            tl.store(obase + slot, c, mask=take & (slot < k))
            taken += tl.sum(t, axis=0)
    elif EMIT == 2:
        key = ukey ^ MIN_KEY
        take = held & (key >= first)
        t = take.to(tl.int32)
        slot = tl.cumsum(t, axis=0) - t
        pos = (4294967295 - (key & 4294967295)).to(tl.int32)
        tl.store(obase + slot, pos, mask=take & (slot < k))
    else:
        tl.store(obase, bound.to(tl.int32))  # keep the search alive


def sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def _time(fn) -> float:
    """Microseconds of one call: 20 calls captured in a CUDA graph (no launch gaps), harness.time_graph's median."""
    from harness import time_graph
    return time_graph([fn] * 20).p50_us / 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,96")
    ap.add_argument("--cols", default="65536,131072")
    ap.add_argument("--k", type=int, default=2048)
    a = ap.parse_args()
    k = a.k
    print(f"{'rows':>5} {'cols':>8} {'G':>3} {'cands':>6} {'live':>6}  " +
          " ".join(f"{p:>11}" for p in ("production", "search", "emit-live", "emit-regs", "sort+rank")) + "  (us)")
    for rows in (int(x) for x in a.rows.split(",")):
        for cols in (int(x) for x in a.cols.split(",")):
            g = torch.Generator(device=DEVICE).manual_seed(rows * 7 + cols)
            x = torch.randn(rows, cols, device=DEVICE, generator=g)
            lens = torch.full((rows,), cols, dtype=torch.int32, device=DEVICE)
            group = topk_group(cols, k)
            k_pow = triton.next_power_of_2(k)
            cap = 2 * k_pow
            summary = torch.empty(rows, -(-cols // group), device=DEVICE)
            from spin_indexer.ops.maxima_triton import row_maxima_triton
            row_maxima_triton(x, lens, summary, group, tokens=64)
            out = torch.empty(rows, k, dtype=torch.int32, device=DEVICE)
            # the chain's buffers, as _chain_v1 allocates them, filled by its first two launches
            thresh = torch.empty(rows, dtype=torch.int32, device=DEVICE)
            count = torch.empty(rows, dtype=torch.int32, device=DEVICE)
            cand = torch.empty(rows, cap, dtype=torch.int64, device=DEVICE)
            live = torch.empty(rows, cap, dtype=torch.int32, device=DEVICE)
            nlive = torch.empty(rows, dtype=torch.int32, device=DEVICE)
            sb = T.threshold_tile(summary.shape[1])
            T._threshold_kernel[(rows,)](summary, lens, thresh, live, nlive, count, summary.shape[1], summary.stride(0),
                                         k, out, thresh, G=group, SB=sb, CAP=cap, HINT=False, HINT_R=32, HINT_STEPS=7,
                                         num_warps=T.threshold_warps(sb))
            lb = max(16, 1024 // group)
            T._gather_kernel[(rows, triton.cdiv(cap, lb))](x, lens, live, nlive, thresh, count, cand, x.stride(0),
                                                          G=group, LB=lb, CAP=cap, EVEN=True, num_warps=4)
            sync()
            e = min(T.SET_EMIT_ELEMS, cap * group)
            warps = T.set_select_warps(cap)
            common = (x, lens, count, cand, live, nlive, thresh, out, x.stride(0), k)
            res = [
                _time(lambda: T._select_set_kernel[(rows,)](x, lens, count, cand, thresh, out, x.stride(0), k, out, 0,
                                                            1, CAP=cap, E=e, MAP=False, num_warps=warps)),
            ]
            for search, emit in ((1, 0), (0, 1), (0, 2)):
                res.append(_time(lambda: _parts_kernel[(rows,)](*common, CAP=cap, G=group, E=e, SEARCH=search,
                                                                EMIT=emit, num_warps=warps)))
            cand_copy = cand.clone()
            chunk = min(T.SORT_CHUNK, cap)

            def sort_rank():
                cand.copy_(cand_copy)
                T._chunk_sort_kernel[(rows, cap // chunk)](count, cand, CAP=cap, CH=chunk, num_warps=4)
                T._rank_kernel[(rows, triton.cdiv(cap, T.RANK_BI))](
                    x, lens, count, cand, out, x.stride(0), k, out, 0, 1, K_POW=k_pow, CAP=cap, CH=chunk,
                    LOG_CH=chunk.bit_length() - 1, BI=T.RANK_BI, MAP=False, num_warps=4, maxnreg=T.RANK_MAXNREG_V1)
            res.append(_time(sort_rank) - _time(lambda: cand.copy_(cand_copy)))
            print(f"{rows:>5} {cols:>8} {group:>3} {int(count.float().mean()):>6} {int(nlive.float().mean()):>6}  "
                  + " ".join(f"{v:>11.1f}" for v in res), flush=True)


if __name__ == "__main__":
    main()
