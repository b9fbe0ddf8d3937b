"""FP8 key cache: byte layout against hand-built blocks, the power-of-two scale rule, the slot mapping
(padding skipped), read/dequantize, and every validation error."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from conftest import E4M3FN, T, dequantize_f64, fp8_bytes, random_cache, random_fp8, split_cache_bytes
from spin_indexer.layout import new_kv_cache
from spin_indexer.ops import (dequantize_blocks, quantize_and_write, quantize_keys, read_kv_cache,
                              write_kv_cache)

SENTINEL = 0xAB  # bytes no write should touch keep this value
FINITE_FP8 = [b for b in range(256) if b not in (0x7F, 0xFF)]


def sentinel_cache(num_blocks: int, dim: int) -> torch.Tensor:
    return torch.full((num_blocks, T, 1, dim + 4), SENTINEL, dtype=torch.uint8)


def exact_tokens(n: int, dim: int, rng: np.random.Generator):
    """Keys that quantize exactly: random finite fp8 bytes with one +-448 per token, times 2^e.

    returns (keys float32 [n, D], value bytes uint8 [n, D], scales float32 [n]): amax = 448 * 2^e, so the
    scale rule gives exactly 2^e and keys / 2^e are exactly the fp8 values.
    """
    value_bytes = rng.choice(FINITE_FP8, size=(n, dim)).astype(np.uint8)
    value_bytes[np.arange(n), rng.integers(0, dim, n)] = rng.choice([0x7E, 0xFE], n)  # +-448
    scales = np.ldexp(1.0, rng.integers(-20, 5, n)).astype(np.float32)
    keys = (E4M3FN[value_bytes] * scales[:, None]).astype(np.float32)
    return torch.from_numpy(keys), value_bytes, scales


def expected_scale(amax: float) -> float:
    """Smallest power of two >= fp32(max(amax, 1e-4)) / 448, the division in fp32 as the engines do it."""
    ratio = float(np.float32(max(np.float32(amax), np.float32(1e-4))) / np.float32(448.0))
    mant, exp = math.frexp(ratio)  # ratio = mant * 2^exp, mant in [0.5, 1)
    return math.ldexp(1.0, exp - 1) if mant == 0.5 else math.ldexp(1.0, exp)


# ------------------------------------------------------------------------------------------ byte layout
def test_worked_example_offsets():
    """layout docstring: token 3 of block 7 has its values at 7*8448 + 3*128 and its scale at
    7*8448 + 8192 + 3*4."""
    cache = sentinel_cache(9, 128)
    keys = torch.zeros(1, 128)
    keys[0, 5] = 448.0 * 2.0**-3  # value byte 0x7E at column 5, scale 2^-3
    quantize_and_write(cache, keys, torch.tensor([7 * T + 3]))
    raw = cache.numpy().reshape(-1)
    base = 7 * 8448
    assert raw[base + 3 * 128 + 5] == 0x7E
    assert bytes(raw[base + 3 * 128: base + 3 * 128 + 5]) == b"\x00" * 5
    assert bytes(raw[base + 8192 + 12: base + 8192 + 16]) == struct.pack("<f", 2.0**-3)
    touched = np.zeros_like(raw, dtype=bool)
    touched[base + 3 * 128: base + 4 * 128] = True
    touched[base + 8192 + 12: base + 8192 + 16] = True
    assert (raw[~touched] == SENTINEL).all(), "bytes outside token 3 of block 7 changed"


@pytest.mark.parametrize("dim", [128, 16])
def test_round_trip_byte_exact_against_hand_built_block(dim):
    rng = np.random.default_rng(dim)
    keys, value_bytes, scales = exact_tokens(T, dim, rng)
    # Hand-built block: T*D fp8 bytes token-major, then T fp32 scales, written with struct.
    block = bytes(value_bytes.reshape(-1)) + b"".join(struct.pack("<f", float(s)) for s in scales)
    assert len(block) == T * (dim + 4)

    cache = sentinel_cache(3, dim)
    order = torch.from_numpy(rng.permutation(T))  # write the tokens in a random order
    quantize_and_write(cache, keys[order], 1 * T + order)
    raw = cache.numpy().reshape(3, -1)
    assert bytes(raw[1]) == block
    assert (raw[[0, 2]] == SENTINEL).all()

    k_fp8, k_scale = read_kv_cache(cache, torch.tensor([1], dtype=torch.int32))
    assert k_fp8.dtype == torch.float8_e4m3fn and k_fp8.shape == (1, T, dim)
    assert (fp8_bytes(k_fp8)[0] == value_bytes).all()
    assert k_scale.dtype == torch.float32 and (k_scale[0].numpy() == scales).all()
    assert torch.equal(dequantize_blocks(cache, torch.tensor([1]))[0], keys)


def test_new_kv_cache_shape_and_zero():
    cache = new_kv_cache(5, head_dim=128)
    assert cache.shape == (5, 64, 1, 132) and cache.dtype == torch.uint8 and not cache.any()


# ------------------------------------------------------------------------------------------- scale rule
@pytest.mark.parametrize("amax", [0.0, 1e-30, 1e-9, 5e-5, 1e-4, 1.0001e-4, 448.0, 224.0, 448.0 * 2**-20,
                                  448.0 * 2**10, 1.0, 3.0, 0.1, 1e6])
def test_scale_rule_fixed_values(amax):
    keys = torch.zeros(2, 8)
    keys[0, 3], keys[1, 6] = amax, -amax
    _, k_scale = quantize_keys(keys)
    assert k_scale.tolist() == [expected_scale(amax)] * 2


@pytest.mark.parametrize("power", [-22, -17, -9, -1, 0, 3, 10])  # 448 * 2^-22 > 1e-4: no floor
def test_scale_rule_exact_powers(power):
    """amax = 448 * 2^p gives exactly 2^p (no extra factor of two), and the value lands on +-448."""
    keys = torch.tensor([[448.0 * 2.0**power, 1.0 * 2.0**power], [-(448.0 * 2.0**power), 0.0]])
    k_fp8, k_scale = quantize_keys(keys)
    assert k_scale.tolist() == [2.0**power] * 2
    assert k_fp8.float()[:, 0].tolist() == [448.0, -448.0]


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(0, 40), dim=st.sampled_from([1, 7, 128]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
def test_quantize_random(seed, rows, dim, dtype):
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(rows, dim, generator=gen) * torch.exp2(torch.randint(-16, 8, (rows, 1), generator=gen))).to(dtype)
    k_fp8, k_scale = quantize_keys(keys)
    assert k_fp8.shape == (rows, dim) and k_fp8.dtype == torch.float8_e4m3fn
    assert k_scale.shape == (rows,) and k_scale.dtype == torch.float32
    k32 = keys.float().double().numpy()
    amax = np.abs(k32).max(axis=1) if dim else np.zeros(rows)
    assert [expected_scale(a) for a in amax] == k_scale.tolist()
    scaled = k32 / k_scale.double().numpy()[:, None]  # exact: power-of-two scale
    got = decode_fp8_np(k_fp8)
    # e4m3: 3 mantissa bits -> half-ulp 2^-4 relative for normals, 2^-10 absolute for subnormals.
    assert (np.abs(got - scaled) <= np.maximum(np.abs(scaled) * 2.0**-4, 2.0**-10)).all()
    big = amax >= 1e-4
    assert (np.abs(got).max(axis=1, initial=0)[big] > 224 - 16).all(), "scale larger than needed"


def decode_fp8_np(t):
    return E4M3FN[fp8_bytes(t)]


def test_quantize_just_above_a_power_of_two():
    """amax one fp32 ulp above 448 * 2^p: the engines' fp32 log2 may round the ratio down to 2^p; either
    way the scale is 2^p or 2^(p+1) and every fp8 value stays finite (saturating at 448)."""
    amax = float(np.nextafter(np.float32(448.0 * 2**-7), np.float32(1.0)))
    k_fp8, k_scale = quantize_keys(torch.tensor([[amax, -amax]]))
    assert k_scale.item() in (2.0**-7, 2.0**-6)
    assert np.isfinite(decode_fp8_np(k_fp8)).all()


# ----------------------------------------------------------------------------------------- slot mapping
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(0, 50), pad_frac=st.floats(0, 1))
def test_slot_mapping_writes_exactly_the_mapped_slots(index_dtype, seed, n, pad_frac):
    rng = np.random.default_rng(seed)
    num_blocks, dim = 3, 8
    k_fp8 = torch.from_numpy(rng.choice(FINITE_FP8, size=(n, dim)).astype(np.uint8)).view(torch.float8_e4m3fn)
    k_scale = torch.from_numpy(rng.random(n).astype(np.float32) + 0.5)
    slots = rng.choice(num_blocks * T, size=n, replace=False)
    slots[rng.random(n) < pad_frac] = -1  # vLLM pads with -1
    cache = sentinel_cache(num_blocks, dim)
    write_kv_cache(cache, k_fp8, k_scale, torch.from_numpy(slots).to(index_dtype))

    want = sentinel_cache(num_blocks, dim).numpy().reshape(num_blocks, -1)  # built by hand
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        blk, row = divmod(int(slot), T)
        want[blk, row * dim:(row + 1) * dim] = fp8_bytes(k_fp8[i])
        want[blk, T * dim + 4 * row: T * dim + 4 * row + 4] = np.frombuffer(struct.pack("<f", float(k_scale[i])), np.uint8)
    np.testing.assert_array_equal(cache.numpy().reshape(num_blocks, -1), want)


@pytest.mark.parametrize("slots", [[0, -1], [-1, 0], [-1, 0, -1, -1], [5, -1, 0, -1]])
def test_padding_never_undoes_a_real_write(slots):
    """A padded row must not touch any slot, in particular not slot 0 written by a real row in the same
    call (duplicate indices in one scatter race, and the last writer wins)."""
    n, dim = len(slots), 4
    cache = sentinel_cache(1, dim)
    k_fp8 = torch.full((n, dim), 2.0).to(torch.float8_e4m3fn)
    write_kv_cache(cache, k_fp8, torch.full((n,), 0.25), torch.tensor(slots))
    values, scales = split_cache_bytes(cache)
    for slot in (s for s in slots if s >= 0):
        assert (E4M3FN[values[0, slot]] == 2.0).all(), f"slot {slot} lost its write"
        assert scales[0, slot] == 0.25
    untouched = [r for r in range(T) if r not in slots]
    assert (values[0, untouched] == SENTINEL).all()


def test_all_padding_and_empty_leave_cache_unchanged():
    cache = sentinel_cache(2, 8)
    write_kv_cache(cache, torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.ones(4), torch.full((4,), -1))
    write_kv_cache(cache, torch.zeros(0, 8).to(torch.float8_e4m3fn), torch.ones(0), torch.zeros(0, dtype=torch.int64))
    assert (cache == SENTINEL).all()


# ------------------------------------------------------------------------------------- read/dequantize
@given(seed=st.integers(0, 2**31 - 1), num_ids=st.integers(0, 6), dim=st.sampled_from([4, 128]))
def test_read_and_dequantize_match_raw_bytes(seed, num_ids, dim):
    gen = torch.Generator().manual_seed(seed)
    cache = random_cache(4, dim, gen)
    ids = torch.randint(0, 4, (num_ids,), generator=gen)  # duplicates allowed
    want = dequantize_f64(cache)[ids.numpy()]
    got = dequantize_blocks(cache, ids.to(torch.int32))
    assert got.dtype == torch.float32 and got.shape == (num_ids, T, dim)
    np.testing.assert_array_equal(got.double().numpy(), want)  # fp8 * 2^e is exact in fp32
    k_fp8, k_scale = read_kv_cache(cache, ids)
    values, scales = split_cache_bytes(cache)
    np.testing.assert_array_equal(fp8_bytes(k_fp8), values[ids.numpy()])
    np.testing.assert_array_equal(k_scale.numpy(), scales[ids.numpy()])


def test_read_returns_a_copy():
    cache = random_cache(2, 8, torch.Generator().manual_seed(0))
    k_fp8, k_scale = read_kv_cache(cache, torch.tensor([0]))
    k_scale.fill_(7.0)
    k_fp8.view(torch.uint8).fill_(0)
    assert not (split_cache_bytes(cache)[1][0] == 7.0).any()


def test_quantize_and_write_matches_the_two_steps():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(10, 16, generator=gen)
    slots = torch.randperm(2 * T, generator=gen)[:10]
    a, b = new_kv_cache(2, 16), new_kv_cache(2, 16)
    quantize_and_write(a, keys, slots)
    write_kv_cache(b, *quantize_keys(keys), slots)
    assert torch.equal(a, b)
    back = dequantize_blocks(a, torch.tensor([0, 1])).reshape(2 * T, 16)[slots]
    assert torch.allclose(back, keys, rtol=2.0**-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------- errors
def _fp8(*shape):
    return torch.zeros(shape).to(torch.float8_e4m3fn)


GOOD = dict(kv_cache=lambda: new_kv_cache(2, 8), k_fp8=lambda: _fp8(3, 8), k_scale=lambda: torch.ones(3),
            slot_mapping=lambda: torch.tensor([0, 1, -1]))
WRITE_ERRORS = [
    ("kv_cache", torch.zeros(2, T, 1, 12), TypeError, "dtype"),
    ("kv_cache", torch.zeros(2, T, 12, dtype=torch.uint8), ValueError, "dimensions"),
    ("kv_cache", torch.zeros(2, T, 2, 12, dtype=torch.uint8), ValueError, "[num_blocks, T, 1, D + 4]"),
    ("kv_cache", torch.zeros(2, T, 1, 4, dtype=torch.uint8), ValueError, "[num_blocks, T, 1, D + 4]"),
    ("kv_cache", torch.zeros(2, T, 1, 24, dtype=torch.uint8)[..., ::2], ValueError, "contiguous"),
    ("kv_cache", [[0]], TypeError, "torch.Tensor"),
    ("k_fp8", torch.zeros(3, 8), TypeError, "float8_e4m3fn"),
    ("k_fp8", _fp8(3, 9), ValueError, "[N, D]"),
    ("k_fp8", _fp8(3, 8, 1), ValueError, "dimensions"),
    ("k_fp8", _fp8(3, 8).to("meta"), ValueError, "device"),
    ("k_scale", torch.ones(3, dtype=torch.float64), TypeError, "float32"),
    ("k_scale", torch.ones(4), ValueError, "[N]"),
    ("k_scale", torch.ones(3, device="meta"), ValueError, "device"),
    ("slot_mapping", torch.tensor([0.0, 1.0, 2.0]), TypeError, "int64"),
    ("slot_mapping", torch.tensor([0, 1]), ValueError, "[N]"),
    ("slot_mapping", torch.tensor([0, 1, 2 * T]), ValueError, "slots"),
    ("slot_mapping", torch.tensor([0, 1, 2], device="meta"), ValueError, "device"),
]


@pytest.mark.parametrize("name,bad,exc,fragment", WRITE_ERRORS,
                         ids=[f"{n}-{i}" for i, (n, *_) in enumerate(WRITE_ERRORS)])
def test_write_errors_name_the_argument(name, bad, exc, fragment):
    args = {k: make() for k, make in GOOD.items()}
    args[name] = bad
    before = args["kv_cache"].clone() if isinstance(args["kv_cache"], torch.Tensor) else None
    with pytest.raises(exc) as info:
        write_kv_cache(args["kv_cache"], args["k_fp8"], args["k_scale"], args["slot_mapping"])
    msg = str(info.value)
    assert msg.startswith(f"{name}: expected") and fragment in msg, msg
    if before is not None and name != "kv_cache":
        assert torch.equal(args["kv_cache"], before), "a rejected write changed the cache"


@pytest.mark.parametrize("bad,exc,fragment", [
    (torch.zeros(3, 8, dtype=torch.int32), TypeError, "dtype"),
    (torch.zeros(3), ValueError, "dimensions"),
    (torch.zeros(2, 3, 4), ValueError, "dimensions"),
    ("keys", TypeError, "torch.Tensor"),
    (torch.zeros(3, 0), ValueError, "D >= 1"),
])
def test_quantize_errors_name_keys(bad, exc, fragment):
    with pytest.raises(exc, match=f"^keys: expected .*{fragment}"):
        quantize_keys(bad)
    with pytest.raises((TypeError, ValueError), match="^keys: expected"):
        quantize_and_write(new_kv_cache(1, 8), bad, torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("keys,match", [(torch.zeros(3, 8, device="meta"), "device"), (torch.zeros(3, 9), r"\[N, D\]")])
def test_quantize_and_write_checks_keys_against_the_cache(keys, match):
    cache = new_kv_cache(1, 8)
    with pytest.raises(ValueError, match=f"^keys: expected .*{match}"):
        quantize_and_write(cache, keys, torch.tensor([0, 1, 2]))
    assert not cache.any()


@pytest.mark.parametrize("fn", [read_kv_cache, dequantize_blocks])
@pytest.mark.parametrize("bad,exc,fragment", [
    (torch.tensor([0, 2]), ValueError, "block ids in [0, 1]"),
    (torch.tensor([-1]), ValueError, "block ids in [0, 1]"),
    (torch.tensor([0.0]), TypeError, "dtype"),
    (torch.tensor([[0]]), ValueError, "dimensions"),
    (torch.tensor([0], device="meta"), ValueError, "device"),
    ([0], TypeError, "torch.Tensor"),
])
def test_read_errors_name_block_ids(fn, bad, exc, fragment):
    with pytest.raises(exc) as info:
        fn(new_kv_cache(2, 8), bad)
    assert str(info.value).startswith("block_ids: expected") and fragment in str(info.value)
    with pytest.raises(TypeError, match="^kv_cache: expected"):
        fn(torch.zeros(2, T, 1, 12), torch.tensor([0]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -float("nan")])
def test_validate_rejects_non_finite_keys_and_writes_nothing(bad):
    cache = sentinel_cache(2, 16)
    keys = torch.randn(3, 16)
    keys[1, 5] = bad
    slots = torch.tensor([0, 70, 3])
    with pytest.raises(ValueError, match=r"keys: expected finite values, got 1 bad row\(s\), the first at row 1"):
        quantize_and_write(cache, keys, slots)
    assert (cache == SENTINEL).all()
    quantize_and_write(cache, keys, slots, validate=False)  # unchecked: stored as it quantizes


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("nan")])
def test_validate_rejects_non_finite_scales_and_nan_fp8_and_writes_nothing(bad):
    cache = sentinel_cache(2, 16)
    k_fp8, k_scale = quantize_keys(torch.randn(3, 16))
    slots = torch.tensor([0, 70, 3])
    scales = k_scale.clone()
    scales[2] = bad
    with pytest.raises(ValueError, match=r"k_scale: expected scales \(finite\), got 1 bad row\(s\), the first at row 2"):
        write_kv_cache(cache, k_fp8, scales, slots)
    for nan_byte in (0x7F, 0xFF):  # e4m3fn's two NaNs
        values = k_fp8.view(torch.uint8).clone()
        values[0, 3] = nan_byte
        with pytest.raises(ValueError, match=r"k_fp8: expected values \(no NaN\).*first at row 0"):
            write_kv_cache(cache, values.view(torch.float8_e4m3fn), k_scale, slots)
    assert (cache == SENTINEL).all()
    write_kv_cache(cache, k_fp8, scales, slots, validate=False)  # unchecked
    write_kv_cache(cache, k_fp8, k_scale, slots)  # finite fp8 values include +-448
