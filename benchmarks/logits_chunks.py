"""SPIN's compact logits at small grids: the Triton kernel by blocks per program, pipeline stages and scale
prefetch, against DeepGEMM + the maxima pass (what the step runs there today).

Why: at B = 8 x 128K the Triton kernel over SPIN's compact table (half the blocks) took 29.2 us against 38.8
dense, 75% of the time for 50% of the blocks, where DeepGEMM took 21.8 against 44.7 (run 61's profile); the
step then pays DeepGEMM plus a 2.5 us maxima pass that the Triton kernel fuses. A launch shape that lets the
Triton kernel scale with the kept blocks would drop that pass from small-batch steps.

Per point (B x L, next_n = 1, sparsity s; run_all's Point and steady-state history; layer 0's compact table of
plan(), each rotation its own key cache): the Triton kernel with the step's outputs (logits, block maxima and,
where the top-k prunes finer than a block, group maxima) for every (config, chunk), and DeepGEMM with plan()'s
schedule followed by the maxima pass. CUDA graphs, median of replays, per call.

    PYTHONPATH=src:benchmarks python benchmarks/logits_chunks.py --points 8x131072,32x131072 --sparsity 0.5
CPU dry run (nothing timed): SPIN_BENCH_DEVICE=cpu TRITON_INTERPRET=1 ... --points 2x2048 --chunks 1,4
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from harness import DEVICE, environment, time_graph

CHUNKS = "1,2,4,8,16,32"
CONFIGS = "s3,s2,s4,s3p,s2p"  # s<num_stages>[p: scales prefetched one block ahead]


def parse_config(text: str):
    """'s3p' -> LogitsConfig(group=1, num_warps=4, num_stages=3, prefetch=1)."""
    from spin_indexer.ops.indexer_logits_triton import LogitsConfig

    body = text.removeprefix("s")
    prefetch = body.endswith("p")
    body = body.removesuffix("p")
    if not text.startswith("s") or not body.isdigit() or not 1 <= int(body) <= 6:
        raise SystemExit(f"--configs: expected s<stages 1-6>[p], got {text!r}")
    return LogitsConfig(1, 4, int(body), prefetch=prefetch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default="1x131072,8x131072,32x131072,8x524288,96x131072")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--chunks", default=CHUNKS)
    p.add_argument("--configs", default=CONFIGS)
    args = p.parse_args(argv)
    from run_all import TOPK, Point, steady_indexer

    from spin_indexer import ops
    from spin_indexer.ops import deepgemm
    from spin_indexer.ops import indexer_logits_triton as L
    from spin_indexer.ops.indexer_logits_triton import (_pick_chunk, default_config, paged_indexer_logits_triton,
                                                        wave_chunk)
    from spin_indexer.predictor import SpinConfig
    from spin_indexer.predictor.select import budget_of

    chunks = [int(c) for c in args.chunks.split(",")]
    configs = {c: parse_config(c) for c in args.configs.split(",")}
    dry = DEVICE == "cpu"
    have_dg = not dry and deepgemm.available()
    print(f"# logits_chunks: {environment()}", flush=True)
    print("| B x L | s | kept blocks | provider | config | chunk | us | vs DeepGEMM + maxima |")
    print("|---|---|---|---|---|---|---|---|")
    for point in args.points.split(","):
        batch, ctx = (int(v) for v in point.split("x"))
        pt = Point(batch, ctx, 1, dry)
        k = min(TOPK, ctx)
        idx, slots = steady_indexer(pt, SpinConfig(sparsity=args.sparsity, topk=k))
        idx.plan(pt.table, pt.lens, slots, validate=False)
        plan = idx.plans(0)
        rows, width, cols = batch, pt.width, pt.width * 64
        kept = int(plan.num_kept.sum())
        group = ops.topk_group(cols, k)
        fine = idx.workspace.GROUP_MIN <= group < 64
        active = budget_of(width, args.sparsity, k, 64)
        outs = [(torch.empty(rows, cols, device=pt.table.device), torch.empty(rows, width, device=pt.table.device),
                 torch.empty(rows, -(-cols // group), device=pt.table.device) if fine else None)
                for _ in range(pt.layers)]
        base = None
        if have_dg:
            schedule = idx.deepgemm_schedule(0)

            def dg(i):
                x = deepgemm.paged_indexer_logits_deepgemm(pt.q[i][0], pt.caches[i], pt.q[i][1],
                                                           plan.compact_seq_lens, plan.compact_block_table,
                                                           validate=False, schedule=schedule)
                _, bm, gm = outs[i]
                ops.update_history(None, x.view(batch, 1, -1), plan.compact_block_table, plan.compact_seq_lens,
                                   block_max_out=bm, group_max_out=gm, group=group)
            base = time_graph([lambda i=i: dg(i) for i in range(pt.layers)]).p50_us
            print(f"| {batch} x {ctx} | {args.sparsity} | {kept} | deepgemm + maxima | | | {base:.1f} | 1.00 |",
                  flush=True)
        prod = default_config(1, batch * width, compact=True)
        rule_chunk = _pick_chunk(batch, min(width, active), prod.target_programs, prod.max_chunk)

        def production(i):  # what SPIN's step launches: the compact configuration, the chunk from the waves
            x, bm, gm = outs[i]
            paged_indexer_logits_triton(pt.q[i][0], pt.caches[i], pt.q[i][1], plan.compact_seq_lens,
                                        plan.compact_block_table, validate=False, out=x, block_max_out=bm,
                                        fill_tail=False, group_max_out=gm, group=group, active_width=active)
        us = time_graph([lambda i=i: production(i) for i in range(pt.layers)]).p50_us
        # the launches' resident places (the launcher caches them per device and constants; only production calls
        # here pass chunk=None): one value, or the chunk cannot be named from here
        seen = {places for places in L._SLOTS.values() if places}
        slots = next(iter(seen)) if len(seen) == 1 else None
        prod_chunk = wave_chunk(batch, min(width, active), slots, rule_chunk, prod.max_chunk) if slots else rule_chunk
        if len(seen) > 1:
            prod_chunk = "?"
        ratio = f"{us / base:.2f}" if base else "-"
        print(f"| {batch} x {ctx} | {args.sparsity} | {kept} | triton | production ({slots} places) | "
              f"{prod_chunk} (rule {rule_chunk}) | {us:.1f} | {ratio} |", flush=True)
        for name, cfg in configs.items():
            for chunk in chunks:
                def triton_call(i, chunk=chunk, cfg=cfg):
                    x, bm, gm = outs[i]
                    paged_indexer_logits_triton(pt.q[i][0], pt.caches[i], pt.q[i][1], plan.compact_seq_lens,
                                                plan.compact_block_table, validate=False, out=x, block_max_out=bm,
                                                fill_tail=False, group_max_out=gm, group=group, chunk=chunk,
                                                config=cfg)
                us = time_graph([lambda i=i: triton_call(i) for i in range(pt.layers)]).p50_us
                same = dataclasses.replace(cfg, target_programs=prod.target_programs, max_chunk=prod.max_chunk) == prod
                mark = " (production)" if same and chunk == prod_chunk else ""
                ratio = f"{us / base:.2f}" if base else "-"
                print(f"| {batch} x {ctx} | {args.sparsity} | {kept} | triton | {name} | {chunk}{mark} | {us:.1f} | "
                      f"{ratio} |", flush=True)
        del idx, pt, outs
        if not dry:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
