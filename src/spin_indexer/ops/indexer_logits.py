"""Paged lightning-indexer logits: the torch reference, ground truth for every kernel.

    logits[r, p] = k_scale[p] * sum_h weights[r, h] * relu(q[r, h] . k_fp8[p])

for row r = b * next_n + j and request-local logical position p < seq_lens[b, j]; other columns are
-inf. The per-token scale is applied after the ReLU and the head sum (valid because it is positive),
as the engines' kernels do. Math in float32 (fp8 inputs are exact in float32).
"""
from __future__ import annotations

import torch

from ..checks import check_int, check_tensor, check_values_in_range
from ..layout import FP8_DTYPE, SCALE_BYTES, cache_views, page_stride_bytes


def check_paged_indexer_args(q_fp8, kv_cache, weights, seq_lens, block_table, validate: bool = True) -> None:
    """Validation shared by the reference and its Triton twin (shapes in the docstring below)."""
    check_tensor("q_fp8", q_fp8, dtype=FP8_DTYPE, ndim=4)
    batch, next_n, heads, dim = q_fp8.shape
    if next_n < 1:  # an empty row dim would make every per-request max below meaningless
        raise ValueError(f"q_fp8: expected shape [B, next_n, H, D] with next_n >= 1, got {list(q_fp8.shape)}")
    dev = q_fp8.device
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, shape=(None, None, 1, dim + SCALE_BYTES),
                 shape_names="[num_blocks, T, 1, D + 4]", device=dev, device_of="q_fp8")
    if kv_cache.shape[1] < 1:
        raise ValueError(f"kv_cache: expected T >= 1 tokens per block, got shape {list(kv_cache.shape)}")
    page_stride_bytes(kv_cache)  # contiguous pages, or padded ones (DeepSeek-V4) read without their padding
    check_tensor("weights", weights, dtype=torch.float32, shape=(batch * next_n, heads),
                 shape_names="[B*next_n, H]", device=dev, device_of="q_fp8")
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(batch, next_n), shape_names="[B, next_n]",
                 device=dev, device_of="q_fp8")
    check_tensor("block_table", block_table, dtype=torch.int32, shape=(batch, None), shape_names="[B, W]",
                 device=dev, device_of="q_fp8")
    if validate:
        if weights.numel() and not bool(torch.isfinite(weights).all()):
            raise ValueError("weights: expected finite values, got NaN or inf")
        nan_bytes = q_fp8.view(torch.uint8) & 0x7F
        if q_fp8.numel() and bool((nan_bytes == 0x7F).any()):
            raise ValueError("q_fp8: expected finite values, got NaN bytes (0x7F / 0xFF)")
        tokens = kv_cache.shape[1]
        width = block_table.shape[1]
        check_values_in_range("seq_lens", seq_lens, 0, width * tokens, "lengths (at most W*T)")
        if batch > 0:
            check_values_in_range("block_table", used_block_table(block_table, seq_lens, tokens), 0,
                                   kv_cache.shape[0] - 1, "block ids of used blocks")


def used_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor, tokens: int) -> torch.Tensor:
    """int64 [B, W]: block_table with the entries past each request's last used block (below its longest row)
    set to 0, so that a reference reading every entry never reads outside the cache."""
    used = (seq_lens.amax(dim=1).long() + tokens - 1) // tokens if seq_lens.shape[0] else seq_lens.new_zeros(0)
    in_use = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < used[:, None]
    return torch.where(in_use, block_table, torch.zeros_like(block_table)).long()


def paged_indexer_logits_ref(q_fp8: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                             seq_lens: torch.Tensor, block_table: torch.Tensor,
                             validate: bool = True) -> torch.Tensor:
    """Dense indexer logits over a paged cache (full or compacted block table).

    q_fp8: float8_e4m3fn [B, next_n, H, D]; kv_cache: uint8 [num_blocks, T, 1, D + 4], pages contiguous
    or padded (stride(0) a multiple of 16 bytes >= T * (D + 4), layout.page_stride_bytes);
    weights: float32 [B*next_n, H] (q scale and softmax scales folded in);
    seq_lens: int32 [B, next_n], row lengths in [0, W*T]; block_table: int32 [B, W].
    returns float32 [B*next_n, W*T]; column c of row (b, j) scores logical position c of request b,
    -inf where c >= seq_lens[b, j]. Entries of block_table past a request's last used block are ignored.
    raises TypeError/ValueError naming the argument.
    """
    check_paged_indexer_args(q_fp8, kv_cache, weights, seq_lens, block_table, validate)
    batch, next_n, heads, dim = q_fp8.shape
    tokens, width = kv_cache.shape[1], block_table.shape[1]
    values, scales = cache_views(kv_cache)
    out = torch.full((batch * next_n, width * tokens), float("-inf"), dtype=torch.float32, device=q_fp8.device)
    safe_table = used_block_table(block_table, seq_lens, tokens)
    cols = torch.arange(width * tokens, device=q_fp8.device)
    for b in range(batch):  # one request at a time keeps memory at [next_n, H, W*T]
        ids = safe_table[b]
        keys = values.view(torch.uint8)[ids].view(FP8_DTYPE).float().reshape(width * tokens, dim)  # [W*T, D]
        k_scale = scales[ids].reshape(width * tokens)
        q = q_fp8[b].float()  # [next_n, H, D]
        per_head = torch.relu(torch.einsum("nhd,cd->nhc", q, keys))  # [next_n, H, W*T]
        w = weights[b * next_n:(b + 1) * next_n]  # [next_n, H]
        # Head sum as multiply + sum, not a matmul: CUDA may run fp32 matmuls in TF32, exact for the FP8
        # operands above but not for these float32 products (the H200 test run failed by 3e-5 relative).
        rows = (per_head * w[:, :, None]).sum(dim=1) * k_scale[None, :]
        valid = cols[None, :] < seq_lens[b].long()[:, None]
        out[b * next_n:(b + 1) * next_n] = torch.where(valid, rows, float("-inf"))
    return out


def block_max_ref(logits: torch.Tensor, tokens_per_block: int = 64) -> torch.Tensor:
    """Max of the logits over each block of `tokens_per_block` columns.

    logits: float32 [R, C] (masked columns are -inf). returns float32 [R, ceil(C / T)]; -inf for a block
    with no valid column. SPIN's state update and the top-k pruning bound both use it.
    """
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    check_int("tokens_per_block", tokens_per_block, low=1)
    rows, cols = logits.shape
    nblk = -(-cols // tokens_per_block)
    pad = nblk * tokens_per_block - cols
    if pad:
        logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    return logits.view(rows, nblk, tokens_per_block).amax(dim=-1)
