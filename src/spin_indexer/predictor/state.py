"""SpinState: the per-request, per-layer history SPIN predicts from, in a pool of request slots.

Per layer and slot:
  vertical[i]   EMA of the indexer score of logical position i          (state_dtype, C + 1 entries)
  diagonal[d]   EMA of the score at offset d = q - i from the query q   (state_dtype, C + 1 entries)
  last_seen[k]  step at which block k was last scored, -1 = never       (int32, W + 1 entries)
and per slot a step counter. -inf in vertical/diagonal means "no observation yet". The last entry of each
table is a trash cell: updates of padding lanes are redirected there so every scatter has static shape and
no two live lanes collide.

Memory per cached token per layer: 2 x sizeof(state_dtype) + 4 / T bytes; 4.06 B in float16, against
the 132 B the key cache holds for the same token (3.1%).
"""
from __future__ import annotations

import torch

from ..checks import check_int
from .config import SpinConfig


class SpinState:
    """A pool of `max_requests` request slots, each with history for `num_layers` layers.

    allocate() -> slot id (cleared); free(slot) clears it and returns it to the pool; reset(slot) clears
    it in place. Slots are host-side bookkeeping done between steps, never inside a decode step.
    """

    def __init__(self, config: SpinConfig, num_layers: int, max_requests: int, max_blocks: int,
                 device: torch.device | str = "cpu"):
        check_int("num_layers", num_layers, low=1)
        check_int("max_requests", max_requests, low=1)
        check_int("max_blocks", max_blocks, low=1)
        self.config = config
        self.num_layers, self.max_requests, self.max_blocks = num_layers, max_requests, max_blocks
        self.device = torch.device(device)
        cols = max_blocks * config.tokens_per_block
        self.max_context = cols
        shape = (num_layers, max_requests, cols + 1)
        self.vertical = torch.full(shape, float("-inf"), dtype=config.state_dtype, device=self.device)
        self.diagonal = torch.full(shape, float("-inf"), dtype=config.state_dtype, device=self.device)
        self.last_seen = torch.full((num_layers, max_requests, max_blocks + 1), -1, dtype=torch.int32,
                                    device=self.device)
        self.step = torch.zeros(max_requests, dtype=torch.int32, device=self.device)
        # Adaptive budgets: a menu level and a count of calm audits per (layer, slot); see adaptive.py.
        adaptive = config.adaptive
        self._start_level = adaptive.start_level(config.sparsity) if adaptive else 0
        self.level = torch.full((num_layers, max_requests), self._start_level, dtype=torch.int32, device=self.device)
        self.calm = torch.zeros(num_layers, max_requests, dtype=torch.int32, device=self.device)
        self.audit_next = torch.zeros(num_layers, max_requests, dtype=torch.bool, device=self.device)
        levels = len(adaptive.menu) if adaptive else 1
        self.curve = torch.zeros(num_layers, max_requests, levels, dtype=torch.float32, device=self.device)
        self._free = list(range(max_requests - 1, -1, -1))
        self._in_use = [False] * max_requests

    def allocate(self) -> int:
        """A cleared slot id for a new request; raises RuntimeError when the pool is exhausted."""
        if not self._free:
            raise RuntimeError(f"SpinState: all {self.max_requests} request slots are in use; free one first")
        slot = self._free.pop()
        self.reset(slot)
        self._in_use[slot] = True
        return slot

    def free(self, slot: int) -> None:
        """Clear `slot` and return it to the pool (a finished or preempted request)."""
        self._check_slot(slot)
        if not self._in_use[slot]:
            raise ValueError(f"slot: expected an allocated slot, got {slot} which is free")
        self.reset(slot)
        self._in_use[slot] = False
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        """Forget every observation of `slot` (all layers)."""
        self._check_slot(slot)
        self.reset_rows_(torch.tensor([slot], device=self.device))

    def reset_rows_(self, slots: torch.Tensor) -> None:
        """Forget every observation of the slots in `slots` (int64 [n], repeats allowed), on the device:
        no host sync, so an engine can reset recycled slots inside a captured step. The one place that
        knows every state field."""
        self.vertical.index_fill_(1, slots, float("-inf"))
        self.diagonal.index_fill_(1, slots, float("-inf"))
        self.last_seen.index_fill_(1, slots, -1)
        self.step.index_fill_(0, slots, 0)
        self.level.index_fill_(1, slots, self._start_level)
        self.calm.index_fill_(1, slots, 0)
        self.audit_next.index_fill_(1, slots, False)
        self.curve.index_fill_(1, slots, 0.0)

    def is_allocated(self, slot: int) -> bool:
        self._check_slot(slot)
        return self._in_use[slot]

    def allocated_mask(self) -> torch.Tensor:
        """bool [max_requests] on the CPU: which slots are in use."""
        return torch.tensor(self._in_use, dtype=torch.bool)

    def bytes_per_token(self) -> float:
        """State bytes per cached token per layer (compare with the key cache's 132)."""
        elem = torch.empty((), dtype=self.config.state_dtype).element_size()
        return 2 * elem + 4 / self.config.tokens_per_block

    def nbytes(self) -> int:
        tensors = (self.vertical, self.diagonal, self.last_seen, self.step, self.level, self.calm, self.audit_next,
                   self.curve)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _check_slot(self, slot: int) -> None:
        check_int("slot", slot, low=0, high=self.max_requests - 1)
