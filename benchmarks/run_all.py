"""The one GPU entry point for the indexer step: check, time the grid, write results, print the table last.

    PYTHONPATH=src python benchmarks/run_all.py --out $OUT                 # check + grid
    bash .dg/build_on_gpu.sh .dg && PYTHONPATH=/tmp/dg/dg:src LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6 \
        python benchmarks/run_all.py --out $OUT                           # the same, DeepGEMM side by side

Per grid point (B requests x context L x next_n, CUDA graphs, median of replays, every layer on its own
random key cache so no replay hits L2), per layer:
  deepgemm_logits_us   DeepGEMM fp8_paged_mqa_logits, dense (empty where deep_gemm does not import)
  dense_logits_us      the project's own logits kernel, dense, as the dense step runs it where DeepGEMM does not: the
                       CUDA kernel at next_n 2-4 (where the op picks it after DeepGEMM; before run 151 this column
                       was the Triton kernel at next_n = 2 whenever DeepGEMM imported), else the Triton one (block
                       max fused, and the top-k's group maxima where the dense step takes them from the kernel:
                       dense.fuses_group_max; tail unwritten)
  torch_topk_us        torch.topk(logits, K, sorted=False) over full rows (sorted=True with --topk-sorted): the same
                       contract as the steps' top-k
  own_topk_us          ops.topk_positions over the dense logits (with their block / group maxima), each layer's in turn
  dense_step_us        DenseIndexer.run: logits + top-k through the step's backends (the "own dense step")
  spin_logits_us       the SPIN step's logits alone, on layer 0's compact table (same backend as the step)
  topk_us              ops.topk_positions alone on those compact logits (each layer's in turn since run 30, as the
                       step sees them), with the group maxima the step's
                       logits op writes (so their cost counts in spin_own_us, where the step pays it)
  plan_us              SpinIndexer.plan (every layer) / 61 layers
  step_us              SpinIndexer step per layer: plan_us + run(layer) (logits + EMA update + top-k)
  spin_own_us          step - logits alone - top-k alone: prediction, selection, compaction, update, per
                       layer, taken per round of paired replays (plan, step, logits, top-k: one replay of each a
                       round, harness.time_graphs_paired) and then the median, as are step_us, spin_logits_us,
                       topk_us and plan_us (before run 65 three medians timed apart: noisy at small B; below ~1 us
                       of real work, e.g. B = 1, it can come out negative)
  dense_other_us       dense_step_us - dense_logits_us - own_topk_us: the same difference for the dense step (what
                       its kernels cost inside the step beyond their times alone; at B = 1 a few us that
                       spin_own_us holds too)
  dense_step_other_backend_us  dense_step_us with the logits backend the dense step does not pick here (DeepGEMM
                       + the maxima pass where it takes the project's kernel, the project's kernel with its maxima
                       where it takes DeepGEMM), when DeepGEMM imports and serves next_n (1-2): which one a dense
                       step should take, per shape (run 153 saw the CUDA kernel 6-11% ahead at next_n = 2 on an H100)
  plan_update_us       the same as spin_own_us, under the column name of the earlier runs
  step_other_backend_us  step_us with the logits backend the step does not choose at this point, as
                       dense_step_other_backend_us: the project's kernel where DeepGEMM is the choice, DeepGEMM + the
                       maxima pass at next_n 1-2 where it is not, else the Triton kernel with the maxima in its
                       epilogue (ops.logits_backend; before run 154 the Triton kernel wherever the CUDA kernel was
                       the choice, before session 63 also where DeepGEMM was), when DeepGEMM imports
  guard_step_us        step_us with dense_below="auto" and dense_batch_below="auto" (the guards on; the same
                       as step_us where neither acts)
  dense_step_paired_us the dense step (dense_step_us's graph) replayed once a round in SPIN's paired rounds, per
                       layer, median (since run 77; dense_step_us is timed apart, back to back)
  vs_dense_paired      dense step / SPIN step per round, median: the two steps under the same clocks and the same
                       order of replays (guard_vs_dense_paired: the same for the guarded step)
  paired_retry         1 where the paired rounds were run again (their dense median off dense_step_us by more than
                       PAIRED_DRIFT: another machine state), then step_first_us / dense_step_paired_first_us are
                       the first rounds' step_us / dense_step_paired_us; 0 and empty elsewhere
SPIN's history is a random steady state (every block scored before, diagonal windows full), so realized
sparsity is the target. Writes <out>/h200_indexer.csv (one row per point and sparsity), h200_env.json and
h200_indexer.md (command, environment, table, targets). A CPU dry run (SPIN_BENCH_DEVICE=cpu,
TRITON_INTERPRET=1, tiny shapes) exercises the same code.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

COLUMNS = ["batch", "ctx", "next_n", "sparsity", "deepgemm_logits_us", "dense_logits_us", "torch_topk_us",
           "own_topk_us", "dense_step_us", "spin_logits_us", "topk_us", "plan_us", "plan_update_us", "step_us",
           "spin_own_us", "dense_other_us", "dense_step_other_backend_us",
           "step_other_backend_us", "guard_step_us", "realized_sparsity", "spin_own_bytes", "spin_own_pct_copy_bw",
           "key_GBps", "copy_GBps", "dense_step_paired_us", "vs_dense_paired", "guard_vs_dense_paired",
           "paired_retry", "step_first_us", "dense_step_paired_first_us"]
TOPK = 2048
PLAN_LAYERS = 61  # DeepSeek-V3.2's indexer layers: plan() covers them all, its cost is shared by them
PAIRED_ROUNDS = 15  # rounds of SPIN's paired replays (spin_step)
PAIRED_DRIFT = 0.10  # paired rounds whose dense median is off the point's dense step by more are run again
ROTATE_BYTES = 512 << 20  # each replay reads at least this many key bytes (L2: 60 MB)
VERTICAL_GRAIN = "block"  # SpinConfig.vertical_grain of every SPIN step timed (--vertical-grain)


def log(*a):
    print(*a, flush=True)


@contextlib.contextmanager
def logits_backend(name: str | None):
    """SPIN_INDEXER_LOGITS for the duration (read when a graph is captured)."""
    old = os.environ.get("SPIN_INDEXER_LOGITS")
    if name is None:
        os.environ.pop("SPIN_INDEXER_LOGITS", None)
    else:
        os.environ["SPIN_INDEXER_LOGITS"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SPIN_INDEXER_LOGITS", None)
        else:
            os.environ["SPIN_INDEXER_LOGITS"] = old


class Point:
    """Inputs of one (B, L, next_n) point: `layers` key caches (distinct memory), one block table shared by
    them (as in a model: one table, one cache per layer), queries and weights per layer."""

    def __init__(self, batch: int, ctx: int, next_n: int, dry: bool):
        import torch
        from harness import DEVICE, KeyPool, decode_lens, random_queries

        self.batch, self.ctx, self.next_n = batch, ctx, next_n
        self.width = -(-ctx // 64)
        blocks = batch * self.width
        self.layers = 2 if dry else max(2, min(8, math.ceil(ROTATE_BYTES / (blocks * 64 * 132))))
        self.pool = KeyPool(blocks * self.layers, seed=batch * 7 + ctx)
        self.caches = [self.pool.cache[i * blocks:(i + 1) * blocks] for i in range(self.layers)]
        self.table = torch.randperm(blocks, device=DEVICE).to(torch.int32).view(batch, self.width)
        self.lens = decode_lens(batch, next_n, ctx)
        self.q = [random_queries(batch, next_n, seed=100 + i) for i in range(self.layers)]
        self.num_cache_blocks = blocks


def steady_indexer(p, config, **indexer_kw):
    """(SpinIndexer, slots int64 [B]): an indexer sized for point p (PLAN_LAYERS layers, p's batch, width, next_n
    and cache) with a slot per request and steady_state's history; indexer_kw: more SpinIndexer arguments."""
    import torch

    from spin_indexer.indexer import SpinIndexer

    idx = SpinIndexer(config, num_layers=PLAN_LAYERS, max_batch=p.batch, max_blocks=p.width, next_n=p.next_n,
                      device=p.table.device, num_cache_blocks=p.num_cache_blocks, **indexer_kw)
    slots = torch.tensor([idx.state.allocate() for _ in range(p.batch)], dtype=torch.int64, device=p.table.device)
    steady_state(idx, p)
    return idx, slots


def steady_state(idx, point) -> None:
    """A random history as after many decode steps: every block of the context scored, windows full."""
    import torch

    from harness import fill_random_history

    st = idx.state
    fill_random_history(st, torch.Generator(device=st.block_max.device).manual_seed(5))
    st.seen_len.fill_(point.ctx)
    st.step.fill_(100)


def grid_point(batch: int, ctx: int, next_n: int, sparsities, env: dict, dry: bool, indexer_kw: dict | None = None) -> list[dict]:
    import torch
    from harness import time_graph

    from spin_indexer import ops
    from spin_indexer.indexer import DenseIndexer
    from spin_indexer.ops import deepgemm
    from spin_indexer.predictor import SpinConfig
    from spin_indexer.predictor.config import AUTO_DENSE_BELOW

    t0 = time.time()
    p = Point(batch, ctx, next_n, dry)
    rows, width, k = batch * next_n, p.width, min(TOPK, ctx)
    lens_flat = p.lens.view(-1)
    timing = dict(max_reps=8) if not dry else {}
    have_dg = (not dry) and deepgemm.available()

    def each_layer(fn):
        return [lambda i=i: fn(i) for i in range(p.layers)]

    out = {}
    if have_dg and next_n <= 2:  # DeepGEMM's SM90 kernel asserts next_n in {1, 2}
        out["deepgemm_logits_us"] = time_graph(each_layer(lambda i: deepgemm.paged_indexer_logits_deepgemm(
            p.q[i][0], p.caches[i], p.q[i][1], p.lens, p.table, validate=False)), **timing).p50_us
    logits = torch.empty(rows, width * 64, device=p.table.device)
    bmax = torch.empty(rows, width, device=p.table.device)
    # the own kernel the dense step runs where DeepGEMM does not serve (where it does: deepgemm_logits_us): the
    # CUDA kernel where the op picks it after DeepGEMM (next_n 2-4), else the Triton one
    from spin_indexer.dispatch import forced_logits_backend
    from spin_indexer.indexer.dense import fuses_group_max
    own = "cuda" if ops.logits_backend(p.q[0][0], p.caches[0], deepgemm=False,
                                       block_table=p.table) == "cuda" else "triton"
    picked = ops.logits_backend(p.q[0][0], p.caches[0], block_table=p.table)  # both steps' backend at this point
    # the backend the steps do not choose here, forced for both *_other_backend columns: the project's kernel
    # where DeepGEMM is picked, DeepGEMM where it covers next_n (1-2) and is not, else the Triton kernel (before
    # run 154 the CUDA kernel chosen at next_n = 2 was compared with the Triton kernel; before session 63 SPIN's
    # step on DeepGEMM was compared with the Triton kernel, not with the CUDA kernel the size rule weighs it against)
    other = own if picked == "deepgemm" else "deepgemm" if next_n <= 2 else "triton"
    # as dense_topk: the top-k's group maxima from the logits kernel where the dense step takes them from there
    group = ops.topk_group(width * 64, k)
    gmax = torch.empty(rows, -(-width * 64 // group), device=p.table.device) if fuses_group_max(rows, group, own) \
        else None
    with logits_backend(own):
        out["dense_logits_us"] = time_graph(each_layer(lambda i: ops.paged_indexer_logits(
            p.q[i][0], p.caches[i], p.q[i][1], p.lens, p.table, validate=False, out=logits, block_max_out=bmax,
            fill_tail=False, group_max_out=gmax, group=group)), **timing).p50_us
    # the steps' top-k order (--topk-sorted): the set in position order by default, best first with the flag
    sorted_ = (indexer_kw or {}).get("topk_sorted", False)
    out["torch_topk_us"] = time_graph([lambda: torch.topk(logits[:, :ctx], k, dim=1, sorted=sorted_)],
                                      **timing).p50_us
    # the own top-k on each layer's logits in turn, as the dense step sees them (see spin_step's top-k)
    dense_inputs = [(logits, bmax, gmax)]  # the last layer's, from the timing above
    with logits_backend("triton"):
        for i in range(p.layers - 1):
            x, bm = torch.empty_like(logits), torch.empty_like(bmax)
            gm = torch.empty_like(gmax) if gmax is not None else None
            ops.paged_indexer_logits(p.q[i][0], p.caches[i], p.q[i][1], p.lens, p.table, validate=False, out=x,
                                     block_max_out=bm, fill_tail=False, group_max_out=gm, group=group)
            dense_inputs.append((x, bm, gm))
    out["own_topk_us"] = time_graph([lambda x=x, bm=bm, gm=gm: ops.topk_positions(x, lens_flat, k, block_max=bm,
                                                                                  validate=False, group_max=gm,
                                                                                  sorted=sorted_)
                                     for x, bm, gm in dense_inputs], **timing).p50_us
    dense = DenseIndexer(k, next_n, device=p.table.device, topk_sorted=sorted_)
    dense.plan(p.table, p.lens, validate=False)

    def dense_step():  # every layer's step; its graph is replayed in SPIN's paired rounds too (spin_step)
        for i in range(p.layers):
            dense.run(i, p.q[i][0], p.caches[i], p.q[i][1])
    out["dense_step_us"] = time_graph([dense_step], **timing).p50_us / p.layers
    if have_dg and next_n <= 2:  # the dense step on the other backend (the variable is read when it is captured)
        with logits_backend(other):
            out["dense_step_other_backend_us"] = time_graph([dense_step], **timing).p50_us / p.layers
    del logits, bmax, gmax, dense_inputs
    results = []
    for s in sparsities:
        row = dict(batch=batch, ctx=ctx, next_n=next_n, sparsity=s, **out)
        # The guards act below AUTO_DENSE_BELOW tokens per request or the per-step threshold (SpinConfig.
        # guard_batch_tokens_for: AUTO_DENSE_BATCH_TOKENS, more for one row at low sparsity); elsewhere the
        # guarded step is the same step.
        step_guard = SpinConfig(sparsity=s, dense_batch_below="auto").guard_batch_tokens_for(batch * next_n)
        guards = (0, "auto") if ctx < AUTO_DENSE_BELOW or batch * ctx < step_guard else (0,)
        for guard in guards:
            # SPIN_INDEXER_LOGITS, where set, forces the step's backend too (before session 61 it was popped
            # here, so a forced run timed SPIN's step on the backend the op picks)
            backends = [(forced_logits_backend(), "")] + ([(other, "_other")] if have_dg and guard == 0 else [])
            for backend, suffix in backends:
                with logits_backend(backend):
                    times = spin_step(p, s, k, guard, indexer_kw, dense_step if not suffix else None)
                    paired_dense = times["dense_step_paired_us"]
                    if not suffix and drifted(paired_dense, out["dense_step_us"]):
                        # the dense step in the paired rounds off the point's own dense timing: the rounds ran
                        # in another machine state (run 179: 1.29x and 1.31x at two points, cause unknown);
                        # they are run again once and the retry kept, both in the log and the row
                        log(f"B={batch} L={ctx} n={next_n} s={s} guard={guard}: paired dense {paired_dense:.1f} us "
                            f"against {out['dense_step_us']:.1f} ({paired_dense / out['dense_step_us']:.2f}x): "
                            f"paired rounds again")
                        first = times
                        times = spin_step(p, s, k, guard, indexer_kw, dense_step)
                        times.update(paired_retry=1, step_first_us=first["step_us"],
                                     dense_step_paired_first_us=first["dense_step_paired_us"])
                if guard == 0 and not suffix:
                    row.update(times)
                elif guard == 0:
                    row["step_other_backend_us"] = times["step_us"]
                else:
                    row["guard_step_us"] = times["step_us"]
                    row["guard_vs_dense_paired"] = times["vs_dense_paired"]
        row.setdefault("paired_retry", 0)
        row.setdefault("guard_step_us", row["step_us"])
        row.setdefault("guard_vs_dense_paired", row["vs_dense_paired"])
        row["plan_update_us"] = row["spin_own_us"]
        row["dense_other_us"] = row["dense_step_us"] - row["dense_logits_us"] - row["own_topk_us"]
        kept = (1 - row["realized_sparsity"]) * batch * ctx
        # SPIN's own bytes: block_max (2 B) + table entry (4 B) per block read, compact table + kept ids
        # written (8 B per kept block), V read + written at kept slots (4 B), the diagonal window (2 x 2 B
        # per offset read in prediction and updated), all per layer.
        window = min(ctx, 8192)
        own_bytes = batch * width * 6 + kept / 64 * 8 + kept * 4 + batch * window * 6
        row["spin_own_bytes"] = own_bytes
        row["spin_own_pct_copy_bw"] = 100 * own_bytes / max(row["spin_own_us"], 1e-3) / 1e3 / env["copy_GBps"]
        row["key_GBps"] = batch * ctx * 132 / row["dense_logits_us"] / 1e3
        row["copy_GBps"] = env["copy_GBps"]
        results.append(row)
    log(f"point B={batch} L={ctx} n={next_n} ({time.time() - t0:.0f} s): " + "; ".join(
        f"s={r['sparsity']}: step {r['step_us']:.1f} vs dense {r['dense_step_us']:.1f} us "
        f"({r['dense_step_us'] / r['step_us']:.2f}x), own {r['spin_own_us']:.1f}" for r in results))
    del p
    torch.cuda.empty_cache() if not dry else None
    return results


def drifted(dense_paired_us: float, dense_us: float) -> bool:
    """Whether the paired rounds' dense median is off the point's own dense timing by more than PAIRED_DRIFT
    (False where either is NaN: the CPU dry run times nothing)."""
    return abs(dense_paired_us / dense_us - 1) > PAIRED_DRIFT


def spin_step(p, sparsity: float, k: int, guard, indexer_kw: dict | None = None, dense_step=None) -> dict:
    """SPIN's step at one sparsity: plan (61 layers) + run per layer, and its logits and top-k alone, in
    paired rounds. indexer_kw: more SpinIndexer arguments (tau_hint, overlap_update, topk_sorted). dense_step:
    the dense step over p's layers, replayed in the same rounds (dense_step_paired_us, vs_dense_paired)."""
    import torch
    from harness import time_graphs_paired

    from spin_indexer import ops
    from spin_indexer.predictor import SpinConfig
    from spin_indexer.predictor.select import budget_of

    cfg = SpinConfig(sparsity=sparsity, topk=k, dense_below=guard, dense_batch_below=guard,
                     vertical_grain=VERTICAL_GRAIN)
    idx, slots = steady_indexer(p, cfg, **(indexer_kw or {}))

    def plan():
        idx.plan(p.table, p.lens, slots, validate=False)

    def step():
        plan()
        for i in range(p.layers):
            idx.run(i, p.q[i][0], p.caches[i], p.q[i][1])

    step()
    plan0 = idx.plans(0)
    realized = float(plan0.sparsity().mean())
    rows = p.batch * p.next_n
    logits = torch.empty(rows, p.width * 64, device=p.table.device)
    bmax = torch.empty(rows, p.width, device=p.table.device)
    from spin_indexer.ops import deepgemm
    active = budget_of(p.width, sparsity, k, 64)  # the kept budget, as the step sizes its kernels by it
    # the step's backend, logits only
    if ops.logits_backend(p.q[0][0], p.caches[0], block_table=p.table) == "deepgemm":
        # with the SM schedule plan() wrote for layer 0 (as the step calls it: no metadata launch)
        calls = [lambda i=i: deepgemm.paged_indexer_logits_deepgemm(
            p.q[i][0], p.caches[i], p.q[i][1], plan0.compact_seq_lens, plan0.compact_block_table, validate=False,
            schedule=idx.deepgemm_schedule(0)) for i in range(p.layers)]
    else:
        # sized by the kept budget as the step sizes it (active_width: the Triton kernel's chunk and its
        # compact-table configuration, indexer_logits_triton.default_config)
        # (their own output buffers: the top-k's inputs below must not change under the paired replays)
        alone, alone_max = torch.empty_like(logits), torch.empty_like(bmax)
        calls = [lambda i=i: ops.paged_indexer_logits(p.q[i][0], p.caches[i], p.q[i][1], plan0.compact_seq_lens,
                                                      plan0.compact_block_table, validate=False, out=alone,
                                                      block_max_out=alone_max, fill_tail=False, active_width=active)
                 for i in range(p.layers)]
    # The top-k alone on each layer's compact logits in turn (as the step sees them, not one layer's replayed),
    # with the block maxima the Triton kernel fuses and the group maxima the step's logits op writes (the update
    # pass) when the top-k prunes finer than a block: given here too, so topk_us is the step's top-k and their
    # cost stays in spin_own_us.
    clens = plan0.compact_seq_lens.reshape(-1)
    group = ops.topk_group(logits.shape[1], k)  # as the step
    inputs = []
    with logits_backend("triton"):
        for i in range(p.layers):
            buf = logits if i == 0 else torch.empty_like(logits)
            bm = bmax if i == 0 else torch.empty_like(bmax)
            result = ops.paged_indexer_logits(p.q[i][0], p.caches[i], p.q[i][1], plan0.compact_seq_lens,
                                              plan0.compact_block_table, validate=False, out=buf, block_max_out=bm,
                                              fill_tail=False)
            inputs.append((result, bm, ops.group_max_ref(result, clens, group) if group < 64 else None))
    tau_hint = (indexer_kw or {}).get("tau_hint", False)
    hint = torch.zeros(clens.shape[0], dtype=torch.int32, device=clens.device) if tau_hint else None
    sorted_ = (indexer_kw or {}).get("topk_sorted", False)
    topk_calls = [lambda x=x, bm=bm, gm=gm: ops.topk_positions(
        x, clens, k, block_max=bm, kept_blocks=plan0.kept_blocks, next_n=p.next_n, validate=False, group_max=gm,
        tau_hint=hint, sorted=sorted_, group=group) for x, bm, gm in inputs]
    # plan(), the step, the logits alone and the top-k alone replayed in turn, one replay of each per round: own
    # work is a difference of these, taken per round (a drift of clocks hits all four alike) and then the median
    graphs = {"plan": plan, "step": step, "logits": lambda: [fn() for fn in calls],
              "topk": lambda: [fn() for fn in topk_calls]}
    if dense_step is not None:
        graphs["dense"] = dense_step
    ms = time_graphs_paired(graphs, rounds=PAIRED_ROUNDS)
    nan = [float("nan")] * PAIRED_ROUNDS
    per_round = []
    for t_plan, t_step, t_logits, t_topk, t_dense in zip(ms["plan"], ms["step"], ms["logits"], ms["topk"],
                                                          ms.get("dense", nan)):
        plan_l, logits_l, topk_l = 1e3 * t_plan / PLAN_LAYERS, 1e3 * t_logits / p.layers, 1e3 * t_topk / p.layers
        step_l = plan_l + 1e3 * (t_step - t_plan) / p.layers
        dense_l = 1e3 * t_dense / p.layers
        per_round.append((plan_l, step_l, logits_l, topk_l, step_l - logits_l - topk_l, dense_l, dense_l / step_l))
    plan_us, step_us, logits_us, topk_us, own_us, dense_us, vs_dense = (statistics.median(col)
                                                                         for col in zip(*per_round))
    del idx, logits, bmax, inputs
    return dict(plan_us=plan_us, step_us=step_us, spin_logits_us=logits_us, topk_us=topk_us, spin_own_us=own_us,
                realized_sparsity=realized, dense_step_paired_us=dense_us, vs_dense_paired=vs_dense)


# ------------------------------------------------------------------------------------------------ checks
def run_checks(env: dict, dry: bool) -> None:
    """Each backend against the torch reference on one mid-size random point; raises on a mismatch."""
    import torch
    from harness import rel_err

    from spin_indexer import ops
    from spin_indexer.ops import deepgemm
    from spin_indexer.ops.topk import ascending, topk_positions_ref

    torch.backends.cuda.matmul.allow_tf32 = False
    batch, ctx = (2, 300) if dry else (4, 20000)
    for n in (1, 2):
        p = Point(batch, ctx, n, dry)
        q, w = p.q[0]
        ref = ops.paged_indexer_logits_ref(q, p.caches[0], w, p.lens, p.table)
        backends = ["triton"] + (["deepgemm"] if deepgemm.available() and not dry else [])
        for name in backends:
            if name == "deepgemm":
                got = deepgemm.paged_indexer_logits_deepgemm(q, p.caches[0], w, p.lens, p.table)
            else:
                with logits_backend(name):
                    got = ops.paged_indexer_logits(q, p.caches[0], w, p.lens, p.table)
            live = torch.isfinite(ref)
            err = rel_err(torch.where(live, got, float("-inf")), ref)
            env.setdefault("checks", {})[f"logits_{name}_n{n}_rel_err"] = err
            if not err < 5e-3:
                raise AssertionError(f"{name} logits n={n}: relative error {err:.2e}")
            k = min(TOPK, ctx // 2)
            bmax = ops.block_max(ref, 64)
            for sorted_ in (True, False):  # sorted=False: the same set, in any order (compared ascending)
                want = topk_positions_ref(ref, p.lens.view(-1), k, sorted=sorted_)
                got_k = ops.topk_positions(ref, p.lens.view(-1), k, block_max=bmax, sorted=sorted_)
                if not sorted_:
                    want, got_k = ascending(want), ascending(got_k)
                if not torch.equal(got_k, want):
                    raise AssertionError(f"topk_positions(sorted={sorted_}) differs from its reference (n={n})")
        log(f"check n={n}: " + ", ".join(f"{k}={v:.2e}" for k, v in env["checks"].items() if f"_n{n}_" in k))


# ---------------------------------------------------------------------------------------------- report
RATIO_COLUMNS = ("vs_dense_paired", "guard_vs_dense_paired")  # written with 4 decimals (ratios near 1.0)


def fmt(v, column: str = ""):
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.4f}" if column in RATIO_COLUMNS else f"{v:.2f}"
    return str(v)


def formatted(rows: list[dict]) -> list[dict]:
    """rows as the csv and the results page write them: every column through fmt (NaN where a row lacks it)."""
    return [{c: fmt(r.get(c, float("nan")), c) for c in COLUMNS} for r in rows]


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, each beside its measured value."""
    out = []

    def find(b, c, n, s):
        return next((r for r in rows if (r["batch"], r["ctx"], r["next_n"], r["sparsity"]) == (b, c, n, s)), None)

    def ratio(a, b):
        return a / b if a == a and b == b and b > 0 else float("nan")

    def vs_deepgemm(r):  # NaN where deep_gemm did not import (the run has no DeepGEMM column)
        return ratio(r.get("deepgemm_logits_us", float("nan")) + r["torch_topk_us"], r["step_us"])

    for c in (524288, 1048576):
        r = find(96, c, 1, 0.5)
        if r:
            out.append(f"B=96 L={c} n=1 s=0.5: vs DeepGEMM+torch.topk {vs_deepgemm(r):.2f}x (target >= 2.0), "
                       f"vs own dense step {ratio(r['dense_step_us'], r['step_us']):.2f}x (target >= 1.7)")
    r = find(96, 131072, 1, 0.5)
    if r:
        out.append(f"B=96 L=131072 n=1 s=0.5: vs own dense step {ratio(r['dense_step_us'], r['step_us']):.2f}x "
                   "(target >= 1.6)")
    r = find(96, 524288, 1, 0.4)
    if r:
        out.append(f"B=96 L=524288 n=1 s=0.4: vs own dense step {ratio(r['dense_step_us'], r['step_us']):.2f}x "
                   "(target >= 1.5)")
    for b, c in ((32, 524288), (96, 131072)):
        r = find(b, c, 2, 0.5)
        if r:
            out.append(f"B={b} L={c} n=2 s=0.5: vs DeepGEMM+torch.topk {vs_deepgemm(r):.2f}x (target >= 1.6)")
    worst = min(rows, key=lambda r: ratio(r["dense_step_us"], r["step_us"]), default=None)
    if worst:
        out.append(f"every point: worst SPIN step vs own dense step {ratio(worst['dense_step_us'], worst['step_us']):.2f}x "
                   f"at B={worst['batch']} L={worst['ctx']} n={worst['next_n']} s={worst['sparsity']} (target >= 1.0); "
                   f"with the guard: {min(ratio(r['dense_step_us'], r['guard_step_us']) for r in rows):.2f}x")
    paired = [r for r in rows if not math.isnan(r.get("vs_dense_paired", float("nan")))]
    if paired:  # the same comparison with both steps in the same rounds (per-round ratios; since run 77)
        w = min(paired, key=lambda r: r["vs_dense_paired"])
        out.append(f"every point, paired rounds: worst SPIN step vs own dense step {w['vs_dense_paired']:.3f}x at "
                   f"B={w['batch']} L={w['ctx']} n={w['next_n']} s={w['sparsity']} (target >= 1.0); with the guard: "
                   f"{min(r.get('guard_vs_dense_paired', r['vs_dense_paired']) for r in paired):.3f}x")
    long = [r for r in rows if r["ctx"] >= 131072]
    if long:
        w = max(long, key=lambda r: r["spin_own_us"] / r["dense_logits_us"])
        out.append(f"SPIN own work at L >= 128K: worst {100 * w['spin_own_us'] / w['dense_logits_us']:.1f}% of dense "
                   f"logits at B={w['batch']} L={w['ctx']} n={w['next_n']} s={w['sparsity']} (target <= 8%)")
    return out


def write_report(out_dir: str, rows: list[dict], env: dict, command: str) -> list[str]:
    from harness import markdown_table
    lines = ["# SPIN indexer step on one H200", "",
             f"- GPU: {env.get('gpu')} ({env.get('sms')} SMs), {env.get('date')}, torch {env.get('torch')}, triton "
             f"{env.get('triton')}, CUDA {env.get('cuda')}, commit {env.get('commit')}, DeepGEMM "
             f"{'yes' if env.get('deepgemm') else 'no'}, SPIN's vertical history per "
             f"{env.get('vertical_grain', 'slot')}",
             f"- command: `{command}`",
             f"- copy bandwidth (same run, read + written): {env.get('copy_GBps', float('nan')):.0f} GB/s",
             f"- checks: {json.dumps(env.get('checks', {}))}",
             "- per layer, CUDA graphs, median of replays; each layer its own random key cache; SPIN history a random "
             "steady state; plan_us = plan() of 61 layers / 61. Columns: see benchmarks/run_all.py.", "",
             "## Targets (issue: the fused step)", ""] + [f"- {t}" for t in targets(rows)] + [""]
    lines += markdown_table(COLUMNS, formatted(rows), str)
    with open(os.path.join(out_dir, "h200_indexer.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--phases", default="check,grid", help="comma list of check,grid")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 96])
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
                   default=[65536, 131072, 262144, 524288, 1048576])
    p.add_argument("--next-ns", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--sparsities", type=lambda s: [float(x) for x in s.split(",")], default=[0.2, 0.3, 0.4, 0.5])
    p.add_argument("--points", default=None,
                   help="comma list of BxLxN points run in this order instead of the batches x contexts x next_ns grid")
    p.add_argument("--max-tokens", type=int, default=96 * 1048576, help="skip points with B x L above this")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting new points after this many seconds")
    p.add_argument("--tau-hint", action="store_true",
                   help="SPIN's top-k starts from the previous step's threshold key (SpinIndexer(tau_hint=True)), its "
                        "standalone top-k too; the benchmark's logits repeat, so every hint hits: an upper bound")
    p.add_argument("--no-overlap", action="store_true",
                   help="SPIN's EMA update in series after the logits (SpinIndexer(overlap_update=False)): one pass "
                        "with the maxima instead of a side stream beside the top-k")
    p.add_argument("--topk-sorted", action="store_true",
                   help="every top-k best first (the indexers' topk_sorted=True, torch.topk(sorted=True)); default: "
                        "the set in position order, what the engines' sparse attention reads")
    p.add_argument("--vertical-grain", choices=("slot", "block"), default="block",
                   help="SPIN's vertical history: per block (SpinConfig's default) or per slot (the paper)")
    p.add_argument("--update-in-topk-blocks", type=int, default=None,
                   help="table blocks (B x W) up to which SPIN's EMA update runs inside the top-k's first launch "
                        "(spin.UPDATE_IN_TOPK_BLOCKS; 0: always on the side stream)")
    args = p.parse_args(argv)
    global VERTICAL_GRAIN
    VERTICAL_GRAIN = args.vertical_grain
    if args.update_in_topk_blocks is not None:
        from spin_indexer.indexer import spin
        spin.UPDATE_IN_TOPK_BLOCKS = args.update_in_topk_blocks
    os.makedirs(args.out, exist_ok=True)
    command = "python benchmarks/run_all.py " + " ".join(argv if argv is not None else sys.argv[1:])
    from harness import DEVICE, copy_bandwidth_gbps, environment

    from spin_indexer.ops import deepgemm

    dry = DEVICE == "cpu"
    env = environment()
    env["deepgemm"] = deepgemm.available()
    env["vertical_grain"] = VERTICAL_GRAIN  # SpinConfig.vertical_grain of every SPIN step of this run
    t0 = time.time()
    env["copy_GBps"] = copy_bandwidth_gbps() if not dry else 4250.0
    log(json.dumps(env))
    phases = set(args.phases.split(","))
    if "check" in phases:
        run_checks(env, dry)
    rows = []
    csv_path = os.path.join(args.out, "h200_indexer.csv")
    if "grid" in phases:
        if args.points:
            points = [tuple(int(x) for x in item.split("x")) for item in args.points.split(",")]
        else:
            points = [(b, c, n) for n in args.next_ns for b in args.batches for c in args.contexts]
        for b, c, n in points:
            if b * c > args.max_tokens or time.time() - t0 > args.budget_s:
                log(f"skipped B={b} L={c} n={n} (size or time budget)")
                continue
            try:
                rows += grid_point(b, c, n, args.sparsities, env, dry,
                                   dict(tau_hint=args.tau_hint, overlap_update=not args.no_overlap,
                                        topk_sorted=args.topk_sorted))
            except Exception as exc:  # one failed point must not cost the whole run
                log(f"FAILED B={b} L={c} n={n}: {exc!r}")
                traceback.print_exc()
            with open(csv_path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
                w.writeheader()
                w.writerows(formatted(rows))
    with open(os.path.join(args.out, "h200_env.json"), "w") as f:
        json.dump(env, f, indent=1)
    if rows:
        for line in write_report(args.out, rows, env, command):
            log(line)
    log(f"total {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
