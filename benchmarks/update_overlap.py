"""Experiment (#14, 96 x 512K s = 0.4): does SPIN's EMA update hide beside the top-k, and what would it win?

In the step (SpinIndexer.run, CUDA) the update pass runs on a low-priority side stream beside the top-k. Its
cost inside the step is step - logits alone - top-k alone - plan (run_all's spin_own_us less plan_us). Each
variant below is captured whole in a CUDA graph and timed in paired rounds (harness.time_graphs_paired) beside
the dense step, per layer:

  spin          the slot-grain step (the paper's per-slot V; SpinConfig's default is block grain since session 66)
  topk_first    the top-k's launches enqueued before the update's (same streams, same kernels; production
                since run 74, so the same as spin from then on)
  no_update     the update not launched at all: the floor any way of hiding it can reach
  fused         SpinIndexer(overlap_update=False): the update in the logits kernel's epilogue, no side stream
                (run 74 timed a form that updated groups of blocks there: HISTORY_GROUP_BLOCKS, since reverted)
  onetile, st2  the step with the update pass as one program per tile (history_triton.PIPELINED_STAGES = 1:
                the kernel before run 75), or pipelined at 2 stages with 7 programs an SM
  stg<N>        the pipelined pass at N stages (N - 1 tiles' loads in flight; production 3), production programs
  prog<N>       the pipelined pass with N programs in all (e.g. prog144: on the SMs the top-k's 96 rows leave)
  pipe          the pipelined pass at any table size (history_triton.PIPELINED_MIN_BLOCKS = 0)
  after_thr     the update forked from the top-k's stream after its threshold launch (just before the gather):
                the gather's programs, at the higher priority, are dispatched before the pass's persistent ones
                hold the SMs (in production the pass starts beside the threshold and the gather gets what is left)
  after_gat     the same, after the gather launch (beside the select and the next layer's logits)
  gat<N>        the top-k's gather with N logits a program (topk_triton.GATHER_VALUES; production 1024)
  thr<W>, sel<W>  the top-k's threshold (every tile size) or set select launched with W warps: fewer warps, fewer
                registers a program, so the top-k's programs can share an SM with the update pass's (at 8-16
                warps of ~127 registers or more, one program fills most of an SM and waits for the pass's to leave)
  ltp<N>        SPIN's compact logits chunked for <= N programs (indexer_logits_triton.COMPACT_TARGET_PROGRAMS;
                production 4096: fewer, longer programs, ~4 waves at 96 x 512K s = 0.4; full tables take 16384)
  lch<N>        SPIN's compact logits at most N blocks a program (indexer_logits_triton.COMPACT_MAX_CHUNK;
                production 32 since run 97, 64 in run 96, 256 before)
  lpf<P>        SPIN's compact logits with the scales loaded P blocks ahead by hand (LogitsConfig.prefetch;
                production 1)
  cudalogits    SPIN's logits on the CUDA kernel at every next_n (indexer_logits_cuda.step_uses), the update as the
                production pass: separates the kernel's speed from the fusion's
  gpass         the top-k's 16 / 32-column group maxima from the pass behind the CUDA logits kernel, as before
                session 60 (ops.writes_group_max: the Triton kernel only), not from the kernel's block-max
                partials; with it the dense step is timed the same way too (dense_gpass)
  wchunk        the CUDA logits kernel chunked by the whole table width, not the kept budget's (before d7bc01b:
                on a compact table the CTAs past the kept columns had nothing to do)
  wave          the CUDA logits kernel's chunk from `wave_chunk` (whole waves of even chunks: the rule before run
                154) instead of indexer_logits_cuda.makespan_chunk (a short last chunk may fill a wave's spare SMs)
  block         SpinConfig(vertical_grain="block"): no per-slot V, the update reads the block maxima (O(blocks),
                history_block_triton) on the side stream beside the top-k at every size (spin.BLOCK_GRAIN_IN_TOPK
                off: the default step before session 67)
  blocktopk     block grain with its update in the top-k's threshold launch up to UPDATE_IN_TOPK_BLOCKS table
                blocks, above them on the side stream (spin.BLOCK_GRAIN_IN_TOPK: the default step since session 67;
                run 161 timed it at 256 blocks a program there, run 162 at 32)
  update_alone  the update pass alone, each layer's history from the step's compact logits (and _onetile,
                _st2: those passes alone)

and a kernel timeline of one replay of the production step (torch.profiler: start / end of each kernel),
to see which kernels actually overlap. Not a production path: the variants patch the step in this process.

    PYTHONPATH=src:benchmarks python benchmarks/update_overlap.py --points 96x524288x1 --sparsities 0.4,0.5
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))


VARIANTS = ("spin", "block", "blocktopk", "topk_first", "no_update", "fused", "cudalogits", "gpass", "wchunk", "wave",
            "onetile", "st2",
            "stg<N>", "prog<N>", "pipe", "thr<W>", "sel<W>", "gat<N>", "ltp<N>", "lch<N>", "lpf<P>", "after_thr",
            "after_gat")


def wave_chunk(batch: int, width: int, sms: int) -> int:
    """The CUDA kernel's default chunk before run 154 (indexer_logits_cuda.balanced_chunk then): the one of
    8..256, as even a split of the width as that count of chunks allows, minimizing waves x (chunk +
    CTA_START_BLOCKS), a last wave that fills a few SMs costing a whole one."""
    from spin_indexer.ops.indexer_logits_cuda import CTA_START_BLOCKS, MAX_CHUNK
    if width <= 8:
        return max(width, 1)
    best_cost, best = None, MAX_CHUNK
    for target in range(min(MAX_CHUNK, width), 7, -1):
        count = -(-width // target)  # chunks a request
        chunk = -(-width // count)   # the even split
        cost = -(-batch * count // sms) * (chunk + CTA_START_BLOCKS)
        if best_cost is None or cost < best_cost:
            best_cost, best = cost, chunk
    return best


@contextlib.contextmanager
def variant(idx, name: str):
    """The step's update rearranged as `name` while the block runs (patches this process's ops / indexer)."""
    from spin_indexer import ops
    from spin_indexer.indexer import spin as spin_module
    from spin_indexer.ops import history_triton, indexer_logits_cuda, indexer_logits_triton, topk_triton

    # (module or object, attribute, value while the block runs)
    per_sm = history_triton.PASS_PROGRAMS_PER_SM
    passes = {"onetile": (1, history_triton.pass_programs),  # (stages, programs in all)
              "st2": (2, lambda device, f=history_triton.pass_programs: 7 * f(device) // per_sm)}
    if name.startswith("stg") and name[3:].isdigit():  # the pipelined pass at this many stages
        passes[name] = (int(name[3:]), history_triton.pass_programs)
    if name.startswith("prog"):  # the pipelined pass with this many programs in all
        passes[name] = (history_triton.PIPELINED_STAGES, lambda device: int(name[4:]))
    if name in passes:
        stages, programs = passes[name]
        patches = [(history_triton, "PIPELINED_STAGES", stages), (history_triton, "pass_programs", programs)]
    elif name[:3] in ("thr", "sel") and name[3:].isdigit():  # the top-k's launch widths
        attr = "threshold_warps" if name.startswith("thr") else "set_select_warps"
        patches = [(topk_triton, attr, lambda _size, w=int(name[3:]): w)]
    elif name.startswith("gat") and name[3:].isdigit():
        patches = [(topk_triton, "GATHER_VALUES", int(name[3:]))]
    elif name.startswith("ltp") and name[3:].isdigit():
        patches = [(indexer_logits_triton, "COMPACT_TARGET_PROGRAMS", int(name[3:]))]
    elif name.startswith("lch") and name[3:].isdigit():
        patches = [(indexer_logits_triton, "COMPACT_MAX_CHUNK", int(name[3:]))]
    elif name.startswith("lpf") and name[3:].isdigit():
        def config(next_n, blocks, compact, default=indexer_logits_triton.default_config, ahead=int(name[3:])):
            cfg = default(next_n, blocks, compact)
            return dataclasses.replace(cfg, prefetch=ahead) if compact else cfg
        patches = [(indexer_logits_triton, "default_config", config)]
    elif name == "cudalogits":
        patches = [(indexer_logits_cuda, "step_uses", lambda next_n: 1 <= next_n <= 4)]
    elif name == "wchunk":
        def whole_width(*args, original=indexer_logits_cuda.paged_indexer_logits_cuda, **kw):
            kw.pop("active_width", None)
            return original(*args, **kw)
        patches = [(indexer_logits_cuda, "paged_indexer_logits_cuda", whole_width)]
    elif name == "wave":
        patches = [(indexer_logits_cuda, "makespan_chunk", wave_chunk)]
    elif name == "gpass":
        patches = [(ops, "writes_group_max", lambda backend, group: backend == "triton")]
    elif name == "pipe":
        patches = [(history_triton, "PIPELINED_MIN_BLOCKS", 0)]
    elif name in ("spin", "fused"):
        patches = []
    elif name in ("block", "blocktopk"):
        patches = [(spin_module, "BLOCK_GRAIN_IN_TOPK", name == "blocktopk")]
    elif name in ("after_thr", "after_gat"):
        patches = _update_before_launch(idx, "_gather_kernel" if name == "after_thr" else "_select_set_kernel")
    else:  # topk_first, no_update: the update through ops.update_history, launched after the top-k or not at all
        original_update, original_topk = ops.update_history, idx._topk
        deferred = []

        def update(history, *args, **kw):
            if history is None:  # the maxima-only pass (DeepGEMM backend) is not the update: always run it
                return original_update(history, *args, **kw)
            if name == "no_update":
                return None
            deferred.append((history, args, kw))  # topk_first: launched after the top-k's, below
            return None

        def topk(*args, **kw):
            out = original_topk(*args, **kw)
            import torch
            while deferred:
                history, a, k = deferred.pop(0)
                with torch.cuda.stream(idx._update_stream):  # forked from the caller's stream before the top-k's
                    original_update(history, *a, **k)
            return out
        patches = [(spin_module.ops, "update_history", update), (idx, "_topk", topk)]
    with contextlib.ExitStack() as stack:
        for target, attr, value in patches:
            stack.enter_context(mock.patch.object(target, attr, value))
        yield


def _update_before_launch(idx, kernel: str) -> list:
    """Patches that move the EMA update from its fork beside the top-k to just before the top-k's launch of
    topk_triton.`kernel`: the update is held back in run() and enqueued on the side stream, forked from the
    top-k's stream at that launch (run() still joins the side stream after the top-k)."""
    import torch

    from spin_indexer import ops
    from spin_indexer.indexer import spin as spin_module
    from spin_indexer.ops import topk_triton

    original_update, original_topk, launcher = ops.update_history, idx._topk, getattr(topk_triton, kernel)
    pending = []

    def update(history, *args, **kw):
        # the maxima-only pass (DeepGEMM backend) is not the update, and off CUDA there is no side stream
        if history is None or idx._update_stream is None:
            return original_update(history, *args, **kw)
        return None  # enqueued by the launch below

    def topk(layer, st, plan, logits, *args, **kw):
        rows3 = logits.view(st.block_table.shape[0], idx.next_n, logits.shape[1])
        if idx._update_stream is not None:
            pending.append(lambda: original_update(idx._history_args(layer, st, plan), rows3,
                                                   plan.compact_block_table, plan.compact_seq_lens))
        return original_topk(layer, st, plan, logits, *args, **kw)

    class UpdateFirst:  # the kernel's launcher, enqueueing the held update on the side stream first
        def __getitem__(self, grid):
            launch = launcher[grid]

            def run(*args, **kw):
                while pending:
                    side = idx._update_stream
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        pending.pop(0)()
                return launch(*args, **kw)
            return run
    return [(spin_module.ops, "update_history", update), (idx, "_topk", topk), (topk_triton, kernel, UpdateFirst())]


def timeline(fn, lines: list[str]) -> list[dict]:
    """Kernels of one replay of fn captured in a CUDA graph: name, start and duration (us from the first)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0]
    kernels.sort(key=lambda e: e.time_range.start)
    t0 = kernels[0].time_range.start if kernels else 0
    out = []
    for e in kernels:
        row = dict(name=e.name[:90], start=round(e.time_range.start - t0, 1),
                   us=round(e.time_range.elapsed_us(), 1), stream=getattr(e, "device_resource_id", -1))
        out.append(row)
        lines.append(f"  {row['start']:9.1f} {row['us']:8.1f}  s{row['stream']:<4} {row['name']}")
    return out


def measure(batch: int, ctx: int, next_n: int, sparsity: float, rounds: int, lines: list[str],
            variants=VARIANTS) -> dict:
    import torch
    from harness import time_graphs_paired
    from run_all import PLAN_LAYERS, TOPK, Point, steady_indexer

    from spin_indexer import ops
    from spin_indexer.indexer import DenseIndexer
    from spin_indexer.predictor import SpinConfig

    p = Point(batch, ctx, next_n, dry=False)
    k = min(TOPK, ctx)
    dense = DenseIndexer(k, next_n, device=p.table.device)

    def dense_step():
        dense.plan(p.table, p.lens, validate=False)
        for i in range(p.layers):
            dense.run(i, p.q[i][0], p.caches[i], p.q[i][1])
    calls = {"dense": dense_step}
    if "gpass" in variants:  # the dense step with its group maxima from the pass too (its plan is no variant's)
        def dense_gpass():
            with variant(None, "gpass"):
                dense_step()
        calls["dense_gpass"] = dense_gpass
    indexers = {}
    for name in variants:
        grain = "block" if name in ("block", "blocktopk") else "slot"
        idx, slots = steady_indexer(p, SpinConfig(sparsity=sparsity, topk=k, vertical_grain=grain),
                                    overlap_update=name != "fused")
        indexers[name] = idx

        def step(idx=idx, slots=slots, name=name):
            with variant(idx, name):
                idx.plan(p.table, p.lens, slots, validate=False)
                for i in range(p.layers):
                    idx.run(i, p.q[i][0], p.caches[i], p.q[i][1])
        calls[name] = step
        if name == "spin":
            calls["plan"] = lambda idx=idx, slots=slots: idx.plan(p.table, p.lens, slots, validate=False)
    # the update alone: each layer's history from the production step's plan, on compact logits of that plan
    spin = indexers["spin"]
    calls["spin"]()
    rows = batch * next_n
    logits = []
    for i in range(p.layers):
        plan = spin.plans(i)
        x = ops.paged_indexer_logits(p.q[i][0], p.caches[i], p.q[i][1], plan.compact_seq_lens, plan.compact_block_table,
                                     validate=False, fill_tail=False)
        logits.append(x.view(batch, next_n, -1))

    def update_alone(name):
        with variant(spin, name):
            for i in range(p.layers):
                st, plan = spin._current(i), spin.plans(i)
                ops.update_history(spin._history_args(i, st, plan), logits[i], plan.compact_block_table,
                                   plan.compact_seq_lens)
    for name in ["spin"] + [v for v in variants if v in ("onetile", "st2", "pipe")
                            or v.startswith(("prog", "stg"))]:
        calls["update_alone" + ("" if name == "spin" else "_" + name)] = lambda name=name: update_alone(name)
    ms = time_graphs_paired(calls, rounds=rounds)
    per_layer = {}
    for name, t in ms.items():
        if name == "plan":
            per_layer[name] = [1e3 * x / PLAN_LAYERS for x in t]
        elif name in indexers:  # plan of 61 layers once + p.layers runs: as run_all's step_us
            per_layer[name] = [1e3 * (x - y) / p.layers + 1e3 * y / PLAN_LAYERS for x, y in zip(t, ms["plan"])]
        else:
            per_layer[name] = [1e3 * x / p.layers for x in t]
    med = {name: statistics.median(v) for name, v in per_layer.items()}
    ratio = {name: statistics.median([d / s for d, s in zip(per_layer["dense"], per_layer[name])])
             for name in indexers}
    head = f"B={batch} L={ctx} n={next_n} s={sparsity} ({p.layers} layers, {rounds} paired rounds), us a layer:"
    lines.append(head + " " + ", ".join(f"{n} {v:.1f}" for n, v in med.items()))
    lines.append("  dense / variant (per round, median): " + ", ".join(f"{n} {v:.3f}x" for n, v in ratio.items()))
    tl = []
    if torch.cuda.is_available():
        lines.append(f"  timeline of one replay of the production step ({p.layers} layers + plan):")
        tl = timeline(calls["spin"], lines)
    return dict(batch=batch, ctx=ctx, next_n=next_n, sparsity=sparsity, layers=p.layers, us=med,
                dense_over=ratio, timeline=tl)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="96x524288x1")
    ap.add_argument("--sparsities", default="0.4,0.5")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--variants", default="spin,no_update,onetile,st2",
                    help="comma list, spin first, of " + ", ".join(VARIANTS))
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--group-blocks", type=int, default=None,
                    help="the fused variant's HISTORY_GROUP_BLOCKS (indexer_logits_triton; default: the module's)")
    a = ap.parse_args(argv)
    if a.group_blocks:
        from spin_indexer.ops import indexer_logits_triton
        indexer_logits_triton.HISTORY_GROUP_BLOCKS = a.group_blocks
    lines, results = [], []
    for spec in a.points.split(","):
        b, l, n = (int(x) for x in spec.split("x"))
        for s in (float(x) for x in a.sparsities.split(",")):
            results.append(measure(b, l, n, s, a.rounds, lines, a.variants.split(",")))
            print("\n".join(lines[-3:]), flush=True)
    from harness import environment
    env = environment()  # the GPU, versions and commit (SPIN_COMMIT) of every result
    for r in results:
        r["env"] = env
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "update_overlap.txt"), "w") as f:
        f.write(f"# {env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, {env['date']}\n")
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(a.out, "update_overlap.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
