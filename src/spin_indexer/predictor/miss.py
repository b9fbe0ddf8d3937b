"""Miss: the share of a row's dense top-k positions that fall outside a set of kept blocks (REFERENCE.md
sec. 3). The one implementation, used by the adaptive controller, replay, quality and the metrics."""
from __future__ import annotations

import torch

from ..checks import check_tensor
from ..layout import TOKENS_PER_BLOCK


def topk_in_blocks(mask: torch.Tensor, topk: torch.Tensor, next_n: int = 1,
                   tokens_per_block: int = TOKENS_PER_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(inside bool [B*next_n, K], valid bool [B*next_n, K]): which top-k positions lie in blocks set in
    `mask`. mask: bool [B, W], one set per request shared by its next_n rows; topk: int [B*next_n, K]
    request-local positions, -1 padded (row r belongs to request r // next_n)."""
    batch, width = mask.shape
    valid = topk >= 0
    block = torch.where(valid, topk.long() // tokens_per_block, 0).clamp(max=max(width - 1, 0))
    rows_mask = mask.repeat_interleave(next_n, dim=0)  # [B*N, W]
    inside = torch.gather(rows_mask, 1, block) if width else torch.zeros_like(valid)
    return inside & valid, valid


def miss_per_row(keep_mask: torch.Tensor, topk: torch.Tensor, next_n: int = 1,
                 tokens_per_block: int = TOKENS_PER_BLOCK) -> torch.Tensor:
    """Fraction of each row's dense top-k positions that lie in skipped blocks.

    keep_mask: bool [B, W] (logical blocks kept, one set per request, shared by its next_n rows);
    topk: int [B*next_n, K] request-local positions, -1 padded (row r belongs to request r // next_n).
    returns float32 [B*next_n]; 0 for a row with no valid top-k entry.
    """
    check_tensor("keep_mask", keep_mask, dtype=torch.bool, ndim=2)
    batch = keep_mask.shape[0]
    check_tensor("topk", topk, dtype=(torch.int32, torch.int64), shape=(batch * next_n, None),
                 shape_names="[B*next_n, K]", device=keep_mask.device, device_of="keep_mask")
    inside, valid = topk_in_blocks(keep_mask, topk, next_n, tokens_per_block)
    missed = (valid & ~inside).sum(dim=1).float()
    count = valid.sum(dim=1).float()
    return torch.where(count > 0, missed / count.clamp(min=1), torch.zeros_like(count))
