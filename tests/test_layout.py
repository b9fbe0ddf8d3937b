"""Engine constants, cache views (byte offsets, shared memory), the cache constructor and block counts."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from conftest import random_cache, split_cache_bytes
from spin_indexer import layout
from spin_indexer.layout import cache_views, head_dim_of, new_kv_cache, num_blocks_for


def test_engine_constants():
    assert (layout.TOKENS_PER_BLOCK, layout.HEAD_DIM, layout.NUM_HEADS) == (64, 128, 64)
    assert layout.BYTES_PER_TOKEN == 132 and layout.FP8_MAX == 448.0 and layout.SCALE_FLOOR == 1e-4
    assert layout.FP8_DTYPE == torch.float8_e4m3fn
    assert torch.finfo(layout.FP8_DTYPE).max == layout.FP8_MAX
    assert new_kv_cache(1).numel() == 64 * 132 == 8448  # one block


def test_cache_views_match_the_byte_offsets():
    cache = random_cache(3, 128, torch.Generator().manual_seed(0))
    values, scales = cache_views(cache)
    assert values.shape == (3, 64, 128) and values.dtype == torch.float8_e4m3fn
    assert scales.shape == (3, 64) and scales.dtype == torch.float32
    raw = cache.numpy().reshape(-1)
    block, token = 2, 37
    start = block * 8448 + token * 128
    assert bytes(values[block, token].view(torch.uint8).numpy()) == bytes(raw[start:start + 128])
    start = block * 8448 + 8192 + token * 4
    assert struct.unpack("<f", bytes(raw[start:start + 4]))[0] == scales[block, token].item()
    want_values, want_scales = split_cache_bytes(cache)
    np.testing.assert_array_equal(values.view(torch.uint8).numpy(), want_values)
    np.testing.assert_array_equal(scales.numpy(), want_scales)


def test_cache_views_share_memory():
    cache = new_kv_cache(2, 16)
    values, scales = cache_views(cache)
    scales[1, 3] = 0.5
    values[0, 0, 5] = 2.0
    raw = cache.numpy().reshape(2, -1)
    assert struct.unpack("<f", bytes(raw[1, 64 * 16 + 12: 64 * 16 + 16]))[0] == 0.5
    assert raw[0, 5] == 0x40  # 2.0 in e4m3: exponent 8 (bias 7), mantissa 0
    assert int(raw.astype(np.int64).sum()) == 0x40 + sum(struct.pack("<f", 0.5))


def test_new_kv_cache_and_head_dim():
    cache = new_kv_cache(3, head_dim=32, tokens_per_block=16, device="meta")
    assert cache.shape == (3, 16, 1, 36) and cache.dtype == torch.uint8 and cache.device.type == "meta"
    assert head_dim_of(cache) == 32
    assert new_kv_cache(np.int64(2)).shape == (2, 64, 1, 132)  # numpy counts are fine
    assert new_kv_cache(0).shape == (0, 64, 1, 132)


@pytest.mark.parametrize("tokens,want", [(0, 0), (1, 1), (63, 1), (64, 1), (65, 2), (128, 2), (16384, 256)])
def test_num_blocks_for(tokens, want):
    assert num_blocks_for(tokens) == want


@pytest.mark.parametrize("call,exc,match", [
    (lambda: new_kv_cache(-1), ValueError, "^num_blocks: expected 0 <= num_blocks, got -1"),
    (lambda: new_kv_cache(2.0), TypeError, "^num_blocks: expected an int"),
    (lambda: new_kv_cache(2, head_dim=0), ValueError, "^head_dim: expected 1 <= head_dim"),
    (lambda: new_kv_cache(2, tokens_per_block=0), ValueError, "^tokens_per_block: expected"),
    (lambda: num_blocks_for(-5), ValueError, "^num_tokens: expected 0 <= num_tokens"),
    (lambda: num_blocks_for(5, 0), ValueError, "^tokens_per_block: expected"),
    (lambda: num_blocks_for(True), TypeError, "^num_tokens: expected an int"),
    (lambda: cache_views(torch.zeros(2, 64, 1, 132)), TypeError, "^kv_cache: expected dtype torch.uint8"),
    (lambda: cache_views(torch.zeros(2, 64, 132, dtype=torch.uint8)), ValueError, "^kv_cache: expected 4 dim"),
    (lambda: cache_views(torch.zeros(2, 64, 2, 132, dtype=torch.uint8)), ValueError, "^kv_cache: expected shape"),
    (lambda: cache_views(torch.zeros(2, 64, 1, 3, dtype=torch.uint8)), ValueError, "^kv_cache: expected shape"),
    (lambda: cache_views(torch.zeros(64, 2, 1, 132, dtype=torch.uint8).transpose(0, 1)), ValueError,
     "^kv_cache: expected each page.s .* contiguous"),
])
def test_errors_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
