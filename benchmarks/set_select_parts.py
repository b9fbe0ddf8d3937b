"""The set select (ops/topk_triton._select_set_kernel) beside the sorted chain's sort + rank, on the GPU, on the
buffers the threshold and gather leave for random rows: where SET_SELECT_MIN_ROWS should sit.

    PYTHONPATH=src:benchmarks python benchmarks/set_select_parts.py [--rows 1,96] [--cols 65536,131072]

Each is 20 launches in one CUDA graph (harness.time_graph: the time of one launch):
  select       _select_set_kernel as the step runs it (rows programs)
  sort+rank    the sorted chain's chunk sort and rank launches (a copy of the candidates restored before each)
Run 47 timed an earlier form (the in-order emit over the live groups, the first digit over all 16 bits) with its
halves apart: the digit search ~14 us, the emit ~38 us at 128K (~4 us a step of 4096 columns), an emit from
registers ~4 us; sort + rank ~10 us at 1-8 rows, ~28 at 96.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton

from harness import DEVICE
from spin_indexer.ops import topk_triton as T
from spin_indexer.ops.topk import topk_group


def sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def _time(fn) -> float:
    """Microseconds of one call: 20 calls captured in one CUDA graph (no launch gaps); harness.time_graph's median
    is per call already (run 48's table divided it by 20 once more: its numbers are 1/20 of the times)."""
    from harness import time_graph
    return time_graph([fn] * 20).p50_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,16,32,48,64,96")
    ap.add_argument("--cols", default="65536,131072,524288")
    ap.add_argument("--k", type=int, default=2048)
    a = ap.parse_args()
    k = a.k
    print(f"{'rows':>5} {'cols':>8} {'G':>3} {'cands':>6} {'live':>6}  " +
          " ".join(f"{p:>11}" for p in ("select", "sort+rank")) + "  (us)")
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
            warps = T.set_select_warps(cap)
            res = [
                _time(lambda: T._select_set_kernel[(rows,)](x, lens, count, cand, thresh, out, x.stride(0), k, out, 0,
                                                            1, K_POW=k_pow, CAP=cap, MAP=False, num_warps=warps)),
            ]
            cand_copy = cand.clone()
            chunk = min(T.SORT_CHUNK, cap)

            def sort_rank():
                cand.copy_(cand_copy)
                T._chunk_sort_kernel[(rows, cap // chunk)](count, cand, CAP=cap, CH=chunk, num_warps=4)
                T._rank_kernel[(rows, triton.cdiv(cap, T.RANK_BI))](
                    x, lens, count, cand, out, x.stride(0), k, out, 0, 1, K_POW=k_pow, CAP=cap, CH=chunk,
                    LOG_CH=chunk.bit_length() - 1, BI=T.RANK_BI, MAP=False, num_warps=4, maxnreg=T.RANK_MAXNREG)
            res.append(_time(sort_rank) - _time(lambda: cand.copy_(cand_copy)))
            print(f"{rows:>5} {cols:>8} {group:>3} {int(count.float().mean()):>6} {int(nlive.float().mean()):>6}  "
                  + " ".join(f"{v:>11.1f}" for v in res), flush=True)


if __name__ == "__main__":
    main()
