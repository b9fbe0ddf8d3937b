"""Speculative-decoding (next_n > 1) row policies.

row0 ("row-0 sharing + row-0 update"): the block set is predicted for row 0's query position only (plus
    every row's newest blocks, which are always kept); only row 0's scores update the history.
row-local ("row-local union + prefix-valid update"): each row predicts with its own query position
    (its own diagonal alignment) and the kept set is the union; rows 0..num_accepted[b] update the
    history, in order. num_accepted is the number of accepted draft tokens that the caller knows when it
    plans: offline replay passes the step's true value; an engine passes what it has (the previous step's
    count) and None means "all rows valid".
"""
from __future__ import annotations

import torch

from .config import MtpPolicy


def prediction_rows(policy: MtpPolicy, next_n: int) -> slice:
    """Which query rows produce block predictions."""
    return slice(0, 1) if policy is MtpPolicy.ROW0 else slice(0, next_n)


def update_rows(policy: MtpPolicy, num_accepted: torch.Tensor | None, batch: int, next_n: int,
                device: torch.device) -> torch.Tensor:
    """bool [B, next_n]: which rows feed the EMA update."""
    rows = torch.arange(next_n, device=device)[None, :].expand(batch, -1)
    if policy is MtpPolicy.ROW0:
        return rows == 0
    if num_accepted is None:
        return torch.ones(batch, next_n, dtype=torch.bool, device=device)
    return rows <= num_accepted.long()[:, None]
