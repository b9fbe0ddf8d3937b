"""Block key summaries scored with this step's query: a current-step signal for SPIN's block choice (issue #18,
docs/current_step_selection.md). The torch reference: the semantics a kernel must match.

    summary[b, j, s] = mean over the tokens t of sub-block s of block j of k_scale[t] * k_fp8[t]   (D floats)
    score[b, j]      = max over the rows r of request b and the sub-blocks s of
                       sum_h weights[r, h] * relu(q[r, h] . summary[b, j, s])

A sub-block holds T / parts consecutive tokens; only tokens below the request's longest row count (a partial last
block is summarized over its valid tokens). It is the indexer's score of a sub-block's mean key: 1/(T / parts) of
the logits' work a block. Math in float32 (fp8 inputs are exact in float32).
"""
from __future__ import annotations

import torch

from ..checks import check_int
from ..layout import FP8_DTYPE, cache_views
from .indexer_logits import check_paged_indexer_args, used_block_table


def block_summary_scores_ref(q_fp8: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                             seq_lens: torch.Tensor, block_table: torch.Tensor, parts: int = 4,
                             validate: bool = True) -> torch.Tensor:
    """float32 [B, W]: each logical block's summary score (module docstring); -inf for a block past the
    request's longest row. Shapes as paged_indexer_logits_ref: q_fp8 float8_e4m3fn [B, next_n, H, D], kv_cache
    uint8 [num_blocks, T, 1, D + 4], weights float32 [B*next_n, H], seq_lens int32 [B, next_n], block_table int32
    [B, W]. parts: sub-blocks a block, a divisor of T. raises TypeError/ValueError naming the argument."""
    check_paged_indexer_args(q_fp8, kv_cache, weights, seq_lens, block_table, validate)
    tokens = kv_cache.shape[1]
    check_int("parts", parts, low=1, high=tokens)
    if tokens % parts:
        raise ValueError(f"parts: expected a divisor of the {tokens} tokens a block, got {parts}")
    batch, next_n, heads, dim = q_fp8.shape
    width, size = block_table.shape[1], tokens // parts
    values, scales = cache_views(kv_cache)
    out = torch.full((batch, width), float("-inf"), dtype=torch.float32, device=q_fp8.device)
    if batch == 0 or width == 0:
        return out
    longest = seq_lens.amax(dim=1).long()  # [B]
    safe_table = used_block_table(block_table, seq_lens, tokens)
    position = torch.arange(width * tokens, device=q_fp8.device).view(width, parts, size)
    for b in range(batch):  # one request at a time, as the logits reference
        ids = safe_table[b]
        keys = values.view(torch.uint8)[ids].view(FP8_DTYPE).float().reshape(width, parts, size, dim)
        keys = keys * scales[ids].reshape(width, parts, size, 1)
        valid = position < longest[b]  # [W, parts, size]
        count = valid.sum(dim=2)  # [W, parts]
        means = (keys * valid[..., None]).sum(dim=2) / count.clamp_min(1)[..., None]  # [W, parts, D]
        q = q_fp8[b].float()  # [next_n, H, D]
        w = weights[b * next_n:(b + 1) * next_n]  # [next_n, H]
        # multiply + sum for the head sum, not a matmul (TF32 on CUDA: see paged_indexer_logits_ref)
        per_head = torch.relu(torch.einsum("nhd,wpd->nhwp", q, means))
        scores = (per_head * w[:, :, None, None]).sum(dim=1)  # [next_n, W, parts]
        scores = torch.where(count[None] > 0, scores, float("-inf"))
        out[b] = scores.amax(dim=2).amax(dim=0)
    return out

