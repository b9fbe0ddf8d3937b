"""A synthetic-weight decode step at DeepSeek-V3.2 shapes: indexer + sparse MLA attention over the top-k, for
all 61 indexer layers, each configuration captured in ONE CUDA graph (issue #7).

    PYTHONPATH=src:benchmarks python3 benchmarks/bench_v32_step.py --out $OUT/v32

Per (batch, context) point, random weights and caches, next_n = 1:
- one FP8 indexer key pool (engine layout, 132 B/token) and one MLA latent pool (fp8 576 dims + fp32 scale,
  580 B/token), each B * context tokens, shared by all layers. Every layer has its own random queries. Sharing
  the caches across layers does not flatter the timing: one layer already reads far more than the 60 MB L2
  (B = 96 at 128K: 1.7 GB of indexer keys), so nothing survives in L2 from one layer to the next.
- configs: dense = DenseIndexer.run (logits + top-k through the step's backends) + sparse MLA, per layer;
  spin-s = SpinIndexer.plan once (every layer) + run per layer + sparse MLA, from a random steady-state history;
  attention alone (61 layers of sparse MLA over a fixed random top-k, in random order) gives attention_ms, and
  indexer_ms = step_ms - attention_ms. Attention alone, dense and one SPIN config are replayed in turn, one replay
  each per round (harness.time_graphs_paired), and every number is a median over rounds of per-round values:
  indexer_ms = median(step - attention of the same round), indexer_vs_dense = median((spin - attention) /
  (dense - attention)) per round (timed apart, attention alone moved by ~1 ms between runs, ~0.01 of the ratio at
  96 x 128K). --variants repeats dense and SPIN with one part of the step set or
  switched back (VARIANTS: plan()'s DeepGEMM schedule, the logits backend, the update's overlap, ...), rows "<config>/<variant>".
Writes <out>/h200_v32_step.csv, .md (command, environment, table) and .json (environment + rows).
The sparse attention is plain torch (benchmarks/sparse_mla.py), not FlashMLA: attention_ms is an upper bound.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import csv
import functools
import gc
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from harness import (DEVICE, KeyPool, decode_lens, environment, fill_random_history, markdown_table,  # noqa: E402
                     random_queries, time_graphs_paired)

from spin_indexer.indexer import DenseIndexer, SpinIndexer  # noqa: E402
from spin_indexer.predictor import SpinConfig  # noqa: E402
from sparse_mla import MLA_HEADS, QK_DIM, T, sparse_mla_decode  # noqa: E402

COLUMNS = ["model_shape", "batch", "context", "config", "layers", "step_ms", "indexer_ms", "attention_ms",
           "indexer_vs_dense", "realized_sparsity", "tokens_per_s_indexer_attention"]
AUTO_BATCHES = (96, 64, 32, 16, 8)
DEVICE_GIB = 139.0  # H200 as lent; the CPU dry run sizes "auto" points against it too
MLA_BYTES_PER_TOKEN = QK_DIM + 4


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------ memory plan
def bytes_needed(batch: int, ctx: int, layers: int, topk: int, index_bytes: int = 132) -> int:
    """Device bytes one point needs: the two pools, one SpinState (V per cached token and layer, the
    diagonal windows), the workspace (per-layer plans and top-k), the logits + block-max buffers, the MLA
    queries, the attention temporaries, 4 GiB slack."""
    tokens, rows = batch * ctx, batch
    pools = tokens * (index_bytes + MLA_BYTES_PER_TOKEN)
    state = layers * (tokens * 2 + tokens // T * 2 + batch * min(ctx, 8192) * 2)
    state += layers * batch * (ctx // T) * 8 + layers * rows * topk * 4
    logits = tokens * 4 + tokens // T * 4
    queries = layers * rows * MLA_HEADS * QK_DIM * 2
    attention = rows * topk * (QK_DIM * 2 * 2 + 8 * 3) + rows * MLA_HEADS * topk * (4 * 2 + 2)
    return pools + state + logits + queries + attention + (4 << 30)


def auto_batch(ctx: int, layers: int, topk: int, capacity: int, index_bytes: int = 132,
               candidates=AUTO_BATCHES) -> int | None:
    """The largest of `candidates` whose point fits in `capacity` bytes, or None."""
    return next((b for b in sorted(candidates, reverse=True)
                 if bytes_needed(b, ctx, layers, topk, index_bytes) <= capacity), None)


def parse_points(text: str) -> list[tuple[int | None, int]]:
    """"96x131072,autox1048576" -> [(96, 131072), (None, 1048576)]; None = choose the batch by memory."""
    points = []
    for item in text.split(","):
        b, _, c = item.strip().lower().replace(" ", "").partition("x")
        points.append((None if b == "auto" else int(b), int(c)))
    return points


# ------------------------------------------------------------------------------------------ latent pool
class LatentPool:
    """The MLA cache: kv_latent float8_e4m3fn [num_blocks * 64, 576] of random finite values, kv_scale float32
    [num_blocks * 64] powers of two. Filled in chunks so no full-size temporary is ever allocated."""

    def __init__(self, num_slots: int, seed: int = 1):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        raw = torch.empty(num_slots, QK_DIM, dtype=torch.uint8, device=DEVICE)
        self.kv_scale = torch.empty(num_slots, dtype=torch.float32, device=DEVICE)
        step = 1 << 22
        for s0 in range(0, num_slots, step):
            part = raw[s0:s0 + step]
            part.random_(0, 256, generator=gen)
            part.copy_(torch.where((part & 0x7F) == 0x7F, part ^ 1, part))  # no fp8 NaN bytes
            exps = torch.randint(-8, -4, (part.shape[0],), device=DEVICE, generator=gen)
            self.kv_scale[s0:s0 + step] = torch.exp2(exps.float())
        self.kv_latent = raw.view(torch.float8_e4m3fn)


# ------------------------------------------------------------------------------------------ one point
def run_point(batch: int, ctx: int, args) -> list[dict]:
    """Time attention alone, dense and every SPIN sparsity at one (batch, context); rows in COLUMNS order."""
    layers, k = args.layers, args.topk
    width = ctx // T
    t0 = time.time()
    keys = KeyPool(batch * width, seed=0, dim=args.index_dim)
    table = keys.tables(batch, width, 1)[0]  # one table addresses both pools (same block ids)
    latent = LatentPool(batch * width * T)
    lens = decode_lens(batch, 1, ctx)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    index_q = [random_queries(batch, 1, heads=args.index_heads, dim=args.index_dim, seed=100 + i)
               for i in range(layers)]
    mla_q = [torch.randn(batch, args.mla_heads, QK_DIM, device=DEVICE, generator=gen).to(torch.bfloat16)
             for _ in range(layers)]
    log(f"  pools ready ({time.time() - t0:.1f} s)")

    def attend(layer, topk_indices):
        return sparse_mla_decode(mla_q[layer], latent.kv_latent, latent.kv_scale, table, topk_indices)

    fixed_topk = torch.randint(0, ctx, (batch, k), device=DEVICE, generator=gen, dtype=torch.int32)

    def attention_step():
        for layer in range(layers):
            attend(layer, fixed_topk)

    def dense_step_of():
        """The dense step, its indexer built under the current variant (which may set its arguments)."""
        dense = DenseIndexer(k, 1, device=DEVICE)

        def dense_step():
            dense.plan(table, lens, validate=False)
            for layer in range(layers):
                q, w = index_q[layer]
                attend(layer, dense.run(layer, q, keys.cache, w))
        return dense_step

    results = []
    for name in args.variants:
        with variant(name):
            results += _configs(name, batch, ctx, args, keys, table, lens, index_q, attend, attention_step,
                                dense_step_of())
    shape = (f"v3.2-synthetic L{layers} idx{args.index_heads}x{args.index_dim} k{k} "
             f"mla{args.mla_heads}x{QK_DIM}")
    return [dict(model_shape=shape, batch=batch, context=ctx, config=name, layers=layers,
                 **{key: round(value, 4) for key, value in times.items()}, realized_sparsity=round(realized, 4),
                 tokens_per_s_indexer_attention=round(batch / (times["step_ms"] / 1e3), 1))
            for name, times, realized in results]


# A/B switches of the step's parts, for attributing a change in one device call (--variants): each sets one part
# (the top-k's chain) or switches it back to run 16's (the DeepGEMM schedule, the logits backend), for dense and
# SPIN alike, while the configs are built and captured.
VARIANTS = {
    "default": "the production step",
    "no-schedule": "no DeepGEMM schedule from plan(): DeepGEMM computes its own per layer (one launch more)",
    "logits-triton": "the Triton logits kernel at every next_n (SPIN_INDEXER_LOGITS=triton; at next_n = 1 it is "
                     "the default of both steps since session 33)",
    "logits-deepgemm": "DeepGEMM's logits at next_n = 1 too, the maxima in a pass after it (SPIN_INDEXER_LOGITS="
                       "deepgemm: SPIN's step before session 33, and the dense step on DeepGEMM)",
    "no-overlap": "the EMA update in series after DeepGEMM (SpinIndexer(overlap_update=False)), not on a side stream",
    "topk-sorted": "every top-k best first (topk_sorted=True: the sort and rank launches) instead of the set in "
                   "position order (one select launch), dense and SPIN alike",
    "compact-16k": "SPIN's compact Triton logits chunked for <= 16384 programs as full tables are (the rule "
                   "before run 68; production: indexer_logits_triton.COMPACT_TARGET_PROGRAMS = 4096)",
    "compact-uncapped": "SPIN's compact Triton logits up to 256 blocks a program (the rule before run 95; "
                        "production: indexer_logits_triton.COMPACT_MAX_CHUNK)",
    "tau-hint": "SPIN's top-k threshold starts from the previous step's key (SpinIndexer(tau_hint=True)); this "
                "benchmark's logits repeat every step, so every hint hits: an upper bound of the gain",
}


@contextlib.contextmanager
def variant(name: str):
    """The step with one part set or switched back (VARIANTS) while the block runs, restored after."""
    if name not in VARIANTS:
        raise SystemExit(f"--variants: unknown {name!r}; expected some of {sorted(VARIANTS)}")
    schedule, env = SpinIndexer._schedule_layers, os.environ.get("SPIN_INDEXER_LOGITS")
    init, dense_init = SpinIndexer.__init__, DenseIndexer.__init__
    from spin_indexer.ops import indexer_logits_triton as ilt
    default_config = ilt.default_config
    try:
        if name in ("compact-16k", "compact-uncapped"):
            change = {"target_programs": ilt.CONFIGS[1].target_programs} if name == "compact-16k" else \
                {"max_chunk": ilt.CONFIGS[1].max_chunk}
            ilt.default_config = lambda next_n, blocks, compact: dataclasses.replace(
                default_config(next_n, blocks, compact), **(change if compact else {}))
        elif name == "no-schedule":
            SpinIndexer._schedule_layers = lambda self, batch, width: False
        elif name in ("logits-triton", "logits-deepgemm"):
            os.environ["SPIN_INDEXER_LOGITS"] = name.removeprefix("logits-")
        elif name == "no-overlap":
            SpinIndexer.__init__ = functools.partialmethod(init, overlap_update=False)
        elif name == "tau-hint":
            SpinIndexer.__init__ = functools.partialmethod(init, tau_hint=True)
        elif name == "topk-sorted":
            SpinIndexer.__init__ = functools.partialmethod(init, topk_sorted=True)
            DenseIndexer.__init__ = functools.partialmethod(dense_init, topk_sorted=True)
        yield
    finally:
        SpinIndexer._schedule_layers, SpinIndexer.__init__ = schedule, init
        ilt.default_config = default_config
        DenseIndexer.__init__ = dense_init
        if env is None:
            os.environ.pop("SPIN_INDEXER_LOGITS", None)
        else:
            os.environ["SPIN_INDEXER_LOGITS"] = env


def _times(step: list, attention: list, dense: list) -> dict:
    """The row's timings (ms) from per-round replays of its step, attention alone and the dense step."""
    return dict(step_ms=statistics.median(step),
                indexer_ms=statistics.median(s - a for s, a in zip(step, attention)),
                attention_ms=statistics.median(attention),
                indexer_vs_dense=statistics.median((s - a) / (d - a) for s, a, d in zip(step, attention, dense)))


def _configs(name, batch, ctx, args, keys, table, lens, index_q, attend, attention_step, dense_step) -> list[tuple]:
    """(config, timings, realized sparsity) of dense and every SPIN sparsity under variant `name`: attention
    alone, dense and one SPIN config replayed in turn per round (the dense row pools every sparsity's rounds)."""
    layers, k = args.layers, args.topk
    width = ctx // T
    tag = "" if name == "default" else f"/{name}"
    results, pooled = [], {"attention": [], "dense": []}
    for s in args.sparsity:
        idx = SpinIndexer(SpinConfig(sparsity=s, topk=k, vertical_grain=args.vertical_grain), num_layers=layers, max_batch=batch, max_blocks=width,
                          device=DEVICE, num_cache_blocks=keys.num_blocks)
        slots = torch.tensor([idx.state.allocate() for _ in range(batch)], dtype=torch.int64, device=DEVICE)
        steady_history(idx, ctx)

        def spin_step():
            idx.plan(table, lens, slots, validate=False)
            for layer in range(layers):
                q, w = index_q[layer]
                attend(layer, idx.run(layer, q, keys.cache, w))

        spin_step()
        realized = float(torch.stack([idx.plans(layer).sparsity().mean() for layer in range(layers)]).mean())
        ms = time_graphs_paired(dict(attention=attention_step, dense=dense_step, spin=spin_step), args.rounds)
        for key in pooled:
            pooled[key] += ms[key]
        times = _times(ms["spin"], ms["attention"], ms["dense"])
        results.append((f"spin-{s:g}{tag}", times, realized))
        log(f"  attention alone {times['attention_ms']:.2f} ms, dense{tag} {statistics.median(ms['dense']):.2f} ms, "
            f"spin-{s:g}{tag} {times['step_ms']:.2f} ms (indexer {times['indexer_vs_dense']:.3f} of dense's, "
            f"{args.rounds} paired rounds), realized sparsity {realized:.3f}")
        del idx, slots, spin_step
        _free_memory()
    dense = _times(pooled["dense"], pooled["attention"], pooled["dense"])
    return [("dense" + tag, dense, 0.0)] + results


def steady_history(idx, ctx: int) -> None:
    """A random history as after many decode steps: every block scored before, diagonal windows full."""
    st = idx.state
    fill_random_history(st, torch.Generator(device=st.block_max.device).manual_seed(5))
    st.seen_len.fill_(ctx)
    st.step.fill_(100)


def _free_memory():
    gc.collect()
    if DEVICE != "cpu":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ output
def markdown(rows: list[dict], env: dict, command: str) -> str:
    lines = ["# DeepSeek-V3.2-shaped decode step: indexer + sparse MLA (synthetic weights)", "",
             f"- GPU {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, "
             f"commit {env.get('commit')}, {env.get('date')}",
             f"- command: `{command}`",
             "- one CUDA graph per config over all layers (median of replays); next_n = 1; caches shared by the "
             "layers (each far larger than L2); sparse MLA is a plain torch gather + bmm (benchmarks/sparse_mla.py), "
             "not FlashMLA, so attention_ms is an upper bound; attention alone (over fixed random top-k), dense "
             "and SPIN replayed in turn, one replay each per round: indexer_ms = median over rounds of step - "
             "attention alone, indexer_vs_dense = median over rounds of SPIN's indexer time / dense's.", ""]
    lines += markdown_table(COLUMNS, rows)
    return "\n".join(lines) + "\n"


def print_table(rows: list[dict]) -> None:
    log(f"\n{'batch':>6} {'context':>8} {'config':>24} {'step_ms':>9} {'indexer_ms':>10} {'attn_ms':>8} "
        f"{'vs_dense':>8} {'sparsity':>8} {'tok/s':>9}")
    for r in rows:
        log(f"{r['batch']:>6} {r['context']:>8} {r['config']:>24} {r['step_ms']:>9.3f} {r['indexer_ms']:>10.3f} "
            f"{r['attention_ms']:>8.3f} {r['indexer_vs_dense']:>8.3f} {r['realized_sparsity']:>8.3f} "
            f"{r['tokens_per_s_indexer_attention']:>9.0f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default="96x131072,96x262144,autox1048576",
                   help="comma list of BATCHxCONTEXT; auto = the largest of 96/64/32/16/8 that fits in memory")
    p.add_argument("--auto-batches", type=lambda s: [int(x) for x in s.split(",")], default=list(AUTO_BATCHES),
                   help="batches an auto point may take, largest first")
    p.add_argument("--sparsity", type=lambda s: [float(x) for x in s.split(",")], default=[0.4, 0.5])
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--vertical-grain", choices=("slot", "block"), default="block",
                   help="SPIN's vertical history: per block (SpinConfig's default) or per slot (the paper)")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--index-heads", type=int, default=64)
    p.add_argument("--index-dim", type=int, default=128)
    p.add_argument("--mla-heads", type=int, default=MLA_HEADS)
    p.add_argument("--variants", type=lambda v: v.split(","), default=["default"],
                   help="comma list of " + ", ".join(f"{k} ({v})" for k, v in VARIANTS.items()))
    p.add_argument("--rounds", type=int, default=10,
                   help="paired rounds per SPIN config (one replay each of attention alone, dense and SPIN)")
    args = p.parse_args(argv)
    if set(args.variants) - set(VARIANTS):
        p.error(f"--variants: unknown {sorted(set(args.variants) - set(VARIANTS))}; expected some of {sorted(VARIANTS)}")
    command = "python3 benchmarks/bench_v32_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    log(json.dumps(env))
    capacity = int(DEVICE_GIB * 2**30) if DEVICE == "cpu" else torch.cuda.mem_get_info()[0]
    csv_path = os.path.join(args.out, "h200_v32_step.csv")
    with open(csv_path, "w", newline="") as f:
        csv.writer(f).writerow(COLUMNS)
    rows, skipped, t0 = [], [], time.time()
    for batch, ctx in parse_points(args.points):
        index_bytes = args.index_dim + 4
        if batch is None:
            batch = auto_batch(ctx, args.layers, args.topk, int(0.9 * capacity), index_bytes,
                               args.auto_batches)
            log(f"auto batch at context {ctx}: {batch} (free {capacity / 2**30:.1f} GiB)")
            if batch is None:
                skipped.append(f"{ctx}: no batch of {args.auto_batches} fits")
                continue
        need = bytes_needed(batch, ctx, args.layers, args.topk, index_bytes)
        log(f"point B={batch} context={ctx}: ~{need / 2**30:.1f} GiB planned")
        try:
            point_rows = run_point(batch, ctx, args)
        except torch.cuda.OutOfMemoryError as exc:  # the same class as torch.OutOfMemoryError
            log(f"  OUT OF MEMORY at B={batch} context={ctx}, skipped: {str(exc).splitlines()[0]}")
            skipped.append(f"{batch}x{ctx}: out of memory")
            point_rows = []
        _free_memory()
        rows += point_rows
        with open(csv_path, "a", newline="") as f:  # after every point: a later failure keeps these rows
            csv.DictWriter(f, fieldnames=COLUMNS).writerows(point_rows)
    env["skipped"] = skipped
    with open(os.path.join(args.out, "h200_v32_step.json"), "w") as f:
        json.dump(dict(env=env, command=command, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "h200_v32_step.md"), "w") as f:
        f.write(markdown(rows, env, command))
    print_table(rows)
    for s in skipped:
        log(f"skipped {s}")
    log(f"total {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
