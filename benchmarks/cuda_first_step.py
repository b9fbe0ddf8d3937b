"""Experiment (#14 / #17): the CUDA logits kernel's grid on SPIN's compact table, steady state and first step.

SPIN's step passes the kept budget as `active_width`: the table's first columns are chunked over the GPU and the
columns past them go in larger chunks (indexer_logits_cuda.grid_chunks). In steady state those columns are empty
(each request keeps about the budget); on a request's first step every block is unscored, so kept, and the whole
table holds blocks. This times, in paired rounds (harness.time_graphs_paired), per point:

  steady_*   each request's compact length = the budget's tokens (the columns past it empty)
  first_*    each request's compact length = the whole context (every block kept: a first step)

under three grids: `width` (active_width None: chunked by the table's width, the rule before d7bc01b),
`budget` (production: grid_chunks with the budget) and `tail256` (d7bc01b's rule: the columns past the budget in
256-block chunks). Prediction: steady budget < steady width (idle CTAs gone); first budget ~= first width (no
CTA larger than the width rule's), first tail256 slower at small B (a few long CTAs).

    PYTHONPATH=src:benchmarks python benchmarks/cuda_first_step.py --points 1x131072x2,8x131072x4,8x524288x2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from unittest import mock

import torch

from harness import KeyPool, environment, random_queries, time_graphs_paired
from spin_indexer.ops import indexer_logits_cuda as cu
from spin_indexer.predictor.select import budget_of

TOPK = 2048


def tail256(batch, width, active_width, chunk, sms):
    lead, chunk, _ = cu.grid_chunks(batch, width, active_width, chunk, sms)
    return lead, chunk, (cu.MAX_CHUNK if lead < width else chunk)


def time_point(batch: int, ctx: int, next_n: int, sparsity: float, rounds: int) -> dict:
    width = ctx // 64
    budget = budget_of(width, sparsity, TOPK, 64)
    pool = KeyPool(batch * width + 1)
    table = pool.tables(batch, width, 1)[0]
    q, w = random_queries(batch, next_n)
    lens = {"steady": budget * 64, "first": ctx}
    out = torch.empty(batch * next_n, width * 64, device="cuda")
    bmax = torch.empty(batch * next_n, width, device="cuda")
    gmax = torch.empty(batch * next_n, width * 64 // 16, device="cuda")

    def call(kind, active):
        seq = torch.full((batch, next_n), lens[kind], dtype=torch.int32, device="cuda")
        seq -= torch.arange(next_n - 1, -1, -1, dtype=torch.int32, device="cuda")  # MTP rows: one token apart
        return lambda: cu.paged_indexer_logits_cuda(q, pool.cache, w, seq, table, validate=False, out=out,
                                                    block_max_out=bmax, group_max_out=gmax, group=16,
                                                    active_width=active)

    calls = {f"{kind}_width": call(kind, None) for kind in lens}
    calls.update({f"{kind}_budget": call(kind, budget) for kind in lens})
    with mock.patch.object(cu, "grid_chunks", tail256):
        times = time_graphs_paired({**calls, **{f"{kind}_tail256": call(kind, budget) for kind in lens}}, rounds)
    sms = cu.sm_count(q.device)
    row = dict(batch=batch, ctx=ctx, next_n=next_n, sparsity=sparsity, budget=budget,
               grid_budget=cu.grid_chunks(batch, width, budget, None, sms), grid_width=cu.grid_chunks(
                   batch, width, None, None, sms))
    for name, ms in times.items():
        row[f"{name}_us"] = 1e3 * statistics.median(ms)
    for kind in lens:
        for var in ("budget", "tail256"):
            row[f"{kind}_{var}_vs_width"] = statistics.median(
                a / b for a, b in zip(times[f"{kind}_{var}"], times[f"{kind}_width"]))
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
