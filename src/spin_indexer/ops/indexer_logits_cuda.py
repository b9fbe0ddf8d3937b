"""Paged indexer logits in CUDA for SM90 (csrc/paged_logits_sm90.cu), next_n 1-4: math warpgroups on key blocks
in turn, each refilling its own TMA stages, so that one block's MMA runs beside another's epilogue, which the
Triton kernel cannot do (issue #17). The logits op's "cuda" backend at next_n 2-4 where DeepGEMM does not serve
(below 8M table tokens at next_n = 2: `step_uses`, ops.logits_backend). Measured (H200, run 124, 96 x 128K, paired
rounds): at next_n = 2 473 us writing the logits only (DeepGEMM 434), 500 us with the block maxima; 736 / 786 at
3 / 4 (873 at 4 with maxima; Triton 1009 / 1180); benchmarks/NOTES.md, runs 101-125. A build with the head sum
through |s| (SPIN_LOGITS_ABS_SUM=1: one FFMA a score, the weighted query's dot product in the MMA,
weighted_query_terms_ref) takes 0.91-0.95x that time at next_n 3-4 on an H100 (runs 147-148) but is not the
library's: where every head's score is <= 0 it misses the FP8-MMA tolerance on widely spread inputs (run 149).
Since run 183 next_n = 3 runs on three warpgroups with the weights in shared memory (0.963x the time of the two of
run 124, twice in paired rounds on an H100; not yet timed on an H200).

Built with nvcc on first use into a cache folder (SPIN_CUDA_CACHE, default ~/.cache/spin_indexer), keyed by the
source's hash, and called through ctypes: no torch extension, no ninja. Where nvcc, an SM90 GPU or the build is
missing, `supports` answers False and callers keep the Triton kernel.

Same math and outputs as `paged_indexer_logits_triton(..., fill_tail=False)`: logits float32 [B*next_n, W*T],
their block maxima [B*next_n, W] and, where asked, the top-k's group maxima of 16 or 32 columns (FUSED_GROUPS);
blocks past each request's longest row are left as they were. Shapes it
takes: H = 64, D = 128, T = 64 (DeepSeek-V3.2's indexer), pages a whole number of 128-byte rows apart (V3.2's
8448 bytes and V4's 8704; not V4's 8640).
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from ..dispatch import forced_logits_backend
from ..layout import page_stride_bytes
from .cuda_build import build_library
from .indexer_logits import check_paged_indexer_args
from .indexer_logits_triton import logits_outputs
from .occupancy import sm_count

SOURCE = Path(__file__).with_name("csrc") / "paged_logits_sm90.cu"
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC")
HEADS, DIM, TOKENS = 64, 128, 64
MAX_CHUNK = 256  # blocks a CTA (the kernel stages their ids in shared memory)
# Group sizes (columns) whose maxima the kernel writes beside the block maxima: a block-max partial covers two
# tokens 8 apart, so groups of 16 (a warp's accumulator rows) and 32 come from the partials, 8 does not
FUSED_GROUPS = (16, 32)
ABS_SUM_TERMS = 4  # the kernel's TERMS: FP8 terms of each row's weighted query (see weighted_query_terms_ref)
ERRORS = {-1: "no cuTensorMapEncodeTiled in the driver", -2: "a TMA tensor map was rejected",
          -3: "the shared-memory attribute was refused", -4: "the launch failed", -5: "bad arguments",
          -6: "the inputs' device could not be made current"}


def build(out_dir: str | os.PathLike | None = None, defines: tuple[str, ...] = ()) -> Path:
    """Compiles the kernel library (about 5 s) unless the cache holds it; returns its path. defines: -D
    switches (NAME=VALUE) of the source's probe builds (benchmarks/cuda_logits_probe.py; none in the library
    this module calls). Raises RuntimeError with nvcc's message when nvcc is missing or fails."""
    return build_library(SOURCE, (*NVCC_FLAGS, *(f"-D{d}" for d in defines)), out_dir)


@functools.cache
def load_library(defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The built library with its entry point typed; None where it does not build or load."""
    try:
        lib = ctypes.CDLL(str(build(defines=defines)))
        fn = lib.spin_paged_logits_sm90
    except (RuntimeError, OSError, AttributeError):  # AttributeError: a library without the entry point
        return None
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [i32, ptr, ptr, i64, i64, ptr, ptr, ptr, i32, i32, i32, ptr, i64, ptr, i64, ptr, i64, i32, i32, i32,
                   i32, i32, ptr]
    fn.restype = i32
    return lib


def weighted_query_terms_ref(q_fp8: torch.Tensor, weights: torch.Tensor,
                             terms: int = ABS_SUM_TERMS) -> tuple[torch.Tensor, torch.Tensor]:
    """The head sum through |s| of the SPIN_LOGITS_ABS_SUM=1 build (csrc: AbsSum), its prologue in torch:
    relu(s) = (s + |s|) / 2 turns sum_h w_h relu(q_h . k) into 1/2 sum_h w_h |q_h . k| + 1/2 q_w . k with
    q_w = sum_h w_h q_h, which the MMA scores as `terms` e4m3 terms beside the heads. Each term rounds the residual
    over a power-of-two scale that puts its largest element at [128, 256), so it keeps 4 significant bits of each
    element: q_w - sum_t scale_t e_t is ~2^-16 of q_w after 4 terms (tests/ops/test_indexer_logits_cuda.py checks the
    bound and the identity on the CPU).
    q_fp8: float8_e4m3fn [B, next_n, 64, 128]; weights: float32 [B*next_n, 64].
    returns (e float8_e4m3fn [B*next_n, terms, 128], scale float32 [B*next_n, terms])."""
    rows = q_fp8.shape[0] * q_fp8.shape[1]
    residual = torch.einsum("rh,rhd->rd", weights.float(), q_fp8.reshape(rows, HEADS, DIM).float())
    out_e, out_scale = [], []
    for _ in range(terms):
        _, exponent = torch.frexp(residual.abs().amax(dim=1))  # max = f 2^exponent, f in [0.5, 1) (0 for 0)
        scale = torch.ldexp(torch.ones(rows), exponent.clamp_min(-100) - 8)
        e = (residual / scale[:, None]).to(torch.float8_e4m3fn)  # nearest; below 256, nothing saturates
        residual = residual - e.float() * scale[:, None]  # exact: e * scale is within one rounding of it
        out_e.append(e)
        out_scale.append(scale)
    return torch.stack(out_e, dim=1), torch.stack(out_scale, dim=1)


def step_uses(next_n: int) -> bool:
    """Whether the logits op picks this kernel at next_n where it runs (ops.logits_backend, after DeepGEMM where
    that serves: next_n = 2 on tables of >= 8M tokens, deepgemm.spin_step_uses): SPIN_INDEXER_LOGITS=cuda forces it
    at next_n 1-4, =triton / deepgemm / reference never; else next_n 2-4 (faster there than the Triton kernel, runs
    108-118; at next_n = 1 both read at copy bandwidth and the Triton kernel also writes the top-k's group maxima
    and the update in its epilogue). A host rule on static shapes."""
    forced = forced_logits_backend()
    if forced not in (None, "cuda") or not 1 <= next_n <= 4:
        return False
    return forced == "cuda" or next_n >= 2


def serves(device: torch.device | str) -> bool:
    """Whether this kernel can run on `device` at all: an SM90 GPU and the library built (nvcc found)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    return load_library() is not None


def supports(q_fp8: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether this kernel runs these inputs: CUDA tensors on a GPU it `serves`, next_n 1-4, H = 64, D = 128,
    T = 64, pages a whole number of 128-byte rows apart."""
    if not (q_fp8.is_cuda and q_fp8.dim() == 4 and kv_cache.dim() == 4):
        return False
    _, next_n, heads, dim = q_fp8.shape
    if (heads, dim, kv_cache.shape[1]) != (HEADS, DIM, TOKENS) or not 1 <= next_n <= 4:
        return False
    try:
        if page_stride_bytes(kv_cache) % DIM:
            return False
    except ValueError:
        return False
    return serves(q_fp8.device)


# A CTA's start (the block ids, q, the first copies into an empty pipeline) costs about as much as 8 blocks: fit
# to chunk 128 taking 1.03x chunk 256's time (96 x 128K and 32 x 512K, paired rounds, run 116)
CTA_START_BLOCKS = 8


def chunk_makespan(batch: int, width: int, sms: int, chunk: int) -> int:
    """Finish time, in blocks, of a grid of batch x ceil(width / chunk) CTAs (each its blocks + CTA_START_BLOCKS;
    a request's last chunk what is left) dispatched in the grid's order (every request's chunk 0, then 1, ...) to
    the SM that frees first, one CTA an SM: the full chunks fill `waves` whole waves and `spare` SMs one more, then
    the B short chunks each take the earliest free slot. Slots on an SM free at load + k * short, so the last short
    CTA starts at the B-th smallest of those; found by bisection (O(log) a chunk, not a heap of B pushes: the rule
    runs on the host the first time a shape comes)."""
    full, part = divmod(width, chunk)
    waves, spare = divmod(batch * full, sms)
    cta = chunk + CTA_START_BLOCKS
    loads = ((waves * cta, sms - spare), ((waves + 1) * cta, spare))  # (an SM's load, how many SMs have it)
    finish = loads[1][0] if spare else loads[0][0]
    if not part:
        return finish
    short = part + CTA_START_BLOCKS

    def slots_before(t: int) -> int:  # free slots starting before t
        return sum(n * -(-(t - load) // short) for load, n in loads if t > load)

    lo, hi = loads[0][0], loads[0][0] + batch * short  # slots_before(lo) = 0 < B <= slots_before(hi)
    while hi - lo > 1:  # the last t with slots_before(t) < B is the B-th smallest slot
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if slots_before(mid) < batch else (lo, mid)
    return max(finish, lo + short)


@functools.lru_cache(maxsize=256)
def makespan_chunk(batch: int, width: int, sms: int) -> int:
    """Blocks a CTA (8..256; a table of 8 blocks or fewer: one chunk) minimizing chunk_makespan, ties to the
    larger chunk: the grid's time where every block costs alike. A short last chunk may fill a wave's spare SMs:
    8 x 512K at s = 0.5 (4096 kept blocks a request) takes 16 chunks of 249 and one of 112 (the 8 short CTAs on 4
    spare SMs) rather than 16 of 256. Paired against the whole-wave rule before it (update_overlap's `wave`; run
    154, H100, SPIN's step on the CUDA kernel at next_n 2-4, 12 points): faster or within 0.1% at every point: 2.5% at
    8 x 512K n = 2 and 1.7% at 32 x 512K n = 4 (s = 0.5). A host rule on static shapes (cached)."""
    if width <= 8:
        return max(width, 1)
    return min(range(min(MAX_CHUNK, width), 7, -1), key=lambda c: (chunk_makespan(batch, width, sms, c), -c))


def grid_chunks(batch: int, width: int, active_width: int | None, chunk: int | None, sms: int) -> tuple[int, int, int]:
    """(lead, chunk, tail_chunk) of the kernel's grid: the table's first `lead` columns (active_width clamped into
    [1, W]; W without it) in chunks of `chunk` (given, or makespan_chunk for B x lead), the rest in chunks of
    max(chunk, makespan_chunk for B x W). The rest is empty on a compact table but where a request keeps more
    blocks than the budget (its first step: every block unscored, so kept): then no CTA there takes more blocks
    than the larger of the two chunks, never one long CTA behind the others."""
    lead = width if active_width is None else min(max(int(active_width), 1), width)
    chunk = chunk or makespan_chunk(batch, lead, sms)
    return lead, chunk, (max(chunk, makespan_chunk(batch, width, sms)) if lead < width else chunk)


def paged_indexer_logits_cuda(q_fp8: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                              seq_lens: torch.Tensor, block_table: torch.Tensor, validate: bool = True,
                              out: torch.Tensor | None = None, block_max_out: torch.Tensor | None = None,
                              chunk: int | None = None, library: ctypes.CDLL | None = None,
                              group_max_out: torch.Tensor | None = None, group: int = 16,
                              active_width: int | None = None) -> torch.Tensor:
    """Paged indexer logits, blocks past each request's longest row left unwritten (as the Triton kernel with
    fill_tail=False). q_fp8: float8_e4m3fn [B, next_n, 64, 128]; kv_cache: uint8 [num_blocks, 64, 1, 132];
    weights: float32 [B*next_n, 64]; seq_lens: int32 [B, next_n]; block_table: int32 [B, W]; out: float32
    [B*next_n, W*64]; block_max_out: float32 [B*next_n, W], or None: the kernel built without the block maxima runs
    (logits only, as DeepGEMM's; 0.94-0.95x the time at next_n = 2, run 106); chunk: blocks a CTA (1-256; None:
    makespan_chunk, see grid_chunks). group_max_out: optional float32 [B*next_n, >= W*T / group] receiving the max
    of every `group` columns (group in FUSED_GROUPS; the top-k's group maxima, ops.topk.group_max_ref) of the
    blocks written, from the block maxima's partials (block_max_out is then computed too, allocated when not
    given). A NaN logit makes its block's and group's max NaN. active_width: the table columns expected to hold
    blocks (SPIN's kept budget on a compact table; None = all W): the default chunk splits those over the GPU, and
    the columns past them go in chunks of the larger of that chunk and the full table's, CTAs that return at once
    unless a request keeps more blocks (`grid_chunks`). Chunked by W instead, half the CTAs of a compact table at
    s = 0.5 had nothing to do: SPIN's step at 8 x 128K next_n = 4 took 108.1 us instead of 78.2 (H100, run 153).
    With the tail in 256-block chunks instead of grid_chunks', a request's first step (every block kept) at
    1 x 128K next_n = 2 took 73.4 us against 13.8 (run 154 c2, H100, benchmarks/cuda_first_step.py).
    Ids outside the cache read block 0 (validate=False: wrong logits, never a read outside the cache).
    library: a probe build (`load_library(defines)`, benchmarks only); None = the production one.
    Raises ValueError for inputs `supports` rejects. returns out: float32 [B*next_n, W*64]."""
    check_paged_indexer_args(q_fp8, kv_cache, weights, seq_lens, block_table, validate)
    if group_max_out is not None and group not in FUSED_GROUPS:
        raise ValueError(f"group: the CUDA kernel writes the maxima of groups of {' or '.join(map(str, FUSED_GROUPS))} "
                         f"columns, got {group}")
    if not supports(q_fp8, kv_cache):
        raise ValueError(f"q_fp8 / kv_cache: the CUDA logits kernel takes CUDA tensors on an SM90 GPU with next_n "
                         f"1-4, H = {HEADS}, D = {DIM}, T = {TOKENS} and pages a whole number of {DIM}-byte rows "
                         f"apart (and nvcc to build it); got q_fp8 {list(q_fp8.shape)} on {q_fp8.device}, kv_cache "
                         f"{list(kv_cache.shape)}")
    if chunk is not None and not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk: expected 1..{MAX_CHUNK} blocks a CTA, got {chunk}")
    batch, next_n = q_fp8.shape[:2]
    width = block_table.shape[1]
    out, block_max_out = logits_outputs(q_fp8, kv_cache, block_table, out, block_max_out,
                                        maxima=block_max_out is not None or group_max_out is not None,
                                        group_max_out=group_max_out, group=group)
    if batch == 0 or width == 0:
        return out
    q = q_fp8 if q_fp8.is_contiguous() else q_fp8.contiguous()
    w = weights if weights.is_contiguous() else weights.contiguous()
    lens = seq_lens if seq_lens.is_contiguous() else seq_lens.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    lead, chunk, tail_chunk = grid_chunks(batch, width, active_width, chunk, sm_count(q.device))  # q's GPU's SMs
    stream = torch.cuda.current_stream(q.device).cuda_stream  # the library makes q's device its current one
    rc = (library or load_library()).spin_paged_logits_sm90(
        next_n, q.data_ptr(), kv_cache.data_ptr(), kv_cache.shape[0], page_stride_bytes(kv_cache), w.data_ptr(),
        lens.data_ptr(), block_table.data_ptr(), batch, width, block_table.stride(0), out.data_ptr(), out.stride(0),
        block_max_out.data_ptr() if block_max_out is not None else None,
        block_max_out.stride(0) if block_max_out is not None else 0,
        group_max_out.data_ptr() if group_max_out is not None else None,
        group_max_out.stride(0) if group_max_out is not None else 0, group if group_max_out is not None else 0,
        chunk, lead, tail_chunk, q.device.index, stream)
    if rc != 0:
        raise RuntimeError(f"paged_indexer_logits_cuda: {ERRORS.get(rc, rc)}")
    return out
