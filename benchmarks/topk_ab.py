"""Paired A/B of the top-k's threshold launch: this tree's ops/topk_triton.py against another copy of it.

At one to a few requests the top-k's chain is most of a decode step (run 156, ncu at 1 x 128K: threshold 16.9 us,
gather 5.2, chunk sort 6.3, rank 8.4 against ~9 us of logits), and its threshold launch is one CTA a row whose
time is its instruction chain. A change to that kernel moves both steps alike, by a few microseconds: less than
the spread between calls, so both builds run here in one process, each step captured in its own CUDA graph, in
paired rounds (harness.time_graphs_paired), and the per-round ratio (variant / tree) is the measurement. Timed
per point (B requests x L tokens, next_n = 1; run_all's inputs): DenseIndexer's step and SpinIndexer's (s = 0.5,
steady state), each with the tree's `_threshold_kernel` / `_threshold_update_kernel` and with the variant's
(the launcher and every other kernel are the tree's). Before timing, each step's top-k of the variant is compared
with the tree's, and each build's whole top-k on random rows (the same positions per row, as sets); the run
fails where any differs.

    PYTHONPATH=src:benchmarks python benchmarks/topk_ab.py --variant .t/old/topk_triton.py \
        --points 1x131072,1x1048576,8x131072 --out $OUT/topk_ab.json

The variant file replaces topk_triton.py's threshold kernels only (it is loaded as a module of the ops package,
so its relative imports resolve there). CPU dry run (SPIN_BENCH_DEVICE=cpu, TRITON_INTERPRET=1): every call runs
once, nothing is timed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

VARIANT_MODULE = "spin_indexer.ops._topk_triton_variant"
KERNELS = ("_threshold_kernel", "_threshold_update_kernel")


def load_variant(path: str):
    """The topk_triton.py at path as a module of the ops package (its relative imports resolve there)."""
    from harness import load_module_copy
    return load_module_copy(path, VARIANT_MODULE, "spin_indexer.ops", "--variant", "a copy of ops/topk_triton.py")


@contextlib.contextmanager
def thresholds_of(module):
    """The tree's top-k launcher with `module`'s threshold kernels while the block runs."""
    from spin_indexer.ops import topk_triton
    with contextlib.ExitStack() as stack:
        for name in KERNELS:
            stack.enter_context(mock.patch.object(topk_triton, name, getattr(module, name)))
        yield


def point(batch: int, ctx: int, variant, rounds: int) -> dict:
    import torch
    from harness import time_graphs_paired
    from run_all import TOPK, Point, steady_indexer

    from spin_indexer.indexer import DenseIndexer
    from spin_indexer.ops import topk_triton as tree
    from spin_indexer.predictor import SpinConfig

    p = Point(batch, ctx, 1, dry=False)
    k = min(TOPK, ctx)
    calls, outs = {}, {}
    for build, mod in (("tree", tree), ("variant", variant)):
        dense = DenseIndexer(k, 1, device=p.table.device)
        spin, slots = steady_indexer(p, SpinConfig(sparsity=0.5, topk=k))

        def dense_step(dense=dense, mod=mod):
            with thresholds_of(mod):
                dense.plan(p.table, p.lens, validate=False)
                return [dense.run(i, p.q[i][0], p.caches[i], p.q[i][1]) for i in range(p.layers)]

        def spin_step(spin=spin, slots=slots, mod=mod):
            with thresholds_of(mod):
                spin.plan(p.table, p.lens, slots, validate=False)
                return [spin.run(i, p.q[i][0], p.caches[i], p.q[i][1]) for i in range(p.layers)]
        outs[build] = [t.sort(dim=1).values.clone() for t in dense_step()]
        calls[f"dense_{build}"], calls[f"spin_{build}"] = dense_step, spin_step
    # and each build's whole top-k on one random row set directly (on the CPU the steps take the reference, so
    # this is where a dry run interprets the variant's kernels)
    gen = torch.Generator(device=p.table.device).manual_seed(2)
    logits = torch.randn(batch, ctx, generator=gen, device=p.table.device)
    direct = [mod.topk_triton(logits, p.lens.view(-1), k, sorted=False).sort(dim=1).values
              for mod in (tree, variant)]
    row = dict(batch=batch, ctx=ctx, layers=p.layers,
               same=all(torch.equal(a, b) for a, b in zip(outs["tree"], outs["variant"]))
               and torch.equal(*direct))
    times = time_graphs_paired(calls, rounds=rounds)
    for step in ("dense", "spin"):
        tree_ms, var_ms = times[f"{step}_tree"], times[f"{step}_variant"]
        row[f"{step}_tree_us"] = statistics.median(tree_ms) * 1e3 / p.layers
        row[f"{step}_variant_us"] = statistics.median(var_ms) * 1e3 / p.layers
        row[f"{step}_ratio"] = statistics.median(v / t for v, t in zip(var_ms, tree_ms))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", required=True, help="a copy of ops/topk_triton.py to time against the tree's")
    p.add_argument("--points", default="1x131072,1x1048576,8x131072,8x524288,32x131072", help="BxL,BxL,...")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=None, help="a JSON file for the rows and the environment")
    args = p.parse_args(argv)
    from harness import environment

    variant = load_variant(args.variant)
    env = dict(environment(), variant=os.path.abspath(args.variant))
    points = [tuple(int(x) for x in s.split("x")) for s in args.points.split(",")]
    rows = []
    print(f"{'B x L':>13s} {'dense tree':>10s} {'variant':>8s} {'ratio':>6s} {'spin tree':>9s} {'variant':>8s} "
          f"{'ratio':>6s} same (us a layer, step incl. plan() over its layers)", flush=True)
    for b, ctx in points:
        r = point(b, ctx, variant, args.rounds)
        rows.append(r)
        print(f"{r['batch']:>4d} x {r['ctx']:>7d} {r['dense_tree_us']:10.1f} {r['dense_variant_us']:8.1f} "
              f"{r['dense_ratio']:6.3f} {r['spin_tree_us']:9.1f} {r['spin_variant_us']:8.1f} {r['spin_ratio']:6.3f} "
              f"{'yes' if r['same'] else 'NO'}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    same = all(r["same"] for r in rows)
    if not same:
        print("topk_ab: the variant's top-k differs from the tree's at some point (same)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
