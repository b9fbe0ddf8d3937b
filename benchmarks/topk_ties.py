"""The top-k on rows whose k-th value is a mass tie (the overflow fallback) against rows without ties.

The e2e proxy model (bench_e2e.py, random weights) has layers whose indexer scores are exactly 0 for most
columns (the weighted sum of ReLUs is 0 wherever every head's dot product is <= 0) with fewer than k positives:
the k-th largest value is 0, shared by thousands of columns, so the 16-bit threshold bucket overflows the
candidate buffer and the row takes the fallback (`_merge_overflow`, in the rank launch with sorted=True and in
the set select with sorted=False). This times `ops.topk_positions` on such rows and on random rows of the
same shape (CUDA graph, per call), both orders.

    PYTHONPATH=src:benchmarks python benchmarks/topk_ties.py --points 96x32768,96x16384,1x131072 --k 512
CPU dry run: SPIN_BENCH_DEVICE=cpu TRITON_INTERPRET=1 ... --points 2x512 --k 16
"""
from __future__ import annotations

import argparse

import torch

from harness import DEVICE, environment, rotations_for, time_graph


def tie_rows(rows: int, cols: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """float32 [rows, cols]: k // 2 positives at random columns, a third of the columns negative, the rest
    exactly 0 (the proxy's zero-tie layers)."""
    x = torch.zeros(rows, cols)
    neg = torch.rand(rows, cols, generator=gen) < 1 / 3
    x[neg] = -torch.rand(int(neg.sum()), generator=gen)
    for r in range(rows):
        x[r, torch.randperm(cols, generator=gen)[:k // 2]] = torch.rand(k // 2, generator=gen) + 0.1
    return x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default="96x32768,96x16384,32x32768,1x32768,96x131072")
    p.add_argument("--k", type=int, default=512)
    args = p.parse_args(argv)
    from spin_indexer import ops
    from spin_indexer.ops.topk import topk_ref
    from spin_indexer.ops.topk_triton import topk_triton

    env = environment()
    print(f"# topk_ties: {env}")
    dev = torch.device(DEVICE)
    gen = torch.Generator().manual_seed(0)
    print("| rows x cols | k | order | random rows us | tie rows us | tie / random | candidates (tie rows) |")
    print("|---|---|---|---|---|---|---|")
    for point in args.points.split(","):
        rows, cols = (int(v) for v in point.split("x"))
        lengths = torch.full((rows,), cols, dtype=torch.int32, device=dev)
        inputs = {"random": torch.randn(rows, cols, generator=gen).to(dev), "tie": tie_rows(rows, cols, args.k, gen).to(dev)}
        stats = torch.zeros(rows, dtype=torch.int32, device=dev)
        # the exact answer once (the tie rows' order: positives best first, then zeros by position)
        got = ops.topk_positions(inputs["tie"], lengths, args.k, validate=False, sorted=True)
        want = topk_ref(inputs["tie"].cpu(), lengths.cpu(), args.k)
        assert torch.equal(got.cpu(), want), "tie rows: the top-k differs from topk_ref"
        if dev.type == "cuda":  # the tie rows' candidate counts (> CAP: the fallback ran)
            topk_triton(inputs["tie"], lengths, args.k, validate=False, stats=stats)
        for order in (True, False):
            times = {}
            for name, x in inputs.items():
                n = rotations_for(x.numel() * 4)
                xs = [x.clone() for _ in range(n)]
                outs = [torch.empty(rows, args.k, dtype=torch.int32, device=dev) for _ in range(n)]
                calls = [lambda x=x, o=o: ops.topk_positions(x, lengths, args.k, validate=False, out=o, sorted=order)
                         for x, o in zip(xs, outs)]
                times[name] = time_graph(calls).p50_us
            print(f"| {rows} x {cols} | {args.k} | {'best first' if order else 'set'} | {times['random']:.1f} | "
                  f"{times['tie']:.1f} | {times['tie'] / times['random']:.2f} | "
                  f"{int(stats.min())}-{int(stats.max())} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
