"""Suite step: the whole SPIN decode step of one indexer layer (SpinIndexer.plan + run: predict, select,
compact, paged logits on the kept blocks, top-k, EMA update) and a 61-layer step captured in one CUDA graph.

Two wirings of SpinIndexer.run's two ops, both benchmark-only substitutions of `spin_indexer.ops` attributes:
- "fused": the logits twin also writes the per-block max into a buffer that the top-k reads (what run()
  should do; today it calls ops.topk without block_max, so the top-k first re-reads the logits);
- "bookkeeping": logits and top-k return precomputed buffers, so the timing is plan + predict + select +
  compaction + position mapping + EMA update alone (the plan_update_us column).
Bytes of plan + update at sparsity s (floor): V/D predictions 2 tables * L * 2 B read, the EMA update
2 * L_kept * 2 B read + written, block tables and plans O(W); everything else is O(W) too.
"""
from __future__ import annotations

import contextlib
import os
import functools

import torch

from bench_indexer_logits import LogitsPoint
from harness import DEVICE

import spin_indexer.ops as ops
from spin_indexer.ops.indexer_logits_triton import paged_indexer_logits_triton
from spin_indexer.ops.topk_triton import topk_triton

T = 64


def spin_available() -> bool:
    try:
        from spin_indexer.indexer import SpinIndexer  # noqa: F401
        from spin_indexer.predictor import SpinConfig  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def patched_ops(logits_fn, topk_fn):
    saved = ops.paged_indexer_logits, ops.topk
    ops.paged_indexer_logits, ops.topk = logits_fn, topk_fn
    try:
        yield
    finally:
        ops.paged_indexer_logits, ops.topk = saved


class FusedOps:
    """ops.paged_indexer_logits + ops.topk with the block max handed from one to the other."""

    def __init__(self, rows: int, width: int, knobs: dict | None = None):
        self.knobs = knobs or {}
        self.bmax = torch.empty(rows, width, device=DEVICE)
        self.out = torch.empty(rows, width * T, device=DEVICE)

    def logits(self, q_fp8, kv_cache, weights, seq_lens, block_table, validate=True, **_):
        return paged_indexer_logits_triton(q_fp8, kv_cache, weights, seq_lens, block_table, validate=validate,
                                           out=self.out, block_max_out=self.bmax, **self.knobs)

    def topk(self, logits, lengths, k, validate=True, **_):
        return topk_triton(logits, lengths, k, validate=validate, block_max=self.bmax)


class FixedOps:
    """Stand-ins returning precomputed buffers: times the bookkeeping around the two kernels."""

    def __init__(self, logits: torch.Tensor, topk: torch.Tensor):
        self.out, self.idx = logits, topk

    def logits(self, *_, **__):
        return self.out

    def topk(self, *_, **__):
        return self.idx


def make_indexer(batch: int, width: int, next_n: int, sparsity: float, num_layers: int = 1, topk: int | None = None):
    from spin_indexer.indexer import SpinIndexer
    from spin_indexer.predictor import SpinConfig

    cfg = SpinConfig(sparsity=sparsity, topk=topk or int(os.environ.get("SPIN_BENCH_TOPK", "2048")))
    idx = SpinIndexer(cfg, num_layers=num_layers, max_batch=batch, max_blocks=width, next_n=next_n, device=DEVICE)
    slots = torch.tensor([idx.state.allocate() for _ in range(batch)], dtype=torch.int32, device=DEVICE)
    return idx, slots


def _step(idx, slots, table, lens, q, cache, w, layers=(0,)):
    idx.plan(table, lens, slots, validate=False)
    for layer in layers:
        idx.run(layer, q, cache, w)


def step_calls(point: LogitsPoint, sparsity: float, wiring: str, knobs: dict | None = None):
    """One-layer SPIN step callables over the point's (dense) tables; the indexer is warmed up so every
    block has been observed once (the first step of a request scores everything)."""
    batch, next_n, width = point.batch, point.next_n, point.tables[0].shape[1]
    idx, slots = make_indexer(batch, width, next_n, sparsity)
    lens = point.lens[0]
    fused = FusedOps(batch * next_n, width, knobs)
    with patched_ops(fused.logits, fused.topk):
        for _ in range(2):
            _step(idx, slots, point.tables[0], lens, point.q, point.pool.cache, point.w)
    if wiring == "bookkeeping":
        fixed = FixedOps(fused.out.clone(), torch.zeros(batch * next_n, idx.config.topk, dtype=torch.int32,
                                                          device=DEVICE))
        fns = (fixed.logits, fixed.topk)
    else:
        fns = (fused.logits, fused.topk)
    calls = [functools.partial(_step, idx, slots, table, lens, point.q, point.pool.cache, point.w)
             for table in point.tables]
    return [_with_ops(fns, c) for c in calls], idx


def _with_ops(fns, call):
    def run():
        with patched_ops(*fns):
            call()
    return run


def graph61(pool, batch: int, ctx: int, next_n: int, sparsity: float, time_graph, layers: int = 61):
    """Capture plan + `layers` x run in one CUDA graph (each layer its own cache slice and queries) and
    time its replays; also the dense baseline (Triton logits + our top-k, and + torch.topk) per step."""
    width = ctx // T
    per_layer = pool.num_blocks // layers
    need = batch * width
    if need > per_layer:
        raise ValueError(f"pool too small for {layers} layers of {batch} x {ctx}")
    caches = [pool.cache[i * per_layer:(i + 1) * per_layer] for i in range(layers)]
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    table = torch.randperm(per_layer, device=DEVICE, generator=gen)[:need].view(batch, width).to(torch.int32)
    from harness import decode_lens, random_queries
    lens = decode_lens(batch, next_n, ctx)
    qs = [random_queries(batch, next_n, seed=100 + i) for i in range(layers)]
    idx, slots = make_indexer(batch, width, next_n, sparsity, num_layers=layers)
    fused = FusedOps(batch * next_n, width)

    def spin_step():
        idx.plan(table, lens, slots, validate=False)
        for layer in range(layers):
            idx.run(layer, qs[layer][0], caches[layer], qs[layer][1])

    with patched_ops(fused.logits, fused.topk):
        for _ in range(2):
            spin_step()
        spin = time_graph([spin_step], target_s=0.3, min_reps=5)
    realized = float(idx.block_plan.sparsity().mean())
    out = torch.empty(batch * next_n, width * T, device=DEVICE)
    bmax = torch.empty(batch * next_n, width, device=DEVICE)
    flat_lens = lens.reshape(-1).contiguous()

    def dense_step(torch_topk: bool):
        for layer in range(layers):
            paged_indexer_logits_triton(qs[layer][0], caches[layer], qs[layer][1], lens, table, validate=False,
                                        out=out, block_max_out=bmax)
            if torch_topk:
                torch.topk(out[:, :ctx], idx.config.topk, dim=1)
            else:
                topk_triton(out, flat_lens, idx.config.topk, validate=False, block_max=bmax)

    dense = time_graph([functools.partial(dense_step, False)], target_s=0.3, min_reps=5)
    dense_torch = time_graph([functools.partial(dense_step, True)], target_s=0.3, min_reps=5)
    return dict(spin_step_us=spin.p50_us, dense_step_us=dense.p50_us, dense_torch_topk_step_us=dense_torch.p50_us,
                realized_sparsity=realized, layers=layers, batch=batch, ctx=ctx, next_n=next_n, sparsity=sparsity)
