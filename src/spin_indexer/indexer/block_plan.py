"""BlockPlan: which logical KV blocks a layer scores this step, and the compacted table that scores them.

Compaction (REFERENCE.md sec. 4): the paged kernel gets a block table listing only the kept blocks,
ascending (so the newest, partial block is last), and shortened row lengths. Worked example, T = 64,
row length 130, kept logical blocks [0, 2]: compact length = 1 * 64 + (129 % 64) + 1 = 66; compact
columns 0-63 -> positions 0-63, columns 64-65 -> positions 128-129.

Entries of kept_blocks / compact_block_table at and past num_kept are unspecified (the fused planning
kernel writes only the kept entries: O(kept blocks), not O(W)); every reader stops at num_kept.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class BlockPlan:
    """Fixed-shape plan of one layer for one step (B requests, N rows, W table width). Its tensors are
    views of the indexer's workspace, valid until the next plan(): clone() keeps one.

    kept_blocks: int32 [B, W] ascending logical block ids (valid below num_kept); num_kept: int32 [B];
    num_blocks: int32 [B] blocks of each request's context; compact_block_table: int32 [B, W] physical ids
    of the kept blocks (valid below num_kept); compact_seq_lens: int32 [B, N] row lengths in compact space;
    guarded: bool [B] requests the guard scored densely (context below SpinConfig.guard_tokens), or None.
    """

    kept_blocks: torch.Tensor
    num_kept: torch.Tensor
    num_blocks: torch.Tensor
    compact_block_table: torch.Tensor
    compact_seq_lens: torch.Tensor
    tokens_per_block: int = 64
    guarded: torch.Tensor | None = None
    predicted_mask: torch.Tensor | None = None  # bool [B, W]: the prediction before audits (adaptive mode)
    audit: torch.Tensor | None = None  # bool [B]: requests this layer scored fully to measure its miss
    explored: torch.Tensor | None = None  # bool [B, W]: blocks kept by exploration (stage 2)
    pred_rank: torch.Tensor | None = None  # int64 [B, W]: predicted keep order (adaptive "curve" controller)

    @classmethod
    def from_keep_mask(cls, keep: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       num_blocks: torch.Tensor, tokens_per_block: int, guarded: torch.Tensor | None = None,
                       out: "BlockPlan | None" = None) -> "BlockPlan":
        """Compaction of a keep mask bool [B, W] (torch); out: a plan whose tensors receive the result."""
        batch, width = keep.shape
        blocks = torch.arange(width, device=keep.device, dtype=torch.int32)
        rank = keep.to(torch.int32).cumsum(dim=1, dtype=torch.int32) - 1  # compact index of each kept block
        # Kept block ids land at their compact index (ascending by construction); the rest hit column W.
        kept = torch.full((batch, width + 1), -1, dtype=torch.int32, device=keep.device)
        kept.scatter_(1, torch.where(keep, rank, width).long(), blocks.expand(batch, -1))
        kept = kept[:, :width]
        table = torch.where(kept >= 0, torch.gather(block_table, 1, kept.long().clamp_min(0)), 0)
        lens = seq_lens.long()
        last_block = (lens - 1).clamp_min(0) // tokens_per_block  # [B, N]; always kept (newest blocks)
        compact = torch.gather(rank, 1, last_block).long() * tokens_per_block + (lens - 1) % tokens_per_block + 1
        compact = torch.where(lens > 0, compact, 0)
        fields = (kept, keep.sum(dim=1).to(torch.int32), table.to(torch.int32), compact.to(torch.int32))
        if out is None:
            return cls(fields[0], fields[1], num_blocks.to(torch.int32), fields[2], fields[3], tokens_per_block,
                       guarded)
        for dst, src in zip((out.kept_blocks, out.num_kept, out.compact_block_table, out.compact_seq_lens), fields):
            dst.copy_(src)
        return out

    def clone(self) -> "BlockPlan":
        """A copy that outlives the step (a live plan's tensors are workspace views, rewritten by the next
        plan())."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).clone() for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    @property
    def keep_mask(self) -> torch.Tensor:
        """bool [B, W]: logical blocks scored (built from kept_blocks; for evaluation, not the decode path)."""
        batch, width = self.kept_blocks.shape
        live = torch.arange(width, device=self.kept_blocks.device)[None, :] < self.num_kept[:, None]
        target = torch.where(live, self.kept_blocks.long().clamp(0, width - 1), width)
        mask = torch.zeros(batch, width + 1, dtype=torch.bool, device=self.kept_blocks.device)
        return mask.scatter_(1, target, True)[:, :width]

    def positions(self, max_blocks: int | None = None) -> torch.Tensor:
        """int64 [B, M*T]: the logical position of every compact column, -1 past the kept blocks; M = W, or
        max_blocks (the first M compact blocks: enough when no request keeps more)."""
        t = self.tokens_per_block
        width = self.kept_blocks.shape[1]
        m = width if max_blocks is None else max_blocks
        live = torch.arange(m, device=self.kept_blocks.device)[None, :] < self.num_kept[:, None]
        kept = torch.where(live, self.kept_blocks[:, :m].long(), -1)[:, :, None]  # [B, M, 1]
        pos = kept * t + torch.arange(t, device=kept.device)  # [B, M, T]
        return torch.where(kept >= 0, pos, -1).flatten(1)

    def sparsity(self) -> torch.Tensor:
        """Realized block sparsity float32 [B]: skipped / total blocks (0 for empty requests)."""
        total = self.num_blocks.float()
        return torch.where(total > 0, 1.0 - self.num_kept.float() / total.clamp_min(1), 0.0)

    def token_mask(self) -> torch.Tensor:
        """bool [B, W*T]: logical positions inside kept blocks."""
        return self.keep_mask.repeat_interleave(self.tokens_per_block, dim=1)
