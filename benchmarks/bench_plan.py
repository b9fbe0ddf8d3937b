"""plan() of a whole step (every layer's select in one launch) under launch variants of the fused planner.

The register path's select runs one program per (request, layer): at 96 requests x 61 layers, 5856 programs
of ~30-40 dependent CTA reductions each, so its time is the number of waves x one program's latency, and the
programs resident per SM (65536 registers / (warps x 32 x registers per thread)) set the waves. Each variant
(warps x register cap) is checked against the production launch on the same state (kept blocks, compact
table and lengths equal) before it is timed (CUDA graph, median of replays).

    PYTHONPATH=src:benchmarks python benchmarks/bench_plan.py --points 96x131072,96x524288 --layers 61
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# (warps, register cap): None = the launcher's default for its tile, 0 = ptxas's choice
VARIANTS = ((None, None), (4, 128), (4, 96), (2, 168), (2, 128), (2, 96), (8, 64))


def plan_point(batch: int, ctx: int, layers: int, sparsity: float, variants) -> list[dict]:
    import torch
    from harness import decode_lens, time_graph
    from run_all import steady_state

    from spin_indexer.indexer import SpinIndexer
    from spin_indexer.predictor import SpinConfig
    from spin_indexer.predictor import plan_triton

    dev = "cuda"
    width = ctx // 64
    cfg = SpinConfig(sparsity=sparsity)
    idx = SpinIndexer(cfg, num_layers=layers, max_batch=batch, max_blocks=width, device=dev)
    slots = torch.tensor([idx.state.allocate() for _ in range(batch)], dtype=torch.int64, device=dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    table = torch.randperm(batch * width, device=dev, generator=gen).to(torch.int32).view(batch, width)
    lens = decode_lens(batch, 1, ctx).to(dev)
    steady_state(idx, types.SimpleNamespace(ctx=ctx))  # run_all's random history of many past steps
    start = copy.deepcopy(idx.state)

    def run(warps, cap):
        plan_triton.plan_step_triton(cfg, idx.state, idx.workspace, table, lens, slots, None, num_warps=warps,
                                     max_registers=cap)

    def outputs():
        ws = idx.workspace
        return [t[:, :batch].clone() for t in (ws.kept_blocks, ws.compact_table, ws.num_kept, ws.compact_lens)]

    rows = []
    want = None
    for warps, cap in variants:
        idx.state = copy.deepcopy(start)
        run(warps, cap)
        got = outputs()
        if want is None:
            want = got
        same = all(torch.equal(a, b) for a, b in zip(want, got))
        t = time_graph([lambda: run(warps, cap)], max_reps=10).p50_us
        rows.append(dict(batch=batch, context=ctx, layers=layers, warps=warps or "default",
                         max_registers="default" if cap is None else cap, plan_us=round(t, 1),
                         us_per_layer=round(t / layers, 2), equal_to_default=same))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", default="96x131072,96x524288")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--variants", default=None,
                   help="comma list of WARPSxCAP (0 = ptxas's choice), e.g. 16x0,8x0,32x64; the production launch "
                        "is always timed first (default: the module's VARIANTS)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    variants = VARIANTS if args.variants is None else ((None, None),) + tuple(
        tuple(int(x) for x in v.split("x")) for v in args.variants.split(",") if v)
    import torch
    from harness import environment
    if not torch.cuda.is_available():
        raise SystemExit("bench_plan.py needs CUDA (it times the fused planner)")
    env = environment()
    print(json.dumps(env), flush=True)
    rows = []
    for pt in args.points.split(","):
        b, c = (int(x) for x in pt.split("x"))
        rows += plan_point(b, c, args.layers, args.sparsity, variants)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_plan.json"), "w") as f:
            json.dump(dict(env=env, command="python " + " ".join(sys.argv), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
