"""Where the time of one SpinIndexer step goes: torch.profiler over plan + run (one layer, eager, after
warm-up), kernels grouped by name, top entries printed. Complements run_all.py's plan_update_us column.

    PYTHONPATH=src python benchmarks/profile_step.py --cases 96,524288,1,0.5 1,131072,1,0.5
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))


def profile_case(pool, batch, ctx, next_n, sparsity, top=25):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench_indexer_logits import LogitsPoint
    from bench_step import FusedOps, make_indexer, patched_ops

    point = LogitsPoint(pool, batch, ctx, next_n, rotations=1)
    width = point.tables[0].shape[1]
    idx, slots = make_indexer(batch, width, next_n, sparsity)
    fused = FusedOps(batch * next_n, width)

    def step():
        idx.plan(point.tables[0], point.lens[0], slots, validate=False)
        idx.run(0, point.q, pool.cache, point.w)

    with patched_ops(fused.logits, fused.topk):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((t / 3, e.count / 3, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"\n== B={batch} ctx={ctx} next_n={next_n} s={sparsity}: {total:.1f} us of kernels per step, "
          f"{sum(r[1] for r in rows):.0f} kernel launches")
    for t, n, name in rows[:top]:
        print(f"{t:9.1f} us {n:5.0f}x  {100 * t / total:5.1f}%  {name[:110]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="+", default=["96,524288,1,0.5", "1,131072,1,0.5"])
    p.add_argument("--pool-gib", type=float, default=8.0)
    args = p.parse_args()
    from harness import KeyPool
    pool = KeyPool(int(args.pool_gib * 2**30 // (64 * 132)))
    for case in args.cases:
        b, c, n, s = case.split(",")
        profile_case(pool, int(b), int(c), int(n), float(s))


if __name__ == "__main__":
    main()
