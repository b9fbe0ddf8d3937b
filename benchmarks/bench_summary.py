"""What the summary mix's two kernels cost a layer beside the dense logits (issue #18, docs/current_step_selection.md).

    PYTHONPATH=src:benchmarks python benchmarks/bench_summary.py --points 96x131072,96x524288,8x131072 \
        --parts 4,16 --out benchmarks/results/summary_cost.json

Per point (B requests x L tokens, next_n = 1, V3.2's indexer: 64 heads x 128 dims) and sub-block count S:
  write   ops.write_block_summaries in decoding's steady state: one block filled a request (first = W - 1):
          reads 64 x 132 B, writes S x 132 B a request
  score   ops.paged_summary_scores over every full block: reads S x 132 B a block (S / 64 of the keys' bytes)
  fused   ops.update_and_score_summaries: the two in one launch (what the step runs), steady state as `write`
  logits  ops.paged_indexer_logits over every block (the dense logits, own Triton kernel): 64 x 132 B a block
  select  the mix's per-layer select launch (plan_triton.select_layer_triton: the layer's history and summary
          scores standardized, mixed, selected, compacted) beside the paper's fused plan() for one layer
          (plan_step_triton, reset + select: `paper_select`), both at s = 0.4 over a random history, and the same
          launch where every request is past SpinConfig.summary_below (`idle_select`: what run() pays a layer for
          long requests when the mix is configured for short ones)
Variants in the same call: --score-tiles (tiles a scoring program, block_summary_triton.SCORE_TILES: score / fused
at each, `score_us_t<N>`, `fused_us_t<N>`) and --select-warps (the mix's select at N warps, `select_us_w<N>`); the
first of each list is the row's `score_us` / `fused_us` / `select_us`; --select-tiles (the mix's select with N-block
score tiles, select_layer_triton's score_block, at the launcher's warps: `select_us_s<N>`).
Each is checked against its torch reference on the first rotation before it is timed (CUDA graph, rotated
inputs, harness.time_graph), and reported with its bytes and bandwidth. Bytes first: score / logits should be
about S / 64 in time too, if both stream at the same bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

ROW_BYTES = 132  # D + 4 bytes a key (or a summary row)
# The score kernel's fp8 MMA accumulates with Hopper's ~14 mantissa bits (tests/conftest.py FP8_MMA_RTOL): its
# ||got - want|| / ||want|| against the float32 reference measured 0.95-1.44e-4 on the H200 (run 129).
SCORE_REL_ERR_MAX = 1e-3


def point(batch: int, ctx: int, parts: int, pool, score_tiles=(None,), select_warps=(None,),
          select_tiles=()) -> dict:
    import torch
    from harness import DEVICE, decode_lens, random_queries, rel_err, rotations_for, time_graph

    from spin_indexer import ops
    from spin_indexer.ops.block_summary import paged_summary_scores_ref, write_block_summaries_ref
    from spin_indexer.ops.block_summary_triton import SCORE_TILES
    # the Triton twins themselves (ops' dispatch would take the references in a CPU dry run)
    from spin_indexer.ops.block_summary_triton import paged_summary_scores_triton as score
    from spin_indexer.ops.block_summary_triton import update_and_score_summaries_triton as fused
    from spin_indexer.ops.block_summary_triton import write_block_summaries_triton as write

    width = ctx // 64
    rot = rotations_for(batch * width * 64 * ROW_BYTES)
    tables = pool.tables(batch, width, rot)
    q, w = random_queries(batch, 1)
    lens = decode_lens(batch, 1, ctx)
    full = torch.full((batch,), width, dtype=torch.int32, device=DEVICE)
    first = full - 1
    summaries = torch.zeros(pool.num_blocks, parts, 1, ROW_BYTES, dtype=torch.uint8, device=DEVICE)
    for table in tables:  # every block of every rotation summarized once (the state a long decode leaves)
        write(pool.cache, summaries, table, torch.zeros_like(full), full, validate=False)
    # checks against the references on the first rotation (on a copy: the reference writes too)
    want = summaries.clone()
    write_block_summaries_ref(pool.cache, want, tables[0], first, full, validate=False)
    got = summaries.clone()
    write(pool.cache, got, tables[0], first, full, validate=False)
    write_ok = bool((got == want).double().mean() > 0.99)
    score_tiles = [n or SCORE_TILES for n in score_tiles]
    want_scores = paged_summary_scores_ref(q, summaries, w, tables[0], full, validate=False)
    score_err = max(rel_err(score(q, summaries, w, tables[0], full, validate=False, score_tiles=n), want_scores)
                    for n in score_tiles)
    t_write = time_graph([lambda t=t: write(pool.cache, summaries, t, first, full, validate=False) for t in tables])
    scores = torch.empty(batch, width, device=DEVICE)
    by_tiles = {}
    for n in score_tiles:
        by_tiles[f"score_us_t{n}"] = time_graph([lambda t=t, n=n: score(q, summaries, w, t, full, validate=False,
                                                                        out=scores, score_tiles=n)
                                                 for t in tables]).p50_us
        by_tiles[f"fused_us_t{n}"] = time_graph([lambda t=t, n=n: fused(q, pool.cache, summaries, w, t, first, full,
                                                                        validate=False, out=scores, score_tiles=n)
                                                 for t in tables]).p50_us
    out = torch.empty(batch, width * 64, device=DEVICE)
    t_logits = time_graph([lambda t=t: ops.paged_indexer_logits(q, pool.cache, w, lens, t, validate=False, out=out,
                                                                fill_tail=False, backend="triton") for t in tables])
    write_bytes = batch * (64 + parts) * ROW_BYTES
    score_bytes = batch * width * parts * ROW_BYTES
    logits_bytes = batch * width * 64 * ROW_BYTES + batch * width * 64 * 4  # keys read, logits written
    row = dict(batch=batch, ctx=ctx, parts=parts, write_us=t_write.p50_us,
               score_us=by_tiles[f"score_us_t{score_tiles[0]}"], logits_us=t_logits.p50_us,
               fused_us=by_tiles[f"fused_us_t{score_tiles[0]}"], write_bytes=write_bytes, score_bytes=score_bytes,
               logits_bytes=logits_bytes, write_matches=write_ok, score_rel_err=score_err, **by_tiles)
    for name in ("write", "score", "logits"):
        row[f"{name}_gbps"] = row[f"{name}_bytes"] / (row[f"{name}_us"] * 1e-6) / 1e9
    row["summary_over_logits"] = (row["write_us"] + row["score_us"]) / row["logits_us"]
    row.update(select_times(batch, width, parts, tables, lens, scores, pool.num_blocks, select_warps,
                            select_tiles))
    row["mix_over_logits"] = (row["fused_us"] + row["select_us"]) / row["logits_us"]
    return row


def select_times(batch: int, width: int, parts: int, tables, lens, summary, num_blocks: int,
                 select_warps=(None,), select_tiles=()) -> dict:
    """The mix's select launch (at each of select_warps, None = the launcher's choice, then at each of
    select_tiles' score tiles) and the paper's one-layer plan(), timed over one random history (every block
    scored, no block entering: decoding's steady state).
    summary: float32 [B, W] scores to mix."""
    import dataclasses

    import torch
    from harness import DEVICE, random_history_indexer, time_graph

    from spin_indexer.predictor import SpinConfig
    from spin_indexer.predictor.plan_triton import plan_step_triton, select_layer_triton

    paper = SpinConfig(sparsity=0.4, topk=2048)
    mixed = dataclasses.replace(paper, summary=0.5, summary_parts=parts)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    out = {}
    idle = dataclasses.replace(mixed, summary_below=1)  # every request is past it: the launch selects nothing
    for name, cfg in (("paper_select", paper), ("select", mixed), ("idle_select", idle)):
        idx, slots = random_history_indexer(cfg, batch, width, lens, gen, num_cache_blocks=num_blocks)
        st, ws = idx.state, idx.workspace
        if cfg.summary:
            plan_step_triton(cfg, st, ws, tables[0], lens, slots, None)  # the step's stash, once
            for i, warps in enumerate(select_warps if name == "select" else select_warps[:1]):
                calls = [lambda t=t, cfg=cfg, st=st, ws=ws, warps=warps: select_layer_triton(
                    cfg, st, ws, 0, t, lens, slots, summary, cached=False, num_warps=warps) for t in tables]
                us = time_graph(calls).p50_us
                if i == 0:
                    out[f"{name}_us"] = us
                if name == "select":
                    out[f"select_us_w{warps or 0}"] = us
            def selected(tiles=None):  # the first table's plan at these tiles (None: the launcher's default;
                # the tiling must not change the plan)
                extra = {} if tiles is None else dict(score_block=tiles)
                select_layer_triton(cfg, st, ws, 0, tables[0], lens, slots, summary, cached=False, **extra)
                return ws.num_kept.clone(), ws.kept_blocks.clone()

            want = selected() if name == "select" and select_tiles else None
            for tiles in select_tiles if name == "select" else ():
                got = selected(tiles)
                out[f"select_same_s{tiles}"] = all(torch.equal(g, w) for g, w in zip(got, want))
                calls = [lambda t=t, cfg=cfg, st=st, ws=ws, tiles=tiles: select_layer_triton(
                    cfg, st, ws, 0, t, lens, slots, summary, cached=False, score_block=tiles) for t in tables]
                out[f"select_us_s{tiles}"] = time_graph(calls).p50_us
        else:
            calls = [lambda t=t, cfg=cfg, st=st, ws=ws: plan_step_triton(cfg, st, ws, t, lens, slots, None)
                     for t in tables]
            out[f"{name}_us"] = time_graph(calls).p50_us
        del idx
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default="96x131072,96x524288,8x131072,1x131072", help="BxL,BxL,...")
    p.add_argument("--parts", default="4,16", help="sub-block counts S")
    p.add_argument("--score-tiles", default="0", help="tiles a scoring program to time (0 = the default)")
    p.add_argument("--select-warps", default="0", help="warps of the mix's select to time (0 = the launcher's)")
    p.add_argument("--select-tiles", default="", help="score tiles (blocks) of the mix's select to time too")
    p.add_argument("--out", default=None, help="a JSON file for the rows and the environment")
    args = p.parse_args(argv)
    from harness import KeyPool, environment

    env = environment()
    points = [tuple(int(x) for x in s.split("x")) for s in args.points.split(",")]
    most = max(b * (l // 64) for b, l in points)
    pool = KeyPool(max(2 * most, 64))
    tiles = tuple(int(x) or None for x in args.score_tiles.split(","))
    warps = tuple(int(x) or None for x in args.select_warps.split(","))
    select_tiles = tuple(int(x) for x in args.select_tiles.split(",") if x)
    rows = [point(b, ctx, int(s), pool, tiles, warps, select_tiles) for b, ctx in points
            for s in args.parts.split(",")]
    print(f"{'B x L':>12s} {'S':>3s} {'write us':>9s} {'score us':>9s} {'logits us':>10s} {'(w+s)/logits':>13s} "
          f"{'score GB/s':>11s} {'logits GB/s':>12s} {'fused us':>9s} {'mix select':>11s} {'paper plan':>11s} "
          f"{'idle sel':>9s} {'mix/logits':>11s} ok")
    for r in rows:
        ok = r["write_matches"] and r["score_rel_err"] < SCORE_REL_ERR_MAX
        print(f"{r['batch']:>4d} x {r['ctx']:>6d} {r['parts']:>3d} {r['write_us']:9.1f} {r['score_us']:9.1f} "
              f"{r['logits_us']:10.1f} {r['summary_over_logits']:13.3f} {r['score_gbps']:11.0f} "
              f"{r['logits_gbps']:12.0f} {r['fused_us']:9.1f} {r['select_us']:11.1f} {r['paper_select_us']:11.1f} "
              f"{r['idle_select_us']:9.1f} "
              f"{r['mix_over_logits']:11.3f} {'yes' if ok else 'NO'}")
        variants = {k: v for k, v in r.items()
                    if k.startswith(("score_us_t", "fused_us_t", "select_us_w", "select_us_s"))}
        if len(variants) > 3:
            print("      " + "  ".join(f"{k} {v:.1f}" for k, v in variants.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    same = all(v for r in rows for k, v in r.items() if k.startswith("select_same_s"))
    if not same:
        print("the mix's select chose other blocks at some --select-tiles (select_same_s<N> false)")
    return 0 if same and all(r["write_matches"] and r["score_rel_err"] < SCORE_REL_ERR_MAX for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
