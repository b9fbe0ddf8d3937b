"""Top-k with per-row lengths and -1 padding: the torch reference.

Order: best first; equal values keep ascending position order, so ties go to the lower position (exact,
through distinct int64 order keys). Rows with lengths[r] <= k return all their positions (still best first), then -1.
sorted=False returns the same set in no particular order (then -1): what the engines' sparse attention reads (a
set of positions: vLLM's and SGLang's decode top-k kernels return one), and what the Triton top-k writes without
ranking its winners (one select launch instead of a sort and a rank launch). The reference writes it in ascending
position order; the Triton path best first below SET_SELECT_MIN_ROWS rows, else in an order that may differ
between runs. Compare sets (`ascending`).
"""
from __future__ import annotations

import torch

from ..checks import check_int, check_tensor, check_values_in_range


TOKENS_PER_GROUP_MAX = 64  # the coarsest group: one block of the logits kernel's fused block max


def topk_group(cols: int, k: int) -> int:
    """The group size G (a power of two <= 64) at which the Triton top-k prunes a row of `cols` columns for
    this k: the largest with >= 4k groups in a full row, so that the k-th largest group max is a tight
    threshold. A caller that already reads the logits (the EMA update pass) can write these group maxima
    for it (`group_max=` of topk_positions): the top-k then launches no group-max pass of its own."""
    g = TOKENS_PER_GROUP_MAX
    while g > 1 and cols // g < 4 * k:
        g //= 2
    return g


def group_max_ref(logits: torch.Tensor, lengths: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [R, ceil(C / group)]: the max of each group of `group` columns over the columns < lengths[r]
    (-inf for a group with none; NaN for a group holding a NaN, which a pruning top-k must never skip)."""
    rows, cols = logits.shape
    pad = -cols % group
    x = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    c = torch.arange(cols + pad, device=logits.device)
    # explicit group count: view(rows, -1, ...) is ambiguous for an empty batch
    x = torch.where(c[None, :] < lengths.long()[:, None], x, float("-inf")).view(rows, (cols + pad) // group, group)
    return torch.where(torch.isnan(x).any(dim=2), float("nan"), x.amax(dim=2))


def check_group(group: int, tokens: int) -> None:
    """A group size for written group maxima: a power of two dividing T (ValueError naming `group`)."""
    if group < 1 or group > tokens or tokens % group or group & (group - 1):
        raise ValueError(f"group: expected a power of two dividing T = {tokens}, got {group}")


def group_max_into(group_max_out: torch.Tensor, logits: torch.Tensor, lengths: torch.Tensor, group: int) -> None:
    """group_max_ref written into group_max_out float32 [R, >= C / group] (the reference of what the kernels
    write: their leading ceil(C / group) columns)."""
    check_tensor("group_max_out", group_max_out, dtype=torch.float32, ndim=2, device=logits.device,
                 device_of="logits")
    gm = group_max_ref(logits, lengths.reshape(-1), group)
    group_max_out[:, :gm.shape[1]].copy_(gm)


def check_topk_args(logits, lengths, k, validate: bool = True, sorted: bool = True) -> None:
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    if not isinstance(sorted, bool):
        raise TypeError(f"sorted: expected a bool, got {type(sorted).__name__}")
    check_tensor("lengths", lengths, dtype=torch.int32, shape=(logits.shape[0],), shape_names="[R]",
                 device=logits.device, device_of="logits")
    check_int("k", k, low=1)
    if validate:
        check_values_in_range("lengths", lengths, 0, logits.shape[1], "lengths (at most C)")


def monotone_bits(scores: torch.Tensor) -> torch.Tensor:
    """int32, same shape: the float32 bit patterns made monotone (negative floats flipped but the sign bit), so
    that integer order is float order; -0.0 is folded into +0.0 and every NaN into +NaN (0x7FC00000, above
    +inf). Adding 2^31 gives the Triton kernels' unsigned key (`topk_triton._ukey`)."""
    x = scores.float() + 0.0
    x = torch.where(torch.isnan(x), float("nan"), x)  # torch's NaN constant is +NaN, 0x7FC00000
    bits = x.contiguous().view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def order_keys(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int64 [R, C] keys whose descending order is topk_ref's: higher score first, ties to the lower
    position, columns >= lengths[r] last.

    The float32 bit pattern is made monotone (negative floats flipped), shifted up 32 bits, and the low 32
    bits hold (2^32 - 1 - position), so every key is distinct and torch.topk (no stable sort needed, ~6x
    faster on the CPU) returns the exact order. -0.0 is folded into +0.0 so the two zeros tie, and every NaN
    (either sign, any payload) into +NaN (0x7FC00000), above +inf: torch.topk's order, where NaN is the
    largest value and NaNs tie (to the lower position).
    """
    mono = monotone_bits(scores)
    cols = torch.arange(scores.shape[1], device=scores.device)
    key = (mono.long() << 32) | (0xFFFFFFFF - cols)[None, :]
    return key.masked_fill_(cols[None, :] >= lengths.long()[:, None], torch.iinfo(torch.int64).min)


def ascending(picked: torch.Tensor) -> torch.Tensor:
    """int32 [R, k]: each row's entries >= 0 in ascending order, then its -1s (the sorted=False order)."""
    big = torch.iinfo(torch.int32).max
    s = torch.sort(picked.masked_fill(picked < 0, big), dim=1).values
    return s.masked_fill_(s == big, -1)


def topk_ref(logits: torch.Tensor, lengths: torch.Tensor, k: int, validate: bool = True,
             sorted: bool = True) -> torch.Tensor:
    """Top-k positions per row.

    logits: float32 [R, C]; columns >= lengths[r] are ignored (whatever they hold).
    lengths: int32 [R] in [0, C].  k: int >= 1 (may exceed C).
    sorted: best first (True) or the same set in no particular order (False; here: ascending positions).
    returns int32 [R, k]: positions, best first, ties to the lower position, -1 past lengths[r].
    raises ValueError or TypeError naming the argument.
    """
    check_topk_args(logits, lengths, k, validate, sorted)
    rows, cols = logits.shape
    take = min(k, cols)
    order = torch.topk(order_keys(logits, lengths), take, dim=1).indices
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    keep = torch.arange(take, device=logits.device)[None, :] < lengths.long()[:, None]
    out[:, :take] = torch.where(keep, order, -1).to(torch.int32)
    return out if sorted else ascending(out)


def pruning_group(group, cols: int, k: int) -> int:
    """The top-k's group size: `group` checked (an int, a power of two dividing TOKENS_PER_GROUP_MAX), or
    topk_group(cols, k) for None."""
    if group is None:
        return topk_group(cols, k)
    check_int("group", group)
    check_group(group, TOKENS_PER_GROUP_MAX)
    return group


def check_topk_positions_args(logits, lengths, k, block_max=None, kept_blocks=None, next_n: int = 1,
                              tokens_per_block: int = 64, out=None, validate: bool = True,
                              group_max=None, sorted: bool = True, group: int | None = None) -> None:
    """The argument checks shared by `topk_positions_ref` and its Triton twin (same messages)."""
    check_topk_args(logits, lengths, k, validate, sorted)
    rows, cols = logits.shape
    check_int("tokens_per_block", tokens_per_block, low=1)
    if tokens_per_block & (tokens_per_block - 1):
        raise ValueError(f"tokens_per_block: expected a power of two, got {tokens_per_block}")
    check_int("next_n", next_n, low=1)
    width = -(-cols // tokens_per_block)
    dev = logits.device
    if block_max is not None:
        check_tensor("block_max", block_max, dtype=torch.float32, shape=(rows, width),
                     shape_names="[R, ceil(C / T)]", device=dev, device_of="logits")
    g = pruning_group(group, cols, k)
    if group_max is not None:
        check_tensor("group_max", group_max, dtype=torch.float32, shape=(rows, -(-cols // g)),
                     shape_names=f"[R, ceil(C / G)] with G = {g}", device=dev, device_of="logits")
    if kept_blocks is not None:
        if rows % next_n:
            raise ValueError(f"next_n: expected a divisor of R = {rows} (kept_blocks has one row per request), "
                             f"got {next_n}")
        check_tensor("kept_blocks", kept_blocks, dtype=torch.int32, ndim=2, device=dev, device_of="logits")
        if kept_blocks.shape[0] != rows // next_n or kept_blocks.shape[1] < width:
            raise ValueError(f"kept_blocks: expected shape [R // next_n, M >= ceil(C / T)] = "
                             f"[{rows // next_n}, >= {width}], got {list(kept_blocks.shape)}")
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, shape=(rows, k), shape_names="[R, k]", device=dev,
                     device_of="logits", contiguous=True)


def topk_positions_ref(logits: torch.Tensor, lengths: torch.Tensor, k: int, block_max=None, kept_blocks=None,
                       next_n: int = 1, tokens_per_block: int = 64, out=None, validate: bool = True,
                       group_max=None, sorted: bool = True, group: int | None = None) -> torch.Tensor:
    """`topk_ref` of compact logits, written as logical positions: the decode step's top-k.

    logits: float32 [R, C]; columns >= lengths[r] are ignored (whatever they hold).
    lengths: int32 [R] in [0, C].  k: int >= 1 (may exceed C or a row's length).
    block_max: optional float32 [R, ceil(C / T)], the exact max of each T-column block of valid logits; only
      checked here (the Triton twin uses it to skip blocks).
    group_max: optional float32 [R, ceil(C / G)]: the same at the top-k's group size G (group_max_ref); only
      checked here, the twin prunes with it instead of computing it.
    group: the top-k's group size G, a power of two <= 64 (None: topk_group(C, k)). It changes how tightly the
      Triton twin prunes, never the result: a caller whose rows fill only part of C (SPIN's compact logits) picks
      it by the columns its rows hold.
    kept_blocks: optional int32 [R // next_n, M >= ceil(C / T)]: column c of row r is position
      kept_blocks[r // next_n, c // T] * T + c % T; None = identity. Example: T = 64, kept [0, 2]: columns
      0-63 -> positions 0-63, 64-65 -> 128-129.
    out: optional int32 [R, k] written in place and returned.
    sorted: True, best first; False, the same set in no particular order (here: ascending columns, so
      ascending positions where kept_blocks rows ascend, as SPIN's plans do).
    returns int32 [R, k]: the columns `topk_ref` picks (higher value first, ties to the lower column), mapped
      to positions, in `sorted`'s order, then -1.
    raises ValueError or TypeError naming the argument.
    """
    check_topk_positions_args(logits, lengths, k, block_max, kept_blocks, next_n, tokens_per_block, out, validate,
                              group_max, sorted, group)
    rows, cols = logits.shape
    picked = topk_ref(logits, lengths, k, validate=False, sorted=sorted)  # [R, k] columns, -1 padded
    if kept_blocks is not None and rows:
        kept = kept_blocks.long().repeat_interleave(next_n, dim=0)  # [R, M]
        c = picked.long().clamp_min(0)
        mapped = kept.gather(1, c // tokens_per_block) * tokens_per_block + c % tokens_per_block
        picked = torch.where(picked >= 0, mapped, -1).to(torch.int32)
    if out is None:
        return picked
    out.copy_(picked)
    return out
