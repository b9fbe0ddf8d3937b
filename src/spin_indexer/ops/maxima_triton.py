"""Triton row maxima: the group maxima the top-k prunes with and the block maxima SPIN keeps, in one pass.

For rows of logits float32 [R, C] with per-row lengths, writes group_max_ref (the max of every G columns,
NaN where a group holds one) and the block max (every T columns; a NaN is skipped there, as PTX max skips
it) for the groups and blocks below each row's length. Two callers: SPIN's step after DeepGEMM's logits (it
writes logits only) and the dense top-k's group-max launch (topk_triton, when no caller wrote them).

Bytes: 4 per column read, 4 / G + 4 / T per column written: a pure stream, ~6.6 us for 96 x 64K columns at
copy bandwidth. The pass it replaces (one program per 2048 columns, each loading its row's length and only
then its tile) ran at 41% of DRAM peak (run 38's counters, 13.0 us there): every program spent half its life
on the length's round trip with no bytes in flight. Here a row's P programs (R x P ~ one wave of resident
programs: a static grid, so CUDA-graph capture keeps it) load the length once and loop over the row's tiles
t = p, p + P, ..., the next tile's load issued before the current tile's maxima are reduced and stored (two
tiles in flight per program); the first tile is loaded beside the length, not after it.
Measured (H200, ncu, SPIN's maxima at 96 x 128K, s = 0.5): 13.0 us at 41% of DRAM peak before (run 38), 8.8 us at
60% (run 43); the rest of the gap to copy speed is, I think, the first loads' latency in a ~9 us kernel (not measured).
"""
from __future__ import annotations

import torch

from ..checks import check_tensor
from .occupancy import sm_count
from .topk import check_group

try:  # the package imports this module only for CUDA tensors; without triton the reference is used
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

TILE_UNITS = 32  # T-column units per tile: [32, 64] = 2048 columns, 16 per thread at 4 warps
NUM_WARPS = 4
# Resident programs per SM the grid is sized for: 4 warps at <= 64 registers (MAX_REGISTERS) fit 8.
PROGRAMS_PER_SM = 8
MAX_REGISTERS = 64


def programs_per_row(rows: int, cols: int, device: torch.device, tile_cols: int) -> int:
    """P: a row's programs, so that rows x P fills the GPU's resident programs once and no more (at most one per
    tile). Rounded down, so no program waits for a second wave (192 rows, next_n = 2 at 96 requests: 6 a row
    rounded up were 1152 programs for 1056 places). Timed alone on an H100 (run 164), the two grids were within 1%
    of each other (86-91% of copy bandwidth): the rule never adds programs, it removed no measurable time there."""
    return max(1, min(triton.cdiv(cols, tile_cols), sm_count(device) * PROGRAMS_PER_SM // max(rows, 1)))


def row_maxima_triton(logits: torch.Tensor, lengths: torch.Tensor, group_max_out: torch.Tensor | None = None,
                      group: int = 64, block_max_out: torch.Tensor | None = None, tokens: int = 64) -> None:
    """Group and block maxima of each row's first lengths[r] columns.

    logits: float32 [R, C] (unit stride along C); lengths: int32 [R] (clamped into [0, C]: no length reads
    outside the row); group_max_out: optional float32 [R, >= ceil(C / group)], entry [r, g] = group_max_ref
    for g * group < lengths[r]; block_max_out: optional float32 [R, >= ceil(C / tokens)], entry [r, m] = the
    max of the row's valid columns in [m * T, (m + 1) * T) for m * T < lengths[r]. Entries past a row's
    length are left as they are. group: a power of two dividing `tokens` (a power of two)."""
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    rows, cols = logits.shape
    check_tensor("lengths", lengths, dtype=torch.int32, shape=(rows,), shape_names="[R]", device=logits.device,
                 device_of="logits")
    check_group(group, tokens)
    for name, out, width in (("group_max_out", group_max_out, -(-cols // group)),
                             ("block_max_out", block_max_out, -(-cols // tokens))):
        if out is not None:
            check_tensor(name, out, dtype=torch.float32, ndim=2, device=logits.device, device_of="logits")
            if out.shape[0] != rows or out.shape[1] < width or out.stride(1) != 1:
                raise ValueError(f"{name}: expected float32 [{rows}, >= {width}] with unit stride along the "
                                 f"columns, got shape {tuple(out.shape)}, strides {tuple(out.stride())}")
    if rows == 0 or cols == 0 or (group_max_out is None and block_max_out is None):
        return
    if logits.stride(1) != 1:
        raise ValueError(f"logits: expected unit stride along the columns, got strides {tuple(logits.stride())}")
    tile_cols = TILE_UNITS * tokens
    grid = (rows, programs_per_row(rows, cols, logits.device, tile_cols))
    gmax = group_max_out if group_max_out is not None else logits  # dummy pointers when unused
    bmax = block_max_out if block_max_out is not None else logits
    _row_maxima_kernel[grid](
        logits, logits.stride(0), lengths.contiguous(), cols, gmax, gmax.stride(0), bmax, bmax.stride(0),
        T=tokens, G=group, TB=TILE_UNITS, GMAX=group_max_out is not None, BMAX=block_max_out is not None,
        EVEN=cols % tokens == 0, num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS or None)


if triton is not None:
    @triton.jit
    def max_nan(a, b):
        """max that returns NaN when either operand is one (PTX max.NaN: one instruction)."""
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _load_tile(x_row, t, bound, T: tl.constexpr, TB: tl.constexpr, EVEN: tl.constexpr):
        """float32 [TB, T]: tile t of a row (units t * TB ...), the columns below `bound` (<= C) loaded, -inf
        elsewhere. Where C is a multiple of T whole units are loaded under a mask constant along T (it
        vectorizes; a per-column mask made scalar loads): the caller masks the columns past the length."""
        u = t * TB + tl.arange(0, TB)
        c = u[:, None] * T + tl.arange(0, T)[None, :]  # int32: C < 2^31
        if EVEN:
            return tl.load(x_row + c, mask=tl.broadcast_to((u * T < bound)[:, None], c.shape), other=float("-inf"))
        return tl.load(x_row + c, mask=c < bound, other=float("-inf"))

    @triton.jit
    def _mask_tile(x, t, length, T: tl.constexpr, TB: tl.constexpr):
        """x with -inf at and past `length`."""
        c = (t * TB + tl.arange(0, TB))[:, None] * T + tl.arange(0, T)[None, :]
        return tl.where(c < length, x, float("-inf"))

    @triton.jit
    def store_maxima(x, t, length, gmax_row, bmax_row, T: tl.constexpr, G: tl.constexpr, TB: tl.constexpr,
                     GMAX: tl.constexpr, BMAX: tl.constexpr):
        """Tile t's group maxima (one NaN-propagating reduction: a NaN wins its group, so the top-k never
        prunes it) and block maxima (from the group maxima: T / G values per block instead of T), for the groups
        and blocks below `length`; x float32 [TB, T] holds units t * TB ... (-inf past the length). Also the
        update pass's (update_tile), for the rows whose maxima it writes. tl.max skips a NaN operand (PTX max):
        a block max is NaN only when every group of the block is."""
        u = t * TB + tl.arange(0, TB)
        if GMAX:
            gm = tl.reduce(tl.reshape(x, [TB, T // G, G]), 2, max_nan)  # [TB, T // G]
            gi = u[:, None] * (T // G) + tl.arange(0, T // G)[None, :]
            tl.store(gmax_row + gi, gm, mask=gi * G < length)
            if BMAX:
                tl.store(bmax_row + u, tl.max(gm, axis=1), mask=u * T < length)
        elif BMAX:
            tl.store(bmax_row + u, tl.max(x, axis=1), mask=u * T < length)

    @triton.jit
    def _row_maxima_kernel(x_ptr, stride_x, len_ptr, cols, gmax_ptr, stride_g, bmax_ptr, stride_b,
                           T: tl.constexpr, G: tl.constexpr, TB: tl.constexpr, GMAX: tl.constexpr,
                           BMAX: tl.constexpr, EVEN: tl.constexpr):
        """Program (r, p): row r's tiles p, p + P, ... (P = the grid's second dimension)."""
        r = tl.program_id(0)
        p = tl.program_id(1)
        step = tl.num_programs(1)
        r64 = r.to(tl.int64)
        x_row = x_ptr + r64 * stride_x
        gmax_row = gmax_ptr + r64 * stride_g
        bmax_row = bmax_ptr + r64 * stride_b
        # The first tile is loaded up to C, beside the length rather than after it (a row's first P tiles are
        # almost always inside its length: a round trip saved for at most one unused tile per program).
        x = _load_tile(x_row, p, cols, T, TB, EVEN)
        length = tl.minimum(tl.maximum(tl.load(len_ptr + r), 0), cols)
        for t in range(p, tl.cdiv(length, TB * T), step):
            # the next tile's load first: its bytes stream while this tile's maxima are reduced and stored
            nxt = _load_tile(x_row, t + step, length, T, TB, EVEN)
            store_maxima(_mask_tile(x, t, length, T, TB), t, length, gmax_row, bmax_row, T, G, TB, GMAX, BMAX)
            x = nxt
