"""Triton twin of `topk_ref`: exact top-k per row with per-row lengths, pruned by group maxima.

Exactness argument. Split a row into groups of G columns and let S_g be the max of group g (over valid
columns). Any threshold tau <= (k-th largest S_g) has at least k elements >= tau (each of the k best
groups holds its max), so the top k elements are all >= tau, and they sit in groups with S_g >= tau.
tau = the lower edge of the 16-bit key bucket holding the k-th largest S_g (tau = 0, every valid element, when
the row has fewer than k groups). Group maxima: with G = 64 the logits kernel's fused block max (`block_max`),
below it those a caller wrote (`group_max`: SPIN's update pass; SpinIndexer always passes one of the two);
without them maxima_triton's pass computes them first (G = topk_group(C, k): a row has >= 4k groups).

The chain (runs 15-17 measured it against a two-launch design with a redundant per-program threshold, which
lost by 13% on the dense V3.2 step and was removed; benchmarks/NOTES.md, run 17). The top-k of a decode step is
latency-bound, not byte-bound: what costs is the launches in series and, inside each, the chain of CTA-wide
reductions and dependent global loads.
  1. `_threshold_kernel` (one program per row): tau by a 16-step bisection, the live groups listed.
  2. `_gather_kernel` (row x 16 listed groups): elements >= tau appended to a per-row buffer of CAP = 2 *
     next_pow2(k) keys with atomics (the threshold program zeroed the count).
  3. `_chunk_sort_kernel` (row x CAP / SORT_CHUNK): each chunk of SORT_CHUNK candidates sorted in place.
  4. `_rank_kernel` (row x CAP / RANK_BI): rank = sum over the sorted chunks of a lockstep binary search.
     A row whose candidates overflowed the buffer (massive ties, or more live groups than CAP holds) gets an
     exact streaming merge over the whole row instead (`_merge_overflow`: CAP columns a step, filtered by the
     running k-th key, sorted only when its entrants fill the buffer; 3-11x a normal row's top-k, run 58).
sorted=False (the engines' contract, SpinIndexer's and DenseIndexer's default): threshold and gather as above, then
  `_select_set_kernel` (one program per row) instead of the sort and the rank: the k-th largest candidate key
  digit by digit, then the keys >= it written from registers (rows >= SET_SELECT_MIN_ROWS; fewer rows take the
  sort and rank, whose best-first order is one order of the set). An overflowing row takes `_merge_overflow`.
Sort key: the fp32 value mapped to an order-preserving uint32 (upper half) and 0xFFFFFFFF - position
(lower half): sorting descending puts larger values first and, among equal values, lower positions
first, exactly as the stable reference. -0.0 is folded into +0.0 (the reference sorts them as equal), every NaN
into +NaN (above +inf, as torch.topk).
"""
from __future__ import annotations

import torch

from ..checks import check_tensor
from .history import block_tokens
from .topk import TOKENS_PER_GROUP_MAX, check_topk_args, pruning_group, topk_ref

try:  # the package imports this module only for CUDA tensors; without triton the reference is used
    import triton
    import triton.language as tl

    from .history_block_triton import update_block_tile
    from .history_triton import update_tile
    from .maxima_triton import row_maxima_triton
except ImportError:  # pragma: no cover
    triton = None

IN_TOPK_BLOCKS = 32  # block-grain update programs in the threshold launch: compact blocks a program (see _chain)
MAX_TRITON_K = 4096  # larger k goes to the reference (sort tile of 2 * next_pow2(k) keys)
# Logits a gather program reads: GATHER_VALUES // G live groups (at least 16). H200, run 85 (SPIN's step, 512K to
# 128K, B = 1 to 96): 2048 ties, 4096 and 8192 are slower at every point (1 x 128K s = 0.4: 1.072x of dense at
# 1024, 1.013x at 4096, 0.917x at 8192); 512 ties (run 86).
GATHER_VALUES = 1024
SORT_CHUNK = 512  # candidates per sort program (the buffer holds CAP = 2 * next_pow2(k): 8 chunks at k = 2048)
RANK_BI = 128  # candidates ranked per program (one per thread at 4 warps)
# The rank path needs 40 registers (ptxas, sm_90a); the overflow merge it may run sorts CAP keys in registers
# and would take the whole kernel to 250 (2 programs per SM instead of 10). Capped, only the merge (rare,
# "slow, never wrong") spills.
RANK_MAXNREG = 48
# tau_hint's bracket: +-32 16-bit keys (a quarter of an octave either way: the 7 mantissa bits of a key step
# 1/128 of an octave) around the previous call's key; 65 keys take 7 bisection counts
TAU_HINT_RADIUS = 32
THRESHOLD_TILE_MAX = 16384  # group maxima held in registers by the threshold program (more: chunked passes)
# Warps of the threshold program (one per row, latency-bound: 16 counts, each a compare and a CTA sum over the
# keys a thread holds) by its tile SB. At 16384 maxima (1M columns) 8 warps compile to 254 registers and 7976
# SASS instructions; inside the step that program cost ~17 us more than alone (runs 29-31; its code fetched
# after the logits streamed the cache through L2 is our guess). 16 warps (128 registers, 5184 instructions):
# dense step 100.8 -> 84.5 us at 1 x 1M, SPIN's (Triton backend) 97.0 -> 81.3; 8 x 1M 349 -> 332 / 272 -> 245;
# 96 x 1M unchanged (run 31, benchmarks/threshold_in_step.py); same top-k as 8 warps at 1-96 rows x 1M (run 30).
# At 8192, 8 warps stay the fastest (run 30).
THRESHOLD_WARPS = {8192: 8, 16384: 16}
# sorted=False: the set select (_select_set_kernel) holds a row's CAP candidate keys, 8 per thread (16 warps at
# CAP = 4096, k = 2048). A row that overflowed the buffer takes the rank path's streaming merge. Below
# SET_SELECT_MIN_ROWS rows the sort and rank run instead (their best-first order is one order of the set): on
# the H200 (set_select_parts.py, run 48, random rows, k = 2048) the select took ~16 us at 1-96 rows (64K-512K
# columns), the sort and rank 10 us at 1-16 rows, 12 at 32, 16 at 48, 20 at 64 and 28 at 96.
SET_SELECT_MIN_ROWS = 48


def set_select_warps(cap: int) -> int:
    """Warps of the set select for a candidate buffer of `cap` keys (8 keys per thread, 4 to 16 warps)."""
    return max(4, min(16, cap // 256))



def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def threshold_tile(num_groups: int) -> int:
    """SB: the group maxima a threshold program holds in registers for a row of num_groups (more: chunked)."""
    return min(_next_pow2(num_groups), THRESHOLD_TILE_MAX)


def threshold_warps(tile: int) -> int:
    """The threshold program's warps for its tile SB (THRESHOLD_WARPS; 8 for the tiles it does not name)."""
    return THRESHOLD_WARPS.get(tile, 8)


def candidate_cap(k: int, cap: int | None = None) -> int:
    """The per-row candidate buffer of topk_triton for k (cap: a caller's request, raised to the minimum): a row
    with more candidates takes the overflow merge, which keeps K_POW = next_pow2(max(k, 16)) keys and takes as
    many."""
    k_pow = _next_pow2(max(k, 16))
    return max(cap or 2 * k_pow, 2 * k_pow)


def topk_triton(logits: torch.Tensor, lengths: torch.Tensor, k: int, validate: bool = True,
                block_max: torch.Tensor | None = None, cap: int | None = None,
                stats: torch.Tensor | None = None, _stages: int = 5, kept_blocks: torch.Tensor | None = None,
                next_n: int = 1, out: torch.Tensor | None = None,
                group_max: torch.Tensor | None = None, tau_hint: torch.Tensor | None = None,
                update: tuple | None = None, sorted: bool = True, group: int | None = None) -> torch.Tensor:
    """Top-k positions per row, same meaning as `topk_ref`.

    logits: float32 [R, C]; columns >= lengths[r] are ignored. lengths: int32 [R] in [0, C]. k: int >= 1.
    block_max: optional float32 [R, ceil(C / 64)], the exact max of each 64-column block over its valid
    columns (-inf when none), as `paged_indexer_logits_triton` writes it; used when a row has >= 4k
    blocks, so the top-k reads only the blocks that can hold a winner.
    cap: candidate buffer size (tests use a small one to exercise the overflow path; at least 2 * next_pow2(k)).
    stats: optional int32 [R] receiving the candidate count of each row (benchmarks, diagnostics); > cap for a
    row that took the overflow merge.
    _stages: run only the first stages (benchmark breakdown; the group-max launch, when there is one, always
    runs): 2 = threshold, 3 = + gather, 4 = + chunk sort (or the set select), 5 = + rank.
    kept_blocks, next_n: optional int32 [R // next_n, M]: column c of row r is written as position
    kept_blocks[r // next_n, c // 64] * 64 + c % 64 (the compact-to-logical map of SPIN's plan), in the
    final write. out: optional int32 [R, k] to write into.
    group_max: optional float32 [R, ceil(C / G)]: the exact max of every G columns of valid logits (NaN for a
    group holding a NaN), written by a pass that read the logits anyway (SPIN's update pass): used instead of
    the group-max launch when G < 64.
    group: G, the columns a group maximum covers (a power of two <= 64; None: topk_group(C, k), >= 4k groups in
    a full row). The threshold is the k-th largest group maximum's bucket: with fewer than ~4k groups below a
    row's length it admits many more candidates (SPIN's compact rows fill only the kept share of C: run 126).
    tau_hint: optional int32 [R], read and written (rows whose group maxima fit one tile): the
    threshold's 16-bit key of each row from an earlier call (any value: a hint never changes the result).
    Where this call's key lies within TAU_HINT_RADIUS of it, one packed count confirms the bracket and the
    bisection takes HINT_STEPS = 7 counts instead of 16; a miss costs that one count. The row's key is
    written back for the next call.
    update: optional (history: HistoryUpdate, compact_table: int32 [R // next_n, M]): also apply SPIN's EMA
    update from these logits (viewed [R // next_n, next_n, C]; lengths are their compact lengths), as
    history_triton.update_history_triton would (a block-grain history, vertical None: as
    history_block_triton.update_block_history_triton would from `block_max`, then required). Where only one row
    per request updates (history.rows == 1), the update pass's programs run in the threshold launch, after the
    rows' threshold programs: at a few rows that launch is one program per row on an otherwise idle GPU, so the
    update costs neither a launch nor a stream fork and join of its own. Elsewhere the pass runs after the top-k.
    sorted: True, best first (the sort and rank launches); False, the same set in no particular order (one
    select launch, `_select_set_kernel`, after the same threshold and gather).
    returns int32 [R, k]: positions, best first, ties to the lower position, -1 past lengths[r] (sorted=False:
    the same positions in no particular order, then -1).
    """
    check_topk_args(logits, lengths, k, validate, sorted)
    if update is not None and update[0].vertical is None and block_max is None:
        raise ValueError("block_max: expected the block maxima with a block-grain update= (its EMA reads them)")
    rows, cols = logits.shape
    dev = logits.device
    group = pruning_group(group, cols, k)
    if tau_hint is not None:
        check_tensor("tau_hint", tau_hint, dtype=torch.int32, shape=(rows,), shape_names="[R]", device=dev,
                     device_of="logits", contiguous=True)
    if k > MAX_TRITON_K:
        from .topk import topk_positions_ref
        out = topk_positions_ref(logits, lengths, k, kept_blocks=kept_blocks, next_n=next_n, out=out,
                                 validate=False, sorted=sorted)
        return _update_after(update, logits, lengths, next_n, out, block_max)
    if block_max is not None:
        check_tensor("block_max", block_max, dtype=torch.float32,
                     shape=(rows, -(-cols // TOKENS_PER_GROUP_MAX)), shape_names="[R, ceil(C / 64)]",
                     device=dev, device_of="logits")
    if out is None:
        out = torch.empty(rows, k, dtype=torch.int32, device=dev)
    if rows == 0:
        return out
    if cols == 0:
        return out.fill_(-1)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    k_pow = _next_pow2(max(k, 16))
    cap = candidate_cap(k, cap)
    num_groups = -(-cols // group)
    if group_max is not None:
        check_tensor("group_max", group_max, dtype=torch.float32, shape=(rows, num_groups),
                     shape_names=f"[R, ceil(C / G)] with G = {group}", device=dev, device_of="logits")
    if group == TOKENS_PER_GROUP_MAX and block_max is not None:
        summary = block_max if block_max.stride(1) == 1 else block_max.contiguous()
    elif group_max is not None:
        summary = group_max if group_max.stride(1) == 1 else group_max.contiguous()
    else:
        # the groups below each row's length (the only ones the threshold reads), in maxima_triton's pass
        summary = torch.empty(rows, num_groups, dtype=torch.float32, device=dev)
        row_maxima_triton(logits, lengths, summary, group, tokens=TOKENS_PER_GROUP_MAX)
    if stats is not None:
        check_tensor("stats", stats, dtype=torch.int32, shape=(rows,), shape_names="[R]", device=dev,
                     device_of="logits", contiguous=True)
    mapped = kept_blocks is not None
    kept = kept_blocks if mapped else out  # dummy pointer when unmapped
    kept_stride = kept_blocks.stride(0) if mapped else 0
    args = (logits, lengths, k, summary, group, num_groups, k_pow, cap, stats, _stages, kept, kept_stride, next_n,
            mapped, out, tau_hint)
    if update is None or update[0].rows == 1:
        return _chain(*args, update=update, maxima=block_max, ordered=sorted)
    _chain(*args, ordered=sorted)
    return _update_after(update, logits, lengths, next_n, out, block_max)


def _update_after(update, logits, lengths, next_n: int, out: torch.Tensor, maxima=None) -> torch.Tensor:
    """The `update=` of topk_triton as a pass of its own (update_history_triton, or under block grain
    update_block_history_triton from the block maxima), then out."""
    if update is not None:
        history, table = update
        x = logits.view(logits.shape[0] // next_n, next_n, logits.shape[1])
        if history.vertical is None:
            from .history_block_triton import update_block_history_triton
            update_block_history_triton(history, x, maxima, table, lengths)
        else:
            from .history_triton import update_history_triton
            update_history_triton(history, x, table, lengths)
    return out


def _chain(logits, lengths, k, summary, group, num_groups, k_pow, cap, stats, _stages, kept, kept_stride, next_n,
              mapped, out, tau_hint=None, update=None, maxima=None, ordered=True):
    rows, cols = logits.shape
    dev = logits.device
    thresh = torch.empty(rows, dtype=torch.int32, device=dev)
    count = torch.empty(rows, dtype=torch.int32, device=dev) if stats is None else stats  # zeroed in-kernel
    cand = torch.empty(rows, cap, dtype=torch.int64, device=dev)
    live = torch.empty(rows, cap, dtype=torch.int32, device=dev)
    num_live = torch.empty(rows, dtype=torch.int32, device=dev)
    sum_block = threshold_tile(num_groups)
    if _stages < 2:
        return _update_after(update, logits, lengths, next_n, out, maxima)
    # The threshold program also zeroes the candidate count and fills the row's output with -1 (the rank
    # launch writes only the ranks it finds): no memset launches on the per-layer path.
    has_hint = tau_hint is not None
    threshold_args = (summary, lengths, cols, thresh, live, num_live, count, num_groups, summary.stride(0), k, out,
                      tau_hint if has_hint else thresh)
    threshold_meta = dict(G=group, SB=sum_block, CAP=cap, HINT=has_hint, HINT_R=TAU_HINT_RADIUS,
                          HINT_STEPS=(2 * TAU_HINT_RADIUS).bit_length(), num_warps=threshold_warps(sum_block))
    if update is None:
        _threshold_kernel[(rows,)](*threshold_args, **threshold_meta)
    else:  # the update pass's programs after the rows' (topk_triton's `update`)
        history, table = update
        batch, t = rows // next_n, block_tokens(history)
        block_grain = history.vertical is None
        if block_grain:  # the O(blocks) update from the block maxima (no V: logits stand in for its pointer)
            from .history_block_triton import block_history_args, block_tile_meta
            # 32 blocks a program, not the pass's 256: the program holding the diagonal window gathers its
            # logits one sub-tile after another, and here the top-k's next launch waits for it (H100, 1 x 128K
            # s = 0.3: 256 blocks a program cost the step 6.7 us, 40.4 against 33.7 with slot grain; at 32 the
            # H200 timed 1.052x the dense step against slot grain's 1.046x, run 162, with 8-block sub-tiles). One
            # 32-block sub-tile a program since (untimed): its registers stay under the threshold rows' (ptxas,
            # sm_90a: 220 either way at 8 warps).
            meta = block_tile_meta(IN_TOPK_BLOCKS, diagonal=IN_TOPK_BLOCKS)
            hist = (logits, *block_history_args(history, maxima))
        else:  # the pass over the logits (no maxima read: logits stand in for their pointer)
            from .history_triton import _history_args, tile_meta
            v, *rest = _history_args(history, logits)
            meta, hist = tile_meta(), (v, logits, 0, *rest)
        tiles = triton.cdiv(cols // t, meta["BLOCKS"])
        _threshold_update_kernel[(rows + batch * tiles,)](
            *threshold_args, rows, tiles, logits, logits.stride(0) * next_n, logits.stride(0), table, table.stride(0),
            *hist, next_n, cols // t, T=t, **meta, HAS_SEEN=history.last_seen is not None,
            NP=triton.next_power_of_2(next_n), BLOCK_GRAIN=block_grain, **threshold_meta,
            enable_fp_fusion=not block_grain)  # block grain's EMA rounded as update_block_history_triton's
    if _stages < 3:
        return out
    lb = max(16, GATHER_VALUES // group)
    _gather_kernel[(rows, triton.cdiv(cap, lb))](logits, lengths, cols, live, num_live, thresh, count, cand,
                                                 logits.stride(0), G=group, LB=lb, CAP=cap, EVEN=cols % group == 0,
                                                 num_warps=4)
    if _stages < 4:
        return out
    if not ordered and rows >= SET_SELECT_MIN_ROWS:  # the set: one select launch instead of the sort and rank
        _select_set_kernel[(rows,)](logits, lengths, cols, count, cand, thresh, out, logits.stride(0), k, kept,
                                    kept_stride,
                                    next_n, K_POW=k_pow, CAP=cap, MAP=mapped, num_warps=set_select_warps(cap))
        return out
    chunk = min(SORT_CHUNK, cap)
    _chunk_sort_kernel[(rows, cap // chunk)](count, cand, CAP=cap, CH=chunk, num_warps=4)
    if _stages < 5:
        return out
    _rank_kernel[(rows, triton.cdiv(cap, RANK_BI))](logits, lengths, cols, count, cand, out, logits.stride(0), k, kept,
                                                    kept_stride, next_n, K_POW=k_pow, CAP=cap, CH=chunk,
                                                    LOG_CH=chunk.bit_length() - 1, BI=RANK_BI, MAP=mapped,
                                                    num_warps=4, maxnreg=RANK_MAXNREG)
    return out



if triton is not None:
    @triton.jit
    def _ukey(x):
        """fp32 -> uint32 with the same order (-0.0 folded into +0.0, every NaN into +NaN, as topk_ref)."""
        x = tl.where(x == 0.0, 0.0, x)
        bits = tl.where(x != x, 0x7FC00000, x.to(tl.uint32, bitcast=True)).to(tl.uint32)
        flip = tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
        return bits ^ flip

    @triton.jit
    def _sort_key(u, pos):
        """int64 key: ukey in the upper half (shifted to signed), 0xFFFFFFFF - pos in the lower half."""
        hi = u.to(tl.int64) - 2147483648
        return (hi << 32) | (4294967295 - pos.to(tl.int64))

    @triton.jit
    def _map_pos(pos, r, kept_ptr, kept_stride, next_n, MAP: tl.constexpr):
        """Compact column -> logical position through SPIN's kept blocks (identity without MAP)."""
        if MAP:
            kb = tl.load(kept_ptr + (r // next_n).to(tl.int64) * kept_stride + tl.maximum(pos, 0) // 64,
                         mask=pos >= 0, other=0)
            pos = tl.where(pos >= 0, kb * 64 + pos % 64, pos)
        return pos

    @triton.jit
    def _bisect_keys(top, lo, hi, k, steps):
        """The largest t in [lo, hi] with count(top >= t) >= k, given count(top >= lo) >= k > count(top > hi)
        and hi - lo < 2^steps: one CTA count per step."""
        for _ in range(steps):
            mid = (lo + hi + 1) // 2
            ok = tl.sum((top >= mid).to(tl.int32), axis=0) >= k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        return lo

    @triton.jit
    def _count_hi_ge(base, n_valid, t16, SB: tl.constexpr):
        """Number of group maxima whose key's upper 16 bits are >= t16 (a pass over base[:n_valid])."""
        cnt = n_valid * 0
        for s0 in range(0, n_valid, SB):
            g = s0 + tl.arange(0, SB)
            u = _ukey(tl.load(base + g, mask=g < n_valid, other=0.0))
            cnt += tl.sum(((g < n_valid) & ((u >> 16).to(tl.int32) >= t16)).to(tl.int32), axis=0)
        return cnt

    @triton.jit
    def _row_length(len_ptr, r, cols):
        """Row r's length, at most the row's C columns: a length past them (validate=False) reads the row only,
        never the row below or past the tensor's end."""
        return tl.minimum(tl.load(len_ptr + r), cols)

    @triton.jit
    def _threshold_kernel(s_ptr, len_ptr, cols, thresh_ptr, live_ptr, nlive_ptr, count_ptr, num_groups, stride_s, k,
                          out_ptr, hint_ptr, G: tl.constexpr, SB: tl.constexpr, CAP: tl.constexpr,
                          HINT: tl.constexpr, HINT_R: tl.constexpr, HINT_STEPS: tl.constexpr):
        _threshold_row(tl.program_id(0), s_ptr, len_ptr, cols, thresh_ptr, live_ptr, nlive_ptr, count_ptr, num_groups,
                       stride_s, k, out_ptr, hint_ptr, G, SB, CAP, HINT, HINT_R, HINT_STEPS)

    @triton.jit
    def _threshold_update_kernel(s_ptr, len_ptr, cols, thresh_ptr, live_ptr, nlive_ptr, count_ptr, num_groups, stride_s,
                                 k, out_ptr, hint_ptr, rows, tiles, x_ptr, x_stride_b, x_stride_n, table_ptr,
                                 table_stride, v_ptr, bm_ptr, bm_stride, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr,
                                 seen_stride, clock_ptr, slot_ptr, kept_ptr, kept_stride, lens_ptr, upd_ptr, alpha,
                                 window, trash, lo, hi, next_n, num_blocks, G: tl.constexpr, SB: tl.constexpr,
                                 CAP: tl.constexpr, HINT: tl.constexpr, HINT_R: tl.constexpr, HINT_STEPS: tl.constexpr,
                                 T: tl.constexpr, BLOCKS: tl.constexpr, DB: tl.constexpr, HAS_SEEN: tl.constexpr,
                                 NP: tl.constexpr, BLOCK_GRAIN: tl.constexpr):
        """Programs [0, rows): the rows' thresholds (_threshold_row); then `tiles` per request, row 0 updating: the
        EMA update pass's programs over the same logits (history_triton.update_tile, no maxima written; v_ptr
        the vertical table) or, under block grain, history_block_triton.update_block_tile from the block maxima
        bm_ptr."""
        pid = tl.program_id(0)
        if pid < rows:
            _threshold_row(pid, s_ptr, len_ptr, cols, thresh_ptr, live_ptr, nlive_ptr, count_ptr, num_groups, stride_s, k,
                           out_ptr, hint_ptr, G, SB, CAP, HINT, HINT_R, HINT_STEPS)
        elif BLOCK_GRAIN:
            u = pid - rows
            update_block_tile(u // tiles, u % tiles, 0, x_ptr, x_stride_b, x_stride_n, table_ptr, table_stride, len_ptr,
                              bm_ptr, bm_stride, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride, clock_ptr,
                              slot_ptr, kept_ptr, kept_stride, lens_ptr, upd_ptr, alpha, window, trash, lo, hi, next_n,
                              num_blocks, T, BLOCKS, DB, HAS_SEEN, True)
        else:
            u = pid - rows
            update_tile(u // tiles, u % tiles, x_ptr, x_stride_b, x_stride_n, table_ptr, table_stride, len_ptr,
                        x_ptr, 0, x_ptr, 0, v_ptr, vb_ptr, vb_stride, d_ptr, d_stride, seen_ptr, seen_stride,
                        clock_ptr, slot_ptr, kept_ptr, kept_stride, lens_ptr, upd_ptr, alpha, window, trash, lo, hi,
                        next_n, num_blocks, 0, T, BLOCKS, HAS_SEEN, False, NP, False, T, DB)

    @triton.jit
    def _threshold_row(r, s_ptr, len_ptr, cols, thresh_ptr, live_ptr, nlive_ptr, count_ptr, num_groups, stride_s, k,
                       out_ptr, hint_ptr, G: tl.constexpr, SB: tl.constexpr, CAP: tl.constexpr,
                       HINT: tl.constexpr, HINT_R: tl.constexpr, HINT_STEPS: tl.constexpr):
        """Row r's threshold: tau (the lower edge of the 16-bit key bucket of the k-th largest group max) and
        the list of the groups that can hold a winner; zeroes the row's candidate count, fills its output with
        -1."""
        tl.store(count_ptr + r, 0)  # the gather launch appends to it
        for c0 in range(0, k, 1024):
            c = c0 + tl.arange(0, 1024)
            tl.store(out_ptr + r.to(tl.int64) * k + c, tl.full([1024], -1, tl.int32), mask=c < k)
        tl.debug_barrier()  # the overflow mark below must land after the zero
        length = _row_length(len_ptr, r, cols)
        n_valid = (length + G - 1) // G
        base = s_ptr + r.to(tl.int64) * stride_s
        if n_valid <= SB:
            # One tile (every row at <= 1M columns): the keys stay in registers for the search and the listing.
            # The program is one CTA's chain of dependent steps (ncu, run 156: ~5.3K instructions a warp at ~5.5
            # cycles each at 8192 maxima); reading the keys once, in whole vectors (the mask is the row's
            # allocated width, num_groups: a multiple of 16 wherever triton's specialization sees one; past
            # n_valid masked after the load), and the listing's count from the scan's last lane instead of a
            # second reduction: the dense step 0.91x / 0.92x at 1 x 128K / 1 x 1M against a second load and
            # count (run 156, H100, benchmarks/topk_ab.py).
            g = tl.arange(0, SB)
            x = tl.load(base + g, mask=g < num_groups, other=0.0)
            top = tl.where(g < n_valid, (_ukey(x) >> 16).to(tl.int32), -1)
            lo = length * 0  # 0 = the smallest key: every valid group is live
            if n_valid >= k:
                # The 16-bit bucket of the k-th largest group max: the largest t with count(top >= t) >= k, by
                # bisection (16 counting steps). A 256-bin tl.histogram over 8K keys costs ~10 us in one program
                # on the H200; a counting step over keys held in registers is a compare and a sum.
                hi = lo + 65535
                if HINT:  # the previous call's answer brackets this one's: one count checks the bracket
                    h = tl.minimum(tl.maximum(tl.load(hint_ptr + r), 0), 65535)
                    a = tl.maximum(h - HINT_R, 0)
                    b = tl.minimum(h + HINT_R, 65535)
                    # both counts in one reduction (each <= SB <= 16384 < 2^16)
                    both = tl.sum((top >= a).to(tl.int32) + ((top > b).to(tl.int32) << 16), axis=0)
                    inside = ((both & 0xFFFF) >= k) & ((both >> 16) < k)  # count(>= a) >= k > count(> b)
                    lo = tl.where(inside, a, lo)
                    hi = tl.where(inside, b, hi)
                    lo = _bisect_keys(top, lo, hi, k, tl.where(inside, HINT_STEPS, 16))
                else:
                    lo = _bisect_keys(top, lo, hi, k, 16)
                if HINT:
                    tl.store(hint_ptr + r, lo)
            tl.store(thresh_ptr + r, lo << 16)
            # the live groups (key >= tau <=> its upper 16 bits >= lo: tau's lower half is 0), compacted
            li = (top >= lo).to(tl.int32)
            incl = tl.cumsum(li, axis=0)
            idx = incl - li
            tl.store(live_ptr + r.to(tl.int64) * CAP + idx, g, mask=(li != 0) & (idx < CAP))
            last = g == SB - 1  # its inclusive count is the row's: lanes past n_valid add 0
            tl.store(nlive_ptr + r + g * 0, incl, mask=last)
            # each live group holds >= 1 candidate: past CAP the buffer would overflow anyway
            tl.store(count_ptr + r + g * 0, tl.full([SB], CAP + 1, tl.int32), mask=last & (incl > CAP))
        else:  # wider rows: a pass over the keys for every count, and the listing tile by tile
            lo = length * 0
            hi = lo + 65535
            for _ in range(16):
                mid = (lo + hi + 1) // 2
                ok = _count_hi_ge(base, n_valid, mid, SB) >= k
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid - 1)
            tau = lo << 16
            tl.store(thresh_ptr + r, tau)
            tau_u = tau.to(tl.uint32, bitcast=True)
            n_live = length * 0
            for s0 in range(0, n_valid, SB):
                g = s0 + tl.arange(0, SB)
                u = _ukey(tl.load(base + g, mask=g < n_valid, other=0.0))
                li = ((g < n_valid) & (u >= tau_u)).to(tl.int32)
                idx = n_live + tl.cumsum(li, axis=0) - li
                tl.store(live_ptr + r.to(tl.int64) * CAP + idx, g, mask=(li != 0) & (idx < CAP))
                n_live += tl.sum(li, axis=0)
            tl.store(nlive_ptr + r, n_live)
            if n_live > CAP:
                tl.store(count_ptr + r, CAP + 1)

    @triton.jit
    def _gather_kernel(x_ptr, len_ptr, cols, live_ptr, nlive_ptr, thresh_ptr, count_ptr, cand_ptr, stride_x,
                       G: tl.constexpr, LB: tl.constexpr, CAP: tl.constexpr, EVEN: tl.constexpr):
        r = tl.program_id(0)
        i0 = tl.program_id(1) * LB
        i = i0 + tl.arange(0, LB)
        # The row's count, length, threshold and this program's slice of the live list in one round trip: the
        # list is read under its capacity, not the count (its entries past the count are stale and only feed
        # masked-off logit addresses), so the logits are the second round trip and the append the third, not
        # the fourth (the gather is latency-bound: ~50 us alone at 96 x 512K, ~117 beside the EMA update;
        # run 94: still ~111-115 beside it, the step a tie at 512K and ~10 us shorter at 1M).
        n_live = tl.load(nlive_ptr + r)
        length = _row_length(len_ptr, r, cols)
        tau = tl.load(thresh_ptr + r).to(tl.uint32, bitcast=True)
        g = tl.load(live_ptr + r.to(tl.int64) * CAP + i, mask=i < CAP, other=0)
        if (i0 < n_live) & (n_live <= CAP):
            g = tl.where(i < n_live, g, 0)
            c = g[:, None] * G + tl.arange(0, G)[None, :]  # [LB, G]
            ok = (i < n_live)[:, None] & (c < length)
            # whole groups under a per-group mask where they lie inside the row (vectorized), then the length mask
            if EVEN:
                x = tl.load(x_ptr + r.to(tl.int64) * stride_x + c,
                            mask=tl.broadcast_to((i < n_live)[:, None], [LB, G]), other=float("-inf"))
                x = tl.where(ok, x, float("-inf"))
            else:
                x = tl.load(x_ptr + r.to(tl.int64) * stride_x + c, mask=ok, other=float("-inf"))
            u = _ukey(x)
            sel = (ok & (u >= tau)).to(tl.int32)
            per_group = tl.sum(sel, axis=1)  # [LB]
            n_sel = tl.sum(per_group, axis=0)
            if n_sel > 0:
                start = tl.atomic_add(count_ptr + r, n_sel)  # one slot range per program
                group_start = start + tl.cumsum(per_group, axis=0) - per_group
                slot = group_start[:, None] + tl.cumsum(sel, axis=1) - sel  # [LB, G]
                tl.store(cand_ptr + r.to(tl.int64) * CAP + slot, _sort_key(u, c), mask=(sel != 0) & (slot < CAP))

    @triton.jit
    def _chunk_sort_kernel(count_ptr, cand_ptr, CAP: tl.constexpr, CH: tl.constexpr):
        """Sort chunk c of row r's candidates in place, descending; slots past the count get MIN_KEY (below
        every real key: a real key's position half is 0xFFFFFFFF - pos with pos < 2^31). Chunks past the
        count, and rows that overflowed (the merge rewrites them), are not touched."""
        r = tl.program_id(0)
        i0 = tl.program_id(1) * CH
        i = i0 + tl.arange(0, CH)
        cbase = cand_ptr + r.to(tl.int64) * CAP
        n = tl.load(count_ptr + r)
        held = tl.load(cbase + i, mask=i < CAP)  # beside the count's load (as the gather's live list)
        if (n <= CAP) & (i0 < n):
            MIN_KEY: tl.constexpr = -9223372036854775807 - 1
            key = tl.sort(tl.where(i < n, held, MIN_KEY), descending=True)
            tl.store(cbase + i, key)

    @triton.jit
    def _rank_kernel(x_ptr, len_ptr, cols, count_ptr, cand_ptr, out_ptr, stride_x, k, kept_ptr, kept_stride, next_n,
                     K_POW: tl.constexpr, CAP: tl.constexpr, CH: tl.constexpr, LOG_CH: tl.constexpr,
                     BI: tl.constexpr, MAP: tl.constexpr):
        """out[r, rank(key)] = position for BI candidates, rank = number of larger keys (keys are distinct),
        summed over the sorted chunks by binary search; program (r, 0) of a row with more than CAP candidates
        runs the exact streaming fallback instead."""
        r = tl.program_id(0)
        i0 = tl.program_id(1) * BI
        n = tl.load(count_ptr + r)
        if (n > CAP) & (i0 == 0):
            _merge_overflow(x_ptr, r, _row_length(len_ptr, r, cols), stride_x, cand_ptr + r.to(tl.int64) * CAP, out_ptr, k,
                            kept_ptr, kept_stride, next_n, K_POW, CAP, MAP)
        if (n <= CAP) & (i0 < n):
            MIN_KEY: tl.constexpr = -9223372036854775807 - 1
            cbase = cand_ptr + r.to(tl.int64) * CAP
            i = i0 + tl.arange(0, BI)
            key = tl.load(cbase + i, mask=i < n, other=MIN_KEY)
            # Count of each chunk's keys > key, all chunks at once ([BI, CAP / CH] searches in lockstep: one
            # chain of LOG_CH + 1 dependent loads; chunk after chunk it was CAP / CH chains, 27 us of a 76 us
            # top-k at 96 x 128K, run 13): a chunk's keys > key are a prefix, grown by halving steps (after
            # them every index below `at` is larger; index `at` itself is checked last). Chunks past the
            # count read as MIN_KEY, never larger.
            NCH: tl.constexpr = CAP // CH
            c = tl.arange(0, NCH)
            chunk = cbase + (c * CH)[None, :]  # [1, NCH]
            live = tl.broadcast_to((c * CH < n)[None, :], [BI, NCH])
            at = tl.zeros([BI, NCH], tl.int32)
            for s in tl.static_range(LOG_CH):
                step = CH >> (s + 1)
                larger = tl.load(chunk + at + step - 1, mask=live, other=MIN_KEY) > key[:, None]
                at = tl.where(larger, at + step, at)
            last = (tl.load(chunk + at, mask=live, other=MIN_KEY) > key[:, None]).to(tl.int32)
            rank = tl.sum(at + last, axis=1)
            pos = _map_pos((4294967295 - (key & 4294967295)).to(tl.int32), r, kept_ptr, kept_stride, next_n, MAP)
            tl.store(out_ptr + r.to(tl.int64) * k + rank, pos, mask=(i < n) & (rank < k))

    @triton.jit
    def _prefix_levels(ukey, valid, bound, hi_mask, shift, lo, q):
        """(c1, c2, c3): how many of the valid keys whose digits above `shift` are bound's have their 16-bit digit
        at `shift` >= lo + q, lo + 2q, lo + 3q, in ONE CTA sum (20-bit fields: < 2^20 keys). ukey: int64 order
        keys XOR 2^63 (unsigned order in the bits: an arithmetic shift and a mask give every digit)."""
        m = valid & (((ukey ^ bound) & hi_mask) == 0)
        return _level_counts(tl.where(m, ((ukey >> shift) & 0xFFFF).to(tl.int32), -1), lo, q)

    @triton.jit
    def _select_set_kernel(x_ptr, len_ptr, cols, count_ptr, cand_ptr, thresh_ptr, out_ptr, stride_x, k, kept_ptr,
                           kept_stride, next_n, K_POW: tl.constexpr, CAP: tl.constexpr, MAP: tl.constexpr):
        """Row r's top k as a set (sorted=False, in no particular order); one program per row.

        The k-th largest candidate key K* (keys are distinct) digit by digit, most significant first: for the
        16-bit digit at `shift`, the largest d with count(keys matching K*'s digits so far whose digit >= d) >=
        need (a 4-way bisection, one CTA sum per step), then need -= count(digit > d). The first digit's search
        spans [tau's digit, the largest candidate's] (a few hundred codes: ~4 steps, not 8); the others the
        whole 16 bits. It stops once every key still matching is needed (usually after the value's two digits;
        the position digits split exact ties). Then `bound` (K*'s digits so far, zeros below) selects exactly
        the keys >= bound, written from the registers in the candidate buffer's order (the gather's atomics
        make it vary from run to run; the set does not). Every loop is a runtime loop: unrolled, the search was
        ~13K SASS instructions and its code fetch cost more than its work (run 45: 75 us at 96 x 128K).
        A row with more than CAP candidates (mass ties) takes the rank path's streaming fallback
        (`_merge_overflow`; its counts over the whole row per digit step took 7.2 ms a layer at 96 x 128K on
        tie rows, run 57)."""
        r = tl.program_id(0)
        MIN_KEY: tl.constexpr = -9223372036854775807 - 1
        n = tl.load(count_ptr + r)
        if n > CAP:
            _merge_overflow(x_ptr, r, _row_length(len_ptr, r, cols), stride_x, cand_ptr + r.to(tl.int64) * CAP, out_ptr, k,
                            kept_ptr, kept_stride, next_n, K_POW, CAP, MAP)
        else:
            i = tl.arange(0, CAP)
            held = i < n
            ukey = tl.load(cand_ptr + r.to(tl.int64) * CAP + i, mask=held, other=0) ^ MIN_KEY
            bound = tl.zeros([], tl.int64)  # unsigned order: the smallest key, every candidate taken
            need = k + n * 0
            go = n > k
            shift = 48 + n * 0
            hi_mask = tl.zeros([], tl.int64)  # the digits above `shift` (none above the first)
            # the first digit's range: every candidate is >= tau (the threshold's 16-bit bucket edge)
            first_lo = (tl.load(thresh_ptr + r).to(tl.uint32, bitcast=True) >> 16).to(tl.int32)
            first_hi = tl.max(tl.where(held, ((ukey >> 48) & 0xFFFF).to(tl.int32), 0), axis=0)
            while go & (shift >= 0):  # (the keys are distinct: after the last digit one key matches, go is False)
                # quartering steps from q (the smallest power of 4 whose 4 q covers [lo, hi]) find the digit
                # d = lo; a last step counts digit >= d - 1, >= d (and >= d + 1): count(digit > d) and
                # count(digit == d). One call site of the counts (code size, above).
                lo = tl.where(shift == 48, first_lo, 0)
                span = tl.where(shift == 48, first_hi, 65535) - lo
                q = n * 0 + 1
                while q * 4 <= span:
                    q = q * 4
                above = n * 0
                at = n * 0
                while q >= 0:
                    last = q == 0
                    qq = tl.where(last, 1, q)
                    base = tl.where(last, lo - 1, lo)
                    c1, c2, c3 = _prefix_levels(ukey, held, bound, hi_mask, shift, base, qq)
                    above = c2
                    at = c1 - c2
                    step = tl.where(c3 >= need, 3 * qq, tl.where(c2 >= need, 2 * qq, tl.where(c1 >= need, qq, 0)))
                    lo = tl.where(last, lo, lo + step)
                    q = tl.where(last, -1, q // 4)
                need -= above
                bound = bound | (lo.to(tl.int64) << shift)
                go = at > need
                hi_mask = hi_mask | (tl.full([], 0xFFFF, tl.int64) << shift)
                shift -= 16
            # back to signed order: the smallest key with K*'s digits so far; the keys >= it from the registers
            key = ukey ^ MIN_KEY
            take = held & (key >= (bound ^ MIN_KEY))
            t = take.to(tl.int32)
            slot = tl.cumsum(t, axis=0) - t
            pos = _map_pos((4294967295 - (key & 4294967295)).to(tl.int32), r, kept_ptr, kept_stride, next_n, MAP)
            tl.store(out_ptr + r.to(tl.int64) * k + slot, pos, mask=take & (slot < k))

    @triton.jit
    def _level_counts(top, lo, q):
        """count(top >= lo + j q) for j = 1, 2, 3 (top: int32 16-bit codes, -1 = invalid) in ONE CTA sum: each
        key's level (how many of the three it reaches) packed into 20-bit fields of an int64 (< 2^20 keys)."""
        lvl = (top >= lo + q).to(tl.int32) + (top >= lo + 2 * q).to(tl.int32) + (top >= lo + 3 * q).to(tl.int32)
        inc = tl.where(lvl == 3, 1 << 40, tl.where(lvl == 2, 1 << 20, lvl.to(tl.int64)))
        packed = tl.sum(inc, axis=0)
        c3 = (packed >> 40).to(tl.int32)
        c2 = ((packed >> 20) & 0xFFFFF).to(tl.int32) + c3
        return (packed & 0xFFFFF).to(tl.int32) + c2, c2, c3

    @triton.jit
    def _merge_overflow(x_ptr, r, length, stride_x, cbase, out_ptr, k, kept_ptr, kept_stride, next_n,
                        K_POW: tl.constexpr, CAP: tl.constexpr, MAP: tl.constexpr):
        """Exact fallback for a row with more than CAP candidates (massive ties): stream the row in position
        order, CAP columns a step. cand[r, :K_POW] holds the best keys so far (sorted), cand[r, K_POW:] the
        columns since that beat the k-th of them (`kth`), appended in position order; the buffer is sorted
        only when those fill it. Keys are distinct and the kept ones only improve, so a column that does not
        beat kth when it streams by is never a winner. A row of ties sorts a few times: once the kept keys hold
        k tied ones, kth is the tie value at an early position, which every later tied column loses to (counted:
        2-3 sorts and 32 steps at 32K columns; run 58: 111-169 us at 96 rows, ~28 for a normal row). Writes the
        row best first (one order of the set, for sorted=False too)."""
        i = tl.arange(0, CAP)
        MIN_KEY: tl.constexpr = -9223372036854775807 - 1
        FREE: tl.constexpr = CAP - K_POW
        tl.debug_barrier()
        tl.store(cbase + i, tl.full([CAP], MIN_KEY, tl.int64))
        tl.debug_barrier()
        kth = tl.full([], MIN_KEY, tl.int64)
        fill = length * 0  # entrants held in cand[K_POW:]
        for c0 in range(0, length, CAP):
            c = c0 + i
            ok = c < length
            key = tl.where(ok, _sort_key(_ukey(tl.load(x_ptr + r.to(tl.int64) * stride_x + c, mask=ok, other=0.0)),
                                         c), MIN_KEY)
            enter = key > kth
            n_in = tl.sum(enter.to(tl.int32), axis=0)
            while n_in > 0:  # the entrants that fit, in position order; a full buffer is sorted, kth rises
                e = enter.to(tl.int32)
                rank = tl.cumsum(e, axis=0) - e
                take = enter & (rank < FREE - fill)
                tl.store(cbase + K_POW + fill + rank, key, mask=take)
                took = tl.minimum(n_in, FREE - fill)
                fill += took
                n_in -= took
                enter = enter & (rank >= took)
                if n_in > 0:
                    tl.debug_barrier()
                    best = tl.sort(tl.load(cbase + i), descending=True)
                    tl.debug_barrier()
                    tl.store(cbase + i, tl.where(i < K_POW, best, MIN_KEY))
                    tl.debug_barrier()
                    kth = tl.max(tl.where(i == k - 1, best, MIN_KEY), axis=0)
                    fill = 0
                    enter = enter & (key > kth)
                    n_in = tl.sum(enter.to(tl.int32), axis=0)
        tl.debug_barrier()
        key = tl.sort(tl.load(cbase + i), descending=True)
        n_out = tl.minimum(length, k)
        pos = (4294967295 - (key & 4294967295)).to(tl.int32)
        pos = _map_pos(tl.where(i < n_out, pos, -1), r, kept_ptr, kept_stride, next_n, MAP)
        tl.store(out_ptr + r.to(tl.int64) * k + i, pos, mask=i < k)
