"""Replay throughput (rows x layers x steps / s) of `traces.replay` on this machine, and where it goes.

    python results/fidelity/replay_speed.py   -> results/fidelity/replay_speed.csv (+ a printed table)
Synthetic v4-like traces (k = 512), spin-default at 40%, 4 traces x 6 layers, 12 timed decode steps; then
a 4-config sweep (spin-default at 20-50%) at 32K with 1 and 2 worker processes (`eval --jobs`).
"""
import cProfile
import csv
import os
import pstats
import sys
import time

import torch

from spin_indexer.eval.policies import get_policy
from spin_indexer.traces.replay import replay
from spin_indexer.traces.synthetic import generate

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replay_speed.csv")
CASES = [(4096, 1, True), (8192, 1, True), (16384, 1, True), (32768, 1, True), (16384, 1, False), (16384, 2, True)]


def main() -> None:
    rows = []
    load = os.getloadavg()[0]
    for ctx, threads, fold in CASES:
        torch.set_num_threads(threads)
        traces = [generate("v4-like", seed=i, prompt_id=f"p{i}", context_len=ctx, num_steps=12, num_layers=6)
                  for i in range(4)]
        cfg = get_policy("spin-default", 0.4, topk=512)
        replay(traces[:1], cfg)  # warm-up
        best = min((replay(traces, cfg, fold_layers=fold) for _ in range(2)), key=lambda r: r.seconds)
        rows.append({"context": ctx, "threads": threads, "fold_layers": fold, "rows_layers_steps": best.row_layer_steps,
                     "seconds": round(best.seconds, 3), "throughput": round(best.throughput, 1),
                     "ms_per_step": round(1000 * best.seconds / 12, 1), "load_avg_1min": round(load, 2)})
        print(rows[-1], flush=True)
    from spin_indexer.eval.ablations import run_sweep

    sets = {"s": [generate("v4-like", seed=i, prompt_id=f"p{i}", context_len=32768, num_steps=12, num_layers=6)
                  for i in range(4)]}
    pairs = [("spin-default", s) for s in (0.2, 0.3, 0.4, 0.5)]
    work = sum(t.num_steps * t.num_layers for t in sets["s"]) * len(pairs)
    torch.set_num_threads(1)
    for jobs in (1, 2):
        t = time.perf_counter()
        run_sweep(sets, pairs, jobs=jobs)
        dt = time.perf_counter() - t
        rows.append({"context": 32768, "threads": 1, "fold_layers": True, "rows_layers_steps": work,
                     "seconds": round(dt, 3), "throughput": round(work / dt, 1),
                     "ms_per_step": round(1000 * dt / 12 / len(pairs), 1), "load_avg_1min": round(load, 2),
                     "jobs": jobs})
        print(rows[-1], flush=True)
    for r in rows:
        r.setdefault("jobs", 1)
    with open(OUT, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[-1]))
        w.writeheader()
        w.writerows(rows)
    torch.set_num_threads(1)
    traces = [generate("v4-like", seed=i, prompt_id=f"p{i}", context_len=32768, num_steps=12, num_layers=6)
              for i in range(4)]
    cfg = get_policy("spin-default", 0.4, topk=512)
    prof = cProfile.Profile()
    prof.enable()
    replay(traces, cfg)
    prof.disable()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("cumtime").print_stats("spin_indexer", 16)


if __name__ == "__main__":
    main()
