"""The paper's per-step planning in torch: step metadata, reset of blocks that entered a request, and the
block selection of every layer. The ground truth of the fused Triton kernel in plan_triton.py.

Per request b (longest row length L, n = ceil(L / T) blocks):
  keep_all   L <= K: every token is selected anyway, so every block is kept (history still updates)
  guarded    L < config.guard_tokens (and L > K), or the step's sum of L below config.guard_batch_tokens_for(rows)
             (every request): the speed guard scores every block and keeps no history
  budget     m = ceil((1 - s) n), raised to cover K tokens + the partial block, capped at n
  explore    e = round(gamma m) (random / staleness / block_age exploration)
  entered    blocks w with w * T >= seen_len[slot]: new to this request; their vertical history is reset
Per layer: block scores from the paged vertical history and the request's diagonal window (score.py),
forced blocks (newest | never scored | entered | keep_all | guarded), then select.select_blocks.
Everything is fixed-shape and free of host syncs.
"""
from __future__ import annotations

import dataclasses

import torch

from .config import Exploration, Pooling, SpinConfig
from .mtp import prediction_rows, update_rows
from .score import block_scores
from .select import budget_blocks, explore_blocks, layer_hash, select_blocks, step_hash
from .state import SpinState

NEG_INF = float("-inf")


@dataclasses.dataclass
class StepMeta:
    """What every layer of one step shares (B requests, N rows, W table width)."""

    block_table: torch.Tensor  # int32 [B, W]
    seq_lens: torch.Tensor  # int32 [B, N]
    slot_ids: torch.Tensor  # int64 [B]
    step: torch.Tensor  # int32 [B]: this step's number for each slot (1 at a slot's first step)
    clock: torch.Tensor  # int32 [1]: this step's number for the whole state
    num_blocks: torch.Tensor  # int64 [B]
    first_new: torch.Tensor  # int64 [B]: first block holding a query token of any row
    first_entered: torch.Tensor  # int64 [B]: first block new to the request (ceil(seen_len / T))
    keep_all: torch.Tensor  # bool [B]: context <= K
    guarded: torch.Tensor  # bool [B]: context below the guard: dense, no history
    budget: torch.Tensor  # int64 [B]
    explore: torch.Tensor  # int64 [B]
    update_rows: torch.Tensor  # bool [B, N]: rows whose scores feed the EMA update

    @property
    def valid(self) -> torch.Tensor:
        """bool [B, W]: blocks of each request's context."""
        width = self.block_table.shape[1]
        return torch.arange(width, device=self.block_table.device)[None, :] < self.num_blocks[:, None]


def step_lengths(seq_lens: torch.Tensor, width: int, tokens_per_block: int) -> torch.Tensor:
    """seq_lens int32 [B, N] with every length capped at W x T (a new tensor; the torch path's one extra launch).
    plan(validate=True) refuses longer rows; with validate=False a row longer than its table reads as the whole
    table, so that no kernel reads a block id past its row (the fused planner caps where it loads them)."""
    return seq_lens.clamp(max=width * tokens_per_block)


def step_meta(config: SpinConfig, state: SpinState, block_table: torch.Tensor, seq_lens: torch.Tensor,
              slot_ids: torch.Tensor, num_accepted: torch.Tensor | None) -> StepMeta:
    """Per-request metadata of one step, from the state before the step (no state is written)."""
    t = config.tokens_per_block
    batch, next_n = seq_lens.shape
    lens = seq_lens.long()
    slots = slot_ids.long()
    longest = lens.amax(dim=1) if batch else lens.new_zeros(0)
    num_blocks = (longest + t - 1) // t
    first_new = (lens.amin(dim=1) - 1).clamp_min(0) // t if batch else lens.new_zeros(0)
    first_entered = (state.seen_len[slots].long() + t - 1) // t
    keep_all = longest <= config.topk
    # the per-step guard (0-dim, stays on the device) covers keep_all requests too: a small step keeps no
    # history at all, so it is the dense step whichever kernels run it (SpinIndexer._run_dense)
    small_step = longest.sum() < config.guard_batch_tokens_for(batch * next_n)
    guarded = ((longest < config.guard_tokens) & ~keep_all) | small_step
    dense = keep_all | guarded
    budget = budget_blocks(num_blocks, config.sparsity, config.topk, t, dense)
    explore = explore_blocks(budget, config.gamma, config.exploration, dense)
    rows = update_rows(config.mtp, num_accepted, batch, next_n, seq_lens.device) & ~guarded[:, None]
    return StepMeta(block_table, seq_lens, slots, state.step[slots] + 1, state.clock + 1, num_blocks, first_new,
                    first_entered, keep_all, guarded, budget, explore, rows)


def dense_plan_(seq_lens: torch.Tensor, tokens_per_block: int, num_blocks: torch.Tensor, guarded: torch.Tensor,
                update_rows: torch.Tensor, width: int) -> None:
    """The counters of a step whose table shape guards it (every block kept, no history read or written):
    num_blocks int32 [B] = ceil(longest row / T), lengths read in [0, width x T] (step_lengths), guarded bool
    [B] = True, update_rows bool [B, N] = False. seq_lens: int32 [B, N]; width: W. Written in place."""
    if seq_lens.shape[0]:
        longest = seq_lens.amax(dim=1).clamp(0, width * tokens_per_block)
        torch.floor_divide(longest + (tokens_per_block - 1), tokens_per_block, out=num_blocks)
    guarded.fill_(True)
    update_rows.fill_(False)


def finish_step_(state: SpinState, meta: StepMeta) -> None:
    """Advance the per-slot counters after the step's selection: step, seen_len, clock."""
    state.step[meta.slot_ids] = meta.step
    state.seen_len[meta.slot_ids] = meta.seq_lens.amax(dim=1) if meta.seq_lens.numel() else state.seen_len[:0]
    state.clock.copy_(meta.clock)


def entered_mask(meta: StepMeta) -> torch.Tensor:
    """bool [B, W]: valid blocks new to their request this step."""
    width = meta.block_table.shape[1]
    blocks = torch.arange(width, device=meta.block_table.device)[None, :]
    return meta.valid & (blocks >= meta.first_entered[:, None])


def physical_blocks(meta: StepMeta, num_cache_blocks: int) -> torch.Tensor:
    """int64 [B, W]: physical block of every valid logical block, the trash block (num_cache_blocks)
    elsewhere. Ids outside the cache also go to the trash block, so no table can address state outside
    it (plan(validate=True) rejects such tables first)."""
    phys = meta.block_table.long()
    inside = (phys >= 0) & (phys < num_cache_blocks)
    return torch.where(meta.valid & inside, phys, num_cache_blocks)


def reset_entered_(state: SpinState, meta: StepMeta, layers: range | None = None) -> None:
    """Reset the vertical history of the blocks that entered a request, and only those (as the Triton
    kernel does): a block shared with another request of the batch (a prefix-cache hit) is reset when it
    enters one of them, whatever the row order. Fixed shape: other blocks are sent to the trash block."""
    target = torch.where(entered_mask(meta), physical_blocks(meta, state.num_cache_blocks),
                         state.num_cache_blocks).reshape(-1)
    for layer in layers if layers is not None else range(state.num_layers):
        if state.vertical is not None:
            state.vertical[layer].index_fill_(0, target, NEG_INF)
        state.block_max[:, layer].index_fill_(0, target, NEG_INF)
        if state.last_seen is not None:
            state.last_seen[:, layer].index_fill_(0, target, -1)


def layer_scores(config: SpinConfig, state: SpinState, layer: int, meta: StepMeta) -> torch.Tensor:
    """Block scores float32 [B, P, W] of one layer from its paged vertical and windowed diagonal history."""
    t = config.tokens_per_block
    batch, width = meta.block_table.shape
    rows = prediction_rows(config.mtp, meta.seq_lens.shape[1])
    lens = meta.seq_lens.long()[:, rows]
    phys = physical_blocks(meta, state.num_cache_blocks)
    if state.vertical is not None:
        vertical = state.vertical[layer][phys].reshape(batch, width * t)  # [B, W*T]
    else:  # block grain: every slot of a block holds the block's history (its max: the same A1-Max score)
        vertical = state.block_max[:, layer][phys][:, :, None].expand(batch, width, t).reshape(batch, width * t)
    window = state.diagonal[layer, meta.slot_ids, :state.window]  # [B, DW]: past the window: no history
    pad = max(0, width * t - window.shape[1])
    diagonal = torch.nn.functional.pad(window.float(), (0, pad), value=NEG_INF) if pad else window
    return block_scores(vertical, diagonal, lens - 1, lens, meta.budget * t, config.pooling, config.reduce,
                        config.combine, t)


def forced_blocks(state: SpinState, layer: int, meta: StepMeta) -> torch.Tensor:
    """bool [B, W]: blocks kept whatever their score: the newest ones, the never-scored, every block of a
    keep_all or guarded request. Call after reset_entered_ (entered blocks then read as never scored)."""
    width = meta.block_table.shape[1]
    blocks = torch.arange(width, device=meta.block_table.device)[None, :]
    phys = physical_blocks(meta, state.num_cache_blocks)
    never = torch.isneginf(state.block_max[phys, layer])
    dense = (meta.keep_all | meta.guarded)[:, None]
    return meta.valid & ((blocks >= meta.first_new[:, None]) | never | dense)


def select_layer(config: SpinConfig, state: SpinState, layer: int, meta: StepMeta,
                 scores: torch.Tensor | None = None, budget: torch.Tensor | None = None,
                 explore: torch.Tensor | None = None):
    """(keep bool [B, W], explored bool [B, W], forced bool [B, W], scores float32 [B, P, W]) of one layer.

    scores / budget / explore: override the history scores and the step's budgets (the extensions' hooks:
    hybrid mixes scores, adaptive moves budgets)."""
    if scores is None:
        scores = layer_scores(config, state, layer, meta)
    budget = meta.budget if budget is None else budget
    explore = meta.explore if explore is None else explore
    width = meta.block_table.shape[1]
    forced = forced_blocks(state, layer, meta)
    if config.pooling is Pooling.A0:
        # A0 keeps every block holding a selected slot (finite score), however many: its block count
        # follows the slot budget only indirectly. Exploration keeps its own share on top.
        budget = meta.num_blocks + explore
    hashes = layer_hash(step_hash(config.seed, meta.slot_ids, meta.step, width), layer)
    uniforms = hashes.to(torch.float32) / float(2**31)
    age = torch.zeros_like(hashes)
    if state.last_seen is not None:
        phys = physical_blocks(meta, state.num_cache_blocks)
        age = meta.clock.long() - state.last_seen[phys, layer].long()
    max_explore = int(config.gamma * width + 0.5) if config.exploration is not Exploration.NONE else 0
    keep, explored = select_blocks(scores, meta.valid, forced, budget, explore, config.exploration, uniforms, age,
                                   return_explored=True, hashes=hashes, max_explore=max_explore)
    return keep, explored, forced, scores
