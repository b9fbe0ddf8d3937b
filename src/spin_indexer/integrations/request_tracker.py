"""RequestTracker: which SPIN state slot each decode row of a vLLM batch belongs to, on the device.

vLLM's indexer metadata has no request ids, and the batch is reordered and condensed between steps. What
it does give, every step, is each row's block table and length, and every KV slot written (slot_mapping).
SPIN's per-block history needs no identity at all (it is keyed by vLLM's block ids and reset when a block
enters a request); only the per-request tables (diagonal window, step counter, seen length, MTP's
accepted count) need to know which request a row is. The tracker derives it from those three inputs:

- A slot remembers what its request's rows wrote in their last step: the blocks of its first and last
  row (`slot_blocks[s]`) and the length after that step (`last_len[s]`).
- A decode row continues slot s when the block holding its previous token (position L - next_n - 1:
  always written by the request in its last step, as one of that step's rows) is one of s's blocks, and
  its length grew by 1..next_n since s's step (what one decode step does; growth - 1 is the previous
  step's accepted-draft count). vLLM never appends two requests' tokens into one block (it shares only
  full blocks and appends to a partial or fresh block), so at most one live slot can match.
- A slot's record is dropped as soon as any token is written into one of its blocks by anybody else
  (a prefill, a decode SPIN did not handle: the step's slot_mapping), before this step's rows record
  theirs. A finished request's record therefore dies with the first write into its freed blocks; a
  preempted request is re-prefilled on resume (its own writes drop its record): it starts fresh.
- Rows that continue no slot get a fresh one, least recently used first; the caller resets it on the
  device. A live request whose slot was reclaimed (idle longer than every other slot) starts fresh: a
  loss of history, never a wrong one.

Nothing is sized by the KV cache: the tracker holds O(num_slots) integers, so it is allocated with the
rest of SPIN's per-server state at vLLM's profile run. Per step: a [B, S] comparison and a sort of the
step's written blocks; fixed shapes, no host sync.

Worked example (T = 64, next_n = 1): a request with L = 130 decodes position 129; its previous token 128
lies in logical block 2, physical block block_table[b, 2] = 17; slot 5 recorded (17, 17) with last_len 129
-> slot 5 (grew by 1). At L = 193 the new token 192 opens logical block 3 (physical 40): the lookup uses
token 191 in block 2 (physical 17), still slot 5, which then records (17, 40).

What it cannot see: a block refilled without a slot_mapping write (a KV connector's load) keeps the old
owner's record until the first write into it; a request loaded there whose length continues that record
by 1..next_n tokens at its first decode would take the old slot (see docs/vllm.md).
"""
from __future__ import annotations

import torch

from ..checks import check_int, check_tensor

NO_BLOCK = -2  # a slot_blocks entry that matches no block (block ids are >= 0, padding -1)


class RequestTracker:
    """Maps decode rows to state slots 0..num_slots-1; slot `num_slots` is the trash slot (padding rows).

    num_slots: real slots (>= the largest decode batch; 2x leaves room for requests that skip a step);
    tokens_per_block: T; next_n: query rows per request.
    """

    def __init__(self, num_slots: int, tokens_per_block: int = 64, device: torch.device | str = "cpu",
                 next_n: int = 1):
        check_int("num_slots", num_slots, low=1)
        check_int("tokens_per_block", tokens_per_block, low=1)
        check_int("next_n", next_n, low=1)
        self.num_slots, self.tokens_per_block, self.next_n = num_slots, tokens_per_block, next_n
        self.device = torch.device(device)
        self.trash_slot = num_slots
        i64 = dict(dtype=torch.int64, device=self.device)
        self.slot_blocks = torch.full((num_slots + 1, 2), NO_BLOCK, **i64)  # blocks of the last step's rows
        self.last_len = torch.zeros((num_slots + 1,), **i64)  # L after the slot's last step
        self.last_used = torch.full((num_slots + 1,), -1, **i64)  # clock of the slot's last step
        self.clock = torch.zeros((), **i64)

    def assign(self, block_table: torch.Tensor, seq_lens: torch.Tensor, written_slots: torch.Tensor):
        """Slots for this step's decode rows, then this step's bookkeeping.

        block_table: int32 [B, W] physical block ids; seq_lens: int32 [B, N] row lengths (row j =
        L - N + j + 1; 0 marks a padding row); written_slots: int [n] every KV slot written this step
        (vLLM's slot_mapping, -1 = padding).
        returns (slot_ids int64 [B] (trash slot for padding rows), fresh bool [B]: rows that got a new
        slot whose SPIN state must be reset before use, num_accepted int32 [B]: draft tokens accepted in the
        row's previous step, L_now - L_prev - 1 in [0, N - 1]; 0 for fresh rows).
        """
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=self.device,
                     device_of="RequestTracker")
        batch = block_table.shape[0]
        check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(batch, None), shape_names="[B, N]",
                     device=self.device, device_of="RequestTracker")
        check_int("B", batch, high=self.num_slots)
        lens = seq_lens.long()
        live = lens[:, -1] > 0
        first_pos, last_pos = lens[:, 0] - 1, lens[:, -1] - 1  # positions of this step's first / last row
        prev_pos = first_pos - 1  # the request's newest token before this step
        first_blk, last_blk, prev_blk = (self._block_of(block_table, p) for p in (first_pos, last_pos, prev_pos))

        # [B, S + 1]: slot s wrote the block of row b's previous token last step, and b continues its length
        holds = (self.slot_blocks[None, :, :] == prev_blk[:, None, None]).any(dim=2)
        grew = lens[:, -1:] - self.last_len[None, :]
        match = holds & (grew >= 1) & (grew <= self.next_n) & (live & (prev_pos >= 0))[:, None]
        match[:, self.trash_slot] = False
        cand = torch.where(match, self.last_used[None, :], -2).argmax(dim=1)  # the most recent, if several
        found = match.any(dim=1)
        # Two rows can never continue one slot legitimately; if they do, the first keeps it.
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

        accepted = torch.where(found, (grew.gather(1, cand[:, None]).squeeze(1) - 1).clamp(0, self.next_n - 1),
                               0).to(torch.int32)
        self.forget_writes(written_slots)  # every record this step writes into dies (ours are set again below)
        self.last_used.scatter_(0, slot, now.expand(batch))
        self.last_len.scatter_(0, slot, lens[:, -1])
        self.slot_blocks.index_copy_(0, slot, torch.stack([first_blk, last_blk], dim=1))
        self._clean_trash()
        self.clock.copy_(now)
        return slot, fresh, accepted

    def forget_writes(self, written_slots: torch.Tensor) -> None:
        """Drop the record of every slot one of whose blocks a token was written into (a step SPIN did not
        handle, or the prefill part of one). written_slots: int [n] KV slots, -1 = padding."""
        check_tensor("written_slots", written_slots, dtype=(torch.int32, torch.int64), ndim=1, device=self.device,
                     device_of="RequestTracker")
        if written_slots.numel() == 0:  # a host-known shape, not data
            return
        slots = written_slots.long()
        blocks = torch.sort(torch.where(slots >= 0, slots // self.tokens_per_block, -1)).values
        flat = self.slot_blocks.reshape(-1)
        at = torch.searchsorted(blocks, flat).clamp_max(blocks.numel() - 1)
        hit = (blocks[at] == flat).view(-1, 2).any(dim=1)
        self.slot_blocks.masked_fill_(hit[:, None], NO_BLOCK)

    def _clean_trash(self) -> None:
        self.slot_blocks[self.trash_slot] = NO_BLOCK
        self.last_used[self.trash_slot] = -1
        self.last_len[self.trash_slot] = 0

    def _block_of(self, block_table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """int64 [B]: physical block holding logical position pos[b] (pos clamped into the table)."""
        logical = (pos.clamp_min(0) // self.tokens_per_block).clamp_max(block_table.shape[1] - 1)
        return torch.gather(block_table.long(), 1, logical[:, None]).squeeze(1)
