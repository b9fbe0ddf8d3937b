"""RequestTracker: which SPIN state slot each decode row of a vLLM batch belongs to, on the device.

vLLM's indexer metadata has no request ids, and the batch is reordered and condensed between steps. A
request is recognised by its KV blocks instead:

- The block that holds a request's newest tokens is exclusively its own: vLLM shares (prefix-caches) only
  full blocks, and a token is only ever appended to a partial block or a fresh one.
- owner[pb] remembers the slot of the request that last wrote decode tokens into physical block pb;
  slot_blocks[s] remembers the (at most two) blocks that slot s's request wrote in its last step.
- A decode row finds its slot through the block of its previous token (position L - next_n - 1, written by
  the request in its last step): slot s = owner[block] is accepted only if slot_blocks[s] still lists that
  block (a double link, so a stale owner entry can never hand a dead request's history to a new one).
- Every token written this step (vLLM's slot_mapping: prefills, and decodes that SPIN did not handle)
  clears owner[] of its block; then SPIN's decode rows set owner[] of theirs. A new request's previous
  token was written by its prefill, so its lookup fails and it gets a fresh, reset slot. A preempted
  request is re-prefilled on resume, so it also starts fresh; a finished request's slot is simply never
  found again.
- Fresh slots come from a least-recently-used order, skipping slots claimed in this step. A live request
  whose slot was reclaimed (it was idle longer than every other slot) fails the double link and restarts
  with an empty history: a loss of history, never a wrong one.

Worked example (T = 64, next_n = 1): a request with L = 130 decodes position 129; its previous token 128
lies in logical block 2, physical block block_table[b, 2] = 17; owner[17] = 5 and slot_blocks[5] = (17, 17)
-> slot 5. At L = 193 the new token 192 opens logical block 3 (physical 40, whose owner entry may be
stale): the lookup uses token 191 in block 2 (physical 17) and still finds slot 5; then owner[40] = 5.

All work is fixed-shape tensor code (no host sync), O(B) per step.
"""
from __future__ import annotations

import torch

from ..checks import check_int, check_tensor


class RequestTracker:
    """Maps decode rows to state slots 0..num_slots-1; slot `num_slots` is the trash slot (padding rows).

    num_slots: real slots (>= the largest decode batch; 2x leaves room for requests that skip a step);
    num_kv_blocks: physical blocks of the engine's indexer cache; tokens_per_block: T.
    """

    def __init__(self, num_slots: int, num_kv_blocks: int, tokens_per_block: int = 64,
                 device: torch.device | str = "cpu", next_n: int = 1):
        check_int("num_slots", num_slots, low=1)
        check_int("num_kv_blocks", num_kv_blocks, low=1)
        check_int("tokens_per_block", tokens_per_block, low=1)
        check_int("next_n", next_n, low=1)
        self.num_slots, self.num_kv_blocks, self.tokens_per_block = num_slots, num_kv_blocks, tokens_per_block
        self.next_n = next_n
        self.device = torch.device(device)
        self.trash_slot = num_slots
        self.owner = torch.full((num_kv_blocks + 1,), -1, dtype=torch.int64, device=self.device)  # last: trash
        self.slot_blocks = torch.full((num_slots + 1, 2), -2, dtype=torch.int64, device=self.device)
        self.last_used = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=self.device)
        self.clock = torch.zeros((), dtype=torch.int64, device=self.device)
        self.last_len = torch.zeros((num_slots + 1,), dtype=torch.int64, device=self.device)  # L at last step

    def assign(self, block_table: torch.Tensor, seq_lens: torch.Tensor, written_slots: torch.Tensor):
        """Slots for this step's decode rows, then this step's bookkeeping.

        block_table: int32 [B, W] physical block ids; seq_lens: int32 [B, N] row lengths (row j =
        L - N + j + 1; 0 marks a padding row); written_slots: int [n] every KV slot written this step
        (vLLM's slot_mapping, -1 = padding).
        returns (slot_ids int64 [B] (trash slot for padding rows), fresh bool [B]: rows that got a new
        slot whose SPIN state must be reset before use, num_accepted int32 [B]: draft tokens accepted in the
        row's previous step, from the length change: L_now - L_prev - 1 in [0, N - 1]; 0 for fresh rows).
        A slot found through its blocks is kept only if the request grew by 1..N tokens since that slot's last
        step (what one decode step does): a request whose blocks were refilled behind the tracker's back (a
        KV connector load, say) rarely continues the old owner's length exactly, and otherwise restarts.
        """
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=self.device,
                     device_of="RequestTracker")
        batch = block_table.shape[0]
        check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(batch, None), shape_names="[B, N]",
                     device=self.device, device_of="RequestTracker")
        check_int("B", batch, high=self.num_slots)
        lens = seq_lens.long()
        live = lens[:, -1] > 0
        first_pos = lens[:, 0] - 1  # position of row 0's query token
        last_pos = lens[:, -1] - 1
        prev_pos = first_pos - 1  # the request's newest token before this step
        first_blk, last_blk, prev_blk = (self._block_of(block_table, p) for p in (first_pos, last_pos, prev_pos))

        has_prev = live & (prev_pos >= 0)
        cand = self.owner[torch.where(has_prev, prev_blk, self.num_kv_blocks)]
        linked = (self.slot_blocks[cand.clamp_min(0)] == prev_blk[:, None]).any(dim=1)
        grew = lens[:, -1] - self.last_len[cand.clamp_min(0)]
        found = has_prev & (cand >= 0) & linked & (grew >= 1) & (grew <= self.next_n)
        # Two rows can never claim one slot legitimately; if they do, the first keeps it.
        rows = torch.arange(batch, device=self.device)
        claim = torch.where(found, cand, self.trash_slot)
        first_row = torch.full((self.num_slots + 1,), batch, dtype=torch.int64, device=self.device)
        first_row.scatter_reduce_(0, claim, rows, reduce="amin")
        found = found & (first_row[claim] == rows)
        fresh = live & ~found

        now = self.clock + 1
        recency = self.last_used.clone()
        recency.scatter_(0, torch.where(found, cand, self.trash_slot), now.expand(batch))
        recency[self.trash_slot] = torch.iinfo(torch.int64).max  # never handed out
        order = torch.sort(recency, stable=True).indices  # least recently used first
        rank = (fresh.long().cumsum(0) - 1).clamp(0, self.num_slots - 1)
        slot = torch.where(found, cand, torch.where(fresh, order[rank], self.trash_slot))

        accepted = torch.where(found, (grew - 1).clamp(0, self.next_n - 1), 0).to(torch.int32)
        self.last_used.scatter_(0, slot, now.expand(batch))
        self.last_len.scatter_(0, slot, lens[:, -1])
        self.forget_writes(written_slots)
        self.slot_blocks.index_copy_(0, slot, torch.stack([first_blk, last_blk], dim=1))
        for blk in (first_blk, last_blk):
            self.owner.scatter_(0, torch.where(live, blk, self.num_kv_blocks), slot)
        self._clean_trash()
        self.clock.copy_(now)
        return slot, fresh, accepted

    def forget_writes(self, written_slots: torch.Tensor) -> None:
        """Clear owner[] of every block that a token was written into (a step SPIN did not handle, or the
        prefill part of one). written_slots: int [n] KV slots, -1 = padding."""
        check_tensor("written_slots", written_slots, dtype=(torch.int32, torch.int64), ndim=1, device=self.device,
                     device_of="RequestTracker")
        slots = written_slots.long()
        blocks = torch.where(slots >= 0, slots // self.tokens_per_block, self.num_kv_blocks)
        self.owner.index_fill_(0, blocks.clamp_max(self.num_kv_blocks), -1)

    def _clean_trash(self) -> None:
        self.owner[self.num_kv_blocks] = -1
        self.slot_blocks[self.trash_slot] = -2
        self.last_used[self.trash_slot] = -1
        self.last_len[self.trash_slot] = 0

    @staticmethod
    def _block_of_impl(block_table, pos, tokens_per_block):
        logical = (pos.clamp_min(0) // tokens_per_block).clamp_max(block_table.shape[1] - 1)
        return torch.gather(block_table.long(), 1, logical[:, None]).squeeze(1)

    def _block_of(self, block_table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """int64 [B]: physical block holding logical position pos[b] (pos clamped into the table)."""
        return self._block_of_impl(block_table, pos, self.tokens_per_block)
