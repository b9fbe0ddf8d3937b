"""DeepGEMM's `fp8_paged_mqa_logits` as a logits backend (the production dense indexer kernel on Hopper).

Serving installs on SM90 have `deep_gemm` (vLLM calls it for the dense indexer). It reads the same
uint8 [num_blocks, 64, 1, 132] cache, int32 block table and int32 [B, next_n] lengths, so a compacted
table from SPIN's plan goes straight in: its cost follows the lengths passed (work in 256-token pieces).
It writes fp32 logits only; columns past a row's length are not cleaned. Covered: next_n in {1, 2},
T = 64, D = 128, 64 heads, SM90, contiguous pages (padded ones go to the Triton kernel). Nothing here is
DeepGEMM's code: the module is imported when present.

Used at next_n = 2 (1.7x faster than the project's kernel, benchmarks/results run 8) and for SPIN's step at
next_n = 1 on tables of more than TRITON_STEP_MAX_BLOCKS blocks (`spin_step_uses`); below it, and for the
dense step at next_n = 1, the project's kernel (its fused maxima save the pass DeepGEMM needs). SPIN_INDEXER_LOGITS=triton turns this backend off, =deepgemm forces it (benchmarks compare both).
DeepGEMM's kernel takes an SM schedule computed from the lengths; SpinIndexer.plan() writes every layer's
at once (deepgemm_schedule.py) and run() passes it (`schedule=`), instead of one metadata launch per layer.
"""
from __future__ import annotations

import functools
import os

import torch

from ..checks import check_tensor
from .indexer_logits import check_paged_indexer_args


@functools.lru_cache(maxsize=1)
def _module():
    """deep_gemm, or None when it does not import here."""
    try:
        import deep_gemm  # noqa: F401
    except Exception:  # absent, or built for another torch / CUDA: the Triton kernel serves instead
        return None
    return deep_gemm


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def available() -> bool:
    return _module() is not None


def schedule_sms(device: torch.device) -> int:
    """The SM count DeepGEMM's schedule is computed for on `device` where DeepGEMM can serve it (SM90 with
    deep_gemm importing, not turned off by SPIN_INDEXER_LOGITS), else 0: SpinIndexer then keeps no
    per-layer schedule (deepgemm_schedule.py) and a DeepGEMM call computes its own."""
    if device.type != "cuda" or os.environ.get("SPIN_INDEXER_LOGITS", "") in ("triton", "reference"):
        return 0
    if _module() is None or torch.cuda.get_device_capability(device) != (9, 0):
        return 0
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


# SPIN's step at next_n = 1 on tables of at most this many blocks (B x W) runs the project's Triton kernel, above it
# DeepGEMM. H200, run 62 (benchmarks/results/run62_logits_chunks, `logits_chunks.py`, s = 0.5 / 0.2, compact tables
# of plan()): the Triton kernel with the scales prefetched (CONFIGS[1]) and the block / group maxima in its epilogue
# against DeepGEMM + the maxima pass the step then needs: 1 x 128K 7.0 vs 7.5 / 8.2 vs 9.2 us, 1 x 512K 14.7 vs
# 14.8, 8 x 128K 25.2-26.3 vs 25.0 / 35.5-36.5 vs 35.5, 32 x 128K 79.5 vs 82.7 / 120.0-123.2 vs 122.3, 8 x 512K
# 76.9 vs 79.0, 96 x 128K 220.6 vs 224.7: a tie or a win up to 96 x 2048 blocks, and one launch fewer in the step.
# Larger tables (96 x 512K: 786K blocks) keep DeepGEMM until measured (run 27 had it win there without prefetch).
TRITON_STEP_MAX_BLOCKS = 96 * 2048


def spin_step_uses(next_n: int, table_blocks: int | None) -> bool:
    """Whether SPIN's step on a table of `table_blocks` blocks (B x W; None: unknown, taken as large) computes its
    logits with DeepGEMM where DeepGEMM covers the shape: SPIN_INDEXER_LOGITS=deepgemm / triton forces the answer;
    else next_n = 2 always, next_n = 1 above TRITON_STEP_MAX_BLOCKS. A host rule on static shapes (a graph
    captured at one table size keeps its backend)."""
    choice = os.environ.get("SPIN_INDEXER_LOGITS", "")
    if choice in ("triton", "reference") or next_n not in (1, 2):
        return False
    if choice == "deepgemm" or next_n == 2:
        return True
    return table_blocks is None or table_blocks > TRITON_STEP_MAX_BLOCKS


def supports(q_fp8: torch.Tensor, kv_cache: torch.Tensor, history: bool = False,
             table_blocks: int | None = None) -> bool:
    """True when DeepGEMM should compute these logits: it covers the shape, the backend is not turned off,
    and the call is one it wins: next_n = 2; SPIN's step (history) by `spin_step_uses(next_n, table_blocks)`;
    or forced by SPIN_INDEXER_LOGITS=deepgemm (see ops.logits_backend).

    History: run 11 had the Triton kernel with the update fused win below 1M table tokens (the update pass
    then ran in series); from run 21 on the pass ran on a side stream and DeepGEMM + the maxima pass won SPIN's
    step at every size run 27 measured (Triton without the scales prefetched); run 62's prefetching kernel wins
    it back up to TRITON_STEP_MAX_BLOCKS."""
    choice = os.environ.get("SPIN_INDEXER_LOGITS", "")
    if choice in ("triton", "reference") or not q_fp8.is_cuda:
        return False
    if _module() is None or torch.cuda.get_device_capability(q_fp8.device) != (9, 0):
        return False
    _, next_n, heads, dim = q_fp8.shape
    if not (heads == 64 and dim == 128 and kv_cache.shape[1] == 64 and next_n in (1, 2)):
        return False
    if kv_cache.shape[0] > 1 and kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.shape[3]:
        return False  # padded pages (DeepSeek-V4) go to the Triton kernel, which takes a page stride
    return choice == "deepgemm" or next_n == 2 or (history and spin_step_uses(next_n, table_blocks))


def paged_indexer_logits_deepgemm(q_fp8, kv_cache, weights, seq_lens, block_table, validate: bool = True,
                                  out: torch.Tensor | None = None,
                                  schedule: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [B*next_n, W*T] logits through DeepGEMM; columns past a row's length are unspecified.

    Same arguments as `paged_indexer_logits_ref`. DeepGEMM allocates its own output; `out`, when given,
    receives a copy (the decode step passes none and uses the returned tensor).
    schedule: optional int32 [num_sms + 1, 2], DeepGEMM's SM schedule for exactly these seq_lens
    (deepgemm_schedule.schedule, computed for every layer in plan()); None: DeepGEMM computes it (a launch)."""
    check_paged_indexer_args(q_fp8, kv_cache, weights, seq_lens, block_table, validate)
    dg = _module()
    batch, next_n = q_fp8.shape[:2]
    width = block_table.shape[1]
    max_len = width * kv_cache.shape[1]
    sms = _num_sms(q_fp8.device.index or 0)
    if schedule is None:
        meta = dg.get_paged_mqa_logits_metadata(seq_lens, kv_cache.shape[1], sms)
    else:
        check_tensor("schedule", schedule, dtype=torch.int32, shape=(sms + 1, 2), shape_names="[num_sms + 1, 2]",
                     device=q_fp8.device, device_of="q_fp8", contiguous=True)
        meta = schedule
    logits = dg.fp8_paged_mqa_logits(q_fp8, kv_cache, weights, seq_lens, block_table, meta, max_len, False)
    if out is not None:
        check_tensor("out", out, dtype=torch.float32, shape=(batch * next_n, max_len), shape_names="[B*next_n, W*T]",
                     device=q_fp8.device, device_of="q_fp8")
        out.copy_(logits)
        return out
    return logits
