"""Fit the lightning indexer to the frozen model's own attention (DeepSeek's dense warm-up).

For each layer and query row t the target is the attention distribution summed over the query heads and
L1-normalised, p[t, :] = mean_h softmax(q_h k^T / sqrt(d))[t, :] (causal); the indexer's distribution is
softmax(I[t, :]) over the same positions. The loss is KL(p || softmax(I)), averaged over the rows
t >= min_row (rows with fewer tokens than any useful top-k teach nothing about selection) and over the
layers. The model is frozen and every layer's indexer sees only that layer's (detached) input, so the
layers are trained independently.

Row chunks (`DistillConfig.row_chunk`): the rows are taken `row_chunk` at a time; a chunk of rows
[r0, r1) needs only the keys 0..r1-1 (causal), so its target, its indexer scores and their backward are
[B, Hq, r1 - r0, r1] at most: memory O(row_chunk x S) per layer instead of O(S^2) (at 32K one [9, S, S]
float32 map alone is 38.7 GB). The indexer's keys are computed once per layer; every chunk's backward
adds into the gradient of a detached copy, which is sent through the key projection once at the end, so
the gradient is the unchunked one (tested). `rows_per_seq` trains on a random subset of the chunks
(each costs its own r1 columns): more sequences per GPU second at 32K.

Also here: top-k recall of an indexer against the attention's top-k, per layer, and perplexity of
decoding with top-k sparse attention (decode.py) against dense decoding.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .decode import Caches, decode_one_step, prefill
from .indexer_head import Indexer
from .llama import Llama


@dataclass
class DistillConfig:
    seq_len: int = 4096
    batch: int = 2
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 30
    time_budget_s: float = 180.0  # training stops at this wall time (cosine schedule over it)
    max_steps: int = 100000
    min_row: int = 128
    seed: int = 0
    log_every: int = 20
    target: str = "mean"  # attention_target reduce: "mean" or "max"
    row_chunk: int = 1024  # query rows per target/backward chunk: memory O(row_chunk x seq_len) per layer
    rows_per_seq: int = 0  # > 0: train on random chunks holding about this many rows per sequence; 0: all rows


@dataclass
class DistillLog:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)  # {"step", "t_s", "lr", "kl", "kl_per_layer"(periodic)}


TARGETS = ("mean", "max")


def _span(rows: slice | None, s: int) -> tuple[int, int]:
    if rows is None:
        return 0, s
    start, stop, _ = rows.indices(s)
    return start, max(start, stop)


def _causal(start: int, stop: int, device) -> torch.Tensor:
    """bool [stop - start, stop]: query row start + i sees key j <= start + i."""
    return torch.arange(start, stop, device=device)[:, None] >= torch.arange(stop, device=device)[None, :]


def attention_target(q: torch.Tensor, k: torch.Tensor, reduce: str = "mean", rows: slice | None = None) -> torch.Tensor:
    """Causal attention distribution reduced over the query heads.

    q: [B, S, Hq, d]; k: [B, S, Hkv, d] (RoPE applied); reduce: "mean" (DeepSeek's L1-normalised head sum)
    or "max" (per position the largest head probability, renormalised: sharp retrieval heads count as much
    as broad ones); rows: query rows r0:r1 (default all). returns float32 [B, r1 - r0, r1] over the keys
    0..r1-1 (the keys a causal row of the chunk can see), rows sum to 1, zero above the diagonal; with
    rows=None [B, S, S]. Largest intermediate: the logits, float32 [B, Hq, r1 - r0, r1].
    """
    if reduce not in TARGETS:
        raise ValueError(f"reduce: expected one of {', '.join(TARGETS)}, got {reduce!r}")
    b, s, hq, d = q.shape
    start, stop = _span(rows, s)
    groups = hq // k.shape[2]
    qs = q[:, start:stop].reshape(b, stop - start, -1, groups, d).float()
    logits = torch.einsum("bthgd,bshd->bhgts", qs, k[:, :stop].float()) * d ** -0.5
    logits = logits.masked_fill(~_causal(start, stop, q.device), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    del logits
    if reduce == "mean":
        return probs.mean(dim=(1, 2))
    top = probs.flatten(1, 2).amax(dim=1)
    return top / top.sum(-1, keepdim=True)


def indexer_scores(indexer: Indexer, layer: int, h: torch.Tensor, rows: slice | None = None,
                   keys: torch.Tensor | None = None) -> torch.Tensor:
    """Float indexer scores of (query, key) pairs of whole sequences, causal.

    h: [B, S, dim] the layer's normed input; rows: query rows r0:r1 (default all); keys: the layer's
    indexer keys float32 [B, >= r1, D_I] when already computed (else from h). returns float32
    [B, r1 - r0, r1], -inf above the diagonal ([B, S, S] with rows=None).
    """
    s = h.shape[1]
    start, stop = _span(rows, s)
    pos = torch.arange(s, device=h.device)
    q, w = indexer.layers[layer].queries(h[:, start:stop], pos[start:stop], indexer.rope)  # [B, R, H, D], [B, R, H]
    if keys is None:
        keys = indexer.layers[layer].keys(h[:, :stop], pos[:stop], indexer.rope)  # [B, r1, D]
    per_head = torch.relu(torch.einsum("bthd,bsd->bths", q, keys[:, :stop]))
    scores = torch.einsum("bths,bth->bts", per_head, w)
    return scores.masked_fill(~_causal(start, stop, h.device), float("-inf"))


def kl_rows(target: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax(scores)) of every row: target/scores [B, R, C] -> float32 [B, R]."""
    logq = torch.log_softmax(scores, dim=-1)
    plogp = torch.where(target > 0, target * torch.log(target.clamp_min(1e-30)), 0.0)
    cross = torch.where(target > 0, target * logq.clamp_min(-1e4), 0.0)
    return (plogp - cross).sum(-1)


def kl_loss(target: torch.Tensor, scores: torch.Tensor, min_row: int) -> torch.Tensor:
    """KL(target || softmax(scores)) per row, averaged over rows t >= min_row. target/scores [B, S, S]."""
    return kl_rows(target[:, min_row:], scores[:, min_row:]).mean()


def row_chunks(seq_len: int, min_row: int, chunk: int, rows_per_seq: int = 0,
               gen: torch.Generator | None = None) -> list[slice]:
    """The query-row chunks a step trains on: [min_row, seq_len) cut every `chunk` rows, in order; with
    rows_per_seq > 0 a random subset of ceil(rows_per_seq / chunk) of them (drawn with gen), still in order.
    Example: seq_len 10, min_row 2, chunk 4 -> [2:6, 6:10]."""
    chunks = [slice(r, min(r + chunk, seq_len)) for r in range(min_row, seq_len, chunk)]
    if rows_per_seq > 0:
        keep = min(len(chunks), -(-rows_per_seq // chunk))
        pick = torch.randperm(len(chunks), generator=gen)[:keep].sort().values.tolist()
        chunks = [chunks[i] for i in pick]
    return chunks


def layer_kl_backward(indexer: Indexer, layer: int, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      chunks: list[slice], reduce: str = "mean", scale: float = 1.0) -> torch.Tensor:
    """Backward of scale x (mean KL over the rows of `chunks`) for one layer, one chunk at a time.

    h: [B, S, dim] normed layer input; q [B, S, Hq, d], k [B, S, Hkv, d]: the model's attention inputs
    (no grad). Gradients accumulate in the indexer's parameters. Peak memory: one chunk's target and
    scores ([B, Hq, R, r1] float32 logits) plus the keys [B, S, D_I]. returns the mean KL (0-dim, detached).
    """
    h = h.float()
    s = h.shape[1]
    pos = torch.arange(s, device=h.device)
    keys = indexer.layers[layer].keys(h, pos, indexer.rope)  # [B, S, D_I], graph through the key projection
    leaf = keys.detach().requires_grad_(True)
    num_rows = h.shape[0] * sum(c.stop - c.start for c in chunks)
    total = torch.zeros((), device=h.device)
    for rows in chunks:
        with torch.no_grad():
            target = attention_target(q, k, reduce, rows)
        kl = kl_rows(target, indexer_scores(indexer, layer, h, rows, keys=leaf)).sum() / num_rows
        (kl * scale).backward()
        total += kl.detach()
        del target, kl
    if leaf.grad is not None:
        keys.backward(leaf.grad)
    return total


def train(model: Llama, indexer: Indexer, tokens: torch.Tensor, cfg: DistillConfig, log_fn=print) -> DistillLog:
    """Train `indexer` in place on random windows of `tokens` (int64 [n], one long stream).

    Stops at cfg.time_budget_s or cfg.max_steps. Returns the log (also streamed through log_fn).
    """
    dev = model.embed.weight.device
    gen = torch.Generator().manual_seed(cfg.seed)
    indexer.train().requires_grad_(True)
    opt = torch.optim.AdamW(indexer.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    log = DistillLog()
    start = time.time()
    num_layers = len(model.layers)
    while log.steps < cfg.max_steps:
        elapsed = time.time() - start
        if elapsed >= cfg.time_budget_s:
            break
        frac = elapsed / cfg.time_budget_s
        lr = cfg.lr * min(1.0, (log.steps + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * frac))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, tokens.numel() - cfg.seq_len, (cfg.batch,), generator=gen)
        batch = torch.stack([tokens[s:s + cfg.seq_len] for s in starts.tolist()]).to(dev)
        saved = model.attention_inputs(batch)
        chunks = row_chunks(cfg.seq_len, cfg.min_row, cfg.row_chunk, cfg.rows_per_seq, gen)
        opt.zero_grad(set_to_none=True)
        per_layer = [layer_kl_backward(indexer, i, h, q, k, chunks, cfg.target, 1.0 / num_layers)
                     for i, (h, q, k) in enumerate(saved)]
        del saved
        torch.nn.utils.clip_grad_norm_(indexer.parameters(), 1.0)
        opt.step()
        log.steps += 1
        log.tokens += batch.numel()
        if log.steps % cfg.log_every == 0 or log.steps == 1:
            kls = torch.stack(per_layer).float().cpu()
            row = {"step": log.steps, "t_s": round(time.time() - start, 1), "lr": lr,
                   "kl": round(float(kls.mean()), 4), "kl_per_layer": [round(float(x), 3) for x in kls]}
            log.history.append(row)
            log_fn(f"step {row['step']:5d}  t {row['t_s']:6.1f}s  lr {lr:.2e}  kl {row['kl']:.4f}")
    log.seconds = time.time() - start
    indexer.eval().requires_grad_(False)
    return log


@torch.no_grad()
def topk_recall(model: Llama, indexer: Indexer | None, tokens: torch.Tensor, k: int, rows: slice) -> dict:
    """Per-layer recall of the attention's top-k (head-averaged probability) by other scorers.

    tokens: int64 [B, S]; rows: the query rows scored (e.g. slice(3072, 4096)). returns
    {"lightning": [L], "oracle": [L] (max-over-heads logits), "random": k / row length averaged}.
    """
    _, saved = model.forward_dense(tokens, return_attn_inputs=True)
    out = {"lightning": [], "oracle": []}
    for i, (h, q, kk) in enumerate(saved):
        target = attention_target(q, kk)[:, rows]  # [B, R, S]
        truth = target.topk(k, dim=-1).indices
        scorers = {"oracle": _oracle_scores(q, kk)[:, rows]}
        if indexer is not None:
            scorers["lightning"] = indexer_scores(indexer, i, h.float())[:, rows]
        for name, sc in scorers.items():
            pick = sc.topk(k, dim=-1).indices
            hit = torch.zeros_like(target, dtype=torch.bool).scatter_(-1, pick, True).gather(-1, truth)
            out[name].append(round(float(hit.float().mean()), 4))
    row_ids = torch.arange(tokens.shape[1])[rows].float() + 1
    out["random"] = round(float((k / row_ids).clamp(max=1).mean()), 4)
    return {name: val for name, val in out.items() if val != []}


def _oracle_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    b, s, hq, d = q.shape
    groups = hq // k.shape[2]
    logits = torch.einsum("bthgd,bshd->bhgts", q.view(b, s, -1, groups, d).float(), k.float())
    return logits.flatten(1, 2).amax(1).masked_fill(~_causal(0, s, q.device), float("-inf"))


@torch.no_grad()
def decode_perplexity(model: Llama, tokens: torch.Tensor, prefix: int, mode: str, k: int,
                      indexer: Indexer | None = None, selector=None) -> float:
    """Perplexity of tokens[:, prefix:] under teacher-forced decoding with top-k sparse attention.

    tokens: int64 [B, S]; the first `prefix` tokens are prefilled densely, then every later token is one
    decode step (mode/k/selector as in decode_one_step). returns exp(mean NLL) over B * (S - prefix) tokens.
    """
    b, s = tokens.shape
    caches = Caches.allocate(model, b, s, indexer if mode == "lightning" else None)
    state = getattr(selector, "state", None)
    slots = [state.allocate() for _ in range(b)] if state is not None else []
    for r, slot in enumerate(slots):
        caches.slot_ids[r] = slot
    nll = torch.zeros((), dtype=torch.float64, device=tokens.device)
    try:
        for r in range(b):
            logits = prefill(model, caches, r, tokens[r, :prefix], indexer)
            nll -= torch.log_softmax(logits, -1)[tokens[r, prefix]].double()
        for p in range(prefix, s - 1):
            logits = decode_one_step(model, caches, tokens[:, p:p + 1], mode, k, indexer, selector)[:, 0]
            nll -= torch.log_softmax(logits, -1).gather(-1, tokens[:, p + 1:p + 2]).double().sum()
    finally:
        for slot in slots:
            state.free(slot)
    return math.exp(float(nll) / (b * (s - prefix)))
