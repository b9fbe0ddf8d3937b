"""DeepGEMM's `fp8_paged_mqa_logits` as a logits backend (the production dense indexer kernel on Hopper).

Serving installs on SM90 have `deep_gemm` (vLLM calls it for the dense indexer). It reads the same
uint8 [num_blocks, 64, 1, 132] cache, int32 block table and int32 [B, next_n] lengths, so a compacted
table from SPIN's plan goes straight in: its cost follows the lengths passed (work in 256-token pieces).
It writes fp32 logits only; columns past a row's length are not cleaned. Covered: next_n in {1, 2},
T = 64, D = 128, 64 heads, SM90, contiguous pages (padded ones go to the Triton kernel). Nothing here is
DeepGEMM's code: the module is imported when present.

Used at next_n = 2 on block tables of >= 8M tokens, and on smaller ones where the project's CUDA kernel cannot run
(no nvcc: indexer_logits_cuda.serves); on smaller tables the CUDA kernel, which writes the maxima the top-k needs
in its epilogue (a pass DeepGEMM needs behind it), makes both steps faster (`spin_step_uses`). At next_n = 1 the
project's Triton kernel serves both steps (the same reason).
SPIN_INDEXER_LOGITS=triton / cuda turns this backend off, =deepgemm forces it (benchmarks compare them).
DeepGEMM's kernel takes an SM schedule computed from the lengths; SpinIndexer.plan() writes every layer's
at once (deepgemm_schedule.py) and run() passes it (`schedule=`), instead of one metadata launch per layer.
"""
from __future__ import annotations

import functools

import torch

from ..checks import check_tensor
from ..dispatch import forced_logits_backend
from .indexer_logits import check_paged_indexer_args
from .occupancy import sm_count


@functools.lru_cache(maxsize=1)
def _module():
    """deep_gemm, or None when it does not import here."""
    try:
        import deep_gemm  # noqa: F401
    except Exception:  # absent, or built for another torch / CUDA: the Triton kernel serves instead
        return None
    return deep_gemm


def available() -> bool:
    return _module() is not None


def schedule_sms(device: torch.device) -> int:
    """The SM count DeepGEMM's schedule is computed for on `device` where DeepGEMM can serve it (SM90 with
    deep_gemm importing, not turned off by SPIN_INDEXER_LOGITS), else 0: SpinIndexer then keeps no
    per-layer schedule (deepgemm_schedule.py) and a DeepGEMM call computes its own."""
    if device.type != "cuda" or forced_logits_backend() not in (None, "deepgemm"):
        return 0
    if _module() is None or torch.cuda.get_device_capability(device) != (9, 0):
        return 0
    return sm_count(device)


# From this many tokens in the block table (B x W x T) DeepGEMM serves next_n = 2 where the project's CUDA kernel
# also runs; below it the CUDA kernel does (its fused maxima save the pass DeepGEMM needs behind it). H200, run 154
# c5 (one call, s = 0.5, us a layer, CUDA kernel / DeepGEMM): SPIN's step 34.9 / 35.6 at 1 x 128K, 57.5 / 59.7 at
# 8 x 128K, 69.9 / 71.5 at 1 x 1M, 125.3 / 127.5 at 8 x 512K (4M tokens), 343.3 / 335.1 at 96 x 128K (12.6M),
# 405.7 / 397.1 at 32 x 512K (16.8M); the dense step 38.2 / 42.5, 79.6 / 86.1, 91.5 / 95.1, 204.7 / 202.2,
# 568.6 / 575.5, 705.7 / 689.5. The boundary is #17's (own logits within 1.11x of DeepGEMM's from 8M tokens).
DEEPGEMM_MIN_TABLE_TOKENS = 1 << 23


def spin_step_uses(next_n: int, device: torch.device | str, table_tokens: int | None = None) -> bool:
    """Whether both steps (SPIN's and the dense one) compute their logits on `device` with DeepGEMM where
    DeepGEMM covers the shape: SPIN_INDEXER_LOGITS=deepgemm / triton / cuda forces the answer; else at next_n = 2
    where the project's CUDA kernel cannot run (indexer_logits_cuda.serves) or the block table holds
    >= DEEPGEMM_MIN_TABLE_TOKENS tokens (table_tokens = B x W x T; None: as a large table). At next_n = 1 the
    project's kernel (scales prefetched on compact tables, the block / group maxima in its epilogue) beats
    DeepGEMM + the maxima pass the step needs after it, or trails it by <= 1%, at every grid point: H200, run 63 (commit 0af490f,
    step_us vs step_other_backend_us, s = 0.5): 96 x 1M 1845.1 vs 1882.8 us, 96 x 512K 957.4 vs 961.0, 96 x 128K
    283.8 vs 284.8, 96 x 64K 166.6 vs 171.0, 8 x 1M 203.6 vs 205.1, 8 x 512K 120.3 vs 120.7, 1 x 1M 71.2 vs 71.9,
    1 x 128K 34.8 vs 35.3; DeepGEMM ahead by <= 1%: 96 x 256K 520.9 vs 524.7, 8 x 128K 57.1 vs 57.6, 32 x 128K
    123.1 vs 123.5. A host rule on static shapes (a captured graph keeps its backend)."""
    forced = forced_logits_backend()
    if forced not in (None, "deepgemm") or next_n not in (1, 2):
        return False
    if forced == "deepgemm":
        return True
    if next_n != 2:
        return False
    if table_tokens is None or table_tokens >= DEEPGEMM_MIN_TABLE_TOKENS:
        return True
    from . import indexer_logits_cuda  # here: it imports triton, which a DeepGEMM-only check needs not
    return not indexer_logits_cuda.serves(device)


def supports(q_fp8: torch.Tensor, kv_cache: torch.Tensor, table_tokens: int | None = None) -> bool:
    """True when DeepGEMM should compute these logits: it covers the shape and `spin_step_uses` picks it for
    their next_n and table size (next_n = 2 from DEEPGEMM_MIN_TABLE_TOKENS, or without the project's CUDA kernel,
    for the dense step and SPIN's alike, or forced by SPIN_INDEXER_LOGITS=deepgemm; see ops.logits_backend).

    History of SPIN's step at next_n = 1: run 11 had the Triton kernel with the update fused win below 1M table
    tokens (the update pass then ran in series); from run 21 the pass ran on a side stream and DeepGEMM + the
    maxima pass won at every size run 27 measured; since runs 62-63 the Triton kernel prefetching its scales
    wins or trails by <= 1% at every grid point (spin_step_uses)."""
    _, next_n, heads, dim = q_fp8.shape
    if not q_fp8.is_cuda or not spin_step_uses(next_n, q_fp8.device, table_tokens):
        return False
    if _module() is None or torch.cuda.get_device_capability(q_fp8.device) != (9, 0):
        return False
    if not (heads == 64 and dim == 128 and kv_cache.shape[1] == 64):
        return False
    padded = kv_cache.shape[0] > 1 and kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.shape[3]
    return not padded  # padded pages (DeepSeek-V4) go to the Triton kernel, which takes a page stride


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
    sms = sm_count(q_fp8.device)
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
