"""DenseIndexer: the s = 0 baseline with SpinIndexer's surface (every block scored, no state)."""
from __future__ import annotations

import torch

from .. import ops
from ..checks import check_int, check_tensor
from .block_plan import BlockPlan


class DenseIndexer:
    """All-keep indexer: full paged logits and top-k. plan() stores the step's metadata, run() per layer."""

    def __init__(self, topk: int, next_n: int = 1, tokens_per_block: int = 64, device: torch.device | str = "cpu"):
        check_int("topk", topk, low=1)
        check_int("next_n", next_n, low=1, high=8)
        self.topk, self.next_n, self.tokens_per_block = topk, next_n, tokens_per_block
        self.device = torch.device(device)
        self.block_plan: BlockPlan | None = None
        self._meta = None

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, slot_ids=None, num_accepted=None,
             validate: bool = True) -> None:
        """block_table int32 [B, W]; seq_lens int32 [B, next_n]; slot_ids and num_accepted are ignored."""
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=self.device, device_of="DenseIndexer")
        check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(block_table.shape[0], self.next_n),
                     shape_names="[B, next_n]", device=self.device, device_of="DenseIndexer")
        t = self.tokens_per_block
        num_blocks = (seq_lens.long().amax(dim=1) + t - 1) // t
        width = block_table.shape[1]
        kept = torch.arange(width, dtype=torch.int32, device=self.device)[None, :].expand(block_table.shape[0], -1)
        # Every block kept: the plan is the table itself (O(1) work per step; keep_mask is derived on demand).
        self.block_plan = BlockPlan(kept, num_blocks.to(torch.int32), num_blocks.to(torch.int32), block_table,
                                    seq_lens, t)
        self._meta = (block_table, seq_lens)

    def run(self, layer: int, q_fp8, kv_cache, weights) -> torch.Tensor:
        """Dense top-k int32 [B*next_n, K] (best first, -1 padded, as SpinIndexer.run); `layer` is
        accepted for API symmetry. Logits and top-k go through the same backends as SPIN's step."""
        block_table, seq_lens = self._current()
        rows, width = q_fp8.shape[0] * q_fp8.shape[1], block_table.shape[1]
        block_max = torch.empty(rows, width, dtype=torch.float32, device=q_fp8.device)
        logits = ops.paged_indexer_logits(q_fp8, kv_cache, weights, seq_lens, block_table, validate=False,
                                          block_max_out=block_max, fill_tail=False)
        return ops.topk_positions(logits, seq_lens.view(-1), self.topk, block_max=block_max,
                                  tokens_per_block=self.tokens_per_block, validate=False)

    def run_from_scores(self, layer: int, scores: torch.Tensor) -> torch.Tensor:
        """Dense top-k of precomputed scores float32 [B*next_n, W*T] (best first)."""
        block_table, seq_lens = self._current()
        return ops.topk_positions(scores, seq_lens.reshape(-1), self.topk, tokens_per_block=self.tokens_per_block,
                                  validate=False)

    def _current(self):
        if self._meta is None:
            raise RuntimeError("DenseIndexer.run: call plan() for this decode step first")
        return self._meta
