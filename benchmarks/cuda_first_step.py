"""Experiment (#14 / #17): the CUDA logits kernel's grid rules on SPIN's compact table and on the dense table.

SPIN's step passes the kept budget as `active_width`: the table's first columns are chunked over the GPU and the
columns past them go in larger chunks (indexer_logits_cuda.grid_chunks). In steady state those columns are empty
(each request keeps about the budget); on a request's first step every block is unscored, so kept, and the whole
table holds blocks. The dense step passes no active_width. Paired rounds (harness.time_graphs_paired), per point:

  steady       each request's compact length = the budget's tokens (the columns past it empty), active_width =
               the budget: production (makespan_chunk)
  first        each request's compact length = the whole context (every block kept: a first step), the same grid
  dense        the dense table (active_width None, the whole context)
  *_wave       the same with the chunk rule before run 154 (update_overlap.wave_chunk: whole waves)
  first_tail256  d7bc01b's grid: the columns past the budget in 256-block chunks (8aff430 bounded them)

and each variant's time over production's, per round, median (`<name>_vs_prod`). Prediction: the tail rule keeps
first ~= dense (no CTA larger than the dense grid's); tail256 slower at small B (a few long CTAs).

    PYTHONPATH=src:benchmarks python benchmarks/cuda_first_step.py --points 1x131072x2,8x131072x4,8x524288x2
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from unittest import mock

import torch

from harness import KeyPool, environment, random_queries, time_graphs_paired
from update_overlap import wave_chunk
from spin_indexer.ops import indexer_logits_cuda as cu
from spin_indexer.predictor.select import budget_of

TOPK = 2048
GRID_CHUNKS = cu.grid_chunks  # production's, before the patches below


def tail256(batch, width, active_width, chunk, sms):
    lead, chunk, _ = GRID_CHUNKS(batch, width, active_width, chunk, sms)
    return lead, chunk, (cu.MAX_CHUNK if lead < width else chunk)


def time_point(batch: int, ctx: int, next_n: int, sparsity: float, rounds: int) -> dict:
    width = ctx // 64
    budget = budget_of(width, sparsity, TOPK, 64)
    pool = KeyPool(batch * width + 1)
    table = pool.tables(batch, width, 1)[0]
    q, w = random_queries(batch, next_n)
    out = torch.empty(batch * next_n, width * 64, device="cuda")
    bmax = torch.empty(batch * next_n, width, device="cuda")
    gmax = torch.empty(batch * next_n, width * 64 // 16, device="cuda")

    def call(tokens, active, patch=None):  # patch: a context manager factory
        seq = torch.full((batch, next_n), tokens, dtype=torch.int32, device="cuda")
        seq -= torch.arange(next_n - 1, -1, -1, dtype=torch.int32, device="cuda")  # MTP rows: one token apart

        def launch():
            with (patch or contextlib.nullcontext)():  # a host rule: the patch acts when the graph is captured
                cu.paged_indexer_logits_cuda(q, pool.cache, w, seq, table, validate=False, out=out, block_max_out=bmax,
                                             group_max_out=gmax, group=16, active_width=active)
        return launch

    def wave():
        return mock.patch.object(cu, "makespan_chunk", wave_chunk)

    def tail():
        return mock.patch.object(cu, "grid_chunks", tail256)

    calls = {"steady": call(budget * 64, budget), "first": call(ctx, budget), "dense": call(ctx, None),
             "steady_wave": call(budget * 64, budget, wave), "first_wave": call(ctx, budget, wave),
             "dense_wave": call(ctx, None, wave), "first_tail256": call(ctx, budget, tail)}
    times = time_graphs_paired(calls, rounds)
    sms = cu.sm_count(q.device)
    row = dict(batch=batch, ctx=ctx, next_n=next_n, sparsity=sparsity, budget=budget, sms=sms,
               grid=cu.grid_chunks(batch, width, budget, None, sms), dense_grid=cu.grid_chunks(batch, width, None, None,
                                                                                                sms),
               grid_wave=(budget, wave_chunk(batch, budget, sms), max(wave_chunk(batch, budget, sms),
                                                                      wave_chunk(batch, width, sms))),
               dense_grid_wave=wave_chunk(batch, width, sms))
    for name, ms in times.items():
        row[f"{name}_us"] = 1e3 * statistics.median(ms)
    for name in calls:
        prod = name.split("_")[0]
        if name != prod:
            row[f"{name}_vs_prod"] = statistics.median(a / b for a, b in zip(times[name], times[prod]))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="1x131072x2,8x131072x4,8x524288x2,96x131072x4")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--out", default="/tmp/out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_first_step: needs a CUDA GPU (SM90)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    rows = []
    for spec in args.points.split(","):
        b, L, n = map(int, spec.split("x"))
        row = time_point(b, L, n, args.sparsity, args.rounds)
        rows.append(row)
        print("point", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
              flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "cuda_first_step.json"), "w") as f:
        json.dump(dict(env=env, command=" ".join(sys.argv), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
