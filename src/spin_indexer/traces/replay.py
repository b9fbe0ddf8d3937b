"""Offline replay: drive a SpinIndexer over recorded traces with the live policy code.

Each step calls `idx.plan(...)` and `idx.run_from_scores(layer, scores)`: the same prediction, selection,
compaction, top-k and EMA update as live decoding; only the paged-logits kernel is replaced by a gather
from the trace, and SPIN sees the scores of the blocks it kept and nothing else. Fidelity is then read
from `idx.block_plan.keep_mask` against the trace's dense top-k.

Batching: several traces with the same (layers, next_n, k) form the batch dimension; request r's block
table is [r*W, (r+1)*W) (the cache itself is never read, but the vertical history lives per physical
block, so every request gets blocks of its own).

Layers folded into the batch (the default unless the config couples layers): SPIN keeps independent state
per (request, layer), and nothing in plan/run couples two layers (except the hybrid predictor, which is
replayed layer by layer), so layer l of trace b can run as its own request
(slot b * L + l) of a one-layer indexer. One plan + one run per step then covers every layer, with the
same policy code on a [B*L, W*T] batch instead of L calls on [B, W*T]. The only difference from the
layer-by-layer order is the random-exploration stream: its counter hash is keyed by (layer, slot), so
folded runs draw different (equally uniform) random blocks, and block_age/staleness break ties between
equal ages differently. With exploration "none" both orders are bit-identical (tests/traces/test_replay.py
checks it)
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from ..checks import check_int
from ..ops.topk import topk_ref
from ..predictor.miss import miss_per_row
from ..predictor.config import SpinConfig
from .schema import Trace


@dataclass
class ReplayResult:
    """Per-trace fidelity arrays (CPU tensors), keyed by trace name (meta.prompt_id).

    miss: float32 [S, L, N] fraction of the dense top-k missed per row; sparsity: float32 [S, L]
    realized block sparsity; eligible: bool [S, N] rows with context > k; num_blocks / num_kept: int32
    [S, L]. `meta` holds each trace's TraceMeta; `seconds` the replay wall time; `row_layer_steps` the
    work done (rows x layers x steps) for throughput.
    """
    config: SpinConfig
    miss: dict[str, torch.Tensor] = field(default_factory=dict)
    sparsity: dict[str, torch.Tensor] = field(default_factory=dict)
    eligible: dict[str, torch.Tensor] = field(default_factory=dict)
    num_blocks: dict[str, torch.Tensor] = field(default_factory=dict)
    num_kept: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    seconds: float = 0.0
    row_layer_steps: int = 0

    @property
    def throughput(self) -> float:
        """rows x layers x steps replayed per second."""
        return self.row_layer_steps / self.seconds if self.seconds > 0 else float("nan")

    def merge(self, other: "ReplayResult") -> None:
        for name in ("miss", "sparsity", "eligible", "num_blocks", "num_kept", "meta"):
            getattr(self, name).update(getattr(other, name))
        self.seconds += other.seconds
        self.row_layer_steps += other.row_layer_steps


def group_traces(traces: list[Trace], max_batch: int = 4, max_ratio: float = 1.25) -> list[list[Trace]]:
    """Batches of compatible traces (same layers, next_n, k, T), sorted by length, each batch's longest
    trace at most max_ratio x its shortest (padding to the longest costs work)."""
    check_int("max_batch", max_batch, low=1)
    key = lambda t: (t.num_layers, t.next_n, t.meta.k, t.meta.tokens_per_block)  # noqa: E731
    groups: list[list[Trace]] = []
    for t in sorted(traces, key=lambda t: (key(t), t.max_len)):
        last = groups[-1] if groups else None
        if (last and key(last[0]) == key(t) and len(last) < max_batch
                and t.max_len <= max_ratio * last[0].max_len):
            last.append(t)
        else:
            groups.append([t])
    return groups


def replay(traces: Trace | list[Trace], config: SpinConfig, device: torch.device | str = "cpu",
           max_batch: int = 4, fold_layers: bool | None = None, progress=None) -> ReplayResult:
    """Replay `config` over traces; returns per-trace miss and sparsity (see ReplayResult).

    config.topk is replaced by the traces' k. SpinConfig.summary > 0 replays from the block summaries the
    traces recorded (Trace.summary_of; a ValueError naming the trace when one has none at summary_parts).
    fold_layers: None = fold unless the config couples layers (hybrid > 0 reads the previous layer's scores of the
    same step, so layers must run in order; a sparsity_profile budgets each layer by its index).
    progress: optional callable(n) called after each step with the rows x layers done (a tqdm's update).
    """
    traces = [traces] if isinstance(traces, Trace) else list(traces)
    if not isinstance(config, SpinConfig):
        raise TypeError(f"config: expected a SpinConfig, got {type(config).__name__}")
    # hybrid > 0 reads the previous layer's scores of the same step; a sparsity profile budgets each layer apart
    couples_layers = getattr(config, "hybrid", 0.0) > 0 or bool(getattr(config, "sparsity_profile", ()))
    if fold_layers is None:
        fold_layers = not couples_layers
    elif fold_layers and couples_layers:
        raise ValueError("fold_layers: expected False (or None) with SpinConfig.hybrid > 0 or a sparsity_profile: "
                         "the hybrid predictor reads the previous layer of the same step, a profile budgets each "
                         "layer by its index, so layers cannot run as separate requests")
    names = [t.name for t in traces]
    if len(set(names)) != len(names):
        raise ValueError(f"traces: expected distinct prompt_id names, got duplicates in {names}")
    out = ReplayResult(config)
    for batch in group_traces(traces, max_batch):
        out.merge(_replay_batch(batch, config, torch.device(device), fold_layers, progress))
    return out


def _replay_batch(batch: list[Trace], config: SpinConfig, device: torch.device, fold: bool,
                  progress) -> ReplayResult:
    from ..indexer import SpinIndexer  # the live decode step, imported here to keep traces/ import-light

    first = batch[0]
    layers, next_n, k, t = first.num_layers, first.next_n, first.meta.k, first.meta.tokens_per_block
    cfg = dataclasses.replace(config, topk=k, tokens_per_block=t)
    num_req = len(batch)
    width = max(-(-tr.max_len // t) for tr in batch)
    steps = max(tr.num_steps for tr in batch)
    # Folded: request r = b * L + l, one indexer layer. Unfolded: request b, L indexer layers.
    per_req = layers if fold else 1
    idx = SpinIndexer(cfg, num_layers=1 if fold else layers, max_batch=num_req * per_req, max_blocks=width,
                      next_n=next_n, device=device, num_cache_blocks=num_req * per_req * width, topk_sorted=True)
    slots = torch.tensor([idx.state.allocate() for _ in range(num_req * per_req)], dtype=torch.int64,
                         device=device)
    res = ReplayResult(cfg)
    miss = torch.zeros(num_req, steps, layers, next_n)
    sparsity = torch.zeros(num_req, steps, layers)
    n_blocks = torch.zeros(num_req, steps, layers, dtype=torch.int32)
    n_kept = torch.zeros(num_req, steps, layers, dtype=torch.int32)
    buf = torch.empty(num_req, layers, next_n, width * t, dtype=torch.float32, device=device)
    # SpinConfig.summary: the block summary scores the capture recorded ([S, L, W] a trace), else None
    recorded = [tr.summary_of(cfg.summary_parts) for tr in batch] if cfg.summary > 0 else None
    sbuf = torch.empty(num_req, layers, width, dtype=torch.float32, device=device) if recorded else None
    tables = torch.arange(num_req * per_req * width, dtype=torch.int32, device=device).view(-1, width)
    start = time.perf_counter()
    for s in range(steps):
        live = [b for b, tr in enumerate(batch) if s < tr.num_steps]  # traces that still decode
        lens = torch.stack([batch[b].seq_lens[s] for b in live]).to(device)  # [B', N]
        acc = None
        if next_n > 1 and all(batch[b].accepted is not None for b in live):
            acc = torch.stack([batch[b].accepted[s] for b in live]).to(device=device, dtype=torch.int32)
        buf.fill_(float("-inf"))
        for b in live:
            sc = batch[b].scores[s]  # [L, N, C_b]
            buf[b, :, :, :sc.shape[-1]] = sc.to(device=device, dtype=torch.float32)
        if sbuf is not None:
            sbuf.fill_(float("-inf"))
            for b in live:
                sbuf[b, :, :recorded[b].shape[-1]] = recorded[b][s].to(device)
        topk = torch.stack([_dense_topk(batch[b], s, buf[b], k) for b in live])  # [B', L, N, K]
        live_t = torch.tensor(live, dtype=torch.int64, device=device)
        if fold:
            req = (live_t[:, None] * layers + torch.arange(layers, device=device)[None, :]).reshape(-1)  # [B'*L]
            rep = lambda x: x.repeat_interleave(layers, dim=0)  # noqa: E731  per-trace -> per-(trace, layer)
            idx.plan(tables[req], rep(lens).contiguous(), slots[req],
                     None if acc is None else rep(acc), validate=(s == 0))
            scores = buf[live_t].reshape(len(live) * layers * next_n, width * t)
            idx.run_from_scores(0, scores, None if sbuf is None else sbuf[live_t].reshape(-1, width))
            plan = idx.block_plan
            keep = plan.keep_mask.view(len(live), layers, width)
            m = miss_per_row(plan.keep_mask, topk.reshape(-1, k), next_n, t).view(len(live), layers, next_n)
            sp = plan.sparsity().view(len(live), layers)
            nb, nk = plan.num_blocks.view(len(live), layers), plan.num_kept.view(len(live), layers)
            del keep
        else:
            idx.plan(tables[live_t], lens.contiguous(), slots[live_t], acc, validate=(s == 0))
            ms, sps, nbs, nks = [], [], [], []
            for layer in range(layers):
                scores = buf[live_t, layer].reshape(len(live) * next_n, width * t)
                idx.run_from_scores(layer, scores, None if sbuf is None else sbuf[live_t, layer])
                plan = idx.block_plan
                ms.append(miss_per_row(plan.keep_mask, topk[:, layer].reshape(-1, k), next_n, t).view(-1, next_n))
                sps.append(plan.sparsity())
                nbs.append(plan.num_blocks)
                nks.append(plan.num_kept)
            m, sp = torch.stack(ms, 1), torch.stack(sps, 1)
            nb, nk = torch.stack(nbs, 1), torch.stack(nks, 1)
        cpu_live = torch.tensor(live)
        miss[cpu_live, s] = m.cpu()
        sparsity[cpu_live, s] = sp.cpu()
        n_blocks[cpu_live, s] = nb.cpu()
        n_kept[cpu_live, s] = nk.cpu()
        res.row_layer_steps += len(live) * next_n * layers
        if progress is not None:
            progress(len(live) * next_n * layers)
    res.seconds = time.perf_counter() - start
    for b, tr in enumerate(batch):
        s_b = tr.num_steps
        res.miss[tr.name] = miss[b, :s_b].clone()
        res.sparsity[tr.name] = sparsity[b, :s_b].clone()
        res.eligible[tr.name] = (tr.seq_lens > k).cpu()
        res.num_blocks[tr.name] = n_blocks[b, :s_b].clone()
        res.num_kept[tr.name] = n_kept[b, :s_b].clone()
        res.meta[tr.name] = tr.meta
    return res


def _dense_topk(trace: Trace, step: int, scores: torch.Tensor, k: int) -> torch.Tensor:
    """The step's dense top-k int [L, N, K]: recorded when the trace has it, else from the scores."""
    if trace.topk is not None:
        return trace.topk[step].to(scores.device)
    layers, next_n, cols = scores.shape
    lens = trace.seq_lens[step].to(scores.device).repeat(layers)
    return topk_ref(scores.reshape(layers * next_n, cols).float(), lens.to(torch.int32), k, validate=False).view(layers, next_n, k)
