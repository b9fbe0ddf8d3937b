"""Paired A/B of the fused planner's kernels: this tree's predictor/plan_triton.py against another copy of it.

The select's timings move by 2-6 us between runs of the same code at B = 96 (runs 137-140: the paper's one-layer
plan read 24.6 and 28.7 us in two calls), more than most changes to it are worth. Here both builds run in one
process, each captured in its own CUDA graph, in paired rounds (harness.time_graphs_paired), so a round's drift
hits both alike and the per-round ratio (variant / this tree) is the measurement. Timed per point (B requests x L
tokens, next_n = 1, s = 0.4, random history: decoding's steady state, as bench_summary.select_times):

  paper  plan_step_triton: the paper's plan() of --layers layers (reset + select; 1 by default: one program a
         request, the select's latency; 61: V3.2's plan(), L x B programs, its throughput),
         SpinConfig(sparsity=0.4, topk=2048)
  mix    select_layer_triton: the summary mix's per-layer select (S = 1, weight 0.5) after one plan()

Before timing, each build's plan is compared with this tree's (`same_paper`, `same_mix`: kept blocks and counts
equal); the run fails if any differs, since an A/B of kernels that choose different blocks times two policies.

    PYTHONPATH=src:benchmarks python benchmarks/select_ab.py --variant .t/old/plan_triton.py \
        --points 96x131072,8x131072,1x131072,8x8192 --out $OUT/select_ab.json

The variant file replaces plan_triton.py only (it imports the package's select_triton, config, ... as the tree's
does). CPU dry run (SPIN_BENCH_DEVICE=cpu, TRITON_INTERPRET=1): every call runs once, nothing is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

VARIANT_MODULE = "spin_indexer.predictor._plan_triton_variant"


def load_variant(path: str):
    """The plan_triton.py at path as a module of the predictor package (its relative imports resolve there)."""
    from harness import load_module_copy
    return load_module_copy(path, VARIANT_MODULE, "spin_indexer.predictor", "--variant",
                            "a copy of predictor/plan_triton.py")


def point(batch: int, ctx: int, variant, rounds: int, calls_per_graph: int, layers: int = 1) -> dict:
    import dataclasses

    import torch
    from harness import DEVICE, decode_lens, random_history_indexer, time_graphs_paired

    from spin_indexer.predictor import SpinConfig
    from spin_indexer.predictor import plan_triton as tree

    width = ctx // 64
    lens = decode_lens(batch, 1, ctx)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    table = torch.randperm(batch * width, generator=gen, device=DEVICE).to(torch.int32).view(batch, width)
    summary = torch.randn(batch, width, generator=gen, device=DEVICE)
    paper = SpinConfig(sparsity=0.4, topk=2048)
    mixed = dataclasses.replace(paper, summary=0.5, summary_parts=1)
    row = dict(batch=batch, ctx=ctx, layers=layers)
    calls = {}
    for kind, cfg in (("paper", paper), ("mix", mixed)):
        plans = {}
        for build, mod in (("tree", tree), ("variant", variant)):
            # the same random history for both builds
            idx, slots = random_history_indexer(cfg, batch, width, lens, torch.Generator(device=DEVICE).manual_seed(0),
                                                num_layers=layers if kind == "paper" else 1)
            st, ws = idx.state, idx.workspace
            if kind == "paper":
                def call(mod=mod, st=st, ws=ws, slots=slots):
                    mod.plan_step_triton(paper, st, ws, table, lens, slots, None)
            else:
                tree.plan_step_triton(cfg, st, ws, table, lens, slots, None)  # the step's stash, once

                def call(mod=mod, st=st, ws=ws, slots=slots):
                    mod.select_layer_triton(mixed, st, ws, 0, table, lens, slots, summary, cached=False)
            call()
            plans[build] = (ws.num_kept.clone(), ws.kept_blocks.clone())
            # counters advance at every plan(): a graph of several calls is the same work each time
            calls[f"{kind}_{build}"] = lambda call=call: [call() for _ in range(calls_per_graph)]
        row[f"same_{kind}"] = all(torch.equal(a, b) for a, b in zip(plans["tree"], plans["variant"]))
    times = time_graphs_paired(calls, rounds=rounds)
    for kind in ("paper", "mix"):
        tree_ms, var_ms = times[f"{kind}_tree"], times[f"{kind}_variant"]
        row[f"{kind}_tree_us"] = statistics.median(tree_ms) * 1e3 / calls_per_graph
        row[f"{kind}_variant_us"] = statistics.median(var_ms) * 1e3 / calls_per_graph
        row[f"{kind}_ratio"] = statistics.median(v / t for v, t in zip(var_ms, tree_ms))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", required=True, help="a copy of predictor/plan_triton.py to time against the tree's")
    p.add_argument("--points", default="96x131072,8x131072,1x131072,96x16384,8x8192", help="BxL,BxL,...")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=8, help="calls a graph (each round's time is divided by it)")
    p.add_argument("--layers", type=int, default=1, help="layers of the paper's plan() (the mix's select: one)")
    p.add_argument("--out", default=None, help="a JSON file for the rows and the environment")
    args = p.parse_args(argv)
    from harness import environment

    variant = load_variant(args.variant)
    env = dict(environment(), variant=os.path.abspath(args.variant))
    points = [tuple(int(x) for x in s.split("x")) for s in args.points.split(",")]
    if args.layers < 1:
        raise SystemExit(f"--layers: expected an int >= 1, got {args.layers}")
    rows = [point(b, ctx, variant, args.rounds, args.calls, args.layers) for b, ctx in points]
    print(f"{'B x L':>12s} {'paper tree':>11s} {'variant':>8s} {'ratio':>6s} {'mix tree':>9s} {'variant':>8s} "
          f"{'ratio':>6s} same")
    for r in rows:
        print(f"{r['batch']:>4d} x {r['ctx']:>6d} {r['paper_tree_us']:11.1f} {r['paper_variant_us']:8.1f} "
              f"{r['paper_ratio']:6.3f} {r['mix_tree_us']:9.1f} {r['mix_variant_us']:8.1f} {r['mix_ratio']:6.3f} "
              f"{'yes' if r['same_paper'] and r['same_mix'] else 'NO'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    same = all(r["same_paper"] and r["same_mix"] for r in rows)
    if not same:
        print("select_ab: the variant chose other blocks than the tree at some point (same_paper / same_mix)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
