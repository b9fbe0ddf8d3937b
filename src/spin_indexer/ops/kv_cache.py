"""FP8 key quantization and the paged indexer-key cache: write through a slot mapping, read back.

Worked example of the byte layout (T = 64, D = 128, 8448 bytes per block): token 3 of block 7 has its
128 fp8 values at bytes [7*8448 + 3*128, +128) and its fp32 scale at bytes [7*8448 + 8192 + 3*4, +4).
All writes go through uint8 views so they work on every device and torch version.
"""
from __future__ import annotations

import torch

from ..checks import check_tensor, check_values_in_range
from ..layout import FP8_DTYPE, FP8_MAX, SCALE_BYTES, SCALE_FLOOR, cache_views


KEY_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # what quantize_keys takes


def quantize_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 quantization with a power-of-two scale.

    keys: [N, D] float32 / float16 / bfloat16 / float64 (KEY_DTYPES).
    returns (k_fp8 [N, D] float8_e4m3fn, k_scale [N] float32) with
    k_scale = 2 ** ceil(log2(max(amax, 1e-4) / 448)) and k_fp8 = keys / k_scale (exact division: the
    scale is a power of two, so k_fp8 * k_scale differs from keys only by FP8 rounding).
    """
    check_keys(keys)
    k32 = keys.float()
    amax = k32.abs().amax(dim=-1).clamp_min(SCALE_FLOOR)
    k_scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    k_fp8 = (k32 / k_scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return k_fp8, k_scale


def check_keys(keys: torch.Tensor) -> None:
    """quantize_keys' argument: [N, D] of a KEY_DTYPES float with D >= 1 (ValueError / TypeError naming it)."""
    check_tensor("keys", keys, dtype=KEY_DTYPES, ndim=2)
    if keys.shape[1] < 1:  # amax over an empty row is undefined
        raise ValueError(f"keys: expected shape [N, D] with D >= 1, got {list(keys.shape)}")


def write_kv_cache(kv_cache: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor,
                   slot_mapping: torch.Tensor, validate: bool = True) -> None:
    """Store quantized keys in place: token n goes to block slot_mapping[n] // T, row slot_mapping[n] % T.

    kv_cache: uint8 [num_blocks, T, 1, D + 4]; k_fp8: float8_e4m3fn [N, D]; k_scale: float32 [N];
    slot_mapping: int64 or int32 [N], negative entries are padding and are skipped (vLLM's -1).
    validate: check the data too (a host sync): slots < num_blocks * T, no NaN in k_fp8 and k_scale finite.
    Skipped with validate=False: those three (a bad slot is then an index error or a wrong write, a
    non-finite key or scale is stored as is). A rejected call writes nothing.
    """
    _check_cache(kv_cache)
    num_blocks, tokens, _, row_bytes = kv_cache.shape
    dim = row_bytes - SCALE_BYTES
    check_tensor("k_fp8", k_fp8, dtype=FP8_DTYPE, shape=(None, dim), shape_names="[N, D]", device=kv_cache.device,
                 device_of="kv_cache")
    n = k_fp8.shape[0]
    check_tensor("k_scale", k_scale, dtype=torch.float32, shape=(n,), shape_names="[N]", device=kv_cache.device,
                 device_of="kv_cache")
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int64, torch.int32), shape=(n,), shape_names="[N]",
                 device=kv_cache.device, device_of="kv_cache")
    if validate:
        check_values_in_range("slot_mapping", slot_mapping, -(2**62), num_blocks * tokens - 1, "slots")
        # e4m3fn has no inf; its NaN is every bit pattern S.1111.111
        _check_finite("k_fp8", (k_fp8.view(torch.uint8) & 0x7F) != 0x7F, "values (no NaN)")
        _check_finite("k_scale", torch.isfinite(k_scale), "scales (finite)")
    if n == 0:  # nothing to write (and an empty k_scale may have stride 0, which .view(uint8) rejects)
        return
    slots = slot_mapping.long()
    valid = slots >= 0
    # Static shapes (no boolean indexing, no host sync): a padding row repeats the write of the first real
    # row, same slot and same bytes, so duplicate indices in the scatter cannot undo a real write whatever
    # order they land in. Example: slots [5, -1, 0] -> rows write [5, 5, 0] with bytes [r0, r0, r2].
    # With no real row at all, every row rewrites slot 0 with its own current bytes (a no-op).
    src = torch.where(valid, torch.arange(n, device=slots.device), valid.to(torch.uint8).argmax())
    src_valid = valid[src]
    safe = torch.where(src_valid, slots[src], torch.zeros_like(slots))
    block, row = safe // tokens, safe % tokens
    flat = kv_cache.view(num_blocks, tokens * row_bytes)
    value_bytes = flat[:, : tokens * dim].view(num_blocks, tokens, dim)
    scale_bytes = flat[:, tokens * dim :].view(num_blocks, tokens, SCALE_BYTES)
    new_values = torch.where(src_valid[:, None], k_fp8.view(torch.uint8)[src], value_bytes[block, row])
    new_scales = torch.where(src_valid[:, None], k_scale.contiguous().view(torch.uint8).view(n, SCALE_BYTES)[src],
                             scale_bytes[block, row])
    value_bytes[block, row] = new_values
    scale_bytes[block, row] = new_scales


def quantize_and_write(kv_cache: torch.Tensor, keys: torch.Tensor, slot_mapping: torch.Tensor,
                       validate: bool = True) -> None:
    """quantize_keys(keys) then write_kv_cache(...): keys [N, D] float, slot_mapping [N] int.

    validate: as write_kv_cache, and keys finite (a NaN or inf key would make the row's scale non-finite
    or its values NaN); validate=False skips these data checks and stores whatever the keys quantize to.
    """
    check_quantize_and_write_args(kv_cache, keys, slot_mapping, validate)
    k_fp8, k_scale = quantize_keys(keys)
    # validated above: finite keys quantize to finite scales and values, the slots were checked
    write_kv_cache(kv_cache, k_fp8, k_scale, slot_mapping, validate=False)


def check_quantize_and_write_args(kv_cache: torch.Tensor, keys: torch.Tensor, slot_mapping: torch.Tensor,
                                  validate: bool = True) -> None:
    """quantize_and_write's arguments (errors name `keys`, not the k_fp8 it would write); validate: also the data
    (keys finite, slots below num_blocks * T: a host sync)."""
    _check_cache(kv_cache)
    check_tensor("keys", keys, dtype=KEY_DTYPES, ndim=2, shape=(None, kv_cache.shape[3] - SCALE_BYTES),
                 shape_names="[N, D]", device=kv_cache.device, device_of="kv_cache")
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int64, torch.int32), shape=(keys.shape[0],),
                 shape_names="[N]", device=kv_cache.device, device_of="kv_cache")
    if validate:
        _check_finite("keys", torch.isfinite(keys), "finite values")
        check_values_in_range("slot_mapping", slot_mapping, -(2**62), kv_cache.shape[0] * kv_cache.shape[1] - 1,
                              "slots")


def read_kv_cache(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy blocks out of the cache.

    block_ids: int [n] physical block ids in [0, num_blocks).
    returns (k_fp8 float8_e4m3fn [n, T, D], k_scale float32 [n, T]).
    """
    _check_cache(kv_cache)
    check_tensor("block_ids", block_ids, dtype=(torch.int32, torch.int64), ndim=1, device=kv_cache.device,
                 device_of="kv_cache")
    check_values_in_range("block_ids", block_ids, 0, kv_cache.shape[0] - 1, "block ids")
    values, scales = cache_views(kv_cache)
    ids = block_ids.long()
    return values.view(torch.uint8)[ids].view(FP8_DTYPE), scales[ids]


def dequantize_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Keys as float32 [n, T, D] = fp8 value * scale, for the blocks `block_ids` [n]."""
    k_fp8, k_scale = read_kv_cache(kv_cache, block_ids)
    return k_fp8.float() * k_scale[..., None]


def _check_finite(name: str, ok: torch.Tensor, what: str) -> None:
    """ok: bool [N, ...] per element; raises naming the first bad row. Reads the data: validate only."""
    if ok.numel() and not bool(ok.all()):
        rows = ok.reshape(ok.shape[0], -1).all(dim=1)
        first = int((~rows).to(torch.uint8).argmax())
        raise ValueError(f"{name}: expected {what}, got {int((~rows).sum())} bad row(s), the first at row {first}")


def _check_cache(kv_cache: torch.Tensor) -> None:
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, ndim=4, contiguous=True)
    if kv_cache.shape[1] < 1 or kv_cache.shape[2] != 1 or kv_cache.shape[3] <= SCALE_BYTES:
        raise ValueError(f"kv_cache: expected shape [num_blocks, T, 1, D + 4], got {list(kv_cache.shape)}")
