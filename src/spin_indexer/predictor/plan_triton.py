"""Triton twin of SpinIndexer.plan()'s torch path (plan.py): step metadata, reset of the blocks that entered
a request, every layer's block selection and compaction, and the per-slot counters, in two launches with no
host sync and no data-dependent shape (CUDA-graph capturable); with the summary mix, the selection per layer in
run() (below).

Launch 1, `_plan_reset_kernel`, grid (B, L): program (b, l) resets layer l of request b's entered blocks
  (w in [ceil(seen_len / T), n): vertical[l, p, :] and block_max[p, l] = -inf, O(entered blocks)); program
  (b, 0) also writes ws.num_blocks / guarded / update_rows and stashes (step + 1, first entered block) for
  launch 2. Every reset lands before any selection reads the history, as in the torch path, so a physical
  block entering one request is "never scored" for every request holding it.
Launch 2, `_plan_select_kernel`, grid (L, max(B, 1)): program (l, b) does the selection of layer l for b.
  Layer fastest (grid order): the block maxima are block_max[p, l] (one 122-byte row of L = 61 fp16 per
  physical block, beside the key cache), so a program gathers one 32-byte sector per block for 2 bytes; the
  ~2-4 requests' 61 layer programs resident together share those sectors through L2 (one DRAM read per
  sector, ~128-160 B per block a step). Request-major (b fastest, as before) made the resident programs one
  layer of every request, whose sectors were evicted before the next layers came: Nsight Compute at 96 x 512K
  (run 68, 73985b1) read 4.2 GB from DRAM in 1.46 ms (59.6% of its bandwidth, L2 hit rate 24%), ~87 B per
  (block, layer). Layer fastest (run 69, e0c0a55): 1.19 ms, DRAM 12.5%, L2 hit rate 87.7%; bench_plan.py per
  layer 96 x 128K 6.75 us (unchanged), 512K 24.0 -> 19.5, 1M 84.3 -> 50.0 (16 warps). What is left is each
  program's chain of dependent block reductions (the selection's own: select_triton.py).
  Register path (next_pow2(W) <= register_tile, at most MAX_TILE = 16384 blocks; 4 warps up to 2048 blocks,
  8 up to 8192, 16 above; ptxas capped at 128 registers (4 / 2 / 1 programs an SM)): the
  request's blocks are the lanes of one [SB = next_pow2(W)] tile. Live from A to D: one float32 score
  tensor in A (forced blocks as a NaN payload), then a uint32 key (0 = not a candidate) and the kept mask
  through B, then one uint32 exploration key (0 = kept or invalid) through C and D; lane tensors are int32:
  A. one gather of every block's id (the table row in 16-byte vectors) and block max; forced blocks (+inf key);
     row 0's scores: reduce=max takes the block max before the diagonal window and, in the window, its max with
     D's window max read in aligned 16-byte chunks (_window_diag_max); the window's blocks of a per-slot rule
     (and of the summary mix) are scored in [score_block, T] tiles; both go through a float32 scratch row
     and are read back once;
  B. per prediction row (1 for row0, next_n for row-local): the exact k1-th largest key t by bisection on
     the key value (count(key >= mid) per step, from [min, max] of the keys, early exit when a count equals
     k1; the keys are the fp32 order key >> 13 when every score is a 16-bit float, so at most 19 steps,
     else 32), then keys > t and the first k1 - count(key > t) ties in block order (ties to the lower
     block; the cut lane by a bisection on the lane index, only when a tie is cut), OR-ed into the kept
     mask. Rows past the first re-score only the blocks their diagonal window reaches, through the scratch
     as in A, and read row 0's scores of the blocks before back from it;
  C. random exploration: the same search over the inline 31-bit hash of (seed, slot, step, block, layer)
     among the valid unkept blocks (hash desc, lower block on ties, as select_blocks with `hashes`), first
     narrowed by two probes around the hashes' expected quantile (exact counts: the result never depends
     on the hashes being uniform);
  D. compaction in ascending block order from the register mask (one scan): only kept entries of
     kept_blocks / compact_table, num_kept, compact_lens. Program (b, 0) writes step and seen_len of the slot,
     (0, 0) the clock, at its start (no program of the launch reads them: they read the stash).
  Chunked path (wider tables, or register_tile=0): tiles of `block` blocks, keys and flags staged in the
  scratch (float32 key and int8 flag per block) and re-read by every pass: B and C are radix selects (4
  passes of 8 bits, tl.histogram) with a mark pass writing flag 2; D reads the flags back.
A step whose table shape guards it runs neither launch: `dense_plan_triton` writes its block counts and flags in
one (plan.dense_plan_ in torch).
The summary mix (SpinConfig.summary > 0, issue #18) selects with this step's query, so plan() runs launch 1 (which
also copies each layer's summary-cache extent summarized[l, slot] to ws.summary_first and writes ws.full_blocks, row
0's full blocks, 0 for a request that does not mix), then launch 2 for the requests at or past
SpinConfig.summary_below tokens only (part 1: the others' programs advance their counters and return; with
summary_below = 0 every request mixes), and launch 2 runs again per
layer in run(layer) over B programs for the requests that mix (part 2, `select_layer_triton`, register path only),
after ops.update_and_score_summaries. Its pass A scores every valid block's own history, the forced ones too (slots
past the query masked, the vertical history read per slot: 2 B a slot for the window's blocks, where the paper's
pass reads their block max), standardizes it and the summary scores (4 B a block) over the request's valid blocks
and mixes them as predictor/summary.py; B-D run unchanged on the mixed float32 keys (no 13-bit shift), and the
program records summarized[l, slot] = full. Against the torch path the mixed scores differ only by the order of the
standardization's two sums (float32 rounding), so a block at a near-tie of the cut may flip.
Bytes per program (W' = n blocks of the request, DW the diagonal window, K' the kept blocks, reduce=max with
combine max / vertical / diagonal): register path: A reads 4 B (table) + 2 B (block_max) per block, the
window's blocks again plus 2 B x DW of diagonal and 8 B of scratch each; B re-scores the window per row
past the first; C reads nothing; D reads 4 B and writes 8 B per kept block: about 6 B x W' + 12 B x K' +
O(DW), never O(context). Chunked path: A writes 5 B per block, B reads 4 B per block per radix pass + 5 B
in the mark pass (~21 B x W'), C 1 B per block per pass, D 1 B per block + 12 B per kept block: about
35 B x W' + 2 B x DW, mostly L1/L2 hits on its own scratch (W' = 16384: ~0.6 MB). reduce=mean or
combine=sum read each block's 64 vertical slots once in pass A (2 B per token) on both paths.
Measured (register path, commit a7cf093, H200, run 12): 1.64 ms per step at B = 96 x 512K (26.8 us per
layer; predicted below: ~1.5 ms) and 0.45 ms at 96 x 128K (7.4 us per layer; predicted ~0.4 ms).
The prediction, as written before that run. Measured at 3b65e13 (H200, triton 3.6): 4.3 ms per step at B = 96 x 512K (W' = 8192, 61 layers: 70 us per layer, worse than the
chunked kernel's 64), 0.52 ms at 96 x 128K (W' = 2048). At 8192 blocks / 8 warps that kernel compiled to
255 registers (1 program per SM: 5856 programs in ~44 waves of ~100 us) with a chain of ~50-70 dependent
block reductions (bisections on 32-bit keys reaching +inf, a [SB] cumsum per tie cut). ptxas -v here
(sm_90a, triton 3.9, benchmarks/plan_registers.py; registers / spill bytes before -> after):
2048 / 4 warps 168 / 0 -> 168 / 68 (cap 168: 3 per SM as before), 8192 / 8 warps 255 / 0 -> 128 / ~380
(2 per SM), 16384 / 16 warps 128 / 348 -> 128 / ~220; no spill inside the bisection loops (the spills are
in code run once per program or per row). Most of the 255 was ptxas scheduling slack: the old kernel
capped at 128 also spilled only outside its loops; the [SB] cumsum and the live masks were the rest.
Steps per row0 program at W' = 8192 (simulated on normal fp16 block maxima and 31-bit hashes): B ~21 ->
~17 (19-bit keys; 32 -> 19 when a tie sits at the threshold), C ~12 -> ~9 (bracket), and 3 reductions
fewer per search (tuple reductions, no cumsum): ~50 -> ~35 dependent reductions. Expected: two programs
per SM overlap their latency-bound chains (32 compares per thread per step), so ~4.3 x 0.7 / 2 = ~1.5 ms
per step at 96 x 512K (~2.9x; 1.3-1.7 ms with the unknowns: triton 3.6's ptxas, the spill traffic, how
well two chains overlap) and ~0.52 x 0.75 = ~0.4 ms at 96 x 128K (same occupancy, fewer steps).
Semantics: bit-identical to the torch path. reduce=mean sums a block's slot scores in another order than
torch, so it is identical when those sums are exact in float32 (the tests use such values) and otherwise
within float32 rounding. Block ids outside [0, num_cache_blocks) read as the trash block, treated as
never scored (forced) and never read or written (the torch path reads whatever the trash holds: plan()
with validate=True rejects such tables).
"""
from __future__ import annotations

import struct

import torch

from .config import Combine, Exploration, MtpPolicy, Pooling, Reduce, SpinConfig

try:  # the package imports this module only for CUDA tensors; without triton the reference is used
    import triton
    import triton.language as tl

    from ..ops.topk_triton import _ukey  # fp32 -> order-preserving uint32, the top-k's own key
    from .select_triton import (NEG_INF, _digit_hist, _forced_value, _is_forced, _mix, _mix32, _pick_digit,
                                _take, _threshold, _tile_key)
except ImportError:  # pragma: no cover
    triton = None

_MASK31 = 0x7FFFFFFF
MAX_TILE = 16384  # widest register tile (blocks): 32 per thread at 16 warps
_COMBINE = {Combine.MAX: 0, Combine.SUM: 1, Combine.VERTICAL: 2, Combine.DIAGONAL: 3}


def supports(config: SpinConfig, width: int | None = None) -> bool:
    """Whether the fused planner covers `config` (on a table `width` blocks wide, where given): A1 pooling with
    max or mean, any combine rule, no or random exploration, no adaptive budgets, no hybrid scores; the summary
    mix on tables of at most MAX_TILE blocks (its select runs the register path only). Everything else runs
    the torch path."""
    if config.summary > 0 and width is not None and _next_pow2(max(width, 1)) > MAX_TILE:
        return False
    return (config.pooling is Pooling.A1 and config.reduce in (Reduce.MAX, Reduce.MEAN)
            and config.exploration in (Exploration.NONE, Exploration.RANDOM)
            and config.adaptive is None and config.hybrid == 0)


def _mix_below(config: SpinConfig) -> int:
    """The kernels' summary_below: requests shorter than it mix (2**62 for 0, every request)."""
    return config.summary_below or 1 << 62


def _f64_bits(x: float) -> int:
    """The IEEE bits of float64 x as an int64 (Triton passes Python floats as float32)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _register_warps(sb: int) -> int:
    """Warps of the register path for an [sb] tile: 4 to 2048 blocks, 8 to 8192, 16 above (32 blocks per
    thread at most: more warps would make every bisection step's block reduction wider for no fewer
    dependent steps). At 16384 blocks (one program an SM either way) bench_plan.py measured 32 warps x 64
    registers 65.5 us a layer against 84.3 at 16 x 128 with the request-fastest grid (run 68), and 53.4
    against 50.0 with the layer-fastest one (run 69): the DRAM stalls that more warps hid are gone."""
    return 4 if sb <= 2048 else 8 if sb <= 8192 else 16


def _register_maxnreg(warps: int) -> int | None:
    """Register cap of the register path: 128 per thread at 4 warps (4 programs per SM) and at 8 (2 per SM:
    65536 registers / (256 threads x 128)). Without it ptxas spends all 255 registers at 8192 blocks / 8
    warps on scheduling slack (1 program per SM, which made the path slower than the chunked one at 512K);
    with it the spills (benchmarks/plan_registers.py; triton 3.6: 36 B at 2048 blocks / 4 warps) sit outside
    the bisection loops, in code run once or once per prediction row. 16 warps are held to 128 by the
    register file already. Measured (benchmarks/results/run22_plan_launch, 96 x 128K x 61 layers): 4 warps
    at 128 registers 6.74 us a layer, at 168 (before) 7.38, at 96 6.88; 2 warps 7.4-8.3 (more programs per SM
    do not pay: a program's chain of reductions is the limit, not residency)."""
    return 128 if warps <= 8 else None


def plan_step_triton(config: SpinConfig, state, ws, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     slot_ids: torch.Tensor, num_accepted: torch.Tensor | None, block: int = 1024,
                     score_block: int = 64, num_warps: int | None = None, register_tile: int = MAX_TILE,
                     max_registers: int | None = None) -> None:
    """The fused plan(): writes ws (kept_blocks, compact_table, num_kept, compact_lens of every layer, and
    num_blocks, guarded, update_rows) and advances the state exactly as the torch path of SpinIndexer.plan().

    config: a SpinConfig with supports(config); state: SpinState; ws: Workspace (leading [:B, :W] slices are
    written); block_table: int32 [B, W]; seq_lens: int32 [B, N]; slot_ids: int32/int64 [B] distinct;
    num_accepted: int32 [B] or None. block / score_block: blocks per tile of the chunked path's flat passes
    (and of the reset kernel, at most 32) / of the scoring passes (powers of two; tests pass small ones to
    cross tiles); num_warps: of the select kernel, None = chosen from the tile. register_tile: the largest
    register tile (capped at MAX_TILE); a table whose next_pow2(W) exceeds it takes the chunked path (tests
    pass 0 to force it). max_registers: the register path's cap per thread, None = _register_maxnreg(warps),
    0 = ptxas's choice (benchmarks/bench_plan.py times the choices).
    With config.summary > 0 (the summary mix) the requests that mix are not selected here: the reset launch also
    writes each layer's summary range (ws.summary_first, ws.full_blocks), the select launch takes only the
    requests at or past config.summary_below tokens (every program still advances its counters), and each layer
    selects the others in run(layer) with this step's summary scores (select_layer_triton).
    """
    batch, width = block_table.shape
    next_n = seq_lens.shape[1]
    step_guard = config.guard_batch_tokens_for(batch * next_n)  # the per-step guard's threshold
    layers = state.num_layers
    t = config.tokens_per_block
    dev = block_table.device
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    lens = seq_lens.contiguous()
    slots = slot_ids.contiguous()
    acc = num_accepted.contiguous() if num_accepted is not None else lens
    late = config.summary > 0
    stash = ws.plan_stash
    tp, np_, wp = _next_pow2(t), _next_pow2(next_n), _next_pow2(max(width, 1))
    if batch > 0:
        vert, bmax = _vertical_or_placeholder(state), state.block_max
        upd = ws.update_rows.view(torch.uint8)
        summarized = state.summarized if late else stash  # a placeholder pointer without the summary mix
        first, full = (ws.summary_first, ws.full_blocks) if late else (stash, stash)
        _plan_reset_kernel[(batch, layers)](
            table, table.stride(0), lens, slots, state.step, state.seen_len, acc,
            vert, vert.stride(0), vert.stride(1), bmax, bmax.stride(0), bmax.stride(1),
            ws.num_blocks, ws.guarded.view(torch.uint8), upd, upd.stride(0), stash,
            summarized, summarized.stride(0), first, first.stride(0), full, width, _mix_below(config),
            next_n, state.num_cache_blocks, config.topk, config.guard_tokens, batch, step_guard,
            T=t, TP=tp, NP=np_, SB=min(32, _next_pow2(block), wp),
            ROW0=config.mtp is MtpPolicy.ROW0, HAS_ACC=num_accepted is not None, SUMMARY=late,
            HAS_V=state.vertical is not None)
    reg = wp <= min(register_tile, MAX_TILE)
    rows_b = max(batch, 1)
    # the register path keeps its flags in registers: no flag scratch
    scratch = torch.empty(rows_b * layers, max(width, 1), dtype=torch.float32, device=dev)
    flags = torch.empty(1 if reg else rows_b * layers, 1 if reg else max(width, 1), dtype=torch.int8, device=dev)
    # with summary_below, the requests that do not mix select here, every layer at once (part 1)
    _launch_select(config, state, ws, table, lens, slots, scratch, flags, step_guard, 0, layers, reg, block,
                   score_block, num_warps, max_registers, finish=True, part=1 if late else 0)


def select_layer_triton(config: SpinConfig, state, ws, layer: int, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, slot_ids: torch.Tensor, summary: torch.Tensor, cached: bool = True,
                        score_block: int = 16, num_warps: int | None = None, max_registers: int | None = 0) -> None:
    """One layer's selection with the summary mix (config.summary > 0) of the requests that mix (shorter than
    config.summary_below, or all), in run(layer) after plan_step_triton: writes their kept_blocks, compact_table,
    num_kept and compact_lens of that layer in ws, as the torch path's Extensions.select does up to the order of
    the standardization's sums (float32 rounding); the other requests' plans (written by plan()) stay.

    summary: float32 [B, W] this step's block summary scores (ops.paged_summary_scores; -inf where a block has
    none); cached: they came from the summary cache, which now holds every full block of the requests that mix:
    state.summarized[layer] of the step's slots = ws.full_blocks (0 for the others; False: a replay's recorded
    scores, the cache untouched). The other arguments as plan_step_triton's (the same step); one launch of B
    programs, register path only (supports(config, W)).
    Its pass A scores every window block per slot ([score_block, T] tiles of vertical, diagonal and their max live
    together), so the defaults differ from plan()'s: 16-block tiles and ptxas's register choice. ptxas -v for
    sm_90a (benchmarks/plan_registers.py --part 2, local triton 3.9): 64-block tiles under plan()'s cap of 128
    spilled 656 / 592 B at 256 blocks, 210 spill instructions inside the bisection loops (912 / 832 B at 2048);
    16-block tiles without the cap use 87 registers (256 blocks) and 238 (2048), no spill. The launch is B
    programs, about one wave: registers cost no overlap there. Warps: _mix_select_warps."""
    batch, width = block_table.shape
    if not supports(config, width) or config.summary == 0:
        raise ValueError(f"select_layer_triton: expected a summary config the fused planner covers on {width} "
                         f"blocks (supports(config, W)), got {config}")
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    step_guard = config.guard_batch_tokens_for(batch * seq_lens.shape[1])
    _launch_select(config, state, ws, table, seq_lens.contiguous(), slot_ids.contiguous(), ws.select_scratch,
                   ws.select_scratch, step_guard, layer, 1, True, 1024, score_block,
                   num_warps or _mix_select_warps(_next_pow2(max(width, 1))), max_registers,
                   finish=False, summary=summary, cached=cached, part=2)


def _vertical_or_placeholder(state) -> torch.Tensor:
    """The kernels' vertical table: the state's, or under block grain (none) a [1, 1, 1] placeholder that no
    launch reads (block grain is never a slot rule, and the reset skips it: HAS_V)."""
    if state.vertical is not None:
        return state.vertical
    return state.block_max[:1, :1].unsqueeze(0)


def _slot_rule(config: SpinConfig) -> bool:
    """Whether block scores come slot by slot (reduce=mean, or combine=sum): the kernels' SLOT."""
    return config.reduce is Reduce.MEAN or config.combine is Combine.SUM


def _window_path_rows(config: SpinConfig, warps: int, reg: bool, mixed: bool, cell_bytes: int) -> int:
    """Rows of _window_diag_max's [rows, T] chunk tiles (16 cells a thread: 8 rows a warp at T = 64) where row 0's
    window takes it, else 0 (the [score_block, T] tiles): the register path of reduce=max with max or diagonal
    combine, no summary mix, and T a power of two and a whole number of 16-byte vectors of D's cells (every chunk
    then starts aligned, which the kernel tells the compiler)."""
    t = config.tokens_per_block
    if not reg or mixed or _slot_rule(config) or config.combine not in (Combine.MAX, Combine.DIAGONAL):
        return 0
    if t != _next_pow2(t) or t % (16 // cell_bytes):
        return 0
    return max(1, 16 * 32 * warps // t)


def _mix_select_warps(sb: int) -> int:
    """Warps of select_layer_triton's program for an [sb] tile: 8 from 2048 blocks (128K tokens), else
    _register_warps's. Run 130 (H100, bench_summary.py --select-warps, us a layer; 4 = the former default):
    2048 blocks: 4 / 8 warps 32.6 / 31.2 (96 x 128K), 29.5 / 24.3 (8 x 128K), 23.0 / 22.1 (1 x 128K); 1 and 2 warps
    79 and 42 (ptxas fits 1 warp in 219-244 registers: one warp's chain is 4x longer); 256 / 128 blocks: 18.4 / 18.8
    (96 x 16K) and 15.5 / 16.1 (8 x 8K). On the H200 (run 131) 8 and 4 warps tie at 2048 blocks (27.8 / 27.6,
    24.3 / 24.1, 22.3 / 23.2 us): the rule costs nothing there."""
    return 8 if 2048 <= sb <= 8192 else _register_warps(sb)


def _launch_select(config: SpinConfig, state, ws, table, lens, slots, scratch, flags, step_guard: int, layer0: int,
                   layers: int, reg: bool, block: int, score_block: int, num_warps: int | None,
                   max_registers: int | None, finish: bool, summary: torch.Tensor | None = None,
                   cached: bool = False, part: int = 0) -> None:
    """The select kernel over layers [layer0, layer0 + layers) of every request (module docstring, launch 2);
    part 1 / 2: only the requests that do not / do take the summary mix (SpinConfig.summary_below)."""
    batch, width = table.shape
    next_n = lens.shape[1]
    t = config.tokens_per_block
    wp = _next_pow2(max(width, 1))
    if reg:  # one tile holds every block of a request (SB >= n)
        sb = wp
        warps = num_warps or _register_warps(sb)
    else:  # chunked: the measured best of the tile table (1024 blocks, 4 warps)
        sb = min(_next_pow2(block), wp)
        warps = num_warps or 4
    sbs = min(_next_pow2(score_block), sb)
    vert, bmax, diag = _vertical_or_placeholder(state), state.block_max, state.diagonal
    mixed = summary is not None
    if mixed:
        summary = summary if summary.stride(-1) == 1 else summary.contiguous()
        full, summarized = ws.full_blocks, state.summarized
    else:
        summary, full, summarized = scratch, ws.plan_stash, ws.plan_stash  # placeholder pointers, never read
    weight = config.summary
    # the requests that mix explore only under SpinConfig.summary_explores (part 2 launches those alone)
    explore = config.exploration is Exploration.RANDOM and (not mixed or config.summary_explores)
    # row 0's window in address order (_window_diag_max) where it applies
    win_rows = _window_path_rows(config, warps, reg, mixed, diag.element_size())
    _plan_select_kernel[(layers, max(batch, 1))](  # layer fastest: see the module docstring (grid order)
        table, table.stride(0), lens, slots, ws.plan_stash,
        vert, vert.stride(0), vert.stride(1), bmax, bmax.stride(0), bmax.stride(1),
        diag, diag.stride(0), diag.stride(1), scratch, flags, scratch.stride(0),
        ws.kept_blocks, ws.compact_table, ws.kept_blocks.stride(0), ws.kept_blocks.stride(1),
        ws.compact_table.stride(0), ws.compact_table.stride(1), ws.num_kept, ws.num_kept.stride(0),
        ws.compact_lens, ws.compact_lens.stride(0), ws.compact_lens.stride(1),
        state.step, state.seen_len, state.clock,
        batch, next_n, 1 if config.mtp is MtpPolicy.ROW0 else next_n, state.num_cache_blocks, state.window,
        config.topk, config.guard_tokens, step_guard, -(-config.topk // t) + 1,
        _f64_bits(config.sparsity), _f64_bits(config.gamma), (config.seed * 0x9E3779B1) & _MASK31, layer0,
        ws.layer_sparsity, config.profile_from, summary, summary.stride(0), width, full, summarized,
        summarized.stride(0), 1.0 - weight, weight, _mix_below(config),
        T=t, TP=_next_pow2(t), NP=_next_pow2(next_n), SB=sb, SBS=sbs,
        SLOT=_slot_rule(config), COMBINE=_COMBINE[config.combine],
        MEAN=config.reduce is Reduce.MEAN, EXPLORE=explore, REG=reg,
        FINISH=finish, SUMMARY=mixed, CACHED=cached, PART=part, WIN_ROWS=win_rows,
        WIN_VEC=16 // diag.element_size(), PROFILE=bool(config.sparsity_profile),  # WIN_VEC 8 / 4: 2 / 4-byte D
        enable_fp_fusion=False, num_warps=warps,
        maxnreg=(_register_maxnreg(warps) if max_registers is None else max_registers or None) if reg else None)


def dense_plan_triton(seq_lens: torch.Tensor, tokens_per_block: int, num_blocks: torch.Tensor,
                      guarded: torch.Tensor, update_rows: torch.Tensor, width: int) -> None:
    """plan.dense_plan_ in one launch (the torch form is 5: amax, clamp, add, floor_divide and two fills, ~8 us
    of a shape-guarded step, ~0.15 us a layer over 61 layers, which a guarded step pays beside the dense
    kernels). seq_lens: int32 [B, N]; num_blocks: int32 [B]; guarded: bool [B]; update_rows: bool [B, N]; width: W,
    the table's blocks (the counts' cap)."""
    batch, next_n = seq_lens.shape
    if batch == 0:
        return
    _dense_plan_kernel[(1,)](seq_lens, seq_lens.stride(0), seq_lens.stride(1), next_n, num_blocks,
                             guarded.view(torch.uint8), update_rows.view(torch.uint8), update_rows.stride(0),
                             update_rows.stride(1), batch, width,
                             T=tokens_per_block, NP=_next_pow2(next_n), BB=min(1024, _next_pow2(batch)),
                             num_warps=4)


if triton is not None:
    @triton.jit
    def _row_lens(lens_ptr, b, next_n, width, T: tl.constexpr, NP: tl.constexpr):
        """int64 [NP]: request b's row lengths (0 past next_n), capped at width x T: a longer row (possible with
        plan(validate=False)) reads as the whole table, never a block id past its row (plan.step_lengths)."""
        j = tl.arange(0, NP)
        return tl.minimum(tl.load(lens_ptr + b * next_n + j, mask=j < next_n, other=0), width * T).to(tl.int64)

    @triton.jit
    def _meta(lens_ptr, b, batch, next_n, topk, guard_tokens, guard_batch, width, T: tl.constexpr,
              NP: tl.constexpr):
        """(longest, n blocks, first new block, keep_all 0/1, guarded 0/1) of request b (plan.step_meta).
        With the per-step guard on (guard_batch > 0) every program sums the batch's longest rows itself
        (B x N int32 reads from L2): the step's decision needs no host sync and no extra launch. Lengths read
        as at most width x T (_row_lens)."""
        j = tl.arange(0, NP)
        lens = _row_lens(lens_ptr, b, next_n, width, T, NP)
        longest = tl.max(lens, axis=0)
        shortest = tl.min(tl.where(j < next_n, lens, 1 << 40), axis=0)
        n = (longest + T - 1) // T
        first_new = tl.maximum(shortest - 1, 0) // T
        keep_all = (longest <= topk).to(tl.int32)
        small = (longest < guard_tokens).to(tl.int32) * (1 - keep_all)
        if guard_batch > 0:  # the per-step guard covers keep_all requests too (plan.step_meta)
            total = tl.zeros([], tl.int64)
            for b0 in range(0, batch, 256):
                i = b0 + tl.arange(0, 256)
                rows = tl.minimum(tl.load(lens_ptr + i[:, None] * next_n + j[None, :],
                                          mask=(i[:, None] < batch) & (j[None, :] < next_n), other=0), width * T)
                total += tl.sum(tl.max(rows, axis=1).to(tl.int64), axis=0)
            small = tl.maximum(small, (total < guard_batch).to(tl.int32))
        guarded = small
        return longest, n, first_new, keep_all, guarded

    @triton.jit
    def _phys_bm(tb, blk, m, bmax_l, stride_bp, num_cache_blocks):
        """Physical block (trash ids outside the cache) and its block max (-inf for trash: never scored)."""
        phys = tl.load(tb + blk, mask=m, other=-1).to(tl.int64)
        inside = m & (phys >= 0) & (phys < num_cache_blocks)
        bm = tl.load(bmax_l + phys * stride_bp, mask=inside, other=NEG_INF).to(tl.float32)
        return phys, inside, bm

    @triton.jit
    def _score_tile(blk, ok, phys, bm, q, in_win, vert_l, stride_vp, diag_row, window,
                    T: tl.constexpr, TP: tl.constexpr, SBS: tl.constexpr, SLOT: tl.constexpr,
                    COMBINE: tl.constexpr, MEAN: tl.constexpr, vin, RAW: tl.constexpr = False):
        """A1 block scores float32 [SBS] of query position q for the ok blocks (valid, not forced: every slot
        of them lies inside every row, so no length mask), -inf elsewhere. The diagonal is read only when
        the tile reaches the window (in_win), and only at offsets q - i in [0, window).
        RAW (the summary mix, which standardizes over every valid block): ok may hold forced blocks too, so the
        slots past q are masked (plan.layer_scores' length mask) and the vertical history is read per slot (the
        block max of the newest block may hold slots past q) and only for the vin blocks (ids inside the cache;
        the others read as the trash block: -inf)."""
        t = tl.arange(0, TP)[None, :]
        cell_ok = ok[:, None] & (t < T)
        if RAW:
            cell_ok = cell_ok & (blk[:, None] * T + t <= q)
        # D_POOLED (the summary mix's per-slot scoring, RAW, where the block's score is a max over its slots of
        # max(v, d), of v or of d alone, so which d a slot meets does not matter): d is read in address order
        # (offsets increasing along the tile's row, slot T - 1 - t) instead of slot order (offsets decreasing),
        # which the compiler could not coalesce: every lane's 2 bytes took their own sector (ncu, run 139: the
        # top stall of the mix's select). Run 140 (H100): the mix's select 0.6-3.6 us faster; the paper's plan
        # (reduce=max, d pooled alone) 4.5-5 us slower in address order (its row max then crosses lanes), so
        # it keeps slot order.
        D_POOLED: tl.constexpr = RAW and (not MEAN) and COMBINE != 1
        d = tl.full([SBS, TP], NEG_INF, tl.float32)
        if in_win:
            if D_POOLED:
                off = q - blk[:, None] * T - (T - 1) + t
                dm = ok[:, None] & (t < T) & (off >= 0) & (off < window)  # off >= 0: the slot is at or before q
            else:
                off = q - blk[:, None] * T - t
                dm = cell_ok & (off >= 0) & (off < window)
            d = tl.load(diag_row + off, mask=dm, other=NEG_INF).to(tl.float32)
        if SLOT or RAW:  # per-slot combine, then pool (reduce=mean, or combine=sum; RAW: every rule)
            v = tl.full([SBS, TP], NEG_INF, tl.float32)
            if COMBINE != 3:
                # whole V rows (a mask constant along the row, so each thread loads its 8 slots as one 16-byte
                # vector rather than 8 scalars); the slots past q are dropped after the load
                row_ok = ok[:, None] & vin[:, None]
                if TP != T:
                    row_ok = row_ok & (t < T)
                v = tl.load(vert_l + phys[:, None] * stride_vp + t, mask=row_ok, other=NEG_INF)
                v = tl.where(cell_ok, v.to(tl.float32), NEG_INF)
            if D_POOLED:  # max over the slots of v, of d (in address order), or of both
                if COMBINE == 0:
                    s = tl.maximum(tl.max(v, axis=1), tl.max(d, axis=1))
                elif COMBINE == 2:
                    s = tl.max(v, axis=1)
                else:
                    s = tl.max(d, axis=1)
            else:  # slot by slot (d in slot order), then the pooling
                if COMBINE == 0:
                    x = tl.maximum(v, d)
                elif COMBINE == 1:  # both: v + d; one missing: twice the other (score.combine)
                    hv = (v > NEG_INF) & (v < float("inf"))
                    hd = (d > NEG_INF) & (d < float("inf"))
                    x = tl.where(hv & hd, v + d, tl.where(hv, 2 * v, tl.where(hd, 2 * d, NEG_INF)))
                elif COMBINE == 2:
                    x = v
                else:
                    x = d
                if MEAN:  # mean over the finite slots, -inf if none (score.pool_blocks)
                    fin = (x > NEG_INF) & (x < float("inf"))
                    cnt = tl.sum(fin.to(tl.int32), axis=1)
                    tot = tl.sum(tl.where(fin, x, 0.0), axis=1)
                    s = tl.where(cnt > 0, tl.math.div_rn(tot, tl.maximum(cnt, 1).to(tl.float32)), NEG_INF)
                else:
                    s = tl.max(x, axis=1)
        else:  # reduce=max: the vertical part of a block is its block max (one fp16 read per block)
            dpart = tl.max(d, axis=1)
            if COMBINE == 2:
                s = bm
            elif COMBINE == 3:
                s = dpart
            else:
                s = tl.maximum(bm, dpart)
        return tl.where(ok, s, NEG_INF)

    @triton.jit
    def _wlo(q, window, T: tl.constexpr):
        """First block holding an offset q - i < window (the blocks the diagonal window reaches)."""
        x = q - window + 1
        return tl.where(x > 0, x // T, 0)

    @triton.jit
    def _window_diag_max(scr, blk, diag_ptr, row_start, q, lo, window, T: tl.constexpr, CR: tl.constexpr,
                         VEC: tl.constexpr):
        """float32 [SB] (the shape of blk): the diagonal part of reduce=max's block score of query position q, the
        max of D[q - i] over the slots i of block blk inside the window (offsets < window), for blk in [lo, q // T)
        (-inf elsewhere, and where the window holds nothing); blk's newer blocks are forced, never scored.

        D is read in address order, in whole 16-byte vectors: chunks of T offsets from the row's start rounded
        down to VEC elements (base = row_start - phi), so each load is aligned whatever the slot's row offset (rows are
        window + 1 elements apart). Block q // T - 1 - c is the tail of chunk c (offsets past the split rp) and
        the head of chunk c + 1, so row c of the [CR, T] tile takes one tile's tail and the next one's head (a
        select per cell, the split the same in every row), then a row max. The older layout, [blocks, T] tiles
        in slot order (offsets decreasing along a row), loaded 2 bytes a lane with lanes a block apart: the top
        stall of plan() at 96 x 128K x 61 layers (ncu, run 141: ~24% of its samples on those loads and maxima).
        Reads stay inside the tensor: chunks start at or after the tensor's start, and SpinState allocates T
        elements of slack past its end. The scores are placed into the [SB] tile through the scratch row."""
        tl.debug_barrier()  # write after read: the scratch row's earlier read-backs
        qc = tl.maximum(q, 0)
        base = (row_start // VEC) * VEC
        phi = row_start - base
        qp = qc + phi
        big_q = qc // T
        qp_blk = qp // T
        rp = qp % T
        t = tl.arange(0, T)
        head = t <= rp  # from chunk c + 1; the tail (t > rp) from chunk c
        u = t - phi + tl.where(head, T, 0)  # a cell's offset from q is c * T + u
        c_last = qp_blk - 1 - lo  # the row of block lo
        for c0 in range(qp_blk - big_q, c_last + 1, CR):  # rows of blocks [lo, q // T)
            c = c0 + tl.arange(0, CR)
            live = c <= c_last
            row = base + c.to(tl.int64) * T
            # the alignment, said to the compiler (it does not derive it from base's construction): 16-byte loads
            if VEC == 8:
                row = tl.multiple_of(row, 8)
            else:
                row = tl.multiple_of(row, 4)
            tail = tl.load(diag_ptr + row[:, None] + t[None, :], mask=(live & (c * T - phi < window))[:, None],
                           other=NEG_INF)
            nxt = tl.load(diag_ptr + row[:, None] + T + t[None, :],
                          mask=(live & ((c + 1) * T - phi < window))[:, None], other=NEG_INF)
            x = tl.where(head[None, :], nxt, tail)
            x = tl.where(u[None, :] < (window - c * T)[:, None], x, NEG_INF)
            tl.store(scr + (qp_blk - 1 - c), tl.max(x, axis=1).to(tl.float32), mask=live)
        tl.debug_barrier()  # the read-back takes other threads' rows
        return tl.load(scr + blk, mask=(blk >= lo) & (blk < big_q), other=NEG_INF)

    @triton.jit
    def _flat_key(scr, flg, blk, mm):
        s = tl.load(scr + blk, mask=mm, other=NEG_INF)
        return _ukey(s), mm & (s > NEG_INF)

    @triton.jit
    def _rescored_key(flg, blk, m, start, tb, bmax_l, stride_bp, num_cache_blocks, q, wlo, vert_l, stride_vp,
                      diag_row, window, T: tl.constexpr, TP: tl.constexpr, SBS: tl.constexpr,
                      SLOT: tl.constexpr, COMBINE: tl.constexpr, MEAN: tl.constexpr):
        """Keys of a tile re-scored for another prediction row (forced blocks read from the flags)."""
        phys, inside, bm = _phys_bm(tb, blk, m, bmax_l, stride_bp, num_cache_blocks)
        f = tl.load(flg + blk, mask=m, other=1)
        forced = f == 1
        s = _score_tile(blk, m & ~forced, phys, bm, q, start + SBS > wlo, vert_l, stride_vp, diag_row, window,
                        T, TP, SBS, SLOT, COMBINE, MEAN, m & ~forced)
        s = tl.where(forced, float("inf"), s)
        return _ukey(s), m & (s > NEG_INF)

    @triton.jit
    def _mark(flg, blk, key, ok, f, prefix, ties, need, need0, all_in, S: tl.constexpr):
        """Flag 2 on the selected unforced blocks of a tile (keys > prefix, then the ties while fewer than
        `need` came before); returns the running tie count."""
        eq = (ok & (key == prefix)).to(tl.int64)
        sel = ok & ((key > prefix) | ((eq != 0) & (ties + tl.cumsum(eq, 0) - eq < need)) | ((blk * 0 + all_in) != 0))
        sel = sel & (f == 0) & ((blk * 0 + need0) > 0)
        tl.store(flg + blk, tl.full([S], 2, tl.int8), mask=sel)
        return ties + tl.sum(eq, axis=0)

    # ---- register path (one [SB] tile per request): keys, candidates and kept blocks stay in registers

    @triton.jit
    def _forced_tile(blk, m, bm, first_new, first_entered, dense):
        """bool [S]: valid blocks kept whatever their score (plan.forced_blocks): a query row's block, never
        scored (block max -inf, trash ids included), entered, or every block of a keep_all / guarded request.
        blk: int [S]; m: bool [S] (blk < n); bm: float32 [S]; the rest int64 scalars."""
        return m & ((blk >= first_new) | (bm == NEG_INF) | (blk >= first_entered) | ((blk * 0 + dense) > 0))

    @triton.jit
    def _standardized(x, seen):
        """summary.standardized on one [SB] lane tensor: (x - mean) / std over the seen lanes (two passes, as
        torch), the others at the lowest z (0 when none is seen). Rounded division and square root, so the
        values differ from torch's only by the order of the two sums."""
        cnt = tl.maximum(tl.sum(seen.to(tl.int32), axis=0), 1).to(tl.float32)
        xs = tl.where(seen, x, 0.0)
        mean = tl.math.div_rn(tl.sum(xs, axis=0), cnt)
        dev = tl.where(seen, xs - mean, 0.0)
        var = tl.math.div_rn(tl.sum(dev * dev, axis=0), cnt)
        z = tl.where(seen, tl.math.div_rn(xs - mean, tl.maximum(tl.sqrt_rn(var), 1e-12)), float("inf"))
        low = tl.min(z, axis=0)
        low = tl.where(low < float("inf"), low, 0.0)
        return tl.where(seen, z, low)

    @triton.jit
    def _summary_mixed(h, zs, forced, m, w_hist, w_sum):
        """float32 [SB]: summary.summary_scores of one prediction row (raw history h, -inf where never scored;
        zs the standardized summary scores), _forced_value() on the forced blocks, -inf past the request."""
        x = w_hist * _standardized(h, m & (h > NEG_INF)) + w_sum * zs
        return tl.where(forced, _forced_value(), tl.where(m, x, NEG_INF))

    @triton.jit
    def _scores_via_scratch(scr, blk, lo, n, tb, bmax_l, stride_bp, num_cache_blocks, first_new, first_entered,
                            dense, q, wlo, vert_l, stride_vp, diag_row, window, T: tl.constexpr,
                            TP: tl.constexpr, SBS: tl.constexpr, SLOT: tl.constexpr, COMBINE: tl.constexpr,
                            MEAN: tl.constexpr, read_lo=-1, RAW: tl.constexpr = False):
        """float32 [SB] (the shape of blk, int32 [SB]): A1 scores of query position q for blocks [lo, n),
        _forced_value() on the forced ones, -inf elsewhere (lo, n: int32 scalars); with read_lo >= 0, the
        scratch's blocks [read_lo, lo) are read back too (row 0's scores parked there). The scores are
        computed in [SBS, TP] tiles, which cannot be placed into the [SB] register tile directly (no register
        indexing), so each tile goes to the program's scratch row and the [SB] tile is read back in one load. The barrier before the
        writes orders them after the previous read-back of the same row (write after read). Forced blocks
        come back as _forced_value() so that a row past the first needs no [SB] forced mask.
        RAW: every valid block's own score, the forced ones too (_score_tile's RAW; the summary mix keeps the
        forced mask apart)."""
        tl.debug_barrier()
        offs_s = tl.arange(0, SBS)
        for start in range(lo, n, SBS):
            sblk = start + offs_s
            sm = sblk < n
            phys, inside, bm = _phys_bm(tb, sblk, sm, bmax_l, stride_bp, num_cache_blocks)
            if RAW:
                sc = _score_tile(sblk, sm, phys, bm, q, start + SBS > wlo, vert_l, stride_vp, diag_row,
                                 window, T, TP, SBS, SLOT, COMBINE, MEAN, inside, True)
            else:
                forced = _forced_tile(sblk, sm, bm, first_new, first_entered, dense)
                sc = _score_tile(sblk, sm & ~forced, phys, bm, q, start + SBS > wlo, vert_l, stride_vp, diag_row,
                                 window, T, TP, SBS, SLOT, COMBINE, MEAN, sm & ~forced)
                sc = tl.where(forced, _forced_value(), sc)
            tl.store(scr + sblk, sc, mask=sm)
        tl.debug_barrier()  # the read-back below takes other threads' tiles
        first = lo
        if read_lo >= 0:
            first = read_lo
        return tl.load(scr + blk, mask=(blk >= first) & (blk < n), other=NEG_INF)

    @triton.jit
    def _dense_plan_kernel(lens_ptr, stride_lb, stride_ln, next_n, nblk_ptr, guard_ptr, upd_ptr, stride_ub,
                           stride_un, batch, width, T: tl.constexpr, NP: tl.constexpr, BB: tl.constexpr):
        offs = tl.arange(0, BB)
        j = tl.arange(0, NP)
        for start in range(0, batch, BB):
            b = start + offs
            mb = b < batch
            m2 = mb[:, None] & (j[None, :] < next_n)
            lens = tl.load(lens_ptr + b[:, None] * stride_lb + j[None, :] * stride_ln, mask=m2, other=0)
            longest = tl.maximum(tl.max(lens, axis=1), 0)
            tl.store(nblk_ptr + b, tl.minimum((longest + (T - 1)) // T, width), mask=mb)
            tl.store(guard_ptr + b, tl.full([BB], 1, tl.uint8), mask=mb)
            tl.store(upd_ptr + b[:, None] * stride_ub + j[None, :] * stride_un, tl.zeros([BB, NP], tl.uint8), mask=m2)

    @triton.jit
    def _plan_reset_kernel(table_ptr, stride_tb, lens_ptr, slot_ptr, step_ptr, seen_ptr, acc_ptr,
                           vert_ptr, stride_vl, stride_vp, bmax_ptr, stride_bp, stride_bl,
                           nblk_ptr, guard_ptr, upd_ptr, stride_upd, stash_ptr,
                           summarized_ptr, stride_sml, sfirst_ptr, stride_sfl, full_ptr, width, summary_below,
                           next_n, num_cache_blocks, topk, guard_tokens, batch, guard_batch,
                           T: tl.constexpr, TP: tl.constexpr, NP: tl.constexpr, SB: tl.constexpr,
                           ROW0: tl.constexpr, HAS_ACC: tl.constexpr, SUMMARY: tl.constexpr,
                           HAS_V: tl.constexpr = True):
        b = tl.program_id(0).to(tl.int64)
        pl = tl.program_id(1)
        l = pl.to(tl.int64)
        longest, n, first_new, keep_all, guarded = _meta(lens_ptr, b, batch, next_n, topk, guard_tokens, guard_batch,
                                                         width, T, NP)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        if SUMMARY:  # the summary cache's range this step: [summarized[l, slot], full blocks of row 0)
            tl.store(sfirst_ptr + l * stride_sfl + b, tl.load(summarized_ptr + l * stride_sml + slot))
            if pl == 0:  # none for a request that does not mix (SpinConfig.summary_below)
                full = tl.minimum(tl.maximum(tl.load(lens_ptr + b * next_n), 0) // T, width)
                tl.store(full_ptr + b, tl.where(longest < summary_below, full, 0))
        first_entered = (tl.load(seen_ptr + slot).to(tl.int64) + T - 1) // T
        offs = tl.arange(0, SB).to(tl.int64)
        t = tl.arange(0, TP)[None, :]
        for start in range(first_entered, n, SB):  # only the entered blocks: O(entered), not O(W)
            blk = start + offs
            m = blk < n
            phys = tl.load(table_ptr + b * stride_tb + blk, mask=m, other=-1).to(tl.int64)
            inside = m & (phys >= 0) & (phys < num_cache_blocks)
            tl.store(bmax_ptr + phys * stride_bp + l * stride_bl,
                     tl.full([SB], NEG_INF, tl.float32).to(bmax_ptr.dtype.element_ty), mask=inside)
            if HAS_V:  # block grain (vertical_grain = "block"): the block max is the whole history
                tl.store(vert_ptr + l * stride_vl + phys[:, None] * stride_vp + t,
                         tl.full([SB, TP], NEG_INF, tl.float32).to(vert_ptr.dtype.element_ty),
                         mask=inside[:, None] & (t < T))
        if pl == 0:
            j = tl.arange(0, NP)
            if ROW0:
                rows = j == 0
            elif HAS_ACC:
                rows = j <= tl.load(acc_ptr + b)
            else:
                rows = j >= 0
            rows = rows & ((j * 0 + guarded) == 0)
            tl.store(upd_ptr + b * stride_upd + j, rows.to(tl.uint8), mask=j < next_n)
            tl.store(nblk_ptr + b, n.to(tl.int32))
            tl.store(guard_ptr + b, guarded.to(tl.uint8))
            tl.store(stash_ptr + b * 2, tl.load(step_ptr + slot) + 1)
            tl.store(stash_ptr + b * 2 + 1, first_entered.to(tl.int32))

    @triton.jit
    def _plan_select_kernel(table_ptr, stride_tb, lens_ptr, slot_ptr, stash_ptr,
                            vert_ptr, stride_vl, stride_vp, bmax_ptr, stride_bp, stride_bl,
                            diag_ptr, stride_dl, stride_ds, scr_ptr, flg_ptr, stride_scr,
                            kept_ptr, ctab_ptr, stride_kl, stride_kb, stride_tl, stride_tbb, nkept_ptr, stride_nl,
                            clen_ptr, stride_cl, stride_cb, step_ptr, seen_ptr, clock_ptr,
                            batch, next_n, num_rows, num_cache_blocks, window, topk, guard_tokens, guard_batch, cover,
                            sparsity_bits, gamma_bits, hash0, layer0, layer_sparsity_ptr, profile_from,
                            sum_ptr, stride_sum, width, full_ptr, summarized_ptr, stride_sml, w_hist, w_sum,
                            summary_below,
                            T: tl.constexpr, TP: tl.constexpr, NP: tl.constexpr, SB: tl.constexpr,
                            SBS: tl.constexpr, SLOT: tl.constexpr, COMBINE: tl.constexpr, MEAN: tl.constexpr,
                            EXPLORE: tl.constexpr, REG: tl.constexpr, FINISH: tl.constexpr, SUMMARY: tl.constexpr,
                            CACHED: tl.constexpr, PART: tl.constexpr, WIN_ROWS: tl.constexpr = 0,
                            WIN_VEC: tl.constexpr = 8, PROFILE: tl.constexpr = False):
        pl = tl.program_id(0)  # layer fastest: a request's layers run together and share its block-max sectors
        pb = tl.program_id(1)
        if FINISH:  # finish_step_'s clock (nothing in this launch reads it)
            if pb == 0:
                if pl == 0:
                    tl.store(clock_ptr, tl.load(clock_ptr) + 1)
        if pb < batch:
            b = pb.to(tl.int64)
            l = pl.to(tl.int64)
            if PART == 2:  # select_layer_triton: one layer a launch (plan()'s launches start at layer 0)
                l = (pl + layer0).to(tl.int64)
            longest, n, first_new, keep_all, guarded = _meta(lens_ptr, b, batch, next_n, topk, guard_tokens,
                                                             guard_batch, width, T, NP)
            dense = tl.maximum(keep_all, guarded)  # 0 or 1 (a small step guards keep_all requests too)
            step = tl.load(stash_ptr + b * 2)
            first_entered = tl.load(stash_ptr + b * 2 + 1).to(tl.int64)
            slot = tl.load(slot_ptr + b).to(tl.int64)
            if FINISH:
                if pl == 0:  # finish_step_: every program of this request reads the stash, not the state
                    tl.store(step_ptr + slot, step)
                    tl.store(seen_ptr + slot, longest.to(tl.int32))
            if PART != 0:  # with SpinConfig.summary_below: plan() takes the requests that do not mix, run() the others
                mixes = longest < summary_below
                if PART == 1:
                    skip = mixes
                else:
                    skip = longest >= summary_below
                if skip:  # not this launch's request: its bookkeeping only, then out (a program that ran the
                    # whole select on no block cost 14-17 us a layer on the H200: run 129, idle_select_us)
                    if CACHED:  # it writes no summary (not mixing): its extent is 0
                        tl.store(summarized_ptr + l * stride_sml + slot, tl.load(full_ptr + b))
                    return
            # budget_blocks / explore_blocks in float64 (no FMA: enable_fp_fusion=False at launch)
            sparsity = (tl.zeros([], tl.int64) + sparsity_bits).to(tl.float64, bitcast=True)
            if PROFILE:  # SpinConfig.sparsity_profile: the layer's own (SpinConfig.layer_sparsity, exact float64,
                # [L, 2]: from profile_from on, and below it)
                sparsity = tl.load(layer_sparsity_ptr + 2 * l + tl.where(longest >= profile_from, 0, 1))
            skipped = (n.to(tl.float64) * sparsity + tl.full([], 1e-9, tl.float64)).to(tl.int64)
            budget = tl.minimum(n, tl.maximum(n - skipped, cover))
            budget = tl.where(dense > 0, n, budget)
            explore = budget * 0
            if EXPLORE:
                gamma = (tl.zeros([], tl.int64) + gamma_bits).to(tl.float64, bitcast=True)
                share = (budget.to(tl.float64) * gamma + tl.full([], 0.5, tl.float64)).to(tl.int64)
                explore = tl.where(dense > 0, 0, share)
            tb = table_ptr + b * stride_tb
            vert_l = vert_ptr + l * stride_vl
            bmax_l = bmax_ptr + l * stride_bl
            diag_row = diag_ptr + l * stride_dl + slot * stride_ds
            row = b * tl.num_programs(0) + pl
            scr = scr_ptr + row * stride_scr
            flg = flg_ptr + row * stride_scr
            # both paths: the prediction rows' queries and windows, the exploration hash, the output rows
            j_all = tl.arange(0, NP)
            row_lens = tl.minimum(tl.load(lens_ptr + b * next_n + j_all, mask=j_all < num_rows, other=0),
                                  width * T).to(tl.int64)
            q0 = tl.minimum(tl.load(lens_ptr + b * next_n), width * T).to(tl.int64) - 1
            wlo0 = _wlo(q0, window, T)
            wmin = tl.min(tl.where(j_all < num_rows, _wlo(row_lens - 1, window, T), 1 << 40), axis=0)
            hp = _mix(tl.zeros([], tl.int64) + hash0 ^ (slot & 0x7FFFFFFF))
            hp = _mix(hp ^ (step.to(tl.int64) & 0x7FFFFFFF))
            lmix = (l * tl.full([], 0x9E3779B1, tl.int64) + 0x7F4A7C15) & 0x7FFFFFFF
            kept_row = kept_ptr + l * stride_kl + b * stride_kb
            ctab_row = ctab_ptr + l * stride_tl + b * stride_tbb
            if REG:
                # Register path: every block of the request is one lane of an [SB] tile (SB >= n). At SB = 8192
                # / 8 warps every 32-bit [SB] tensor is 32 registers per thread and the cap is 128, so few stay
                # live: the scores (forced as a NaN payload) in A, the key (uint32, 0 = not a candidate) and
                # the kept mask through B, one uint32 (the exploration key, 0 = kept or invalid) through C and
                # D. Lane tensors are int32 (block ids, physical ids) with one int64 base pointer per row (an
                # int64 or pointer [SB] tensor costs 2 registers per lane). Only the scores made in [SBS, TP]
                # tiles (the diagonal window's blocks; every block of a per-slot rule) go through the scratch.
                SHIFT: tl.constexpr = 0 if SLOT or SUMMARY else (
                    13 if bmax_ptr.dtype.element_ty.primitive_bitwidth == 16
                    and diag_ptr.dtype.element_ty.primitive_bitwidth == 16 else 0)
                blk = tl.arange(0, SB)
                n32 = n.to(tl.int32)
                m = blk < n32
                # A. row 0's scores; forced blocks (key +inf). One gather of every block's id and block max
                # (int32 ids, widened only inside the address).
                phys = tl.load(tb + blk, mask=blk < width, other=-1)
                inside = m & (phys >= 0) & (phys < num_cache_blocks)
                bm = tl.load(bmax_l + phys.to(tl.int64) * stride_bp, mask=inside, other=NEG_INF).to(tl.float32)
                forced = m & ((blk >= first_new.to(tl.int32)) | (bm == NEG_INF) | (blk >= first_entered.to(tl.int32))
                              | ((blk * 0 + dense.to(tl.int32)) > 0))
                num_forced = tl.sum(forced.to(tl.int32), axis=0).to(tl.int64)
                lo = tl.minimum(wlo0, n).to(tl.int32)  # reduce=max before the window: the block max is the score
                if SLOT:
                    lo = n32 * 0
                if COMBINE == 3:  # diagonal only, and no diagonal history before the window
                    bm = tl.full([SB], NEG_INF, tl.float32)
                if SUMMARY:
                    # the summary mix standardizes every valid block's own history (the forced ones too, as
                    # summary.summary_scores): raw scores, the forced mask kept apart, then the mixed scores
                    h = tl.where(blk < lo, bm, NEG_INF)
                    hw = _scores_via_scratch(scr, blk, lo, n32, tb, bmax_l, stride_bp, num_cache_blocks, first_new,
                                             first_entered, dense, q0, wlo0, vert_l, stride_vp, diag_row, window,
                                             T, TP, SBS, SLOT, COMBINE, MEAN, -1, True)
                    h = tl.where(blk >= lo, hw, h)
                    if num_rows * (1 - dense) > 1:
                        tl.store(scr + blk, h, mask=blk < lo)
                    # (blk < width: lengths past the table, possible with plan(validate=False), read no summary)
                    summ = tl.load(sum_ptr + b * stride_sum + blk, mask=m & (blk < width), other=NEG_INF)
                    zs = _standardized(summ, m & (summ > NEG_INF))
                    s = _summary_mixed(h, zs, forced, m, w_hist, w_sum)
                else:
                    # one float tensor from here on: the forced blocks as the _forced_value() NaN (no second mask
                    # live through the window's scoring), the blocks before the window scored by their block max
                    s = tl.where(forced, _forced_value(), tl.where(blk < lo, bm, NEG_INF))
                    if WIN_ROWS > 0:  # reduce=max, the block max and D's window max (_window_diag_max)
                        dp = _window_diag_max(scr, blk, diag_ptr, l * stride_dl + slot * stride_ds, q0, lo, window,
                                              T, WIN_ROWS, WIN_VEC)
                        sw = tl.where(forced, _forced_value(), tl.where(m, tl.maximum(bm, dp), NEG_INF))
                    else:
                        sw = _scores_via_scratch(scr, blk, lo, n32, tb, bmax_l, stride_bp, num_cache_blocks,
                                                 first_new, first_entered, dense, q0, wlo0, vert_l, stride_vp, diag_row,
                                                 window, T, TP, SBS, SLOT, COMBINE, MEAN)
                    s = tl.where(blk >= lo, sw, s)
                    if num_rows * (1 - dense) > 1:
                        # rows past 0 read row 0's scores of the blocks before their windows back from the
                        # scratch (the window's blocks [lo, n) are there already), rather than row 0's keys
                        # staying live in registers through every row
                        tl.store(scr + blk, s, mask=blk < lo)
                key = _tile_key(s, SHIFT)
                k1 = tl.maximum(num_forced, budget - explore)
                kept = _is_forced(s)  # select_blocks: keep1 |= forced, whatever the ranks

                # B. stage 1 per prediction row: the k1 best keys (forced = +inf), ties to the lower block; the
                # forced blocks are kept whatever the ranks (select_blocks: keep1 |= forced). Rows past 0
                # re-score only the blocks from the first one a row's window reaches (the same rec_lo as the
                # chunked path; forced ones come back as _forced_value()); the blocks before read row 0's
                # scores back from the scratch.
                for j in range(0, num_rows * (1 - dense)):
                    if j > 0:  # row j's scores for [rec_lo, n), row 0's before: the whole row from the scratch
                        qj = tl.minimum(tl.load(lens_ptr + b * next_n + j), width * T).to(tl.int64) - 1
                        rec_lo = tl.minimum(wmin, n).to(tl.int32)
                        sj = _scores_via_scratch(scr, blk, rec_lo, n32, tb, bmax_l, stride_bp, num_cache_blocks,
                                                 first_new, first_entered, dense, qj, _wlo(qj, window, T), vert_l,
                                                 stride_vp, diag_row, window, T, TP, SBS, SLOT, COMBINE, MEAN,
                                                 0, SUMMARY)
                        if SUMMARY:
                            sj = _summary_mixed(sj, zs, forced, m, w_hist, w_sum)
                        key = _tile_key(sj, SHIFT)
                    t1, ties1 = _threshold(key, k1)
                    kept = kept | _take(key, t1, ties1)

                # C. random exploration: the `need2` largest hashes among valid unkept blocks, lower block on
                # ties. The key is hash + 1 (<= 2**31) on the candidates and 0 elsewhere, so it also carries
                # the kept mask into D (kept = valid and key 0): one live [SB] tensor instead of three.
                if EXPLORE:
                    need2 = tl.maximum(tl.minimum(explore, budget - k1), 0)
                    h = _mix32(_mix32(hp.to(tl.uint32) ^ blk.to(tl.uint32)) ^ lmix.to(tl.uint32))
                    key2 = tl.where(m & ~kept, h + 1, 0)
                    t2, ties2 = _threshold(key2, need2, True)
                    kept = m & ((key2 == 0) | _take(key2, t2, ties2))

                # D. compaction, ascending, from the register mask (no scratch: it never left this program's
                # registers). The table row is read again (in 16-byte vectors, as in A; stored for the kept
                # blocks) rather than holding phys through B and C (registers are the tighter resource here; the
                # reads are L1/L2 hits).
                ki = kept.to(tl.int32)
                rank = tl.cumsum(ki, 0) - 1
                tl.store(kept_row + rank, blk, mask=kept)
                tl.store(ctab_row + rank, tl.load(tb + blk, mask=blk < width, other=0), mask=kept)
                done = tl.sum(ki, axis=0).to(tl.int64)
            else:  # chunked path (next_pow2(W) > the register tile): keys and flags staged in the scratch
                offs = tl.arange(0, SB).to(tl.int64)
                offs_s = tl.arange(0, SBS).to(tl.int64)

                # A. row 0's block scores and the forced blocks, staged (forced: key +inf and flag 1)
                num_forced = tl.zeros([], tl.int64)
                # reduce=max reads one block max per block: blocks before the diagonal window go in wide 1-D
                # tiles (a [SBS, T] tile per 64 blocks made this pass latency-bound: 128 dependent gathers at
                # W = 8K); the window's blocks, and every block of a per-slot rule, take the [SBS, T] tiles.
                lo = tl.minimum(wlo0, n)
                if SLOT:
                    lo = n * 0
                for start in range(0, lo, SB):
                    blk = start + offs
                    m = blk < lo
                    phys, inside, bm = _phys_bm(tb, blk, m, bmax_l, stride_bp, num_cache_blocks)
                    forced = m & ((blk >= first_new) | (bm == NEG_INF) | (blk >= first_entered) | ((blk * 0 + dense) > 0))
                    s = bm
                    if COMBINE == 3:  # diagonal only, and no diagonal history before the window
                        s = tl.full([SB], NEG_INF, tl.float32)
                    s = tl.where(m & ~forced, s, NEG_INF)
                    tl.store(scr + blk, tl.where(forced, float("inf"), s), mask=m)
                    tl.store(flg + blk, forced.to(tl.int8), mask=m)
                    num_forced += tl.sum(forced.to(tl.int64), axis=0)
                for start in range(lo, n, SBS):
                    blk = start + offs_s
                    m = blk < n
                    phys, inside, bm = _phys_bm(tb, blk, m, bmax_l, stride_bp, num_cache_blocks)
                    forced = m & ((blk >= first_new) | (bm == NEG_INF) | (blk >= first_entered) | ((blk * 0 + dense) > 0))
                    s = _score_tile(blk, m & ~forced, phys, bm, q0, start + SBS > wlo0, vert_l, stride_vp, diag_row,
                                    window, T, TP, SBS, SLOT, COMBINE, MEAN, m & ~forced)
                    tl.store(scr + blk, tl.where(forced, float("inf"), s), mask=m)
                    tl.store(flg + blk, forced.to(tl.int8), mask=m)
                    num_forced += tl.sum(forced.to(tl.int64), axis=0)
                tl.debug_barrier()  # the staged keys and flags are read back by other threads
                k1 = tl.maximum(num_forced, budget - explore)

                # B. stage 1 per prediction row: the k1 best keys (forced = +inf), ties to the lower block
                # (keep_all / guarded: every valid block is forced and k1 = n, nothing to select)
                for j in range(0, num_rows * (1 - dense)):
                    qj = tl.minimum(tl.load(lens_ptr + b * next_n + j), width * T).to(tl.int64) - 1
                    wloj = _wlo(qj, window, T)
                    rec_lo = tl.where(j > 0, tl.minimum(wmin, n), n)  # rows past 0 re-score the window blocks
                    prefix = tl.zeros([], tl.uint32)
                    need = k1
                    need0 = k1
                    all_in = tl.zeros([], tl.int32)  # 1: every candidate is taken (no threshold needed)
                    for p in tl.static_range(4):
                        if all_in == 0:
                            hist = tl.zeros([256], tl.int32)
                            for start in range(0, rec_lo, SB):
                                blk = start + offs
                                key, ok = _flat_key(scr, flg, blk, blk < rec_lo)
                                hist += _digit_hist(key, ok, prefix, 24 - 8 * p)
                            for start in range(rec_lo, n, SBS):
                                blk = start + offs_s
                                key, ok = _rescored_key(flg, blk, blk < n, start, tb, bmax_l, stride_bp,
                                                        num_cache_blocks, qj, wloj, vert_l, stride_vp, diag_row, window,
                                                        T, TP, SBS, SLOT, COMBINE, MEAN)
                                hist += _digit_hist(key, ok, prefix, 24 - 8 * p)
                            if p == 0:
                                count = tl.sum(hist, axis=0).to(tl.int64)
                                need = tl.minimum(need, count)
                                need0 = need
                                all_in = (need == count).to(tl.int32)
                            digit, above = _pick_digit(hist, need)
                            need -= above
                            prefix = prefix | (digit.to(tl.uint32) << (24 - 8 * p))
                    # mark: keys above the threshold, then the first `need` ties in block order (flag 2)
                    ties = tl.zeros([], tl.int64)
                    for start in range(0, rec_lo, SB):
                        blk = start + offs
                        mm = blk < rec_lo
                        key, ok = _flat_key(scr, flg, blk, mm)
                        f = tl.load(flg + blk, mask=mm, other=1)
                        ties = _mark(flg, blk, key, ok, f, prefix, ties, need, need0, all_in, SB)
                    for start in range(rec_lo, n, SBS):
                        blk = start + offs_s
                        mm = blk < n
                        key, ok = _rescored_key(flg, blk, mm, start, tb, bmax_l, stride_bp, num_cache_blocks, qj, wloj,
                                                vert_l, stride_vp, diag_row, window, T, TP, SBS, SLOT, COMBINE, MEAN)
                        f = tl.load(flg + blk, mask=mm, other=1)
                        ties = _mark(flg, blk, key, ok, f, prefix, ties, need, need0, all_in, SBS)
                tl.debug_barrier()  # stage 2 and compaction read the final flags

                # C. stage 2, random exploration: the `extra` best hashes among valid unmarked blocks
                prefix2 = tl.zeros([], tl.uint32)
                need2 = tl.zeros([], tl.int64)
                need2_0 = need2
                if EXPLORE:
                    need2 = tl.maximum(tl.minimum(explore, budget - k1), 0)
                    for p in tl.static_range(4):
                        hist = tl.zeros([256], tl.int32)
                        for start in range(0, n, SB):
                            blk = start + offs
                            m = blk < n
                            f = tl.load(flg + blk, mask=m, other=1)
                            h = _mix(_mix(hp ^ blk) ^ lmix).to(tl.uint32)
                            hist += _digit_hist(h, m & (f == 0), prefix2, 24 - 8 * p)
                        if p == 0:
                            need2 = tl.minimum(need2, tl.sum(hist, axis=0).to(tl.int64))
                            need2_0 = need2
                        digit, above = _pick_digit(hist, need2)
                        need2 -= above
                        prefix2 = prefix2 | (digit.to(tl.uint32) << (24 - 8 * p))

                # D. compaction, ascending: only the kept entries are written
                done = tl.zeros([], tl.int64)
                ties2 = tl.zeros([], tl.int64)
                for start in range(0, n, SB):
                    blk = start + offs
                    m = blk < n
                    f = tl.load(flg + blk, mask=m, other=0)
                    keep = m & (f != 0)
                    if EXPLORE:
                        cand = m & (f == 0)
                        h = _mix(_mix(hp ^ blk) ^ lmix).to(tl.uint32)
                        eq = (cand & (h == prefix2)).to(tl.int64)
                        pick = cand & ((h > prefix2) | ((eq != 0) & (ties2 + tl.cumsum(eq, 0) - eq < need2)))
                        keep = keep | (pick & ((blk * 0 + need2_0) > 0))
                        ties2 += tl.sum(eq, axis=0)
                    ki = keep.to(tl.int64)
                    rank = done + tl.cumsum(ki, 0) - 1
                    tl.store(kept_row + rank, blk.to(tl.int32), mask=keep)
                    tl.store(ctab_row + rank, tl.load(tb + blk, mask=keep, other=0), mask=keep)
                    done += tl.sum(ki, axis=0)
            tl.store(nkept_ptr + l * stride_nl + b, done.to(tl.int32))
            # Every block from a row's last block to the newest is forced, so the compact rank of row j's
            # last block is done - n + last_block (length 130, kept [0, 2]: rank 1, compact length 66).
            jn = tl.arange(0, NP)
            lens = _row_lens(lens_ptr, b, next_n, width, T, NP)
            last = tl.maximum(lens - 1, 0)
            clen = (done - n + last // T) * T + last % T + 1
            tl.store(clen_ptr + l * stride_cl + b * stride_cb + jn, tl.where(lens > 0, clen, 0).to(tl.int32),
                     mask=jn < next_n)
            if CACHED:  # the summary cache now holds this layer's full blocks of the request (none: not mixing)
                tl.store(summarized_ptr + l * stride_sml + slot, tl.load(full_ptr + b))
