"""DenseIndexer: the s = 0 baseline with SpinIndexer's surface (every block scored, no state)."""
from __future__ import annotations

import torch

from .. import ops
from ..checks import check_device, check_int, check_tensor
from ..layout import FP8_DTYPE
from ..ops.indexer_logits import check_paged_indexer_args
from .block_plan import BlockPlan
from .step_checks import check_ids_fit_cache, check_lengths_and_blocks
from .workspace import Workspace


# Where the dense step takes the top-k's group maxima from the logits kernel's epilogue: at most this many rows and
# groups of at most this many columns. Measured on the H200 (run 35, benchmarks/results/run35_group_max_epilogue):
# one row gained (1 x 64K G = 8: 36.8 -> 35.2 us, 1 x 128K G = 16: 38.6 -> 36.8), while at 8 rows and more, or
# G = 32, the epilogue's work (72 registers instead of 64, ~20% more instructions per key block) slowed the
# bandwidth-bound kernel more than the top-k's own launch costs (96 x 128K 500 -> 522 us, 96 x 256K 945 -> 1032,
# 8 x 128K 74 -> 87, 1 x 256K 42.6 -> 45.4).
FUSED_GROUP_MAX_ROWS = 1
FUSED_GROUP_MAX_LARGEST = 16


def fuses_group_max(rows: int, group: int, backend: str = "triton", tokens: int = 64) -> bool:
    """Whether the dense step takes the top-k's G-column maxima (G = group) for `rows` query rows from the
    logits op of `backend` rather than from the top-k's own launch: the Triton kernel within the two bounds
    above; the CUDA kernel wherever it writes them (16 or 32 columns, from its block maxima's partials after the
    loop: no epilogue work a block); DeepGEMM wherever the top-k prunes finer than a block of `tokens`: the pass
    after its logits that writes the block maxima writes them too, one read of the logits where the top-k's own
    launch would be a second (96 x 128K next_n = 2: 100 MB each)."""
    if backend == "deepgemm":
        return Workspace.GROUP_MIN <= group < tokens
    if backend == "cuda":
        return ops.writes_group_max(backend, group)
    return (backend == "triton" and Workspace.GROUP_MIN <= group <= FUSED_GROUP_MAX_LARGEST
            and rows <= FUSED_GROUP_MAX_ROWS)


def dense_topk(q_fp8, kv_cache, weights, seq_lens, block_table, topk: int, tokens_per_block: int,
               block_max: torch.Tensor, logits_out: torch.Tensor | None = None,
               out: torch.Tensor | None = None, group_max: torch.Tensor | None = None,
               sorted: bool = True) -> torch.Tensor:
    """The dense step's kernels: paged logits over the whole table (block max fused) and their top-k.

    Shapes as DenseIndexer.run; block_max: float32 [B*N, W] written; logits_out: optional float32 [B*N, W*T]
    for the logits, unused when DeepGEMM computes them (it allocates its own: a copy would cost every logit);
    out: optional int32 [B*N, K]; group_max: optional float32 [B*N, >= W*T / 8], room for the top-k's group
    maxima when it prunes at 8 or 16 columns (allocated here when needed and not given); sorted: best first,
    or the set in no particular order (ops.topk_positions). returns the top-k int32 [B*N, K] (out when given).
    Where the top-k prunes at G < T columns (ops.topk_group: tables under 4k blocks), the logits op writes
    the G-column maxima too where `fuses_group_max` says so (the Triton kernel's epilogue at one row and G <= 16,
    the CUDA kernel at G = 16 or 32, DeepGEMM's maxima pass at any G < T), so the top-k launches no group-max
    pass of its own; elsewhere that launch measured faster (FUSED_GROUP_MAX_ROWS) or the kernel cannot write them."""
    backend = ops.logits_backend(q_fp8, kv_cache, block_table=block_table)
    if logits_out is not None and backend == "deepgemm":
        logits_out = None
    rows, cols = block_max.shape[0], block_table.shape[1] * tokens_per_block
    group = ops.topk_group(cols, topk)
    gmax = None
    if fuses_group_max(rows, group, backend, tokens_per_block):
        n = -(-cols // group)
        gmax = group_max[:rows, :n] if group_max is not None else torch.empty(rows, n, dtype=torch.float32,
                                                                               device=block_max.device)
    logits = ops.paged_indexer_logits(q_fp8, kv_cache, weights, seq_lens, block_table, validate=False,
                                      out=logits_out, block_max_out=block_max, fill_tail=False,
                                      group_max_out=gmax, group=group, backend=backend)
    return ops.topk_positions(logits, seq_lens.view(-1), topk, block_max=block_max,
                              tokens_per_block=tokens_per_block, out=out, validate=False, group_max=gmax,
                              sorted=sorted)


class DenseIndexer:
    """All-keep indexer: full paged logits and top-k. plan() stores the step's metadata, run() per layer.

    topk: K >= 1; next_n: query rows per request in [1, 8]; tokens_per_block: T >= 1, a power of two, the
    kv_cache's T (run() checks it); topk_sorted: each row best first (True) or, by default, the same set in
    no particular order (as SpinIndexer's).
    """

    def __init__(self, topk: int, next_n: int = 1, tokens_per_block: int = 64, device: torch.device | str = "cpu",
                 topk_sorted: bool = False):
        check_int("topk", topk, low=1)
        if not isinstance(topk_sorted, bool):
            raise TypeError(f"topk_sorted: expected a bool, got {type(topk_sorted).__name__}")
        self.topk_sorted = topk_sorted
        check_int("next_n", next_n, low=1, high=8)
        check_int("tokens_per_block", tokens_per_block, low=1)
        if tokens_per_block & (tokens_per_block - 1):
            raise ValueError(f"tokens_per_block: expected a power of two, got {tokens_per_block}")
        self.topk, self.next_n, self.tokens_per_block = topk, next_n, tokens_per_block
        self.device = check_device("device", device)
        self.block_plan: BlockPlan | None = None
        self._meta = None  # (block_table, seq_lens, max_block_id or None) of the current step

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, slot_ids=None, num_accepted=None,
             validate: bool = True) -> None:
        """block_table int32 [B, W]; seq_lens int32 [B, next_n] in [0, W*T]; slot_ids and num_accepted are
        ignored.

        validate: check the data too (a host sync). Skipped with validate=False: the seq_lens range (a length
        past W*T reads as W*T), block ids of the used blocks >= 0, and in every run() of the step the check of
        those ids against kv_cache.shape[0] (the paged kernels clamp out-of-range ids instead of reading
        outside). Shape, dtype and device checks always run. A rejected call changes no state (block_plan keeps the previous
        step's) and leaves run() unusable until the next plan().
        """
        self._meta = None  # a rejected plan must not leave the previous step runnable
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=self.device, device_of="DenseIndexer")
        check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(block_table.shape[0], self.next_n),
                     shape_names="[B, next_n]", device=self.device, device_of="DenseIndexer")
        t = self.tokens_per_block
        width = block_table.shape[1]
        max_block_id = None
        if validate:
            max_block_id = check_lengths_and_blocks(block_table, seq_lens, t, 2**31 - 1, "block ids of used blocks")
        num_blocks = (seq_lens.long().amax(dim=1) + t - 1) // t
        kept = torch.arange(width, dtype=torch.int32, device=self.device)[None, :].expand(block_table.shape[0], -1)
        # Every block kept: the plan is the table itself (O(1) work per step; keep_mask is derived on demand).
        self.block_plan = BlockPlan(kept, num_blocks.to(torch.int32), num_blocks.to(torch.int32), block_table,
                                    seq_lens, t)
        self._meta = (block_table, seq_lens, max_block_id)

    def run(self, layer: int, q_fp8, kv_cache, weights) -> torch.Tensor:
        """Dense top-k int32 [B*next_n, K] (-1 padded, in topk_sorted's order, as SpinIndexer.run); `layer` is
        accepted for API symmetry. Logits and top-k go through the same backends as SPIN's step.

        q_fp8: float8_e4m3fn [B, next_n, H, D]; kv_cache: uint8 [num_blocks, T, 1, D + 4] with T =
        tokens_per_block; weights: float32 [B*next_n, H]. When the step's plan() validated, the block ids of
        the used blocks are checked against kv_cache.shape[0] (a host int kept by plan(): no device read).
        """
        block_table, seq_lens, max_block_id = self._current()
        check_tensor("q_fp8", q_fp8, dtype=FP8_DTYPE, ndim=4, device=self.device, device_of="DenseIndexer")
        check_paged_indexer_args(q_fp8, kv_cache, weights, seq_lens, block_table, validate=False)
        if kv_cache.shape[1] != self.tokens_per_block:
            raise ValueError(f"kv_cache: expected T = tokens_per_block = {self.tokens_per_block} tokens per block, "
                             f"got shape {list(kv_cache.shape)}")
        check_ids_fit_cache(max_block_id, kv_cache)
        with torch.no_grad():
            rows, width = q_fp8.shape[0] * q_fp8.shape[1], block_table.shape[1]
            block_max = torch.empty(rows, width, dtype=torch.float32, device=q_fp8.device)
            return dense_topk(q_fp8, kv_cache, weights, seq_lens, block_table, self.topk, self.tokens_per_block,
                              block_max, sorted=self.topk_sorted)

    def run_from_scores(self, layer: int, scores: torch.Tensor) -> torch.Tensor:
        """Dense top-k of precomputed scores float32 [B*next_n, W*T] (in topk_sorted's order)."""
        block_table, seq_lens, _ = self._current()
        return ops.topk_positions(scores, seq_lens.reshape(-1), self.topk, tokens_per_block=self.tokens_per_block,
                                  validate=False, sorted=self.topk_sorted)

    def _current(self):
        if self._meta is None:
            raise RuntimeError("DenseIndexer.run: call plan() for this decode step first")
        return self._meta
