"""SpinState: the history SPIN predicts from, laid out so that its memory follows the cached tokens.

Per layer, beside the key cache (addressed through the same block table, one entry per physical KV slot):
  vertical[l, p, t]   EMA of the indexer score of the token in slot t of physical block p   fp16 [L, P, T]
  block_max[p, l]     max of vertical[l, p, :], -inf = the block was never scored            fp16 [P, L]
  last_seen[p, l]     clock value at which block p was last scored (block_age / staleness)   int32 [P, L]
Per request slot (a bounded window, so a slot costs the same at 4K and at 1M):
  diagonal[l, s, d]   EMA of the score at offset d = q - i from the query q, d < window      fp16 [L, S, DW]
  step[s]             decode steps the slot has planned (keys its exploration hash)          int32 [S]
  seen_len[s]         context length at its last plan: blocks past it are new to the slot    int32 [S]
and one `clock` (plans so far). With SpinConfig.summary > 0 (the summary mix, beyond the paper), also
  summaries[l, p]     the sub-block mean keys of full block p, in the key cache's layout    uint8 [L, P, S, 1, D + 4]
  summarized[l, s]    full blocks of slot s whose summaries layer l has written              int32 [L, S]
(ops.write_block_summaries / paged_summary_scores; S x (D + 4) / T bytes a token a layer: 8.25 at S = 4, D = 128).
-inf means "no observation yet". Each table has one extra trash entry
(block P, offset DW): fixed-shape updates send their dead lanes there, and nothing ever reads it.

Sharing, by design: two requests that hold the same physical block (a shared prefix) share its vertical
history, which is a property of the token in that slot; the diagonal history is per request and never
shared. A block that enters a request (a new decode block, or every block of a new request's first step)
is reset for that request in plan(), so a reused physical block never carries a previous owner's history:
reset cost is O(blocks that entered), never O(maximum context).

Memory per cached token per layer: 2 + 2/T (+ 4/T with last_seen) bytes of vertical history, about 2.03 B
against the key cache's 132, plus DW x 2 B per request slot and layer for the diagonal window. With
SpinConfig.vertical_grain = "block" there is no vertical table (vertical is None): block_max is the history
itself (the EMA of each block's max score), 2/T B a token (0.03 B at T = 64).
"""
from __future__ import annotations

import math

import torch

from ..checks import allocation_error, check_device, check_int
from ..layout import HEAD_DIM, SCALE_BYTES
from .config import Exploration, Grain, SpinConfig


class SpinState:
    """History for `num_layers` layers over a cache of `num_cache_blocks` physical blocks, and
    `max_requests` request slots (allocate() a slot per request, free() it when the request ends).

    max_context: longest context a request may have (tokens); bounds the diagonal window. head_dim: D of the
    key cache, which sizes the summary cache (only with SpinConfig.summary > 0).
    """

    def __init__(self, config: SpinConfig, num_layers: int, max_requests: int, num_cache_blocks: int,
                 max_context: int, device: torch.device | str = "cpu", head_dim: int = HEAD_DIM):
        if not isinstance(config, SpinConfig):
            raise TypeError(f"config: expected a SpinConfig, got {type(config).__name__}")
        check_int("num_layers", num_layers, low=1)
        check_int("max_requests", max_requests, low=1)
        check_int("num_cache_blocks", num_cache_blocks, low=1)
        check_int("max_context", max_context, low=1)
        self.head_dim = check_int("head_dim", head_dim, low=1)
        self.config = config
        self.num_layers, self.max_requests, self.num_cache_blocks = num_layers, max_requests, num_cache_blocks
        self.device = check_device("device", device)
        t, dtype = config.tokens_per_block, config.state_dtype
        self.window = min(config.diagonal_window or max_context, max_context)  # DW offsets of diagonal history
        neg = float("-inf")
        blocks = num_cache_blocks + 1  # + the trash block
        elem = torch.empty((), dtype=dtype).element_size()
        per_slot = config.grain is Grain.SLOT
        need = (num_layers * (blocks * (t * per_slot + 1) + max_requests * (self.window + 1)) + t) * elem
        try:
            self.vertical = (torch.full((num_layers, blocks, t), neg, dtype=dtype, device=self.device)
                             if per_slot else None)
            self.block_max = torch.full((blocks, num_layers), neg, dtype=dtype, device=self.device)
            # T elements of slack past the last row: the fused plan reads D's window in aligned chunks of T
            # (plan_triton._window_diag_max), which may run up to T - 1 elements past a row's end
            shape = (num_layers, max_requests, self.window + 1)
            cells = math.prod(shape)
            self.diagonal = torch.full((cells + t,), neg, dtype=dtype, device=self.device)[:cells].view(shape)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise allocation_error("SpinState", need, self.device,
                                   f"num_layers={num_layers}, num_cache_blocks={num_cache_blocks}, "
                                   f"max_requests={max_requests}, window={self.window}") from exc
        ages = config.exploration in (Exploration.STALENESS, Exploration.BLOCK_AGE)
        self.last_seen = (torch.full((blocks, num_layers), -1, dtype=torch.int32, device=self.device)
                          if ages else None)
        self.step = torch.zeros(max_requests, dtype=torch.int32, device=self.device)
        self.seen_len = torch.zeros(max_requests, dtype=torch.int32, device=self.device)
        self.clock = torch.zeros(1, dtype=torch.int32, device=self.device)
        # Adaptive budgets: a menu level and a count of calm audits per (layer, slot); see adaptive.py.
        adaptive = config.adaptive
        self._start_level = adaptive.start_level(config.sparsity) if adaptive else 0
        self.level = torch.full((num_layers, max_requests), self._start_level, dtype=torch.int32, device=self.device)
        self.calm = torch.zeros(num_layers, max_requests, dtype=torch.int32, device=self.device)
        self.audit_next = torch.zeros(num_layers, max_requests, dtype=torch.bool, device=self.device)
        levels = len(adaptive.menu) if adaptive else 1
        self.curve = torch.zeros(num_layers, max_requests, levels, dtype=torch.float32, device=self.device)
        self.summaries = self.summarized = None
        if config.summary > 0:
            self._allocate_summaries()
            self.summarized = torch.zeros(num_layers, max_requests, dtype=torch.int32, device=self.device)
        self._free = list(range(max_requests - 1, -1, -1))
        self._in_use = [False] * max_requests
        # Host counters of ownership changes: generation[s] is bumped by every allocate()/free() of slot s,
        # epoch by every allocate()/free() at all. A step records them in plan() and run() refuses to
        # hand the plan to a slot whose owner changed in between (see SpinIndexer.run).
        self._generation = [0] * max_requests
        self.epoch = 0

    @property
    def trash_block(self) -> int:
        """Index of the trash block (= num_cache_blocks)."""
        return self.num_cache_blocks

    # -- request slots (host bookkeeping between steps, never inside one) ------------------------------
    def allocate(self) -> int:
        """A cleared slot id for a new request; raises RuntimeError when the pool is exhausted."""
        if not self._free:
            raise RuntimeError(f"SpinState: all {self.max_requests} request slots are in use; free one first")
        slot = self._free.pop()
        self.reset(slot)
        self._in_use[slot] = True
        self._bump(slot)
        return slot

    def free(self, slot: int) -> None:
        """Return `slot` to the pool (a finished or preempted request); it is cleared when reallocated."""
        self._check_slot(slot)
        if not self._in_use[slot]:
            raise ValueError(f"slot: expected an allocated slot, got {slot} which is free")
        self._in_use[slot] = False
        self._free.append(slot)
        self._bump(slot)

    def generation(self, slot: int) -> int:
        """How many times `slot` was allocated or freed: a changed value means a new owner (or none)."""
        self._check_slot(slot)
        return self._generation[slot]

    def generations(self) -> list[int]:
        """Every slot's generation (a host copy, no device work)."""
        return list(self._generation)

    def _bump(self, slot: int) -> None:
        self._generation[slot] += 1
        self.epoch += 1

    def reset(self, slot: int) -> None:
        """Forget the request history of `slot` (all layers); its blocks are reset at its next plan()."""
        self._check_slot(slot)
        self.reset_rows_(torch.tensor([slot], device=self.device))

    def reset_rows_(self, slots: torch.Tensor) -> None:
        """Forget the per-request history of `slots` (int64 [n], repeats allowed) on the device, without a
        host sync (an engine may reset recycled slots inside a captured step). seen_len = 0 makes the slot's
        next plan() reset the vertical history of every block it brings. The one place that knows every
        per-slot field."""
        self.diagonal.index_fill_(1, slots, float("-inf"))
        self.step.index_fill_(0, slots, 0)
        self.seen_len.index_fill_(0, slots, 0)
        self.level.index_fill_(1, slots, self._start_level)
        self.calm.index_fill_(1, slots, 0)
        self.audit_next.index_fill_(1, slots, False)
        self.curve.index_fill_(1, slots, 0.0)
        if self.summarized is not None:  # its blocks' summaries are (re)written at its first run()
            self.summarized.index_fill_(1, slots, 0)

    def reset_blocks_(self, blocks: torch.Tensor) -> None:
        """Forget the vertical history of physical blocks `blocks` (int64 [n], all layers), on the device.
        plan() calls it for the blocks that entered a request; an engine may call it when it refills a block
        behind the indexer's back (a KV connector, say)."""
        if self.vertical is not None:
            self.vertical.index_fill_(1, blocks, float("-inf"))
        self.block_max.index_fill_(0, blocks, float("-inf"))
        if self.last_seen is not None:
            self.last_seen.index_fill_(0, blocks, -1)

    def bind_history_(self, vertical: torch.Tensor | None, block_max: torch.Tensor) -> None:
        """Keep the per-block history in caller-provided memory (an engine's KV-cache allocation) instead of
        this state's own tensors, which are dropped; both are filled with -inf (nothing observed yet).

        vertical: [L, P + 1, T] of config.state_dtype, each layer's [P + 1, T] contiguous (the kernels address
        vertical[l] as rows of T), any layer stride; None (and only None) with vertical_grain = "block";
        block_max: [P + 1, L], same dtype and device, any strides.
        Row P is the trash block: it may alias memory nobody reads (an engine's null block). P becomes
        num_cache_blocks; last_seen (staleness / block-age exploration) is reallocated for P + 1 blocks here.
        Raises TypeError / ValueError naming the argument.
        """
        t, dtype = self.config.tokens_per_block, self.config.state_dtype
        if (vertical is None) != (self.vertical is None):
            raise ValueError(f"vertical: expected {'None' if self.vertical is None else 'a tensor'} with "
                             f"vertical_grain = {self.config.grain.value!r}, got "
                             f"{'None' if vertical is None else 'a tensor'}")
        for name, x in (("vertical", vertical), ("block_max", block_max)):
            if x is None:
                continue
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
            if x.dtype != dtype:
                raise TypeError(f"{name}: expected dtype {dtype}, got {x.dtype}")
            if x.device != self.device:
                raise ValueError(f"{name}: expected device {self.device}, got {x.device}")
        if vertical is not None:
            if vertical.dim() != 3 or vertical.shape[0] != self.num_layers or vertical.shape[1] < 2 \
                    or vertical.shape[2] != t:
                raise ValueError(f"vertical: expected shape [L, P + 1, T] = [{self.num_layers}, >= 2, {t}], "
                                 f"got {list(vertical.shape)}")
            if vertical.stride(2) != 1 or vertical.stride(1) != t:
                raise ValueError(f"vertical: expected each layer's rows contiguous (strides [*, {t}, 1]), "
                                 f"got {list(vertical.stride())}")
        blocks = vertical.shape[1] if vertical is not None else block_max.shape[0]
        if list(block_max.shape) != [blocks, self.num_layers] or blocks < 2:
            raise ValueError(f"block_max: expected shape [P + 1, L] = [{blocks}, {self.num_layers}] (P + 1 >= 2), "
                             f"got {list(block_max.shape)}")
        if vertical is not None:
            vertical.fill_(float("-inf"))
        block_max.fill_(float("-inf"))
        self.vertical, self.block_max, self.num_cache_blocks = vertical, block_max, blocks - 1
        if self.last_seen is not None:
            self.last_seen = torch.full((blocks, self.num_layers), -1, dtype=torch.int32, device=self.device)
        if self.summaries is not None:  # one row per physical block of the new size, every slot rewritten
            self._allocate_summaries()
            self.summarized.zero_()

    def _allocate_summaries(self) -> None:
        shape = (self.num_layers, self.num_cache_blocks, self.config.summary_parts, 1, self.head_dim + SCALE_BYTES)
        try:
            self.summaries = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise allocation_error("SpinState summaries", math.prod(shape), self.device,
                                   f"shape={list(shape)}") from exc

    def is_allocated(self, slot: int) -> bool:
        self._check_slot(slot)
        return self._in_use[slot]

    def allocated_mask(self) -> torch.Tensor:
        """bool [max_requests] on the CPU: which slots are in use."""
        return torch.tensor(self._in_use, dtype=torch.bool)

    # -- sizes -----------------------------------------------------------------------------------------
    def bytes_per_token(self) -> float:
        """Vertical-history bytes per cached token per layer (compare with the key cache's 132)."""
        elem = torch.empty((), dtype=self.config.state_dtype).element_size()
        t = self.config.tokens_per_block
        summary = self.config.summary_parts * (self.head_dim + SCALE_BYTES) / t if self.summaries is not None else 0.0
        per_slot = elem if self.vertical is not None else 0.0
        return per_slot + elem / t + (4 / t if self.last_seen is not None else 0.0) + summary

    def bytes_per_request(self) -> int:
        """Per-request bytes over all layers (the diagonal window and counters)."""
        return self.num_layers * self.window * self.diagonal.element_size() + 8

    def nbytes(self) -> int:
        tensors = (self.vertical, self.block_max, self.diagonal, self.last_seen, self.step, self.seen_len,
                   self.clock, self.level, self.calm, self.audit_next, self.curve, self.summaries, self.summarized)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _check_slot(self, slot: int) -> None:
        check_int("slot", slot, low=0, high=self.max_requests - 1)
