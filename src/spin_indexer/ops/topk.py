"""Top-k with per-row lengths and -1 padding: the torch reference.

Order: best first; equal values keep ascending position order (a stable sort), so ties go to the lower
position. Rows with lengths[r] <= k return all their positions (still best first), then -1.
"""
from __future__ import annotations

import torch

from ..checks import check_int, check_tensor, check_values_in_range


def check_topk_args(logits, lengths, k, validate: bool = True) -> None:
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    check_tensor("lengths", lengths, dtype=torch.int32, shape=(logits.shape[0],), shape_names="[R]",
                 device=logits.device, device_of="logits")
    check_int("k", k, low=1)
    if validate:
        check_values_in_range("lengths", lengths, 0, logits.shape[1], "lengths (at most C)")


def topk_ref(logits: torch.Tensor, lengths: torch.Tensor, k: int, validate: bool = True) -> torch.Tensor:
    """Top-k positions per row.

    logits: float32 [R, C]; columns >= lengths[r] are ignored (whatever they hold).
    lengths: int32 [R] in [0, C].  k: int >= 1 (may exceed C).
    returns int32 [R, k]: positions, best first, ties to the lower position, -1 past lengths[r].
    raises ValueError or TypeError naming the argument.
    """
    check_topk_args(logits, lengths, k, validate)
    rows, cols = logits.shape
    col_ids = torch.arange(cols, device=logits.device)
    valid = col_ids[None, :] < lengths.long()[:, None]
    # Masked columns sort after every valid one, -inf included: they sit at higher positions and the
    # sort is stable.
    masked = torch.where(valid, logits, float("-inf"))
    take = min(k, cols)
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :take]
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    keep = torch.arange(take, device=logits.device)[None, :] < lengths.long()[:, None]
    out[:, :take] = torch.where(keep, order, -1).to(torch.int32)
    return out
