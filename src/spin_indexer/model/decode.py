"""Prefill, one decode step, greedy generation: DSA-style sparse decoding of the proxy model.

Every layer of a decode step attends only to the top-k cached tokens its indexer picks (mode):
    dense      full attention, no indexer (the reference)
    oracle     indexer scores = the layer's own attention logits of the new query, max over query heads
    lightning  the distilled lightning indexer (indexer_head.py): FP8 keys in the engines' paged cache
Selection comes from all-keep (`selector=None`: dense indexer scores, `ops.topk`) or from a SpinIndexer
(or DenseIndexer): `plan()` once per step, then per layer `run()` on the paged cache (lightning) or
`run_from_scores()` on the oracle scores. Prefill is dense (SPIN concerns decode) and writes the indexer
keys of the prompt.

Request b owns the model KV rows caches.k[l][b, :P] and the paged indexer blocks b*W .. b*W + W - 1
(block_table[b] = those ids), P = W * 64. A step takes next_n tokens per request; row j sees
seq_lens[b, j] = L_b + j + 1 tokens, L_b the length before the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .. import ops
from ..checks import check_int, check_tensor
from ..layout import TOKENS_PER_BLOCK, new_kv_cache, num_blocks_for
from .indexer_head import Indexer
from .llama import Llama, add_rms_norm, rms_norm

MODES = ("dense", "oracle", "lightning")


class IndexerInputs(NamedTuple):
    """What the lightning indexer scored a layer with (ops.paged_indexer_logits' arguments): q_fp8
    float8_e4m3fn [B, N, H, D], kv_cache uint8 [num_blocks, T, 1, D + 4], weights float32 [B*N, H], seq_lens
    int32 [B, N], block_table int32 [B, W]."""
    q_fp8: torch.Tensor
    kv_cache: torch.Tensor
    weights: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor


# observer(layer, scores float32 [B*N, P], topk int32 [B*N, K], inputs) sees every layer's dense indexer scores;
# inputs: the IndexerInputs behind them in lightning mode (trace capture records block summaries from them),
# None in oracle mode (the scores are the attention's own)
Observer = Callable[[int, torch.Tensor, torch.Tensor, "IndexerInputs | None"], None]


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    return mode


@dataclass
class Caches:
    """Model KV cache, paged indexer-key cache and lengths for B requests of up to P = W*T tokens."""
    k: list[torch.Tensor]  # per layer [B, P, Hkv, d]
    v: list[torch.Tensor]
    index_kv: list[torch.Tensor] | None  # per layer uint8 [B*W, T, 1, D_I + 4], lightning only
    block_table: torch.Tensor  # int32 [B, W]
    lengths: torch.Tensor  # int64 [B], tokens cached per request
    slot_ids: torch.Tensor  # int32 [B], SPIN state slots (one per request)

    @classmethod
    def allocate(cls, model: Llama, batch: int, max_len: int, indexer: Indexer | None = None,
                 dtype: torch.dtype | None = None) -> "Caches":
        check_int("batch", batch, low=1)
        check_int("max_len", max_len, low=1, high=model.max_len)
        cfg, dev = model.cfg, model.embed.weight.device
        dtype = dtype or model.embed.weight.dtype
        width = num_blocks_for(max_len)
        p = width * TOKENS_PER_BLOCK
        shape = (batch, p, cfg.num_kv_heads, cfg.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(cfg.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(cfg.num_layers)]
        index_kv = None
        if indexer is not None:
            index_kv = [new_kv_cache(batch * width, indexer.cfg.head_dim, dev) for _ in range(cfg.num_layers)]
        table = torch.arange(batch * width, dtype=torch.int32, device=dev).view(batch, width)
        return cls(k, v, index_kv, table, torch.zeros(batch, dtype=torch.int64, device=dev),
                   torch.arange(batch, dtype=torch.int32, device=dev))

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


@torch.no_grad()
def prefill(model: Llama, caches: Caches, request: int, tokens: torch.Tensor, indexer: Indexer | None = None,
            chunk: int = 1024, progress: bool = False) -> torch.Tensor:
    """Dense causal prefill of one request's prompt, in chunks; writes KV (and indexer keys) at 0..S-1.

    tokens: int64 [S] prompt (the request's cache must be empty); progress: a bar over the chunks.
    returns float32 logits [vocab] of the last prompt token.
    """
    check_tensor("tokens", tokens, dtype=torch.int64, ndim=1)
    check_int("len(tokens)", tokens.shape[0], low=1, high=caches.capacity)
    return prefill_batch(model, caches, request, [tokens], indexer, chunk, progress)[0]


@torch.no_grad()
def prefill_batch(model: Llama, caches: Caches, first_request: int, prompts: list[torch.Tensor],
                  indexer: Indexer | None = None, chunk: int = 1024, progress: bool = False) -> torch.Tensor:
    """Dense causal prefill of the prompts of requests first_request, first_request + 1, ... in one pass.

    prompts: int64 [S_b] each (lengths may differ; the requests' caches must be empty). Shorter prompts are
    padded at the end: causal attention keeps the padding out of every real token, and the padded
    positions (>= S_b) are past caches.lengths[b], so decoding never reads them and overwrites them.
    returns float32 logits [len(prompts), vocab] of each prompt's last token.
    """
    n = len(prompts)
    check_int("first_request", first_request, low=0, high=caches.block_table.shape[0] - max(n, 1))
    for b, ids in enumerate(prompts):
        check_tensor(f"prompts[{b}]", ids, dtype=torch.int64, ndim=1)
        check_int(f"len(prompts[{b}])", ids.shape[0], low=1, high=caches.capacity)
    lens = [ids.shape[0] for ids in prompts]
    dev = prompts[0].device
    padded = torch.zeros(n, max(lens), dtype=torch.int64, device=dev)
    for b, ids in enumerate(prompts):
        padded[b, :lens[b]] = ids
    rows = slice(first_request, first_request + n)
    requests = torch.arange(first_request, first_request + n, device=dev)
    cfg = model.cfg
    x_last: list[torch.Tensor | None] = [None] * n
    starts = range(0, max(lens), chunk)
    if progress:
        from tqdm import tqdm
        starts = tqdm(starts, desc=f"prefill {n} x {max(lens)} tokens", unit="chunk", leave=False)
    for start in starts:
        ids = padded[:, start:start + chunk]  # [n, C]
        end = start + ids.shape[1]
        pos = torch.arange(start, end, device=dev)
        rope = model.rope.at(pos)
        if caches.index_kv is not None:  # the chunk's rotary tables and cache slots, the same for every layer
            index_rope = indexer.rope.at(pos)
            index_slots = _index_slots(caches, requests, pos[None].expand(n, -1))
        x = model.embed(ids)
        for i, layer in enumerate(model.layers):
            h = rms_norm(x, layer.attn_norm, cfg.norm_eps)
            q, k, v = layer.qkv(h, rope)
            caches.k[i][rows, start:end] = k
            caches.v[i][rows, start:end] = v
            if caches.index_kv is not None:
                indexer.layers[i].write_keys(h, index_rope, caches.index_kv[i], index_slots)
            keys = caches.k[i][rows, :end]  # [n, end, Hkv, d]
            vals = caches.v[i][rows, :end]
            mask = pos[:, None] >= torch.arange(end, device=dev)[None, :]  # [C, end]
            x = x + layer.wo(_attend(q, keys, vals, mask[None, None]).flatten(2))
            x = x + layer.mlp(x)
        for b, length in enumerate(lens):
            if start < length <= end:  # this chunk holds prompt b's last token
                x_last[b] = x[b, length - 1 - start]
    caches.lengths[rows] = torch.tensor(lens, dtype=torch.int64, device=dev)
    return model.logits(torch.stack(x_last))


@torch.no_grad()
def decode_one_step(model: Llama, caches: Caches, tokens: torch.Tensor, mode: str = "lightning", k: int = 256,
                    indexer: Indexer | None = None, selector=None, observer: Observer | None = None,
                    num_accepted: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """Append next_n tokens per request and return their logits; each layer attends to its top-k tokens.

    tokens: int64 [B, N]; mode: dense | oracle | lightning; k: top-k per layer and row;
    selector: None (all-keep top-k) or an object with the SpinIndexer surface (plan/run/run_from_scores);
    observer: called with every layer's dense indexer scores (all-keep only);
    validate: let the selector's plan() check its data (a host sync: False when capturing a CUDA graph).
    returns float32 logits [B, N, vocab]. caches.lengths advance by N.
    """
    check_mode(mode)
    check_tensor("tokens", tokens, dtype=torch.int64, ndim=2, shape=(caches.block_table.shape[0], None),
                 shape_names="[B, N]")
    if mode == "lightning" and (indexer is None or caches.index_kv is None):
        raise ValueError("indexer: mode 'lightning' needs an Indexer and Caches allocated with it")
    if selector is not None and observer is not None:
        raise ValueError("observer: dense scores are only seen with selector=None (all-keep)")
    b, n = tokens.shape
    dev = tokens.device
    pos = caches.lengths[:, None] + torch.arange(n, device=dev)[None, :]  # [B, N]
    seq_lens = (pos + 1).to(torch.int32)  # row j sees L_b + j + 1 tokens
    if selector is not None and mode != "dense":
        selector.plan(caches.block_table, seq_lens, caches.slot_ids, num_accepted=num_accepted, validate=validate)
    cfg = model.cfg
    rope = model.rope.at(pos)  # every layer rotates at these positions: the tables gathered once a step
    if mode == "lightning":  # so do the indexer's, and every layer's keys go to the same cache slots
        index_rope = indexer.rope.at(pos)
        index_slots = _index_slots(caches, torch.arange(b, device=dev), pos)
    x = model.embed(tokens)
    delta = None  # the last layer's MLP output: the next norm adds it to the residual stream (one launch for both)
    for i, layer in enumerate(model.layers):
        x, h = add_rms_norm(x, delta, layer.attn_norm, cfg.norm_eps)
        q = layer.qkv_into_cache(h, rope, caches.k[i], caches.v[i], pos)
        keys, vals = caches.k[i], caches.v[i]
        if mode == "dense":
            out = attend_dense(q, keys, vals, seq_lens)
        else:
            if mode == "oracle":
                topk = _oracle_topk(i, q, keys, seq_lens, k, selector, observer)
            else:
                topk = _lightning_topk(indexer, i, h, index_rope, index_slots, caches, seq_lens, k, selector,
                                       observer)
            out = attend_topk(q, keys, vals, topk.view(b, n, -1))
        x, h = add_rms_norm(x, layer.wo(out.flatten(2)), layer.ffn_norm, cfg.norm_eps)
        delta = layer.mlp_normed(h)
    caches.lengths += n
    return model.logits(x, delta)


@torch.no_grad()
def verify_step(model: Llama, caches: Caches, row_tokens: torch.Tensor, mode: str, k: int,
                indexer: Indexer | None = None, selector=None, observer: Observer | None = None):
    """One speculative-decoding step of request 0: row 0 is the last emitted token, rows 1..N-1 drafts.

    A draft is accepted while it equals the greedy token of the row before and every draft before it was;
    the cache keeps the accepted rows only (lengths roll back; rejected entries are overwritten later).
    row_tokens: int64 [1, N]. returns (greedy int64 [N], accepted int64 0-dim in [0, N-1]) on the device.
    """
    drafts = row_tokens.shape[1] - 1
    greedy = decode_one_step(model, caches, row_tokens, mode, k, indexer, selector, observer)[0].argmax(-1)
    accepted = (greedy[:drafts] == row_tokens[0, 1:]).cumprod(0).sum()
    caches.lengths -= drafts - accepted
    return greedy, accepted


def _oracle_topk(layer, q, keys, seq_lens, k, selector, observer):
    """Scores = attention logits of the new query, max over the query heads; -inf past each row."""
    b, n, hq, d = q.shape
    groups = hq // keys.shape[2]
    logits = torch.einsum("bnhgd,bphd->bnhgp", q.view(b, n, -1, groups, d).to(keys.dtype), keys)
    scores = logits.flatten(2, 3).amax(dim=2).float() * d ** -0.5  # [B, N, P]
    cols = torch.arange(scores.shape[-1], device=q.device)
    scores = torch.where(cols[None, None] < seq_lens[:, :, None], scores, float("-inf")).view(b * n, -1)
    if selector is not None:
        return selector.run_from_scores(layer, scores)
    topk = ops.topk(scores, seq_lens.view(-1), k, validate=False)
    if observer is not None:
        observer(layer, scores, topk, None)
    return topk


def _lightning_topk(indexer, layer, h, rope, slots, caches, seq_lens, k, selector, observer):
    """Write this step's indexer keys (FP8) into the paged cache, then score every cached token (rope: the
    indexer's rotary tables at the step's positions, slots: their cache slots, `_index_slots`)."""
    q_fp8, weights = indexer.layers[layer].decode_inputs(h, rope, caches.index_kv[layer], slots)
    if selector is not None:
        return selector.run(layer, q_fp8, caches.index_kv[layer], weights)
    scores = ops.paged_indexer_logits(q_fp8, caches.index_kv[layer], weights, seq_lens, caches.block_table,
                                      validate=False)
    topk = ops.topk(scores, seq_lens.view(-1), k, validate=False)
    if observer is not None:
        observer(layer, scores, topk, IndexerInputs(q_fp8, caches.index_kv[layer], weights, seq_lens,
                                                    caches.block_table))
    return topk


def _index_slots(caches, requests, pos):
    """int64 [B' * S]: the paged-cache slot of each token at positions pos [B', S] of `requests` [B']."""
    blocks = caches.block_table[requests.long()].long()  # [B', W]
    block = torch.gather(blocks, 1, pos // TOKENS_PER_BLOCK)  # physical block of each token
    return (block * TOKENS_PER_BLOCK + pos % TOKENS_PER_BLOCK).reshape(-1)


def _attend(q, keys, vals, mask):
    """q [B, S, Hq, d]; keys/vals [B, P, Hkv, d]; mask bool broadcastable to [B, Hq, S, P] -> [B, S, Hq, d]."""
    groups = q.shape[2] // keys.shape[2]
    kt = keys.transpose(1, 2).repeat_interleave(groups, dim=1)
    vt = vals.transpose(1, 2).repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, attn_mask=mask)
    return out.transpose(1, 2)


def attend_dense(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Full attention of decode rows: q [B, N, Hq, d]; keys/vals [B, P, Hkv, d]; row (b, j) sees positions
    < seq_lens[b, j] (int32 [B, N]). returns [B, N, Hq, d]. GQA without copying the cache per head."""
    b, n, hq, d = q.shape
    hkv = keys.shape[2]
    qg = q.view(b, n, hkv, hq // hkv, d).to(keys.dtype)
    logits = torch.einsum("bnhgd,bphd->bnhgp", qg, keys).float() * d ** -0.5
    cols = torch.arange(keys.shape[1], device=q.device)
    visible = cols[None, None, :] < seq_lens[:, :, None]  # [B, N, P]
    logits = logits.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(vals.dtype)
    return torch.einsum("bnhgp,bphd->bnhgd", probs, vals).reshape(b, n, hq, d).to(q.dtype)


def attend_topk(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, topk: torch.Tensor,
                validate: bool = False) -> torch.Tensor:
    """Sparse attention of each query row over its selected tokens only (ops.topk_attention: the Triton
    kernel on CUDA, the torch reference elsewhere).

    q: [B, N, Hq, d]; keys/vals: [B, P, Hkv, d]; topk: int32 [B, N, K] positions, -1 = padding (each row
    selects at least its own token, so no row is empty). returns [B, N, Hq, d]. validate: check the positions'
    range (a host sync; the top-k that produced them already bounds them by the row's length).
    """
    return ops.topk_attention(q, keys, vals, topk, validate=validate)


@torch.no_grad()
def generate(model: Llama, prompt: torch.Tensor, max_new_tokens: int, mode: str = "lightning", k: int = 256,
             indexer: Indexer | None = None, selector=None, eos_id: int | None = None,
             observer: Observer | None = None, progress: bool = False) -> torch.Tensor:
    """Greedy decoding of one prompt (int64 [S]) -> generated int64 [<= max_new_tokens] (stops at eos_id).

    A SpinIndexer selector gets a fresh state slot for this prompt, freed at the end. The observer, if
    any, sees (layer, scores, topk) of every decode step (all-keep only).
    """
    check_int("max_new_tokens", max_new_tokens, low=0)
    caches = Caches.allocate(model, 1, prompt.shape[0] + max_new_tokens, indexer if mode == "lightning" else None)
    state = getattr(selector, "state", None)  # a SpinIndexer keeps per-request history in a slot
    slot = state.allocate() if state is not None else None
    if slot is not None:
        caches.slot_ids[0] = slot
    try:
        logits = prefill(model, caches, 0, prompt, indexer)
        out = []
        steps = range(max_new_tokens)
        if progress:
            from tqdm import tqdm
            steps = tqdm(steps, desc=f"decode ({mode})", leave=False)
        for s in steps:
            nxt = logits.argmax(-1).view(1, 1)
            out.append(nxt.view(1))
            if s == max_new_tokens - 1 or (eos_id is not None and int(nxt) == eos_id):
                break
            logits = decode_one_step(model, caches, nxt, mode, k, indexer, selector, observer)[0, -1]
    finally:
        if slot is not None:
            state.free(slot)
    return torch.cat(out) if out else prompt.new_zeros(0)
