"""Where the time of one indexer step goes, per layer: torch.profiler over SpinIndexer and DenseIndexer
(eager, after warm-up, kernels grouped by name), then CUDA-graph timings of the top-k's stages and of the
EMA update pass alone (with tile variants). Complements run_all.py, whose columns are whole-step times.

    PYTHONPATH=src:benchmarks python benchmarks/profile_step.py --points 96x524288x1,1x131072x1 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))


def kernel_table(fn, iters: int = 3) -> list[tuple[float, float, str]]:
    """(device us per call, launches per call, kernel name) of fn(), profiled eagerly after a warm-up."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((t / iters, e.count / iters, e.key))
    return sorted(rows, reverse=True)


def per_layer_rows(step_rows: list, plan_rows: list, layers: int, plan_layers: int) -> list[tuple[float, float, str]]:
    """One layer's share of a step of plan_layers layers, from kernel_table rows (us, launches, name) of a profiled
    step (plan() of plan_layers layers, then run() of `layers`) and of plan() alone: run()'s kernels / layers plus
    plan()'s / plan_layers, as run_all's columns count them. The whole step / layers would charge each profiled
    layer plan_layers / layers times its share of plan() (96 x 128K next_n = 2, two layers: a 148 us plan row)."""
    plan = {name: (t, n) for t, n, name in plan_rows}
    out = {name: (t / plan_layers, n / plan_layers) for name, (t, n) in plan.items()}
    for t, n, name in step_rows:
        pt, pn = plan.get(name, (0.0, 0.0))
        out[name] = (max(t - pt, 0.0) / layers + pt / plan_layers, max(n - pn, 0.0) / layers + pn / plan_layers)
    return sorted(((t, n, name) for name, (t, n) in out.items()), reverse=True)


PARTS = ("kernels", "topk", "update")  # what profile_point measures (--parts); each compiles its own variants


def profile_point(batch: int, ctx: int, next_n: int, sparsity: float, lines: list[str],
                  parts: tuple = PARTS) -> dict:
    import torch
    from harness import time_graph
    from run_all import PLAN_LAYERS, TOPK, Point, steady_indexer

    from spin_indexer import ops
    from spin_indexer.indexer import DenseIndexer
    from spin_indexer.ops import history_triton
    from spin_indexer.ops.topk_triton import topk_triton
    from spin_indexer.predictor import SpinConfig

    p = Point(batch, ctx, next_n, dry=False)
    k = min(TOPK, ctx)
    idx, slots = steady_indexer(p, SpinConfig(sparsity=sparsity, topk=k))

    def spin_plan():
        idx.plan(p.table, p.lens, slots, validate=False)

    def spin_step():
        spin_plan()
        for i in range(p.layers):
            idx.run(i, p.q[i][0], p.caches[i], p.q[i][1])

    dense = DenseIndexer(k, next_n, device=p.table.device)

    def dense_plan():
        dense.plan(p.table, p.lens, validate=False)

    def dense_step():
        dense_plan()
        for i in range(p.layers):
            dense.run(i, p.q[i][0], p.caches[i], p.q[i][1])

    # The per-step guard forced on (every request scored densely: SpinIndexer._run_dense), to set its kernels
    # beside DenseIndexer's: a guarded step should cost the dense step plus plan().
    guarded, gslots = steady_indexer(p, SpinConfig(sparsity=sparsity, topk=k, dense_batch_below=1 << 62))

    def guarded_plan():
        guarded.plan(p.table, p.lens, gslots, validate=False)

    def guarded_step():
        guarded_plan()
        for i in range(p.layers):
            guarded.run(i, p.q[i][0], p.caches[i], p.q[i][1])

    out = {"batch": batch, "ctx": ctx, "next_n": next_n, "sparsity": sparsity, "layers": p.layers}
    steps = (("spin", spin_plan, spin_step), ("guarded", guarded_plan, guarded_step), ("dense", dense_plan, dense_step))
    if "kernels" in parts:  # whole steps in CUDA graphs first (what run_all times), per layer of a 61-layer step
        graph = {}
        for name, plan_fn, fn in steps:
            plan_us = time_graph([plan_fn], max_reps=10).p50_us
            graph[name] = (time_graph([fn], max_reps=10).p50_us - plan_us) / p.layers + plan_us / PLAN_LAYERS
        out["graph_us_per_layer"] = graph
        lines.append(f"\n== B={batch} L={ctx} n={next_n} s={sparsity}, CUDA-graph step per layer (plan() / "
                     f"{PLAN_LAYERS}): " + ", ".join(f"{n} {t:.2f} us" for n, t in graph.items()))
    for name, plan_fn, fn in steps if "kernels" in parts else ():
        rows = per_layer_rows(kernel_table(fn), kernel_table(plan_fn), p.layers, PLAN_LAYERS)
        total = sum(r[0] for r in rows)
        launches = sum(r[1] for r in rows)
        lines.append(f"\n== {name} B={batch} L={ctx} n={next_n} s={sparsity}: {total:.1f} us of kernels per layer "
                     f"(run()'s, and plan()'s / {PLAN_LAYERS}), {launches:.1f} launches per layer")
        for t, n, kname in rows[:14]:
            lines.append(f"{t:9.1f} us/layer {n:5.2f}x  {kname[:120]}")
        out[f"{name}_kernels"] = [(round(t, 2), round(n, 2), kname[:160]) for t, n, kname in rows]

    # The top-k's stages alone on the step's compact logits (graph timings, cumulative stages), with the group
    # maxima SpinIndexer passes (the logits op writes them when G = topk_group < 64, as the step does).
    spin_step()
    plan = idx.plans(0)
    rows_n = batch * next_n
    logits = torch.empty(rows_n, p.width * 64, device=p.table.device)
    bmax = torch.empty(rows_n, p.width, device=p.table.device)
    group = ops.topk_group(logits.shape[1], k)
    use_gmax = idx.workspace.GROUP_MIN <= group < 64  # SpinIndexer._run's rule
    gmax = torch.empty(rows_n, -(-logits.shape[1] // group), device=p.table.device) if use_gmax else None
    ops.paged_indexer_logits(p.q[0][0], p.caches[0], p.q[0][1], plan.compact_seq_lens, plan.compact_block_table,
                             validate=False, out=logits, block_max_out=bmax, fill_tail=False, group_max_out=gmax,
                             group=group)
    clens = plan.compact_seq_lens.reshape(-1)
    from spin_indexer.ops import topk_triton as topk_module

    def topk_time(**kw):
        return time_graph([lambda: topk_triton(logits, clens, k, validate=False, block_max=bmax, group_max=gmax,
                                               kept_blocks=plan.kept_blocks, next_n=next_n, **kw)],
                          max_reps=10).p50_us

    if "topk" in parts:
        chosen = topk_module.SORT_CHUNK
        stats = torch.zeros(rows_n, dtype=torch.int32, device=p.table.device)
        try:
            # 2 = threshold, 3 = + gather, 4 = + chunk sort, 5 = + rank (best first)
            for stages in (2, 3, 4, 5):
                out[f"topk_stages{stages}_us"] = topk_time(_stages=stages)
            topk_triton(logits, clens, k, validate=False, block_max=bmax, group_max=gmax, stats=stats)
            out["topk_candidates"] = [int(stats.min()), int(stats.float().mean()), int(stats.max())]
            lines.append(f"top-k stages (cumulative, compact logits, G={group}"
                         f"{', group_max' if gmax is not None else ', block_max'}): " +
                         ", ".join(f"{s}: {out[f'topk_stages{s}_us']:.1f} us" for s in (2, 3, 4, 5)) +
                         f"; candidates min/mean/max {out['topk_candidates']}")
            # the sort-chunk size (a module constant read at each call; restored after)
            for ch in (256, 512, 1024):
                topk_module.SORT_CHUNK = ch
                out[f"topk_chunk{ch}_us"] = topk_time()
            lines.append(f"top-k by sort chunk (production {chosen}): " +
                         ", ".join(f"{ch}: {out[f'topk_chunk{ch}_us']:.1f} us" for ch in (256, 512, 1024)))
        finally:
            topk_module.SORT_CHUNK = chosen

    # The EMA update pass alone (history + block max), tile variants: blocks x warps, "r<N>" a register cap
    # (MAX_REGISTERS; "r0": ptxas's choice), "+g<G>" with the top-k's group maxima as the DeepGEMM step writes them.
    if "update" in parts:
        st = idx._step
        hist = idx._history_args(0, st, plan)
        view = logits.view(batch, next_n, logits.shape[1])
        base = (history_triton.BLOCKS_PER_PROGRAM, history_triton.NUM_WARPS, history_triton.MAX_REGISTERS)
        variants = {}
        cap0 = base[2]
        for blocks, warps, cap, with_g in ((32, 4, cap0, False), (32, 4, 0, False), (32, 4, cap0, True), (32, 4, 0, True),
                                           (16, 4, cap0, False), (16, 4, 0, False), (64, 8, cap0, False), (8, 4, 0, False),
                                           (16, 8, 0, False), (4, 1, 0, False), (16, 2, 0, False), (32, 8, 0, False),
                                           (64, 4, 0, False)):
            if with_g and gmax is None:
                continue
            history_triton.BLOCKS_PER_PROGRAM, history_triton.NUM_WARPS, history_triton.MAX_REGISTERS = blocks, warps, cap
            name = f"{blocks}x{warps}r{cap}" + (f"+g{group}" if with_g else "")
            try:
                t = time_graph([lambda: ops.update_history(hist, view, plan.compact_block_table, plan.compact_seq_lens,
                                                           block_max_out=bmax, group_max_out=gmax if with_g else None,
                                                           group=group)], max_reps=10).p50_us
            except Exception as exc:  # a variant that does not compile must not cost the run
                t = float("nan")
                lines.append(f"update variant {name} failed: {exc!r}")
            variants[name] = t
        history_triton.BLOCKS_PER_PROGRAM, history_triton.NUM_WARPS, history_triton.MAX_REGISTERS = base
        out["update_us"] = variants
        kept = float((1 - plan.sparsity().mean()) * batch * ctx)
        out["update_bytes"] = kept * (4 + 4) + kept / 64 * (4 + 4 + 2)
        lines.append(f"update pass (blocks x warps: us): {variants}; bytes {out['update_bytes'] / 1e6:.1f} MB")
    del p, idx, dense, guarded, logits, bmax
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="1x131072x1,8x131072x1,96x131072x1,96x524288x1,32x524288x2")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--parts", type=lambda v: tuple(v.split(",")), default=PARTS,
                    help="comma list of " + ", ".join(PARTS) + " (kernels: torch.profiler tables of both steps; topk: the "
                    "top-k's stages and variants; update: the update pass's tile variants)")
    args = ap.parse_args(argv)
    if set(args.parts) - set(PARTS):
        ap.error(f"--parts: unknown {sorted(set(args.parts) - set(PARTS))}; expected some of {list(PARTS)}")
    os.makedirs(args.out, exist_ok=True)
    from harness import environment
    env = environment()
    lines = [f"# step profile: {json.dumps(env)}"]
    results = []
    for item in args.points.split(","):
        b, c, n = (int(x) for x in item.split("x"))
        try:
            results.append(profile_point(b, c, n, args.sparsity, lines, args.parts))
        except Exception as exc:  # one failed point must not cost the run
            import traceback
            traceback.print_exc()
            lines.append(f"FAILED {item}: {exc!r}")
        print("\n".join(lines[-40:]), flush=True)
    with open(os.path.join(args.out, "profile_step.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "profile_step.json"), "w") as f:
        json.dump({"env": env, "points": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
