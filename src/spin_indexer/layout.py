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

Pages may be padded: DeepSeek-V4's indexer cache in vLLM puts its 64 x 132 = 8448-byte pages 8640
(fp8_ds_mla) or 8704 bytes apart. The paged ops read a view whose block stride (stride(0)) is the page
size or any multiple of 16 bytes above it (the Triton kernel's TMA loads need 16-byte strides), with the
T * (D + 4) bytes of each page contiguous; the padding is never read (`page_stride_bytes`).
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
PAGE_ALIGN_BYTES = 16  # a padded page stride must be a multiple of this (TMA strides are 16-byte multiples)


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """D of a cache shaped [num_blocks, T, 1, D + 4]."""
    return kv_cache.shape[-1] - SCALE_BYTES


def page_stride_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes from one page of the cache to the next; raises ValueError naming kv_cache when the layout is not
    one the paged ops read.

    kv_cache: uint8 [num_blocks, T, 1, D + 4] (shape checked by the caller) whose T * (D + 4) bytes per page
    are contiguous (strides [P, D + 4, *, 1]) and whose page stride P = stride(0) is T * (D + 4) (contiguous
    pages) or a multiple of 16 bytes above it (padded pages: V4's P = 8640 or 8704 for 8448 bytes).
    With one block the stride is meaningless and the page size is returned.
    """
    num_blocks, tokens, _, row = kv_cache.shape
    page = tokens * row
    if (row > 1 and kv_cache.stride(3) != 1) or (tokens > 1 and kv_cache.stride(1) != row):
        raise ValueError(f"kv_cache: expected each page's T * (D + 4) = {page} bytes contiguous (strides "
                         f"[P, {row}, *, 1]), got strides {list(kv_cache.stride())}")
    if num_blocks <= 1:
        return page
    stride = kv_cache.stride(0)
    if stride != page and (stride < page or stride % PAGE_ALIGN_BYTES):
        raise ValueError(f"kv_cache: expected a page stride (stride(0)) of {page} bytes or a multiple of "
                         f"{PAGE_ALIGN_BYTES} bytes above it, got {stride}")
    return stride


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed views of the cache bytes, sharing its memory (no copy); page padding is not part of them.

    kv_cache: uint8 [num_blocks, T, 1, D + 4], contiguous or with padded pages (see page_stride_bytes).
    returns (values fp8 e4m3 [num_blocks, T, D], scales float32 [num_blocks, T]).
    """
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, shape=(None, None, 1, None),
                 shape_names="[num_blocks, T, 1, D + 4]")
    num_blocks, tokens, _, row_bytes = kv_cache.shape
    if row_bytes <= SCALE_BYTES:
        raise ValueError(f"kv_cache: expected shape [num_blocks, T, 1, D + 4] with D >= 1, got {list(kv_cache.shape)}")
    stride = page_stride_bytes(kv_cache)
    dim = row_bytes - SCALE_BYTES
    # one page = T*D value bytes, then T*4 scale bytes; pages `stride` bytes apart
    values = torch.as_strided(kv_cache, (num_blocks, tokens, dim), (stride, dim, 1)).view(FP8_DTYPE)
    scale_bytes = torch.as_strided(kv_cache, (num_blocks, tokens * SCALE_BYTES), (stride, 1),
                                   kv_cache.storage_offset() + tokens * dim)
    return values, scale_bytes.view(torch.float32)  # [num_blocks, T]


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
