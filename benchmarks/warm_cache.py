"""Compile the kernels a benchmark run will meet, in parallel processes, before the timed run starts.

On the H200 host a kernel variant costs triton 3-30 s of CPU to compile (DeepGEMM's JIT likewise), and a
benchmark meets dozens of variants one after another in ONE process: run 17's grid spent its first 120 s on
its first point. Triton and DeepGEMM keep what they compile in on-disk caches, so running each point once
beforehand, all points at once over the host's cores, leaves the timed run only cache hits.

    PYTHONPATH=src:benchmarks python3 benchmarks/warm_cache.py --points 96x131072x1,1x131072x1,32x524288x2

Each point runs as `run_all.py --phases grid` at the smallest batch that compiles the same variants
(`warm_batch`: triton specializes an integer argument on == 1 and on divisibility by 16, and the set top-k
takes another path from SET_SELECT_MIN_ROWS rows), one more process runs run_all's checks. What they print goes to
<out>/warm_<i>.log; their timings are discarded. A point that fails or runs past --timeout-s costs only its
own log: the timed run then compiles what is missing, as it would have anyway.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def warm_batch(batch: int, next_n: int, select_rows: int | None = None, width: int | None = None) -> int:
    """The smallest batch whose launches compile as `batch`'s do: the same == 1 / % 16 specialization of the
    batch and of the rows (batch x next_n), the same side of the set top-k's row limit (rows >= select_rows,
    default topk_triton.SET_SELECT_MIN_ROWS: the select launch instead of the sort and rank) and, given the
    table width, the same configuration of the dense logits kernel (indexer_logits_triton.default_config: it
    depends on the table's blocks, B x W)."""
    from spin_indexer.ops.indexer_logits_triton import default_config
    if select_rows is None:
        from spin_indexer.ops.topk_triton import SET_SELECT_MIN_ROWS as select_rows

    def same(b: int) -> bool:
        return all(((x == 1), (x % 16 == 0)) == ((y == 1), (y % 16 == 0))
                   for x, y in ((b, batch), (b * next_n, batch * next_n))) and \
            ((b * next_n >= select_rows) == (batch * next_n >= select_rows)) and \
            (width is None or default_config(next_n, b * width, False) == default_config(next_n, batch * width, False))

    return next(b for b in range(1, batch + 1) if same(b))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", required=True, help="comma list of BxLxN points (run_all.py's --points)")
    ap.add_argument("--sparsities", default="0.5,0.4")
    ap.add_argument("--workers", type=int, default=8, help="processes at once")
    ap.add_argument("--timeout-s", type=float, default=240, help="wall limit of each process")
    ap.add_argument("--out", default="/tmp/warm")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    jobs = [["--phases", "check"]]
    seen = set()
    for item in args.points.split(","):
        b, c, n = (int(x) for x in item.split("x"))
        point = (warm_batch(b, n, width=-(-c // 64)), c, n)
        if point not in seen:
            seen.add(point)
            jobs.append(["--phases", "grid", "--points", "x".join(map(str, point)), "--sparsities", args.sparsities])
    t0, running, failed = time.time(), [], 0
    for i, job in enumerate(jobs):
        while len(running) >= args.workers:
            failed += _reap(running)
        log = open(os.path.join(args.out, f"warm_{i}.log"), "w")
        cmd = ["timeout", str(int(args.timeout_s)), sys.executable, os.path.join(HERE, "run_all.py"),
               "--out", os.path.join(args.out, f"run_{i}"), *job]
        running.append((" ".join(job), subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    while running:
        failed += _reap(running)
    print(f"warm_cache: {len(jobs)} processes ({', '.join(sorted(' x '.join(map(str, p)) for p in seen))}), "
          f"{failed} failed or timed out, {time.time() - t0:.0f} s", flush=True)
    return 0


def _reap(running: list) -> int:
    """Wait for the first of the running processes to finish and collect it: 1 if it failed, else 0."""
    while True:
        for entry in list(running):
            name, proc, log = entry
            if proc.poll() is not None:
                running.remove(entry)
                log.close()
                if proc.returncode != 0:
                    print(f"warm_cache: {name} exited {proc.returncode}", flush=True)
                return int(proc.returncode != 0)
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
