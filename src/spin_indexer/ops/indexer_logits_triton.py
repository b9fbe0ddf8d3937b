"""Triton twin of `paged_indexer_logits_ref`: paged FP8 indexer logits with the per-block max fused.

One program per (request, chunk of CHUNK blocks). For each block it loads the [T, D] fp8 key tile once
(TMA descriptor) and feeds it to one MMA per group of next_n rows: `dot(k, q^T)` with the group's [G*H, D]
queries, T on the MMA's M axis and the G*H (row, head) pairs on N, so each row's head sum stays inside a
thread quad. Then ReLU, the per-head weights, the head sum per row and the per-token scale, and the stores
of the T logits and the block max of every row of the group at once. Groups (LogitsConfig.group): 1 row per
MMA is the n = 1 kernel; 2 or 4 rows per MMA read the key tile from shared memory once for all of them and
share the mask / store / block-max work (next_n = 3: rows {0, 1} + {2}, or one group padded to 4). Triton's
pipeliner prefetches the next key tiles; the block's T fp32 scales come by a pointer load in the iteration that
uses them, or by hand one or two blocks ahead (LogitsConfig.prefetch). (A second TMA descriptor for the scales
was tried: Triton pipelines only loads that feed an MMA operand, so that load waited in its own iteration;
benchmarks/NOTES.md, #17.)

With a HistoryUpdate (SPIN's step, row-0 MTP policy) the epilogue also applies the EMA update of the
block's history from row 0's scores, still in registers (history_triton.ema_tile): the update costs its
V / D bytes only, never a second pass over the logits. Without fill_tail, blocks past each request's
longest row are not written, logits nor block max (as the production kernel leaves them), so the cost
follows the lengths, not W; inside the blocks it scores, columns past a row's length still get -inf.

Cache bytes: pages P bytes apart (P = T * (D + 4) = 8448 contiguous, or padded: DeepSeek-V4's 8640 /
8704), each T*D fp8 key bytes then T fp32 scales; the padding is never read. Where P is a whole number RB
of D-byte rows (66 for contiguous T=64, D=128; 68 for 8704) the keys are a 2D fp8 array [rows, D] and rows
[b*RB, b*RB + T) are block b's keys (the layout the H200 runs measured). Otherwise (8640 = 67.5 rows) a 3D
descriptor [num_blocks, T, D] with strides [P, D, 1] loads the tile. Block b's scales start at byte
b*P + T*D. TMA needs 16-byte-multiple strides and a 16-byte-aligned base (checked in the launcher).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..checks import check_tensor
from ..layout import FP8_DTYPE, PAGE_ALIGN_BYTES, SCALE_BYTES, page_stride_bytes
from .history import HistoryUpdate, update_history_ref
from .indexer_logits import block_max_ref, check_paged_indexer_args, paged_indexer_logits_ref
from .topk import check_group, group_max_into

try:  # the package imports this module only for CUDA tensors; without triton the reference is used
    import triton
    import triton.language as tl

    from .history_triton import _history_args, _no_history, ema_tile, row_constants, update_history_triton
    from .maxima_triton import max_nan
    from .occupancy import resident_programs, sm_count
except ImportError:  # pragma: no cover
    triton = None

# Blocks per program (a runtime argument: no recompiles), from request count x table width; picked on the
# H200 (benchmarks/NOTES.md, run 2: 16 blocks best up to ~8K programs, 64 for 96 x 8192 blocks).
_TARGET_PROGRAMS = 16384


def _pick_chunk(batch: int, width: int, target_programs: int = _TARGET_PROGRAMS, max_chunk: int = 256) -> int:
    """Blocks per program: 16, halved (down to 4) while the grid has < 1K programs, doubled (up to max_chunk)
    while it has > target_programs (run 2 on the H200: 16 best at 1-8K programs, 64 at 96 x 8192 blocks;
    B=1 x 64K with 16 left 64 programs for 132 SMs)."""
    def programs(c):
        return batch * -(-width // c)
    chunk = 16
    while chunk > 4 and programs(chunk) < 1024:
        chunk //= 2
    while chunk < max_chunk and programs(chunk) > target_programs:
        chunk *= 2
    return chunk


@dataclasses.dataclass(frozen=True)
class LogitsConfig:
    """A launch configuration of the kernel.

    group: next_n rows per MMA (N = group * H); the rows are cut into groups of `group`, the last one
    shorter (next_n = 3, group 2 -> rows {0, 1} and {2}; group 4 -> one group padded with a zero row).
    num_warps: 4 (one warpgroup: N whole in each thread quad) or 8 (two warpgroups split N; with group >= 2
    each holds whole rows, so the head sum stays inside a warp). num_stages: the pipeliner's stages.
    max_registers: ptxas's cap per thread (None: its own choice); a cap trades a few spills for resident
    programs (64K registers per SM: 4 warps at <= 128 -> 4 programs, <= 168 -> 3).
    target_programs: the chunk rule doubles blocks per program while the grid has more programs (each
    program loads next_n x 8 KB of queries before its loop: more rows argue for longer chunks), up to
    max_chunk blocks.
    prefetch: load the block ids and scales `prefetch` blocks ahead by hand: 0 (none), 1 (the next block's, in
    the iteration before; True means 1) or 2 (two sets in flight: block blk + 2's issued in iteration blk).
    Triton 3.6's pipeliner prefetches the id and the key tile but loads the scales in the iteration that uses
    them: a DRAM round trip per block that only other resident programs hide (run 15: prefetch 1 won by 23-27%
    at n >= 2, with <= 4 resident programs; run 2 at n = 1 with 8 resident: 4-9% slower).
    """
    group: int = 1
    num_warps: int = 4
    num_stages: int = 3
    max_registers: int | None = None
    target_programs: int = _TARGET_PROGRAMS
    prefetch: int = 0
    max_chunk: int = 256

    def __post_init__(self):
        if self.prefetch not in (0, 1, 2):  # True == 1, False == 0
            raise ValueError(f"LogitsConfig.prefetch: expected 0, 1 or 2 (blocks ahead), got {self.prefetch!r}")
        object.__setattr__(self, "prefetch", int(self.prefetch))  # True -> 1: one spelling, one kernel

    def group_rows(self, next_n: int) -> tuple[int, int, int, int]:
        """Rows of each of the (at most 4) groups, 0 for absent ones: next_n 3, group 2 -> (2, 1, 0, 0)."""
        rows = [min(self.group, next_n - g * self.group) for g in range(-(-next_n // self.group))]
        if len(rows) > 4 or self.group not in (1, 2, 4):
            raise ValueError(f"config: expected group in (1, 2, 4) with at most 4 groups, got group "
                             f"{self.group} for next_n {next_n}")
        return tuple(rows + [0] * (4 - len(rows)))


# The production configuration per next_n. Counts from benchmarks/logits_registers.py (ptxas for sm_90a,
# Triton 3.6), per key block: a block must cost <= ~480 SM cycles to read keys at copy bandwidth; the FP8 MMA
# of one row is 128 cycles at the nominal peak; the loop's instructions per warp are the issue cycles per
# block of each of the SM's 4 schedulers (4 warps).
# - n 1: one [T, H] MMA; 64 registers (8 resident programs), ~200 instructions: at copy bandwidth (run 4).
# - n 2: both rows in one [T, 2H] MMA: the key tile read from shared memory once, one mask/store/block-max
#   pass for both rows.
# - n 3: rows {0, 1} in one MMA, row 2 in a second (a padded group of 4 does 4/3 of the MMA work).
# - n 4: one [T, 4H] MMA (wgmma N = 256: the most MMA work per key-tile read).
# Measured (bench_mtp_logits.py, H200, commit 32d228a, benchmarks/results/run15_final/mtp): at n >= 2 the
# scales loaded one block ahead by hand (prefetch) win every point, by 23-27% (n = 2: 572 vs 744 us at
# 96 x 128K; n = 4: 1154 vs 1570), the scale load's latency being the loop's critical path once the MMA
# of several rows follows it; the register caps chosen from counts lost to the uncapped + prefetch configs
# at n = 2 and tied at n = 3. n = 1: see default_config (whether the scales are prefetched depends on the table).
# The register cap is dropped when the EMA update is fused (its extra live values spill under the cap).
# n = 3 / 4 since runs 70-71 (bench_mtp_logits.py, commits e7e11ba / 02a6b27, benchmarks/results/run70_mtp_candidates,
# run71_guard_mtp): n = 3 with the scales two blocks ahead (prefetch 2): 96 x 128K 969.2 -> 941.5 and 975.0 -> 947.2
# us, 32 x 512K 1345.3 -> 1314.8; n = 4 chunked for <= 4096 programs (fewer, longer programs; 2 resident an SM
# either way): 96 x 128K 1141.7 -> 1092.2 (run 71; run 70 1109.3), 32 x 512K 1704.0 / 1571.4 -> 1462.8 / 1459.5,
# 48 x 384K 1612.4 / 1705.2 -> 1639.6 / 1668.8 (a loss in run 70, a gain in run 71).
CONFIGS = {1: LogitsConfig(1, 4, 3), 2: LogitsConfig(2, 4, 3, prefetch=True),
           3: LogitsConfig(2, 4, 3, max_registers=168, prefetch=2),
           4: LogitsConfig(4, 4, 3, prefetch=True, target_programs=4096)}


# next_n = 1 prefetches the scales on SPIN's compact tables at every size and on full tables of at most
# PREFETCH_MAX_SMALL or at least PREFETCH_MIN_LARGE blocks (B x W). H200, per layer (CUDA graphs, default chunk):
# compact tables (run 62, logits_chunks.py, with the maxima fused) 1 x 128K 8.2 -> 7.0 us, 8 x 128K 29.7 -> 26.3,
# 32 x 128K 91.5 -> 79.5, 96 x 128K 237.7 -> 220.6 (1 x 512K 13.8 -> 14.7 the one loss); full tables (run 63 vs
# run 58, the dense logits) 1 x 64K 8.1 -> 6.6, 1 x 128K 9.7 -> 8.4, 32 x 128K / 8 x 512K 147.6 / 147.4 -> 146.2 /
# 145.0, 8 x 1M 286.6 -> 276.8, 96 x 128K / 512K / 1M 454.3 / 1701.4 / 3519.6 -> 439.6 / 1623.4 / 3251.1, but 4096
# to 16384 blocks slower: 1 x 256K 13.0 -> 14.1, 1 x 512K / 8 x 64K 22.1 -> 24.7, 8 x 128K / 1 x 1M 40.5 / 40.4 ->
# 45.2 / 45.1 (sizes between 16384 and 65536 blocks: not measured, left without).
PREFETCH_MAX_SMALL = 2048
PREFETCH_MIN_LARGE = 65536
# SPIN's compact tables at next_n = 1 take longer chunks than a full table of as many kept blocks (the chunk rule
# stops doubling at 4096 programs, not 16384): the step runs the EMA update on a side stream beside these logits,
# and fewer, longer programs leave it room. Measured in the 61-layer V3.2 step (bench_v32_step.py, B = 96, SPIN
# indexer time / dense): 128K 0.603 -> 0.595, 256K 0.594 -> 0.580, 1M 0.598 -> 0.600 (run 67, e9ab0f4) and
# 0.604 -> 0.595, 0.596 -> 0.581, 0.596 -> 0.597 (run 68, 73985b1), although the logits alone are no faster
# outside the step (run 68, logits_chunks.py: 96 x 128K chunk 16 -> 32 219.1 -> 215.4 us, 256K 16 -> 64 437.5
# -> 467.1, 512K 32 -> 128 857.5 -> 862.2, 1M 64 -> 256 1714.4 -> 1715.9). Grids below 4096 programs at chunk
# 16 (B x kept blocks < 64K) are unchanged. But at most COMPACT_MAX_CHUNK blocks a program: since the update left
# the logits' side (run 73: it runs beside the top-k) the long programs of large tables only leave a ragged last
# wave (96 x 512K s = 0.4: 39 programs of 128 blocks a request, ~4 waves). H200, run 95 (update_overlap.py, SPIN's
# step paired with the dense step): 96 x 512K s = 0.4 1.477x -> 1.492x at 64 blocks (1.490x at 32), s = 0.5
# 1.756x -> 1.765x; 96 x 1M s = 0.4 1.469x -> 1.488x at 64 (1.481x at 128); 96 x 128K (chunk 32 either way)
# 1.502x against 1.491x at 16: so a cap on the chunk, not a larger program target (the V3.2 step at 128K:
# 0.597 -> 0.607 with 16384 programs, run 95). Run 97 (31 paired rounds, cap 32 against 64): 512K s = 0.4 / 0.5 /
# 0.3 1.482x -> 1.497x / 1.751x -> 1.755x / 1.299x -> 1.303x, 1M 1.472x -> 1.480x / 1.740x -> 1.745x / 1.275x ->
# 1.281x, 256K 1.489x -> 1.487x / 1.756x -> 1.747x / 1.281x -> 1.317x (512K s = 0.4 at 32 three times, 1.496-1.497x).
COMPACT_TARGET_PROGRAMS = 4096
COMPACT_MAX_CHUNK = 32

# Within those bounds the grid runs in waves. A program of the compact launch (scales prefetched) holds 33 KB of
# shared memory (three key stages and the query tile; ptxas for sm_90a, triton 3.6: 64 registers, 33,048 B), so an
# SM holds 6 of them (792 places on 132 SMs; 8 without the prefetch: 24,852 B, 1056 places). Programs of equal work
# run in waves of the places, and a last wave too small to keep HBM busy runs at its programs' own latency-bound
# pace. H100, run 166 (logits_chunks.py, s = 0.5): at 1024 programs (one wave and 232) the prefetching launch took
# 60.5 us at 64 x 32K against 56.2 / 57.2 at 2048 / 512 programs, and 32.3 / 32.7 us at 32 x 32K / 8 x 128K
# against 30.6 / 31.1 at 512, where the launch without the prefetch (1056 places) was fastest at 1024 at two of
# the three. wave_cost models it; wave_chunk lengthens the block-count rule's chunk where the model sees more than
# WAVE_GAIN. Run 167 (H100, 89353fc, paired in one run): 64 x 32K 60.6 -> 56.9 us, 32 x 32K 32.3 -> 30.4, 8 x 128K
# 32.8 -> 30.8, 1 x 1M 32.0 -> 30.8; at s = 0.2 47.6 -> 45.9 / 45.5 / 45.6 (8 x 128K / 32 x 32K / 1 x 1M, chunk 8
# -> 32); 8 x 1M 16 -> 32 blocks (4.3% modeled) 204.2 -> 204.4: many waves drift apart, so their tails cost less
# than modeled, hence the 5% margin. Over runs 166-167's 20 timed (point, sparsity) groups of this configuration at
# 8 / 16 / 32 blocks the chunk chosen so is within 1.8% of the fastest timed one (the block-count rule's up to 8.4%
# off). SATURATING_PROGRAMS is this configuration's: without the prefetch each program is slower, and one wave of
# 512 programs ran 11% behind 1024 (64 x 32K s = 0.5) where this number calls them even.
SATURATING_PROGRAMS = 320
WAVE_GAIN = 0.05


def _wave(long: int, short: int, chunk: int, rest: int, saturating: int) -> int:
    """One wave in the model: `long` programs of `chunk` blocks and `short` of `rest` < chunk blocks start
    together; while n run each moves at 1 / max(n, saturating) blocks a time unit."""
    if not long:
        return rest * max(short, saturating)
    return rest * max(long + short, saturating) + (chunk - rest) * max(long, saturating)


def wave_cost(batch: int, blocks: int, chunk: int, slots: int, saturating: int = SATURATING_PROGRAMS) -> int:
    """Modeled time of a launch of `batch` rows of `blocks` blocks in programs of `chunk` on `slots` resident
    places, in units of one block's bytes at full bandwidth: each row's blocks // chunk full programs, in the grid's
    order (chunk index, then row), fill waves of `slots`; each row's short program (blocks % chunk, the last chunk
    index) follows, beside the last full wave's programs where places are free. While n programs run each moves
    at 1 / max(n, saturating) blocks a unit: HBM's one block a unit shared, or, below `saturating` programs, each
    program's own latency-bound pace. Short programs that find no free place count as a wave of their own after
    (an upper bound: they would start as the first ones leave)."""
    full, rest = divmod(blocks, chunk)
    waves, last = divmod(batch * full, slots)
    short = batch if rest else 0
    beside = min(short, slots - last)
    cost = waves * chunk * max(slots, saturating)
    if last or beside:
        cost += _wave(last, beside, chunk, rest, saturating)
    more_waves, more = divmod(short - beside, slots)
    cost += more_waves * _wave(0, slots, chunk, rest, saturating)
    return cost + (_wave(0, more, chunk, rest, saturating) if more else 0)


@functools.lru_cache(maxsize=1024)  # asked on every compact launch (each layer of an eager step): its few shapes
def wave_chunk(batch: int, blocks: int, slots: int, chunk: int, max_chunk: int = 256, gain: float = WAVE_GAIN) -> int:
    """Blocks per program for `batch` rows of `blocks` blocks on `slots` resident places: `chunk` (the
    block-count rule's, `_pick_chunk`), or a longer one (chunk x 2^i <= max_chunk, up to the first covering
    `blocks`) whose launch wave_cost finishes soonest, where that beats `chunk` by more than `gain`; ties go to the
    longer. Never shorter: the model leaves out what each program costs to start (its queries, its pipeline's
    first loads), and no measurement has a shorter chunk winning by more than the noise (run 166: 96 x 128K s =
    0.4, the model's 1.3% for 8 blocks against 16 measured 2% the other way)."""
    def cost(c):
        return wave_cost(batch, blocks, c, slots)
    candidates = [chunk]
    while candidates[-1] * 2 <= max_chunk and candidates[-1] < blocks:
        candidates.append(candidates[-1] * 2)
    best = min(candidates, key=lambda c: (cost(c), -c))
    return best if cost(best) < (1 - gain) * cost(chunk) else chunk


def default_config(next_n: int, table_blocks: int, compact: bool) -> LogitsConfig:
    """The launch configuration for next_n rows on a table of table_blocks blocks (B x W); compact: SPIN's
    compact table (the kernel sized by its kept budget, `active_width`)."""
    if next_n != 1:
        return CONFIGS[next_n]
    if compact:
        return dataclasses.replace(CONFIGS[1], prefetch=1, target_programs=COMPACT_TARGET_PROGRAMS,
                                   max_chunk=COMPACT_MAX_CHUNK)
    prefetch = table_blocks <= PREFETCH_MAX_SMALL or table_blocks >= PREFETCH_MIN_LARGE
    return dataclasses.replace(CONFIGS[1], prefetch=prefetch)


def _kernel_supports(next_n: int, heads: int, dim: int, tokens: int) -> bool:
    def pow2(x):
        return x > 0 and x & (x - 1) == 0
    return 1 <= next_n <= 4 and pow2(heads) and heads >= 4 and pow2(dim) and dim >= 32 and pow2(tokens) \
        and tokens >= 16


def logits_outputs(q_fp8: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                   out: torch.Tensor | None, block_max_out: torch.Tensor | None,
                   maxima: bool = True, group_max_out: torch.Tensor | None = None,
                   group: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out float32 [B*next_n, W*T], block_max_out float32 [B*next_n, W]) of a paged logits launch: the
    caller's buffers checked (dtype, shape, device, out's unit column stride), or new ones; with maxima=False and
    no block_max_out, block_max_out stays None (a kernel that can leave the maxima out). group_max_out, when
    given, is checked too: float32 [B*next_n, >= W*T / group], unit column stride, group a power of two
    dividing T."""
    batch, next_n = q_fp8.shape[:2]
    tokens, width = kv_cache.shape[1], block_table.shape[1]
    rows, dev = batch * next_n, q_fp8.device
    if out is None:
        out = torch.empty(rows, width * tokens, dtype=torch.float32, device=dev)
    check_tensor("out", out, dtype=torch.float32, shape=(rows, width * tokens), shape_names="[B*next_n, W*T]",
                 device=dev, device_of="q_fp8")
    if out.stride(1) != 1:
        raise ValueError(f"out: expected unit column stride, got strides {out.stride()}")
    if group_max_out is not None:
        check_tensor("group_max_out", group_max_out, dtype=torch.float32, ndim=2, device=dev, device_of="q_fp8")
        check_group(group, tokens)
        if group_max_out.shape[0] != rows or group_max_out.shape[1] < width * tokens // group:
            raise ValueError(f"group_max_out: expected shape [B*next_n, >= W*T / group] = [{rows}, >= "
                             f"{width * tokens // group}], got {list(group_max_out.shape)}")
        if group_max_out.stride(1) != 1:
            raise ValueError(f"group_max_out: expected unit column stride, got strides {group_max_out.stride()}")
    if block_max_out is None:
        if not maxima:
            return out, None
        block_max_out = torch.empty(rows, width, dtype=torch.float32, device=dev)
    check_tensor("block_max_out", block_max_out, dtype=torch.float32, shape=(rows, width),
                 shape_names="[B*next_n, W]", device=dev, device_of="q_fp8")
    return out, block_max_out


def paged_indexer_logits_triton(q_fp8: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                                seq_lens: torch.Tensor, block_table: torch.Tensor, validate: bool = True,
                                out: torch.Tensor | None = None, block_max_out: torch.Tensor | None = None,
                                fill_tail: bool = True, history: HistoryUpdate | None = None,
                                chunk: int | None = None, config: LogitsConfig | None = None,
                                active_width: int | None = None, group_max_out: torch.Tensor | None = None,
                                group: int = 64) -> torch.Tensor:
    """Paged indexer logits, same arguments and meaning as `paged_indexer_logits_ref`.

    q_fp8: float8_e4m3fn [B, next_n, H, D]; kv_cache: uint8 [num_blocks, T, 1, D + 4] (pages contiguous or
    padded to a 16-byte-multiple stride, its data pointer 16-byte aligned);
    weights: float32 [B*next_n, H]; seq_lens: int32 [B, next_n]; block_table: int32 [B, W].
    out: optional float32 [B*next_n, W*T] to write into; block_max_out: optional float32 [B*next_n, W],
    receives the max of each block's valid logits (-inf for a block with none).
    fill_tail: write -inf past each row's length (False: leave the logits and block maxima of blocks past
    the request's longest row unwritten; columns past a row's length inside its scored blocks are -inf). history: also apply SPIN's EMA update (ops/history.py), fused into
    the epilogue when only row 0 updates, else by the standalone update kernel after the logits.
    chunk: blocks per program (default from the grid size, `_pick_chunk`). config: the launch configuration
    (default `default_config`; benchmarks pass others to compare them). active_width: the table columns
    expected to hold blocks (SPIN's compact tables fill about (1 - s) x W of their W columns): the default
    chunk is picked for B x active_width blocks, so that the programs that have work fill the GPU (a
    program past a row's last kept block exits at once); the grid still covers all W columns.
    group_max_out: optional float32 [B*next_n, >= W*T / group] receiving the max of every `group` columns
    (group_max_ref: -inf for a group with no valid column, NaN for one holding a NaN), from the scores in the
    epilogue, as the block max: the top-k's group maxima (ops.topk.topk_group) without a pass of their own.
    group: a power of two dividing T. Written where the block max is (fill_tail as there).
    The FP8 MMA accumulates with Hopper's reduced-precision adder, ~2-3e-4 relative error against fp32 math
    over D = 128 (as the production kernel). Shapes the kernel does not take (next_n > 4, H or D not powers of
    two, D < 32) are computed by the reference into the same buffers.
    returns out: float32 [B*next_n, W*T].
    """
    check_paged_indexer_args(q_fp8, kv_cache, weights, seq_lens, block_table, validate)
    batch, next_n, heads, dim = q_fp8.shape
    tokens, width = kv_cache.shape[1], block_table.shape[1]
    out, block_max_out = logits_outputs(q_fp8, kv_cache, block_table, out, block_max_out,
                                        group_max_out=group_max_out, group=group)
    if batch == 0 or width == 0:
        return out
    if not _kernel_supports(next_n, heads, dim, tokens):
        # Shapes the MMA tiles cannot take (next_n > 4, D < 32, non-powers of two): the reference, same outputs.
        out.copy_(paged_indexer_logits_ref(q_fp8, kv_cache, weights, seq_lens, block_table, validate=False))
        block_max_out.copy_(block_max_ref(out, tokens))
        if group_max_out is not None:
            group_max_into(group_max_out, out, seq_lens, group)
        if history is not None:
            update_history_ref(history, out.view(batch, next_n, -1), block_table, seq_lens)
        return out
    k_arg, scales_f32, page_bytes, rows_per_block = _cache_args(kv_cache, tokens, dim)
    q = q_fp8 if q_fp8.is_contiguous() else q_fp8.contiguous()
    w = weights if weights.is_contiguous() else weights.contiguous()
    lens = seq_lens if seq_lens.is_contiguous() else seq_lens.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    fused = history is not None and history.rows == 1
    hist = _history_args(history, out) if fused else _no_history(out)
    cfg = config or default_config(next_n, batch * width, active_width is not None)
    r0, r1, r2, r3 = cfg.group_rows(next_n)
    gmax = group_max_out if group_max_out is not None else block_max_out  # a dummy pointer when unused
    meta = dict(NEXT_N=next_n, H=heads, D=dim, T=tokens, PAGE_BYTES=page_bytes, RB=rows_per_block, G=cfg.group,
                R0=r0, R1=r1, R2=r2, R3=r3, PREFETCH=cfg.prefetch, FILL_TAIL=fill_tail, HIST=fused,
                GMAX=group_max_out is not None, GS=group if group_max_out is not None else tokens,
                HAS_SEEN=fused and history.last_seen is not None, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, maxnreg=None if fused else cfg.max_registers)

    def args(blocks_per_program):
        return (q, k_arg, scales_f32, w, lens, block_table, out, block_max_out, gmax, width, block_table.stride(0),
                out.stride(0), block_max_out.stride(0), gmax.stride(0), blocks_per_program, kv_cache.shape[0], *hist)
    if not chunk:
        blocks = min(width, active_width or width)
        chunk = _pick_chunk(batch, blocks, cfg.target_programs, cfg.max_chunk)
        if active_width is not None and q.is_cuda:  # SPIN's compact table: the grid's waves decide (wave_chunk)
            slots = _resident_slots(args(chunk), meta, q.device)
            if slots:
                chunk = wave_chunk(batch, blocks, slots, chunk, max_chunk=cfg.max_chunk)
    _paged_indexer_logits_kernel[(batch, triton.cdiv(width, chunk))](*args(chunk), **meta)
    if history is not None and not fused:
        update_history_triton(history, out.view(batch, next_n, -1), block_table, seq_lens)
    return out


_SLOTS: dict = {}  # (device index, the launch's constants) -> resident places of its compiled kernel, or None


def _resident_slots(args: tuple, meta: dict, device: torch.device) -> int | None:
    """Programs of this launch's compiled kernel the GPU holds at once (an SM's, occupancy.resident_programs, x
    SMs), or None where the driver cannot say; once per (device, constants): the kernel compiles here, for the
    launch just after. Not asked inside a CUDA-graph capture (the driver query is no stream work, but a capture
    should hold no call the eager step did not make): a launch first seen there keeps the block-count rule."""
    key = (device.index, tuple(meta.items()))  # the launcher builds meta in one order
    if key not in _SLOTS:
        if torch.cuda.is_current_stream_capturing():
            return None
        per_sm = resident_programs(_paged_indexer_logits_kernel.warmup(*args, grid=(1,), **meta))
        _SLOTS[key] = None if per_sm is None else per_sm * sm_count(device)
    return _SLOTS[key]


def _cache_args(kv_cache: torch.Tensor, tokens: int, dim: int):
    """(key descriptor, fp32 view of the cache bytes, page stride P in bytes, RB) for the kernel. RB = P / D
    rows per page when P is a whole number of D-byte rows (a 2D descriptor, block b's keys at row b*RB),
    else 0 (a 3D descriptor [num_blocks, T, D] with strides [P, D, 1]). Raises ValueError naming kv_cache
    where TMA cannot take the layout."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    num_blocks = kv_cache.shape[0]
    page_bytes = page_stride_bytes(kv_cache)
    if page_bytes % PAGE_ALIGN_BYTES or kv_cache.data_ptr() % PAGE_ALIGN_BYTES:
        raise ValueError(f"kv_cache: expected a page stride and data pointer that are multiples of "
                         f"{PAGE_ALIGN_BYTES} bytes (TMA), got stride {page_bytes}, pointer offset "
                         f"{kv_cache.data_ptr() % PAGE_ALIGN_BYTES}")
    # Every byte from the first page's start to the last page's scales: the padding after the last page
    # may not exist (a view into a tighter allocation), and no load reaches past the last scale.
    span = max((num_blocks - 1) * page_bytes + tokens * (dim + SCALE_BYTES), 0)
    flat = torch.as_strided(kv_cache, (span,), (1,))
    scales_f32 = flat.view(torch.float32)  # block b's scales at [(b*P + T*D) / 4, + T)
    keys = flat.view(FP8_DTYPE)
    if page_bytes % dim == 0:
        rows_per_block = page_bytes // dim
        keys2d = keys[: span // dim * dim].view(span // dim, dim)  # [rows, D]; block b's keys at row b*RB
        desc = TensorDescriptor(base=keys2d, shape=list(keys2d.shape), strides=[dim, 1], block_shape=[tokens, dim])
        return desc, scales_f32, page_bytes, rows_per_block
    keys3d = torch.as_strided(keys, (num_blocks, tokens, dim), (page_bytes, dim, 1))
    desc = TensorDescriptor(base=keys3d, shape=[num_blocks, tokens, dim], strides=[page_bytes, dim, 1],
                            block_shape=[1, tokens, dim])
    return desc, scales_f32, page_bytes, 0


if triton is not None:
    @triton.jit
    def _load_group(q_ptr, w_ptr, row, ROWS: tl.constexpr, GP: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
                    D: tl.constexpr):
        """q^T float8 [D, GP*HP] and weights float32 [GP*HP] of rows row .. row + ROWS - 1, column g*HP + h =
        head h of row row + g; zero for padded heads (h >= H) and padded rows (g >= ROWS): relu(0) * 0 adds
        nothing. Transposed here, outside the block loop, so the MMA's shared-memory copy of q is made once
        (a tl.trans inside the loop re-stored q byte by byte every block on Triton 3.9)."""
        n = tl.arange(0, GP * HP)
        live = (n // HP < ROWS) & (n % HP < H)
        src = (row + n // HP).to(tl.int64) * H + n % HP  # [GP*HP] row-major index into [R, H]
        q = tl.load(q_ptr + src[:, None] * D + tl.arange(0, D)[None, :], mask=live[:, None], other=0.0)
        return tl.trans(q), tl.load(w_ptr + src, mask=live, other=0.0)

    @triton.jit
    def _score_group(k, qt, w, sc, T: tl.constexpr, GP: tl.constexpr, HP: tl.constexpr):
        """GP rows at once: k [T, D] fp8, qt [D, GP*HP] fp8, w [GP*HP], sc [T] -> logits float32 [T, GP].
        One MMA with N = GP*HP (T on the M axis): the key tile is read from shared memory once for the GP
        rows, and each row's head sum stays inside a thread quad (the reshape splits N, not M)."""
        s = tl.maximum(tl.dot(k, qt), 0.0) * w[None, :]  # [T, GP*HP]: relu(k[t] . q[g, h]) * w[g, h]
        return tl.sum(tl.reshape(s, (T, GP, HP)), axis=2) * sc[:, None]

    @triton.jit
    def _store_group(x, lens, rows64, out_ptr, out_stride, bmax_ptr, bmax_stride, gmax_ptr, gmax_stride, blk,
                     ROWS: tl.constexpr, GP: tl.constexpr, T: tl.constexpr, GMAX: tl.constexpr, GS: tl.constexpr):
        """Masks x [T, GP] past each row's length (lens [GP]), stores the ROWS live rows' logits and block
        maxima (and with GMAX the maxima of every GS columns), returns the masked x."""
        cols = blk * T + tl.arange(0, T)
        x = tl.where(cols[:, None] < lens[None, :], x, float("-inf"))
        ptrs = out_ptr + rows64[None, :] * out_stride + cols[:, None]
        bptrs = bmax_ptr + rows64 * bmax_stride + blk
        live = tl.arange(0, GP) < ROWS
        if ROWS < GP:  # next_n = 3 in one group of 4: the padded row is not stored
            tl.store(ptrs, x, mask=live[None, :])
            tl.store(bptrs, tl.max(x, axis=0), mask=live)
        else:
            tl.store(ptrs, x)
            tl.store(bptrs, tl.max(x, axis=0))
        if GMAX:  # a NaN wins its group (the top-k never prunes it), as group_max_ref: one max.NaN reduction
            gm = tl.reduce(tl.reshape(x, [T // GS, GS, GP]), 1, max_nan)  # [T // GS, GP]
            gptrs = gmax_ptr + rows64[None, :] * gmax_stride + blk * (T // GS) + tl.arange(0, T // GS)[:, None]
            if ROWS < GP:
                tl.store(gptrs, gm, mask=live[None, :])
            else:
                tl.store(gptrs, gm)
        return x

    @triton.jit
    def _group_rows(lens_ptr, row, ROWS: tl.constexpr, GP: tl.constexpr):
        """(lengths int32 [GP], row ids int64 [GP]) of a group; padded rows get length 0 (all -inf)."""
        g = tl.arange(0, GP)
        return tl.load(lens_ptr + row + g, mask=g < ROWS, other=0), (row + g).to(tl.int64)

    @triton.jit
    def _paged_indexer_logits_kernel(q_ptr, k_arg, scale_ptr, w_ptr, lens_ptr, table_ptr, out_ptr, bmax_ptr,
                                     gmax_ptr, width, stride_table, out_stride, bmax_stride, gmax_stride, chunk,
                                     num_cache_blocks,
                                     v_ptr, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride, clock_ptr,
                                     slot_ptr, kept_ptr, kept_stride, hlens_ptr, upd_ptr, alpha, window, trash, lo,
                                     hi, NEXT_N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                                     PAGE_BYTES: tl.constexpr, RB: tl.constexpr, G: tl.constexpr,
                                     R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr,
                                     PREFETCH: tl.constexpr, FILL_TAIL: tl.constexpr, HIST: tl.constexpr,
                                     HAS_SEEN: tl.constexpr, GMAX: tl.constexpr, GS: tl.constexpr):
        """One program per (request, CHUNK blocks). The next_n rows are cut into groups of G (R0..R3 rows,
        0 = no such group; R0 + R1 + R2 + R3 = NEXT_N): one MMA per group and block (_score_group)."""
        b = tl.program_id(0)
        blk0 = tl.program_id(1) * chunk
        row0 = b * NEXT_N
        NP: tl.constexpr = 4 if NEXT_N == 3 else NEXT_N  # arange needs a power of two
        offs_n = tl.arange(0, NP)
        lens = tl.load(lens_ptr + row0 + offs_n, mask=offs_n < NEXT_N, other=0)
        # blocks the longest row touches, at most the table's (validate=False lengths past W x T read no id past
        # the row)
        used = tl.minimum((tl.max(lens, axis=0) + T - 1) // T, width)
        blk_end = tl.minimum(blk0 + chunk, used)
        chunk_end = tl.minimum(blk0 + chunk, width)
        ids = table_ptr + b.to(tl.int64) * stride_table
        offs_t = tl.arange(0, T)
        # MMA tiles need >= 16 columns: H < 16 is padded with zero-weight heads (relu(0) * 0 adds nothing).
        HP: tl.constexpr = 16 if H < 16 else H
        # Groups of G rows, each padded to a power of two (only R = 3 needs it: next_n = 3 with G = 4).
        GP0: tl.constexpr = 4 if R0 == 3 else R0
        GP1: tl.constexpr = 4 if R1 == 3 else (R1 if R1 > 0 else 1)
        GP2: tl.constexpr = R2 if R2 > 0 else 1
        GP3: tl.constexpr = R3 if R3 > 0 else 1
        qt0, w0 = _load_group(q_ptr, w_ptr, row0, R0, GP0, H, HP, D)
        lens0, rows0 = _group_rows(lens_ptr, row0, R0, GP0)
        qt1, w1, lens1, rows1 = qt0, w0, lens0, rows0  # placeholders for absent groups (never used)
        qt2, w2, lens2, rows2 = qt0, w0, lens0, rows0
        qt3, w3, lens3, rows3 = qt0, w0, lens0, rows0
        if R1 > 0:
            qt1, w1 = _load_group(q_ptr, w_ptr, row0 + G, R1, GP1, H, HP, D)
            lens1, rows1 = _group_rows(lens_ptr, row0 + G, R1, GP1)
        if R2 > 0:
            qt2, w2 = _load_group(q_ptr, w_ptr, row0 + 2 * G, R2, GP2, H, HP, D)
            lens2, rows2 = _group_rows(lens_ptr, row0 + 2 * G, R2, GP2)
        if R3 > 0:
            qt3, w3 = _load_group(q_ptr, w_ptr, row0 + 3 * G, R3, GP3, H, HP, D)
            lens3, rows3 = _group_rows(lens_ptr, row0 + 3 * G, R3, GP3)
        len0 = tl.load(lens_ptr + row0)
        kept_row = kept_ptr + b.to(tl.int64) * kept_stride
        if HIST:  # a request that does not update (guarded) reads and writes no history: the dense loop
            upd0, qpos0, slot0, clock = row_constants(upd_ptr, hlens_ptr, slot_ptr, clock_ptr, row0, b, HAS_SEEN)
        SCALE_OFF: tl.constexpr = T * D // 4  # scales follow the T*D key bytes of a block, in fp32 units
        # Pages are PAGE_BYTES apart (padded on DeepSeek-V4). A constexpr (fixed for a run, like T and D): the
        # compiler sees the scales' 16-byte alignment, as it did with the contiguous page size.
        PAGE_F32: tl.constexpr = PAGE_BYTES // 4
        # Ids are clamped into the cache: with validate=False a bad table gives wrong logits, never a read
        # outside the cache (the key tile's TMA load is bounds-checked; the scales' pointer load is not).
        # Hand prefetch: the ids and scales of the next PREFETCH blocks in flight, loaded before the loop (masked
        # when the chunk has no block to score), then block blk + PREFETCH's in iteration blk (clamped to the
        # last block: the last iterations reload it, harmlessly). The key tile's coordinate is then a loop-carried
        # value, not a load of this iteration: the pipeliner issues its TMA num_stages - 1 blocks ahead (with the
        # id loaded in the loop it splits those stages between the id and the tile: one block ahead each).
        if PREFETCH >= 1:
            any_blk = blk0 < blk_end
            phys_next = tl.minimum(tl.maximum(tl.load(ids + blk0, mask=any_blk, other=0), 0), num_cache_blocks - 1)
            sc_next = tl.load(scale_ptr + phys_next.to(tl.int64) * PAGE_F32 + SCALE_OFF + offs_t)
        if PREFETCH == 2:
            raw_next2 = tl.load(ids + tl.minimum(blk0 + 1, blk_end - 1), mask=any_blk, other=0)
            sc_next2 = tl.load(scale_ptr + (tl.minimum(tl.maximum(raw_next2, 0), num_cache_blocks - 1)).to(tl.int64)
                               * PAGE_F32 + SCALE_OFF + offs_t)
        for blk in range(blk0, blk_end):
            if PREFETCH == 2:  # this block's id and scales were loaded two blocks ahead; block blk + 2's now
                phys = phys_next
                sc = sc_next
                # No carried value may be yielded unchanged (a loop-carried distance of 2, which makes Triton's
                # pipeliner skip the loop: the key tile's TMA then waits in its own iteration): the id is
                # carried raw and clamped here, the scales pass through an add of +0.0 (not folded: -0.0 + 0.0
                # is +0.0; a scale is > 0).
                phys_next = tl.minimum(tl.maximum(raw_next2, 0), num_cache_blocks - 1)
                sc_next = sc_next2 + 0.0
                raw_next2 = tl.load(ids + tl.minimum(blk + 2, blk_end - 1))
                sc_next2 = tl.load(scale_ptr + (tl.minimum(tl.maximum(raw_next2, 0), num_cache_blocks - 1)).to(
                    tl.int64) * PAGE_F32 + SCALE_OFF + offs_t)
            elif PREFETCH == 1:  # this block's id and scales were loaded one block ahead; the next block's now
                phys = phys_next
                sc = sc_next
                nxt = tl.minimum(blk + 1, blk_end - 1)
                phys_next = tl.minimum(tl.maximum(tl.load(ids + nxt), 0), num_cache_blocks - 1)
                sc_next = tl.load(scale_ptr + phys_next.to(tl.int64) * PAGE_F32 + SCALE_OFF + offs_t)
            else:  # the pipeliner prefetches the id; the scales load here, after it
                phys = tl.minimum(tl.maximum(tl.load(ids + blk), 0), num_cache_blocks - 1)
                sc = tl.load(scale_ptr + phys.to(tl.int64) * PAGE_F32 + SCALE_OFF + offs_t)
            if HIST:  # the history's reads first, so their latency hides under the key load and the MMA
                # (masked, not under a branch; the row's constants were loaded once, above the loop)
                on = (tl.zeros([1], tl.int32) + upd0.to(tl.int32)) != 0  # [1]: a tensor mask (the interpreter)
                kb = tl.load(kept_row + blk + tl.zeros([1], tl.int32), mask=on, other=-1)
                pv = tl.where(on & (phys < trash), tl.zeros([1], tl.int64) + phys, trash)  # as load_vertical
                old_v = tl.load(v_ptr + pv[:, None] * T + offs_t[None, :], mask=tl.broadcast_to(on[:, None], [1, T]),
                                other=0.0)
            if RB > 0:  # pages a whole number RB of D-byte rows apart: block phys starts at row phys * RB
                k = k_arg.load([phys * RB, 0])  # [T, D] fp8 through the TMA descriptor
            else:  # other padded strides (8640 = 67.5 rows): the 3D descriptor's page index
                k = tl.reshape(k_arg.load([phys, 0, 0]), (T, D))
            # The key tile, loaded once, feeds every group's MMA.
            x0 = _store_group(_score_group(k, qt0, w0, sc, T, GP0, HP), lens0, rows0, out_ptr, out_stride,
                              bmax_ptr, bmax_stride, gmax_ptr, gmax_stride, blk, R0, GP0, T, GMAX, GS)
            if R1 > 0:
                _store_group(_score_group(k, qt1, w1, sc, T, GP1, HP), lens1, rows1, out_ptr, out_stride,
                             bmax_ptr, bmax_stride, gmax_ptr, gmax_stride, blk, R1, GP1, T, GMAX, GS)
            if R2 > 0:
                _store_group(_score_group(k, qt2, w2, sc, T, GP2, HP), lens2, rows2, out_ptr, out_stride,
                             bmax_ptr, bmax_stride, gmax_ptr, gmax_stride, blk, R2, GP2, T, GMAX, GS)
            if R3 > 0:
                _store_group(_score_group(k, qt3, w3, sc, T, GP3, HP), lens3, rows3, out_ptr, out_stride,
                             bmax_ptr, bmax_stride, gmax_ptr, gmax_stride, blk, R3, GP3, T, GMAX, GS)
            if HIST:  # row 0's scores are still in registers: SPIN's EMA update of this block
                if upd0:
                    logit0 = tl.sum(tl.where(tl.arange(0, GP0)[None, :] == 0, x0, 0.0), axis=1)  # [T]: row 0
                    ema_tile(logit0[None, :], (blk * T + offs_t < len0)[None, :], pv, old_v.to(tl.float32), kb, upd0,
                             qpos0, slot0, clock, v_ptr, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride,
                             alpha, window, lo, hi, T, HAS_SEEN)
        if FILL_TAIL:  # blocks of this chunk past the longest row: -inf logits and block max, no key reads
            neg = tl.full([NP, T], float("-inf"), tl.float32)
            rows64 = (row0 + offs_n).to(tl.int64)
            live = offs_n < NEXT_N
            for blk in range(tl.maximum(blk_end, blk0), chunk_end):
                tl.store(out_ptr + rows64[:, None] * out_stride + blk * T + offs_t[None, :], neg, mask=live[:, None])
                tl.store(bmax_ptr + rows64 * bmax_stride + blk, tl.full([NP], float("-inf"), tl.float32), mask=live)
                if GMAX:
                    gi = blk * (T // GS) + tl.arange(0, T // GS)
                    tl.store(gmax_ptr + rows64[:, None] * gmax_stride + gi[None, :],
                             tl.full([NP, T // GS], float("-inf"), tl.float32), mask=live[:, None])
