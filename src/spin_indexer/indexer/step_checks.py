"""The data checks of the indexers' plan(validate=True): they read tensors (host syncs), so they run only when
the caller validates. Shape, dtype and device checks are free and always run in plan() / run() themselves."""
from __future__ import annotations

import torch

from ..checks import check_values_in_range


def check_lengths_and_blocks(block_table: torch.Tensor, seq_lens: torch.Tensor, tokens_per_block: int,
                             max_block_id: int, what: str) -> int:
    """seq_lens in [0, W*T] and the ids of the blocks the rows use in [0, max_block_id]; returns the largest
    used id (-1 when no block is used), which run() compares with its kv_cache without reading the table."""
    width = block_table.shape[1]
    check_values_in_range("seq_lens", seq_lens, 0, width * tokens_per_block, "lengths (at most W*T)")
    if not block_table.shape[0]:
        return -1
    used = (seq_lens.amax(dim=1).long() + tokens_per_block - 1) // tokens_per_block
    in_use = torch.arange(width, device=block_table.device)[None, :] < used[:, None]
    check_values_in_range("block_table", torch.where(in_use, block_table, 0), 0, max_block_id, what)
    return int(torch.where(in_use, block_table, -1).max()) if bool(in_use.any()) else -1


def check_ids_fit_cache(max_block_id: int | None, kv_cache: torch.Tensor) -> None:
    """run()'s half of the block-id check: the largest used id plan(validate=True) kept (None: plan did not
    validate) against this layer's cache; a host int, no device read."""
    if max_block_id is not None and max_block_id >= kv_cache.shape[0]:
        raise ValueError(f"block_table: expected block ids of used blocks in [0, {kv_cache.shape[0] - 1}] "
                         f"(kv_cache.shape[0] = {kv_cache.shape[0]}), got max {max_block_id}")


def check_rows_and_slots(state, seq_lens: torch.Tensor, slot_ids: torch.Tensor, num_accepted, next_n: int) -> None:
    """SPIN's own: rows one token apart, distinct allocated slots, accepted draft counts in range."""
    if seq_lens.shape[1] > 1 and seq_lens.numel():
        steps = seq_lens[:, 1:] - seq_lens[:, :-1]
        check_values_in_range("seq_lens", steps, 0, 1, "row-to-row increments (row j = L - next_n + j + 1)")
    check_values_in_range("slot_ids", slot_ids, 0, state.max_requests - 1, "slot ids")
    ids = slot_ids.cpu().tolist()
    if len(set(ids)) != len(ids):
        raise ValueError(f"slot_ids: expected distinct slots, got {ids}")
    free = [s for s in ids if not state.is_allocated(s)]
    if free:
        raise ValueError(f"slot_ids: expected allocated slots (SpinState.allocate()), got free slots {free}")
    if num_accepted is not None:
        check_values_in_range("num_accepted", num_accepted, 0, next_n - 1, "accepted draft counts")
