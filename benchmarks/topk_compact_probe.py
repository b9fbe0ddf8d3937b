"""Experiment (#14, one-request points): why SPIN's top-k alone costs ~2 us more than the dense step's at one row.

run_all's `topk_us` (the top-k alone on SPIN's compact logits) against `own_topk_us` (on the dense logits): H200
run 162 at 1 x 64K / 128K / 512K / 1M +2.2 / +2.0 / +2.0 / +2.3 us (256K: +0.5) whatever the sparsity, H100 run 171 at
1 x 128K +1.8; at 8 x 128K +0.1. Same k, same group, same buffers' width. Two things differ: a compact row's length
(the kept share of the width: fewer live groups, more candidates each) and the final write through the kept-block
map (`kept_blocks`: one more dependent load in the rank launch's chain). This times, in paired rounds, the top-k on
one set of random rows four ways: full length / half length, each without and with an ascending kept-block map
(every other block), and each cumulatively by stage (2 = threshold, 3 = + gather, 4 = + chunk sort or the set
select, 5 = + rank), so the differences say which launch holds the 2 us. Before timing, each variant's whole top-k
is compared with topk_positions_ref on its inputs (as sets); the run fails where one differs.

    PYTHONPATH=src:benchmarks python benchmarks/topk_compact_probe.py [--points 1x131072,1x1048576] [--out F]

CPU dry run (SPIN_BENCH_DEVICE=cpu, TRITON_INTERPRET=1): every call runs once, nothing is timed.
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

POINTS = "1x65536,1x131072,1x1048576,8x131072"
VARIANTS = ("full", "full_map", "half", "half_map")


def inputs(rows: int, cols: int, k: int, variant: str):
    """(logits, lengths, block max, group max, group, kept blocks or None) for one variant: the same random values
    for every variant, in buffers of its own (as each layer of a step has its own logits: run 177 measured so)."""
    import torch
    from harness import DEVICE, random_topk_rows

    from spin_indexer import ops

    logits, lens, bmax, _ = random_topk_rows(rows, cols, k)
    if variant.startswith("half"):
        lens = torch.full_like(lens, cols // 2)
    group = ops.topk_group(cols, k)
    gmax = ops.group_max_ref(logits, lens, group) if group < 64 else None
    kept = None
    if variant.endswith("_map"):  # ascending logical ids, as BlockPlan's: every other block (half) or all (full)
        width = cols // 64
        step = 2 if variant.startswith("half") else 1
        ids = (torch.arange(width, device=DEVICE, dtype=torch.int32) * step).clamp(max=width - 1)
        kept = ids[None, :].expand(rows, width).contiguous()
    return logits, lens, bmax, gmax, group, kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=POINTS, help="comma list of ROWSxCOLS")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--sorted", action="store_true", help="best first (the sort and rank at every row count)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch
    from harness import environment, time_graphs_paired

    from spin_indexer.ops.topk import topk_positions_ref
    from spin_indexer.ops.topk_triton import topk_triton

    env = environment()
    print(json.dumps(env))
    results = []
    for spec in a.points.split(","):
        rows, cols = (int(x) for x in spec.split("x"))
        calls = {}
        for variant in VARIANTS:
            x, lens, bm, gm, group, kept = inputs(rows, cols, a.topk, variant)
            got = topk_triton(x, lens, a.topk, validate=False, block_max=bm, group_max=gm, group=group,
                              kept_blocks=kept, sorted=a.sorted)
            want = topk_positions_ref(x, lens, a.topk, kept_blocks=kept, sorted=a.sorted)
            if not torch.equal(got.sort(dim=1).values, want.sort(dim=1).values):
                raise SystemExit(f"topk_compact_probe: {variant} at {spec}: the top-k differs from the reference")
            for stages in (2, 3, 4, 5):
                calls[f"{variant}/{stages}"] = (lambda x=x, lens=lens, bm=bm, gm=gm, group=group, kept=kept, s=stages:
                                                topk_triton(x, lens, a.topk, validate=False, block_max=bm,
                                                            group_max=gm, group=group, kept_blocks=kept,
                                                            sorted=a.sorted, _stages=s))
        times = time_graphs_paired(calls, rounds=a.rounds)
        med = {name: 1e3 * statistics.median(ms) for name, ms in times.items()}
        row = {"rows": rows, "cols": cols, "k": a.topk, "sorted": a.sorted, **{f"{n}_us": round(v, 2)
                                                                             for n, v in med.items()}}
        # paired differences against the full row without a map, per stage (median of the per-round differences)
        for variant in VARIANTS[1:]:
            for stages in (2, 3, 4, 5):
                d = [1e3 * (v - f) for v, f in zip(times[f"{variant}/{stages}"], times[f"full/{stages}"])]
                row[f"d_{variant}/{stages}_us"] = round(statistics.median(d), 2)
        results.append(row)
        print(f"{rows} x {cols}: " + "  ".join(
            f"{v}: " + " / ".join(f"{med[f'{v}/{s}']:.1f}" for s in (2, 3, 4, 5)) for v in VARIANTS))
        print("   paired vs full, by stage 2/3/4/5: " + "  ".join(
            f"{v}: " + " / ".join(f"{row[f'd_{v}/{s}_us']:+.2f}" for s in (2, 3, 4, 5)) for v in VARIANTS[1:]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"env": env, "args": vars(a), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
