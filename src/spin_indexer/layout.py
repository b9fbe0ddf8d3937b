"""Engine constants, the dims glossary, and views of the paged indexer-key cache.

Dims glossary (used in every docstring and shape comment of the package):
    B  requests in the batch            N  next_n query rows per request (1 + draft tokens)
    R  rows = B * N                     H  indexer heads (64 on DeepSeek-V3.2)
    D  head dim (128)                   W  block-table width (max blocks per request)
    T  tokens per block (64)            M  kept blocks per request (SPIN budget)
    K  top-k                            C  logits columns (W * T, or M * T when compacted)

The cache is the one vLLM, SGLang and DeepGEMM use: uint8 [num_blocks, T, 1, D + 4]. Inside one block
the bytes are *not* interleaved per token: first T x D fp8 e4m3 values (token-major), then T fp32
scales. Engines view the block as [T, 1, D + 4] only to size it.
"""
from __future__ import annotations

import numbers

import torch

from .checks import allocation_error, check_device, check_int, check_tensor

TOKENS_PER_BLOCK = 64  # T: tokens per KV page
HEAD_DIM = 128  # D
NUM_HEADS = 64  # H
SCALE_BYTES = 4  # one fp32 scale per token
BYTES_PER_TOKEN = HEAD_DIM + SCALE_BYTES  # 132
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_FLOOR = 1e-4  # amax floor before dividing by FP8_MAX


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """D of a cache shaped [num_blocks, T, 1, D + 4]."""
    return kv_cache.shape[-1] - SCALE_BYTES


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed views of the cache bytes, sharing its memory (no copy).

    kv_cache: uint8 [num_blocks, T, 1, D + 4], contiguous.
    returns (values fp8 e4m3 [num_blocks, T, D], scales float32 [num_blocks, T]).
    """
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, shape=(None, None, 1, None),
                 shape_names="[num_blocks, T, 1, D + 4]", contiguous=True)
    num_blocks, tokens, _, row_bytes = kv_cache.shape
    if row_bytes <= SCALE_BYTES:
        raise ValueError(f"kv_cache: expected shape [num_blocks, T, 1, D + 4] with D >= 1, got {list(kv_cache.shape)}")
    dim = row_bytes - SCALE_BYTES
    flat = kv_cache.view(num_blocks, tokens * row_bytes)  # one block = T*D value bytes, then T*4 scale bytes
    values = flat[:, : tokens * dim].view(FP8_DTYPE).view(num_blocks, tokens, dim)
    scales = flat[:, tokens * dim :].view(torch.float32)  # [num_blocks, T]
    return values, scales


def new_kv_cache(num_blocks: int, head_dim: int = HEAD_DIM, device: torch.device | str = "cpu",
                 tokens_per_block: int = TOKENS_PER_BLOCK) -> torch.Tensor:
    """An all-zero cache uint8 [num_blocks, T, 1, D + 4] on `device`."""
    num_blocks = _count("num_blocks", num_blocks, 0)
    head_dim = _count("head_dim", head_dim, 1)
    tokens_per_block = _count("tokens_per_block", tokens_per_block, 1)
    device = check_device("device", device)
    try:
        return torch.zeros(num_blocks, tokens_per_block, 1, head_dim + SCALE_BYTES, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        need = num_blocks * tokens_per_block * (head_dim + SCALE_BYTES)
        raise allocation_error("new_kv_cache", need, device, f"num_blocks={num_blocks}, head_dim={head_dim}, "
                               f"tokens_per_block={tokens_per_block}") from exc


def num_blocks_for(num_tokens: int, tokens_per_block: int = TOKENS_PER_BLOCK) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceil division)."""
    num_tokens = _count("num_tokens", num_tokens, 0)
    tokens_per_block = _count("tokens_per_block", tokens_per_block, 1)
    return -(-num_tokens // tokens_per_block)


def _count(name: str, value, low: int) -> int:
    """A count as a Python int: numpy integers are accepted, floats and bools are not."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    return check_int(name, value, low=low)
