"""kv_cache_triton: the FP8 key quantization and the cache write in one launch, bit for bit against the torch
references (kv_cache.quantize_keys / quantize_and_write), on poisoned caches, with padding, strided keys and slots
past the cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import T
from spin_indexer import ops
from spin_indexer.layout import new_kv_cache
from spin_indexer.ops.kv_cache import quantize_and_write as quantize_and_write_ref
from spin_indexer.ops.kv_cache import quantize_keys as quantize_keys_ref

pytest.importorskip("triton")
from spin_indexer.ops.kv_cache_triton import (quantize_and_write_triton, quantize_keys_triton,  # noqa: E402
                                              writes_directly)

pytestmark = pytest.mark.interpreter
SENTINEL = 0xAB  # bytes no write should touch keep this value


def random_keys(rows: int, dim: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Rows of very different magnitudes (each its own scale), some exactly 448 x 2^p (the scale rule's edge)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(rows, dim, generator=gen) * torch.exp2(torch.randint(-20, 10, (rows, 1), generator=gen).float())
    if rows > 1:
        keys[0, 0] = 448.0 * 2.0**-3  # amax exactly 448 x 2^-3
        keys[0, 1:] = keys[0, 1:].clamp(-1e-3, 1e-3)
    if rows > 2:
        keys[1] = 0.0  # amax 0: the floor's scale
    return keys.to(dtype)


def assert_same_fp8(got, want):
    assert torch.equal(got[0].view(torch.uint8).cpu(), want[0].view(torch.uint8))
    assert torch.equal(got[1].cpu(), want[1])


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(0, 40), dim=st.sampled_from([1, 7, 36, 128]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
def test_quantize_keys_bit_exact(seed, rows, dim, dtype):
    keys = random_keys(rows, dim, seed, dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    assert_same_fp8(quantize_keys_triton(keys.to(dev)), quantize_keys_ref(keys))


@pytest.mark.parametrize("amax", [0.0, 1e-30, 1e-9, 1e-4, 1.0001e-4, 448.0, 224.0, 448.0 * 2**-20, 1e6])
def test_quantize_keys_scale_edges(amax, triton_device):
    keys = torch.zeros(2, 8)
    keys[0, 3], keys[1, 6] = amax, -amax
    keys[0, 0] = amax / 3
    assert_same_fp8(quantize_keys_triton(keys.to(triton_device)), quantize_keys_ref(keys))


def test_quantize_keys_strided_input(triton_device):
    """A column-strided view (every other column) quantizes as its contiguous copy."""
    keys = random_keys(9, 64, 5)
    view = keys.to(triton_device)[:, ::2]
    assert not view.is_contiguous()
    assert_same_fp8(quantize_keys_triton(view), quantize_keys_ref(keys[:, ::2].contiguous()))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(0, 50), dim=st.sampled_from([8, 36, 128]),
       pad_frac=st.floats(0, 1), index_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_quantize_and_write_bit_exact_on_a_poisoned_cache(seed, n, dim, pad_frac, index_dtype):
    """Every mapped slot holds the reference's bytes; padding (-1) and every other byte keep the poison."""
    gen = torch.Generator().manual_seed(seed)
    keys = random_keys(n, dim, seed)
    slots = torch.randperm(3 * T, generator=gen)[:n]
    slots = torch.where(torch.rand(n, generator=gen) < pad_frac, -1, slots).to(index_dtype)
    want = torch.full((3, T, 1, dim + 4), SENTINEL, dtype=torch.uint8)
    quantize_and_write_ref(want, keys, slots)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = torch.full((3, T, 1, dim + 4), SENTINEL, dtype=torch.uint8, device=dev)
    quantize_and_write_triton(got, keys.to(dev), slots.to(dev))
    assert torch.equal(got.cpu(), want)


def test_slots_past_the_cache_write_nothing(triton_device):
    """With validate=False a slot past num_blocks x T (or hugely negative) is skipped, never written outside: the
    cache is the first two blocks of a larger buffer whose other blocks keep their poison."""
    keys = random_keys(4, 16, 1).to(triton_device)
    buffer = torch.full((4, T, 1, 20), SENTINEL, dtype=torch.uint8, device=triton_device)
    cache = buffer[:2]
    slots = torch.tensor([2 * T, 3, -(2**40), 2 * T + 5], device=triton_device)
    quantize_and_write_triton(cache, keys, slots)
    want = torch.full((4, T, 1, 20), SENTINEL, dtype=torch.uint8)
    quantize_and_write_ref(want[:2], keys[1:2].cpu(), torch.tensor([3]))
    assert torch.equal(buffer.cpu(), want)


def test_writes_directly_needs_aligned_scales():
    assert writes_directly(new_kv_cache(2, 128)) and writes_directly(new_kv_cache(1, 7))  # T = 64: T x D % 4 == 0
    assert not writes_directly(torch.zeros(2, 3, 1, 9, dtype=torch.uint8))  # T x D = 15 bytes


def test_ops_dispatch_keeps_the_checks():
    """ops.quantize_and_write rejects bad input before any backend runs (and leaves the cache unchanged)."""
    cache = new_kv_cache(1, 8)
    with pytest.raises(ValueError, match="^slot_mapping: expected"):
        ops.quantize_and_write(cache, torch.ones(3, 8), torch.tensor([0, 1, T]))
    with pytest.raises(ValueError, match="^keys: expected finite"):
        ops.quantize_and_write(cache, torch.tensor([[float("nan")] * 8]), torch.tensor([0]))
    assert not cache.any()
    assert np.array_equal(ops.quantize_keys(torch.ones(2, 8))[1].numpy(), [2.0**-8] * 2)
