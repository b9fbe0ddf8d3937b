"""Triton twin of `history.update_history_ref`, and the per-block EMA step the logits kernel's epilogue shares.

`ema_tile` updates kept blocks for one query row from their scores (already in registers): V and its
block max through the physical block id, D at the row's offsets inside the diagonal window, last_seen.
The standalone kernel (replay, and after the DeepGEMM backend) runs its two halves (ema_vertical,
ema_diagonal) over compact logits: one program per (request, BLOCKS compact blocks), one launch per updating
row so rows fold in strictly in order (row j+1's diagonal offsets overlap row j's at block edges). It can
write the compact block maxima and the top-k's group maxima too, the one pass over the logits they all need
(the maxima without an update come from maxima_triton's persistent pass). The update alone on a large table
(SpinIndexer's side stream from PIPELINED_MIN_BLOCKS table blocks) is a pipelined pass instead: a few programs
per request loop over its tiles, the next tiles' loads in flight (`_update_pass_kernel`); each tile's work is
the same.

Bytes per kept token: 4 (logits) + 2 + 2 (V read + written) + 4 more for D inside the window (+ 4 of logits
read again from L2 there); per kept block 2 B of block max (and 4 of last_seen). No two programs of a launch write the same V cell (one
program per physical block of a request; two requests that share a block by design race benignly: each
cell ends with one of their updates) or the same D cell (distinct positions of a request).
"""
from __future__ import annotations

import torch

from ..checks import check_tensor
from .history import HistoryUpdate, block_tokens
from .maxima_triton import row_maxima_triton
from .occupancy import sm_count
from .topk import check_group

try:  # the package imports this module only for CUDA tensors; without triton the reference is used
    import triton
    import triton.language as tl

    from .maxima_triton import store_maxima
except ImportError:  # pragma: no cover
    triton = None

BLOCKS_PER_PROGRAM = 32  # compact blocks per program, one [32, T] tile (loads issued together)
NUM_WARPS = 4
# ptxas's cap per thread (0: its own choice). The pass only moves bytes: resident programs are what keep them in
# flight. At 32 x 4 it needs ~70 (triton 3.9, sm_90a: 7 programs of 4 warps per SM); 64 fits 8, spill-free
# (benchmarks/update_registers.py prints both).
MAX_REGISTERS = 64
DIAGONAL_BLOCKS = 8  # blocks per sub-tile of the diagonal window's gathers (a divisor of BLOCKS_PER_PROGRAM)
# The update alone (no maxima: SpinIndexer's side stream, replay) runs as a pipelined pass: per request a few
# programs loop over its tiles with the next PIPELINED_STAGES - 1 tiles' loads in flight (cp.async into shared
# memory), PASS_PROGRAMS_PER_SM programs per SM in all. The one-tile-per-program kernel kept about half of copy
# bandwidth (run 73: 114.8 us for 242 MB at 96 x 512K s = 0.4), its bytes in flight bounded by registers and its
# programs' dependent round trips (lengths, ids, then V). 1: that one-tile kernel for every call.
# (triton 3.6, sm_90a, stages 3: 96 registers uncapped and 27 KB of shared memory a program, 78 with the ids
# prefetched by hand: benchmarks/update_registers.py. Run 94, the same paired rounds twice: no change at 512K /
# 128K s = 0.4 (alone 101.7 / 101.6 against 101.9 / 101.7 us), the 1M step with the top-k's e4a6b14 ~10 us shorter.)
# H200, run 75 (96 x 512K s = 0.4 / 96 x 1M s = 0.4 / 96 x 256K s = 0.3): alone 102.1 / 210.6 / 64.1 us against
# the one-tile kernel's 116.8 / 231.9 / 63.7, SPIN's step 1180.4 / 2294.3 / 713.1 against 1198.0 / 2361.0 / 713.6;
# the V3.2 step at 128K went 0.595 -> 0.605 of dense with it: from PIPELINED_MIN_BLOCKS table blocks (B x W) only.
# Three programs an SM, rounded down to a whole number per request (4 a request at B = 96: 384 programs), not
# four rounded up (6 a request: 576). H200 at 96 x 512K s = 0.4: the pass alone (update_pass_configs.py, run 78)
# 104.7 us at 2 an SM (3 a request), 110.8 at 4; Nsight Compute on 4 an SM: 26% occupancy, DRAM 57%, 0.43
# instructions issued a scheduler a cycle, and a sorted block table only 2-3% faster than the random one, so V's
# random rows are not the limit. Run 79 (update_overlap.py, paired with the dense step): 384 programs 99.3 us
# alone and 1.496x, 288 105.5 / 1.476x, 480 103.5 / 1.479x. Run 93 (Nsight Compute, 384 programs, s = 0.5): a
# third of the warps' samples wait for the pipelined loads (DEPBAR 19.5%) and the barrier after them (13%);
# achieved occupancy 17% against 31% possible (0.6 of a wave).
PIPELINED_STAGES = 3
PASS_PROGRAMS_PER_SM = 3
PIPELINED_MIN_BLOCKS = 1 << 19


def tile_meta() -> dict:
    """The update programs' tile constexprs (BLOCKS compact blocks, DB per diagonal sub-tile), read at each
    launch so tests can shrink BLOCKS_PER_PROGRAM."""
    return dict(BLOCKS=BLOCKS_PER_PROGRAM, DB=min(DIAGONAL_BLOCKS, BLOCKS_PER_PROGRAM))


def update_history_triton(history: HistoryUpdate | None, logits: torch.Tensor, compact_table: torch.Tensor,
                          compact_lens: torch.Tensor, block_max_out: torch.Tensor | None = None,
                          group_max_out: torch.Tensor | None = None, group: int = 64) -> None:
    """Same as update_history_ref (history may be None when only block_max_out is wanted).

    logits: float32 [B, N, X]; compact_table: int32 [B, W]; compact_lens: int32 [B, N];
    block_max_out: optional float32 [B*N, >= X/T], entry [r, m] = max of row r's valid logits in compact
    block m (written for the blocks below the row's compact length; the rest are left as they are).
    group_max_out: optional float32 [B*N, >= X/group], the same at `group` columns (a power of two dividing
    T): the top-k's group maxima when it prunes at a finer grain than a block (ops.topk.topk_group),
    from the same pass over the logits instead of a launch of its own."""
    if history is not None and history.vertical is None:
        raise ValueError("history: expected a slot-grain history (a vertical table); a block-grain one updates "
                         "through ops.update_history (history_block_triton)")
    batch, next_n, cols = logits.shape
    t = block_tokens(history)
    blocks = cols // t
    if block_max_out is not None:
        check_tensor("block_max_out", block_max_out, dtype=torch.float32, ndim=2, device=logits.device,
                     device_of="logits")
    if group_max_out is not None:
        check_tensor("group_max_out", group_max_out, dtype=torch.float32, ndim=2, device=logits.device,
                     device_of="logits")
        check_group(group, t)
    if batch == 0 or blocks == 0 or (history is None and block_max_out is None and group_max_out is None):
        return
    if history is None:  # the maxima alone: the persistent pass (maxima_triton) streams them near copy speed
        flat = logits.reshape(batch * next_n, cols)
        row_maxima_triton(flat if flat.stride(1) == 1 else flat.contiguous(), compact_lens.reshape(-1),
                          group_max_out, group, block_max_out, t)
        return
    if logits.stride(2) != 1:
        logits = logits.contiguous()
    grid = (batch, triton.cdiv(blocks, BLOCKS_PER_PROGRAM))
    bmax = block_max_out if block_max_out is not None else logits  # dummy pointers when unused
    gmax = group_max_out if group_max_out is not None else logits
    h = history
    pipelined = PIPELINED_STAGES > 1 and block_max_out is None and group_max_out is None and \
        batch * blocks >= PIPELINED_MIN_BLOCKS
    if pipelined:  # each request's tiles over `programs` programs, a static grid (a CUDA graph keeps it)
        programs = max(1, min(pass_programs(logits.device) // batch, triton.cdiv(blocks, BLOCKS_PER_PROGRAM)))
    for j in range(h.rows):
        if pipelined:
            _update_pass_kernel[(batch, programs)](
                logits, logits.stride(0), logits.stride(1), compact_table, compact_table.stride(0), compact_lens,
                *_history_args(h, logits), next_n, blocks, j, programs, T=t, **tile_meta(),
                HAS_SEEN=h.last_seen is not None, NP=triton.next_power_of_2(next_n), STAGES=PIPELINED_STAGES,
                num_warps=NUM_WARPS)  # uncapped (a cap of 64 spilled ~240 B when it needed 107)
            continue
        _update_history_kernel[grid](
            logits, logits.stride(0), logits.stride(1), compact_table, compact_table.stride(0), compact_lens,
            bmax, bmax.stride(0), gmax, gmax.stride(0), *_history_args(h, logits), next_n, blocks, j,
            T=t, **tile_meta(), HAS_SEEN=h.last_seen is not None, NP=triton.next_power_of_2(next_n),
            BMAX=(block_max_out is not None) and j == 0, GMAX=(group_max_out is not None) and j == 0, G=group,
            num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS or None)


def pass_programs(device: torch.device) -> int:
    """Programs of the pipelined update pass in all, at most: PASS_PROGRAMS_PER_SM per SM of `device`, each
    request taking a whole share, at least one (on the CPU, the interpreter's, 8: the tests' few requests then
    take two or more programs each, each looping over several tiles)."""
    if device.type != "cuda":
        return 8
    return PASS_PROGRAMS_PER_SM * sm_count(device)


def _history_args(h: HistoryUpdate, like: torch.Tensor):
    """The history arguments every kernel that updates takes, in order (see ema_tile)."""
    finfo = torch.finfo(h.vertical.dtype)
    seen = h.last_seen if h.last_seen is not None else h.block_max
    return (h.vertical, h.block_max, h.block_max.stride(0), h.diagonal, h.diagonal.stride(0), seen,
            seen.stride(0) if seen.dim() else 0, h.clock, h.slot_ids, h.kept_blocks, h.kept_blocks.stride(0),
            h.seq_lens, h.update_rows, float(h.alpha), int(h.window), h.trash_block, float(finfo.min), float(finfo.max))


def _no_history(like: torch.Tensor):
    """Dummy history arguments (pointers to `like`) for a kernel compiled without the update (HIST=False)."""
    z = like
    return (z, z, 0, z, 0, z, 0, z, z, z, 0, z, z, 0.0, 0, 0, 0.0, 0.0)


if triton is not None:
    @triton.jit
    def load_vertical(v_ptr, phys, trash, T: tl.constexpr):
        """(safe physical ids int64 [BB], float16 [BB, T] V of those blocks) for ids int [BB]: ids outside the
        cache read the trash block. A kernel issues this load early (before its MMA) so the update's read
        latency hides under it; V stays fp16 (half the registers of fp32) until the EMA converts it."""
        inside = (phys >= 0) & (phys < trash)
        pv = tl.where(inside, phys, trash).to(tl.int64)
        return pv, tl.load(v_ptr + pv[:, None] * T + tl.arange(0, T)[None, :])

    @triton.jit
    def row_constants(upd_ptr, lens_ptr, slot_ptr, clock_ptr, row, b, HAS_SEEN: tl.constexpr):
        """(updates: bool, q: int64 query position, slot: int64, clock: int32) of query row `row` = b * N + j:
        what ema_tile needs per row, loaded once per program, outside the caller's block loop (four dependent
        scalar loads per block cost their latency in every iteration)."""
        upd = tl.load(upd_ptr + row).to(tl.int32) != 0
        q = tl.load(lens_ptr + row).to(tl.int64) - 1
        slot = tl.load(slot_ptr + b).to(tl.int64)
        clock = tl.zeros([], tl.int32)
        if HAS_SEEN:
            clock = tl.load(clock_ptr)
        return upd, q, slot, clock

    @triton.jit
    def ema_vertical(obs, live, pv, old, kb, upd, clock, v_ptr, vb_ptr, vb_stride, seen_ptr, seen_stride, alpha,
                     lo, hi, T: tl.constexpr, HAS_SEEN: tl.constexpr):
        """The V half of ema_tile (arguments as there): V, the blocks' max and last_seen. Returns (live: bool
        [BB, T] cells that take the observation, any_live: bool [BB] blocks that take one)."""
        # Row conditions as a [BB] vector, broadcast once. Scalar conditions go through a where: `block &
        # scalar` of int1 yields an int32 mask in the interpreter (Triton 3.9), which tl.store rejects.
        row_ok = tl.where(upd, kb >= 0, False)
        live = live & row_ok[:, None] & (obs > float("-inf")) & (obs < float("inf"))
        any_live = tl.max(live.to(tl.int32), axis=1) > 0  # [BB]
        old = old.to(tl.float32)
        new = tl.where(old > float("-inf"), alpha * obs + (1.0 - alpha) * old, obs)
        new = tl.minimum(tl.maximum(new, lo), hi)
        v = tl.where(live, new, old)
        # Whole rows under a per-block mask: v holds the old value in the cells not updated, so the bytes
        # written are the same, and a mask constant along T lets the store vectorize. A per-cell mask made
        # it 2-byte stores: 73 of the pass's ~180 us at B = 96 x 512K (benchmarks/update_variants.py).
        row_mask = tl.broadcast_to(any_live[:, None], obs.shape)
        tl.store(v_ptr + pv[:, None] * T + tl.arange(0, T)[None, :], v.to(v_ptr.dtype.element_ty), mask=row_mask)
        tl.store(vb_ptr + pv * vb_stride, tl.max(v, axis=1).to(vb_ptr.dtype.element_ty), mask=any_live)
        if HAS_SEEN:
            tl.store(seen_ptr + pv * seen_stride, clock + pv * 0, mask=any_live)
        return live, any_live

    @triton.jit
    def reaches_window(any_live, kb, q, window, T: tl.constexpr):
        """Whether a block that took an observation (any_live bool [BB], logical ids kb [BB]) holds a position
        inside the row's diagonal window (the `window` positions before query position q): only then does a
        tile do the window's per-cell gathers."""
        return tl.max(tl.where(any_live, kb.to(tl.int64) * T + T - 1, -1), axis=0) > q - window

    @triton.jit
    def window_subtiles(m, on, kb, lim, q, window, pm, T: tl.constexpr, BLOCKS: tl.constexpr, DB: tl.constexpr):
        """(s0, s1): the sub-tiles of DB blocks of compact tile pm (blocks m [BLOCKS], `on` the row's, logical ids
        kb) that can hold a cell of the diagonal window: from the first block ending past q - window (compact
        blocks run in logical order, so every later one does too) to lim. A tile of 256 blocks holding a 128-block
        window then loops over the window's sub-tiles only, not over all 32 (each a chain of dependent loads)."""
        reach = on & (kb >= 0) & (kb.to(tl.int64) * T + T - 1 > q - window)
        first = tl.min(tl.where(reach, m, pm * BLOCKS + BLOCKS), axis=0)
        end = tl.minimum(lim - pm * BLOCKS, BLOCKS)
        return (first - pm * BLOCKS) // DB, (end + DB - 1) // DB

    @triton.jit
    def ema_diagonal(obs, live, kb, q, slot, d_ptr, d_stride, alpha, window, lo, hi, T: tl.constexpr):
        """The D half of ema_tile: the cells of `live` (from ema_vertical) inside the diagonal window. Block kb's
        slot t sits at offset q - (kb * T + t) from the query: D cells descend along T, so they are per-cell
        gathers (no vector loads), worth doing only in the few tiles that reach the window."""
        off = q - (kb.to(tl.int64)[:, None] * T + tl.arange(0, T)[None, :])
        in_window = live & (off >= 0) & (off < window)
        d_cells = d_ptr + slot * d_stride + tl.where(in_window, off, 0)
        old_d = tl.load(d_cells, mask=in_window, other=0.0).to(tl.float32)
        new_d = tl.where(old_d > float("-inf"), alpha * obs + (1.0 - alpha) * old_d, obs)
        new_d = tl.minimum(tl.maximum(new_d, lo), hi)
        tl.store(d_cells, new_d.to(d_ptr.dtype.element_ty), mask=in_window)

    @triton.jit
    def ema_tile(obs, live, pv, old, kb, upd, q, slot, clock, v_ptr, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr,
                 seen_stride, alpha, window, lo, hi, T: tl.constexpr, HAS_SEEN: tl.constexpr):
        """EMA update of BB blocks for one query row. obs: float32 [BB, T] scores of the blocks' slots; live:
        bool [BB, T] columns inside the row's compact length; pv, old: from load_vertical (old float16 or
        float32); kb: int [BB] logical block ids (-1: not a kept block); upd, q, slot, clock: the row's constants
        (row_constants). Writes V, the blocks' max, D inside the window and last_seen, with masked stores only.
        For small tiles (the logits kernel's [1, T]); the update kernel runs the two halves itself."""
        live, any_live = ema_vertical(obs, live, pv, old, kb, upd, clock, v_ptr, vb_ptr, vb_stride, seen_ptr,
                                      seen_stride, alpha, lo, hi, T, HAS_SEEN)
        # The diagonal window covers the request's last `window` positions: only the tiles that reach it
        # do its per-cell gathers (every tile doing the masked address work cost ~50 us at 96 x 512K).
        if reaches_window(any_live, kb, q, window, T):
            ema_diagonal(obs, live, kb, q, slot, d_ptr, d_stride, alpha, window, lo, hi, T)

    @triton.jit
    def _row_logits(x_row, m, in_table, clen, T: tl.constexpr):
        """float32 [BB, T] logits of compact blocks m (int [BB]) of one row (x_row: its first column), -inf
        past clen. Whole blocks are loaded (a mask constant along T vectorizes; the columns past clen inside
        the last block are in the buffer, their values unspecified), then masked."""
        cols = m[:, None] * T + tl.arange(0, T)[None, :]  # int32 compact columns
        x = tl.load(x_row + cols, mask=tl.broadcast_to(in_table[:, None], cols.shape), other=float("-inf"))
        return tl.where(cols < clen, x, float("-inf"))

    @triton.jit
    def _update_pass_kernel(x_ptr, x_stride_b, x_stride_n, table_ptr, table_stride, clen_ptr, v_ptr, vb_ptr,
                            vb_stride, d_ptr, d_stride, seen_ptr, seen_stride, clock_ptr, slot_ptr, kept_ptr,
                            kept_stride, lens_ptr, upd_ptr, alpha, window, trash, lo, hi, next_n, num_blocks, j,
                            programs, T: tl.constexpr, BLOCKS: tl.constexpr, HAS_SEEN: tl.constexpr,
                            NP: tl.constexpr, DB: tl.constexpr, STAGES: tl.constexpr):
        """Program (b, p): row j's EMA update of request b's compact tiles p, p + programs, ... below its used
        blocks, the loads of the next STAGES - 1 tiles in flight while one is updated (the loop's pipelining).
        The tile's work is update_tile's without the maxima."""
        b = tl.program_id(0)
        b64 = b.to(tl.int64)
        rows_n = tl.arange(0, NP)
        clens = tl.load(clen_ptr + b * next_n + rows_n, mask=rows_n < next_n, other=0)
        used = tl.minimum((tl.max(clens, axis=0) + T - 1) // T, num_blocks)  # compact blocks the request uses
        upd, q, slot, clock = row_constants(upd_ptr, lens_ptr, slot_ptr, clock_ptr, b * next_n + j, b, HAS_SEEN)
        clen = tl.load(clen_ptr + b * next_n + j)
        x_row = x_ptr + b64 * x_stride_b + j * x_stride_n
        # a row that does not update (guarded) reads and writes no history: no tiles
        tiles = tl.where(upd, (used + BLOCKS - 1) // BLOCKS, 0)
        # The physical ids by hand one tile ahead (a loop-carried register tile, a plain load): the pipelining
        # then stages only V, the logits and the kept ids through shared memory, not the ids V's addresses need
        # (ptxas: 96 -> 78 registers, 3 of 11 cp.async and a barrier fewer a tile; run 94: a tie at 512K).
        table_row = table_ptr + b64 * table_stride
        m_next = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        phys_next = tl.load(table_row + m_next, mask=m_next < used, other=-1)
        for pm in tl.range(tl.program_id(1), tiles, programs, num_stages=STAGES):
            m = pm * BLOCKS + tl.arange(0, BLOCKS)
            in_table = m < used
            phys = phys_next
            m_next = m + programs * BLOCKS
            phys_next = tl.load(table_row + m_next, mask=m_next < used, other=-1)
            kb = tl.load(kept_ptr + b64 * kept_stride + m, mask=in_table, other=-1)
            pv, old = load_vertical(v_ptr, phys, trash, T)
            x = _row_logits(x_row, m, in_table, clen, T)
            live = tl.broadcast_to(in_table[:, None], x.shape)  # x is -inf past clen: ema_vertical drops those
            live, any_live = ema_vertical(x, live, pv, old, kb, upd, clock, v_ptr, vb_ptr, vb_stride, seen_ptr,
                                          seen_stride, alpha, lo, hi, T, HAS_SEEN)
            if reaches_window(any_live, kb, q, window, T):
                ema_diagonal_tile(x_row, kept_ptr + b64 * kept_stride, pm, used, upd, clen, q, slot, d_ptr, d_stride,
                                  alpha, window, lo, hi, 0, BLOCKS // DB, T, BLOCKS, DB)

    @triton.jit
    def _update_history_kernel(x_ptr, x_stride_b, x_stride_n, table_ptr, table_stride, clen_ptr, bmax_ptr,
                               bmax_stride, gmax_ptr, gmax_stride, v_ptr, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride,
                               clock_ptr, slot_ptr, kept_ptr, kept_stride, lens_ptr, upd_ptr, alpha, window, trash,
                               lo, hi, next_n, num_blocks, j, T: tl.constexpr, BLOCKS: tl.constexpr,
                               HAS_SEEN: tl.constexpr, BMAX: tl.constexpr, NP: tl.constexpr,
                               GMAX: tl.constexpr, G: tl.constexpr, DB: tl.constexpr):
        """One program per (request, BLOCKS compact blocks): update_tile."""
        update_tile(tl.program_id(0), tl.program_id(1), x_ptr, x_stride_b, x_stride_n, table_ptr, table_stride, clen_ptr, bmax_ptr,
                    bmax_stride, gmax_ptr, gmax_stride, v_ptr, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride,
                    clock_ptr, slot_ptr, kept_ptr, kept_stride, lens_ptr, upd_ptr, alpha, window, trash,
                    lo, hi, next_n, num_blocks, j, T, BLOCKS, HAS_SEEN, BMAX, NP, GMAX, G, DB)

    @triton.jit
    def update_tile(b, pm, x_ptr, x_stride_b, x_stride_n, table_ptr, table_stride, clen_ptr, bmax_ptr,
                    bmax_stride, gmax_ptr, gmax_stride, v_ptr, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride,
                    clock_ptr, slot_ptr, kept_ptr, kept_stride, lens_ptr, upd_ptr, alpha, window, trash,
                    lo, hi, next_n, num_blocks, j, T: tl.constexpr, BLOCKS: tl.constexpr,
                    HAS_SEEN: tl.constexpr, BMAX: tl.constexpr, NP: tl.constexpr,
                    GMAX: tl.constexpr, G: tl.constexpr, DB: tl.constexpr):
        """The update pass's program for request b and compact blocks [pm * BLOCKS, (pm + 1) * BLOCKS), loaded
        as one [BLOCKS, T] tile per row (the kernel above runs one per (b, pm); the top-k's threshold launch
        runs them beside its own programs: topk_triton, `update=`).

        Registers decide this pass's speed (it moves bytes and computes little: more resident programs, more
        bytes in flight), so the code is straight-line where the history lives: the updating row j runs after
        the loop over the other rows' maxima (a runtime loop around the update kept its tiles live across
        every iteration), and the diagonal window runs last, over [DB, T] sub-tiles that reload their scores
        (from L2) instead of keeping the tile's alive through the V update."""
        m = pm * BLOCKS + tl.arange(0, BLOCKS)
        b64 = b.to(tl.int64)
        # The table and kept ids under the static bound only, so their loads issue beside the lengths' (no
        # round trip in between): lengths and ids, then V and the logits, two round trips instead of three.
        # The few ids read past the request's used blocks are dropped below, never dereferenced.
        phys_all = tl.load(table_ptr + b64 * table_stride + m, mask=m < num_blocks, other=-1)
        kb_all = tl.load(kept_ptr + b64 * kept_stride + m, mask=m < num_blocks, other=-1)
        rows_n = tl.arange(0, NP)
        clens = tl.load(clen_ptr + b * next_n + rows_n, mask=rows_n < next_n, other=0)
        used = (tl.max(clens, axis=0) + T - 1) // T  # compact blocks the request uses (the rest: no reads)
        in_table = (m < num_blocks) & (m < used)
        x_req = x_ptr + b64 * x_stride_b
        out_row = b64 * next_n  # block / group max rows of the request start here
        if BMAX or GMAX:  # the maxima of the rows that do not update here (first launch only)
            for r in range(0, next_n):
                if r != j:
                    clen = tl.load(clen_ptr + b * next_n + r)
                    x = _row_logits(x_req + r * x_stride_n, m, in_table, clen, T)
                    store_maxima(x, pm, tl.minimum(clen, num_blocks * T), gmax_ptr + (out_row + r) * gmax_stride,
                                 bmax_ptr + (out_row + r) * bmax_stride, T, G, BLOCKS, GMAX, BMAX)
        # a row that does not update (guarded) reads and writes no history: its `upd` masks every access
        upd, q, slot, clock = row_constants(upd_ptr, lens_ptr, slot_ptr, clock_ptr, b * next_n + j, b, HAS_SEEN)
        on = tl.where(upd, in_table, False)
        phys = tl.where(on, phys_all, -1)
        kb = tl.where(on, kb_all, -1)
        pv, old = load_vertical(v_ptr, phys, trash, T)
        clen = tl.load(clen_ptr + b * next_n + j)
        x_row = x_req + j * x_stride_n
        x = _row_logits(x_row, m, in_table, clen, T)
        live = tl.broadcast_to(in_table[:, None], x.shape)  # x is -inf past clen: ema_vertical drops those
        live, any_live = ema_vertical(x, live, pv, old, kb, upd, clock, v_ptr, vb_ptr, vb_stride, seen_ptr,
                                      seen_stride, alpha, lo, hi, T, HAS_SEEN)
        store_maxima(x, pm, tl.minimum(clen, num_blocks * T), gmax_ptr + (out_row + j) * gmax_stride,
                     bmax_ptr + (out_row + j) * bmax_stride, T, G, BLOCKS, GMAX, BMAX)
        # The diagonal window covers the request's last `window` positions: only the tiles that reach it
        # do its per-cell gathers (every tile doing the masked address work cost ~50 us at 96 x 512K).
        if reaches_window(any_live, kb, q, window, T):
            ema_diagonal_tile(x_row, kept_ptr + b64 * kept_stride, pm, tl.minimum(num_blocks, used), upd, clen, q,
                              slot, d_ptr, d_stride, alpha, window, lo, hi, 0, BLOCKS // DB, T, BLOCKS, DB)

    @triton.jit
    def ema_diagonal_tile(x_row, kept_row, pm, lim, upd, clen, q, slot, d_ptr, d_stride, alpha, window, lo, hi,
                          s0, s1, T: tl.constexpr, BLOCKS: tl.constexpr, DB: tl.constexpr):
        """D of a row's compact tile pm (blocks [pm * BLOCKS, (pm + 1) * BLOCKS) below lim; x_row: the row's
        first logit, kept_row: its first logical block id), for a tile that reaches the diagonal window, sub-tiles
        s0 <= s < s1 of DB blocks (0 and BLOCKS // DB: all of them; `window_subtiles`: those from the first block
        that reaches the window to lim). Sub-tiles reload their scores from the logits (just read: L2) rather than
        keep the tile's alive through the V update (the whole tile in update_tile: 91 registers instead of 70)."""
        for s in range(s0, s1):
            ema_diagonal_blocks(x_row, kept_row, pm * BLOCKS + s * DB, lim, upd, clen, q, slot, d_ptr, d_stride,
                                alpha, window, lo, hi, T, DB)

    @triton.jit
    def ema_diagonal_blocks(x_row, kept_row, first, lim, upd, clen, q, slot, d_ptr, d_stride, alpha, window, lo, hi,
                            T: tl.constexpr, DB: tl.constexpr):
        """D of a row's compact blocks [first, first + DB) inside [0, lim) (x_row: the row's first logit, kept_row:
        its first logical block id): their scores reloaded from the logits, the cells inside the window updated."""
        ms = first + tl.arange(0, DB)
        on_s = tl.where(upd, (ms >= 0) & (ms < lim), False)
        kb_s = tl.load(kept_row + ms, mask=on_s, other=-1)
        obs = _row_logits(x_row, ms, on_s, clen, T)
        # as ema_vertical's live: a kept block of an updating row, a finite score before clen
        # (a branch per sub-tile on whether it reaches the window cost 4-8 registers: none here)
        live_s = tl.broadcast_to((kb_s >= 0)[:, None], obs.shape) & (obs > float("-inf")) & (obs < float("inf"))
        ema_diagonal(obs, live_s, kb_s, q, slot, d_ptr, d_stride, alpha, window, lo, hi, T)
