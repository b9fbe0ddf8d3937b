"""Block key summaries scored with this step's query: a current-step signal for SPIN's block choice (issue #18,
docs/current_step_selection.md). The torch references: the semantics the kernels must match.

    summary[b, j, s] = mean over the tokens t of sub-block s of block j of k_scale[t] * k_fp8[t]   (D floats)
    score[b, j]      = max over the rows r of request b and the sub-blocks s of
                       sum_h weights[r, h] * relu(q[r, h] . summary[b, j, s])

A sub-block holds T / S consecutive tokens (S = parts). It is the indexer's score of a sub-block's mean key:
1/(T / S) of the logits' work a block. Math in float32 (fp8 inputs are exact in float32).

Two forms:
- block_summary_scores_ref computes the means from the keys every call (only tokens below the request's longest
  row count, so a partial last block is summarized over its valid tokens): what traces record, and the
  evaluation reference; it reads every key, as many bytes as the logits.
- the summary cache: the means of full blocks, stored once per physical block when the block fills, in the key
  cache's own layout with S rows a page (uint8 [num_blocks, S, 1, D + 4]: S x D fp8 values, then S fp32 scales;
  each row quantized as a key is, ops.quantize_keys). write_block_summaries_ref fills it, paged_summary_scores_ref
  scores it (update_and_score_summaries_ref: both, the decode step's form): S x 132 B a block instead of 64 x 132.
  Shared prefix blocks share their summaries (they are a property of the block's keys); a block not yet written
  scores -inf (the caller keeps such blocks anyway).
"""
from __future__ import annotations

import torch

from ..checks import check_int, check_tensor, check_values_in_range
from ..layout import FP8_DTYPE, SCALE_BYTES, cache_views
from .indexer_logits import check_paged_indexer_args, used_block_table
from .kv_cache import quantize_keys, write_kv_cache


def block_summary_scores_ref(q_fp8: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                             seq_lens: torch.Tensor, block_table: torch.Tensor, parts: int = 4,
                             validate: bool = True) -> torch.Tensor:
    """float32 [B, W]: each logical block's summary score (module docstring); -inf for a block past the
    request's longest row. Shapes as paged_indexer_logits_ref: q_fp8 float8_e4m3fn [B, next_n, H, D], kv_cache
    uint8 [num_blocks, T, 1, D + 4], weights float32 [B*next_n, H], seq_lens int32 [B, next_n], block_table int32
    [B, W]. parts: sub-blocks a block, a divisor of T. raises TypeError/ValueError naming the argument."""
    return block_summary_scores_many_ref(q_fp8, kv_cache, weights, seq_lens, block_table, (parts,), validate)[0]


def block_summary_scores_many_ref(q_fp8: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                                  seq_lens: torch.Tensor, block_table: torch.Tensor, parts: tuple[int, ...],
                                  validate: bool = True) -> torch.Tensor:
    """float32 [P, B, W]: block_summary_scores_ref at each sub-block count of `parts` (P of them), the keys
    dequantized once for all (trace capture records several)."""
    check_paged_indexer_args(q_fp8, kv_cache, weights, seq_lens, block_table, validate)
    tokens = kv_cache.shape[1]
    for s in parts:
        check_int("parts", s, low=1, high=tokens)
        if tokens % s:
            raise ValueError(f"parts: expected a divisor of the {tokens} tokens a block, got {s}")
    batch, next_n, heads, dim = q_fp8.shape
    width = block_table.shape[1]
    values, scales = cache_views(kv_cache)
    out = torch.full((len(parts), batch, width), float("-inf"), dtype=torch.float32, device=q_fp8.device)
    if batch == 0 or width == 0:
        return out
    longest = seq_lens.amax(dim=1).long()  # [B]
    safe_table = used_block_table(block_table, seq_lens, tokens)
    position = torch.arange(width * tokens, device=q_fp8.device)
    for b in range(batch):  # one request at a time, as the logits reference
        ids = safe_table[b]
        keys = values.view(torch.uint8)[ids].view(FP8_DTYPE).float() * scales[ids][..., None]  # [W, T, D]
        valid = (position < longest[b]).view(width, tokens)
        q = q_fp8[b].float()  # [next_n, H, D]
        w = weights[b * next_n:(b + 1) * next_n]  # [next_n, H]
        for i, s in enumerate(parts):
            size = tokens // s
            ok = valid.view(width, s, size)
            count = ok.sum(dim=2)  # [W, S]
            means = (keys.view(width, s, size, dim) * ok[..., None]).sum(dim=2) / count.clamp_min(1)[..., None]
            # multiply + sum for the head sum, not a matmul (TF32 on CUDA: see paged_indexer_logits_ref)
            per_head = torch.relu(torch.einsum("nhd,wpd->nhwp", q, means))
            scores = (per_head * w[:, :, None, None]).sum(dim=1)  # [next_n, W, S]
            scores = torch.where(count[None] > 0, scores, float("-inf"))
            out[i, b] = scores.amax(dim=2).amax(dim=0)
    return out


def check_summary_cache(summaries: torch.Tensor, kv_cache: torch.Tensor) -> int:
    """S of a summary cache that fits kv_cache: uint8 [P, S, 1, D + 4] with P >= the cache's num_blocks (a row per
    physical block id), the cache's D, S a divisor of the cache's T; raises TypeError/ValueError naming
    `summaries` otherwise."""
    num_blocks, tokens, _, row = kv_cache.shape
    check_tensor("summaries", summaries, dtype=torch.uint8, ndim=4, device=kv_cache.device, device_of="kv_cache",
                 contiguous=True)
    parts = summaries.shape[1]
    if summaries.shape[0] < num_blocks or summaries.shape[2:] != (1, row) or parts < 1 or tokens % parts:
        raise ValueError(f"summaries: expected shape [>= {num_blocks}, S, 1, {row}] (a row per kv_cache block, its row "
                         f"bytes, S dividing its {tokens} tokens a block), got {list(summaries.shape)}")
    return parts


def check_block_ranges(first: torch.Tensor, stop: torch.Tensor, block_table: torch.Tensor, num_blocks: int,
                       validate: bool) -> None:
    """first / stop int32 [B] on block_table's device; with validate (a host sync), 0 <= first, stop <= W and every
    table entry in [first, stop) a block id below num_blocks."""
    batch, width = block_table.shape
    for name, t in (("first", first), ("stop", stop)):
        check_tensor(name, t, dtype=torch.int32, shape=(batch,), shape_names="[B]", device=block_table.device,
                     device_of="block_table")
    if validate and batch:
        check_values_in_range("first", first, 0, width, "logical blocks")
        check_values_in_range("stop", stop, 0, width, "logical blocks")
        cols = torch.arange(width, device=block_table.device)[None, :]
        written = (cols >= first[:, None]) & (cols < stop[:, None])
        check_values_in_range("block_table", torch.where(written, block_table, 0), 0, num_blocks - 1,
                              "block ids (of the blocks written)")


def check_write_args(kv_cache, summaries, block_table, first, stop, validate: bool, contiguous: bool = False) -> int:
    """write_block_summaries' arguments (its docstring has the shapes; contiguous: the cache's pages too, as
    the Triton twin reads them); returns S. Raises TypeError / ValueError naming the argument."""
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, ndim=4, contiguous=contiguous)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=kv_cache.device, device_of="kv_cache")
    parts = check_summary_cache(summaries, kv_cache)
    check_block_ranges(first, stop, block_table, kv_cache.shape[0], validate)
    return parts


def write_block_summaries_ref(kv_cache: torch.Tensor, summaries: torch.Tensor, block_table: torch.Tensor,
                              first: torch.Tensor, stop: torch.Tensor, validate: bool = True) -> None:
    """Write the summaries of logical blocks first[b] <= j < stop[b] of each request b (module docstring): for
    every such block, its S sub-block mean keys, quantized as keys are, into summaries[block_table[b, j]].

    kv_cache: uint8 [num_blocks, T, 1, D + 4]; summaries: uint8 [>= num_blocks, S, 1, D + 4] (check_summary_cache);
    block_table: int32 [B, W]; first, stop: int32 [B]. The blocks must be full (all T keys written): the caller
    passes stop <= (committed tokens) // T. validate: check the ranges and the written ids (a host sync); without
    it an out-of-range id is clamped into the cache (a wrong block, never a read or write outside it).
    """
    parts = check_write_args(kv_cache, summaries, block_table, first, stop, validate)
    num_blocks, tokens = kv_cache.shape[:2]
    if block_table.numel() == 0 or num_blocks == 0:
        return
    width = block_table.shape[1]
    cols = torch.arange(width, device=kv_cache.device)[None, :]
    written = (cols >= first[:, None].long()) & (cols < stop[:, None].long())  # [B, W]
    ids = block_table.long().clamp(0, num_blocks - 1)[written]  # [n] (a host sync: the reference)
    if ids.numel() == 0:
        return
    values, scales = cache_views(kv_cache)
    keys = values[ids].float() * scales[ids][..., None]  # [n, T, D]
    means = keys.view(ids.numel(), parts, tokens // parts, -1).mean(dim=2)  # [n, S, D]
    k_fp8, k_scale = quantize_keys(means.reshape(-1, means.shape[-1]))
    slots = (ids[:, None] * parts + torch.arange(parts, device=ids.device)[None, :]).reshape(-1)
    write_kv_cache(summaries, k_fp8, k_scale, slots, validate=False)


def check_summary_score_args(q_fp8, summaries, weights, block_table, num_summarized, validate: bool,
                             out: torch.Tensor | None = None) -> None:
    """paged_summary_scores' arguments (its docstring has the shapes; out: None or float32 [B, W] with contiguous
    rows, e.g. the leading columns of a wider buffer); with validate, the block ids below num_summarized (a host
    sync). Raises TypeError / ValueError naming the argument."""
    check_tensor("q_fp8", q_fp8, dtype=FP8_DTYPE, ndim=4)
    batch, next_n, heads, dim = q_fp8.shape
    check_tensor("summaries", summaries, dtype=torch.uint8, shape=(None, None, 1, dim + SCALE_BYTES),
                 shape_names="[num_blocks, S, 1, D + 4]", device=q_fp8.device, device_of="q_fp8", contiguous=True)
    check_tensor("weights", weights, dtype=torch.float32, shape=(batch * next_n, heads), shape_names="[B*next_n, H]",
                 device=q_fp8.device, device_of="q_fp8")
    check_tensor("block_table", block_table, dtype=torch.int32, shape=(batch, None), shape_names="[B, W]",
                 device=q_fp8.device, device_of="q_fp8")
    check_tensor("num_summarized", num_summarized, dtype=torch.int32, shape=(batch,), shape_names="[B]",
                 device=q_fp8.device, device_of="q_fp8")
    width = block_table.shape[1]
    if out is not None:
        check_tensor("out", out, dtype=torch.float32, shape=(batch, width), shape_names="[B, W]", device=q_fp8.device,
                     device_of="q_fp8")
        if width and out.stride(1) != 1:  # rows may be a wider buffer's leading columns, each row contiguous
            raise ValueError(f"out: expected contiguous rows (stride 1 along W), got strides {out.stride()}")
    if validate and batch and width:
        live = torch.arange(width, device=q_fp8.device)[None, :] < num_summarized[:, None].long()
        check_values_in_range("block_table", torch.where(live, block_table, 0), 0, summaries.shape[0] - 1,
                              "block ids (of the summarized blocks)")


def paged_summary_scores_ref(q_fp8: torch.Tensor, summaries: torch.Tensor, weights: torch.Tensor,
                             block_table: torch.Tensor, num_summarized: torch.Tensor,
                             validate: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [B, W]: score[b, j] = max over the rows r and sub-blocks s of sum_h weights[r, h] *
    relu(q[b, r, h] . summary[block_table[b, j], s]) for j < num_summarized[b] (blocks whose summaries were
    written), -inf for the others.

    q_fp8: float8_e4m3fn [B, next_n, H, D]; summaries: uint8 [num_blocks, S, 1, D + 4]; weights: float32
    [B*next_n, H]; block_table: int32 [B, W]; num_summarized: int32 [B] (values past W read as W, below 0 as
    0). validate: the table's entries below num_summarized are block ids (a host sync); without it they are
    clamped into the cache. out: optional float32 [B, W], written in place (every entry) and returned.
    """
    check_summary_score_args(q_fp8, summaries, weights, block_table, num_summarized, validate, out)
    batch, next_n, heads, _ = q_fp8.shape
    num_blocks, width = summaries.shape[0], block_table.shape[1]
    live = torch.arange(width, device=q_fp8.device)[None, :] < num_summarized[:, None].long()  # [B, W]
    if out is None:
        out = torch.empty((batch, width), dtype=torch.float32, device=q_fp8.device)
    out.fill_(float("-inf"))
    if batch == 0 or width == 0 or num_blocks == 0:
        return out
    values, scales = cache_views(summaries)
    ids = block_table.long().clamp(0, num_blocks - 1)  # [B, W]
    means = values[ids].float() * scales[ids][..., None]  # [B, W, S, D]
    q = q_fp8.float()  # [B, N, H, D]
    per_head = torch.relu(torch.einsum("bnhd,bwsd->bnhws", q, means))
    scores = (per_head * weights.view(batch, next_n, heads, 1, 1)).sum(dim=2)  # [B, N, W, S]
    return out.copy_(torch.where(live, scores.amax(dim=3).amax(dim=1), out))


def update_and_score_summaries_ref(q_fp8: torch.Tensor, kv_cache: torch.Tensor, summaries: torch.Tensor,
                                   weights: torch.Tensor, block_table: torch.Tensor, first: torch.Tensor,
                                   stop: torch.Tensor, validate: bool = True,
                                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The decode step's use of the cache: write_block_summaries_ref of blocks [first[b], stop[b]), then
    paged_summary_scores_ref of every block below stop[b] (float32 [B, W], into `out` when given). Shapes as the
    two; both checks run before anything is written."""
    check_write_args(kv_cache, summaries, block_table, first, stop, validate)
    check_summary_score_args(q_fp8, summaries, weights, block_table, stop, validate, out)
    write_block_summaries_ref(kv_cache, summaries, block_table, first, stop, validate=False)
    return paged_summary_scores_ref(q_fp8, summaries, weights, block_table, stop, validate=False, out=out)
