"""SPIN's EMA history update (ops/history.py): the torch reference against a plain-python loop over the rule in
its docstring, the Triton twin (history_triton.py) against the reference, and the logits kernel's fused
epilogue (indexer_logits_triton.py, history=) against logits + the reference update.

The loop shares no code with the ops: it walks every (request, row, compact column) in order, maps the column
to its logical position and physical slot by hand, and applies the EMA in numpy float32 (two products and a
sum) before rounding into the fp16 table. Inputs carry what the live step carries: -inf holes in the state,
NaN padding past each row's compact length, garbage in the plan past num_kept, rows gated by update_rows, a
diagonal window shorter than the context, and the block max / last_seen columns of one layer (strided views).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import T, assert_logits_close, logits_f64, make_paged_inputs, row_lengths
from spin_indexer.ops import HistoryUpdate, update_history
from spin_indexer.ops.history import update_history_ref
from spin_indexer.ops.indexer_logits import block_max_ref
from spin_indexer.ops.topk import group_max_ref

FP16_MAX = float(np.finfo(np.float16).max)


# ---------------------------------------------------------------------------------------- random inputs
@dataclasses.dataclass
class Plan:
    """One step's compact plan: kept [B, W] logical ids, table [B, W] physical ids (both garbage past
    num_kept), lens [B, N] compact row lengths, seq_lens [B, N] real row lengths, num_kept [B]."""
    kept: torch.Tensor
    table: torch.Tensor
    lens: torch.Tensor
    seq_lens: torch.Tensor
    num_kept: torch.Tensor


def make_plan(lengths, next_n, num_cache_blocks, gen, keep_prob=0.6, width=None) -> Plan:
    """Random kept blocks per request (the blocks holding a row's last token always kept), distinct physical
    blocks across requests, compact lengths as BlockPlan computes them (worked example: T = 64, row length
    130, kept [0, 2] -> 1 * 64 + 129 % 64 + 1 = 66)."""
    seq_lens = row_lengths(lengths, next_n)
    blocks = [-(-L // T) for L in lengths]
    width = width or max(blocks + [1])
    perm = torch.randperm(num_cache_blocks, generator=gen).tolist()
    batch = len(lengths)
    kept = torch.randint(-3, width + 3, (batch, width), generator=gen, dtype=torch.int32)  # garbage
    table = torch.randint(-3, num_cache_blocks + 3, (batch, width), generator=gen, dtype=torch.int32)
    lens = torch.zeros(batch, next_n, dtype=torch.int32)
    num_kept = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        first_new = max(int(seq_lens[b].min()) - 1, 0) // T
        ids = [w for w in range(blocks[b])
               if w >= first_new or float(torch.rand((), generator=gen)) < keep_prob]
        phys, perm = perm[:blocks[b]], perm[blocks[b]:]
        kept[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        table[b, :len(ids)] = torch.tensor([phys[w] for w in ids], dtype=torch.int32)
        num_kept[b] = len(ids)
        for j in range(next_n):
            L = int(seq_lens[b, j])
            if L > 0:
                lens[b, j] = ids.index((L - 1) // T) * T + (L - 1) % T + 1
    return Plan(kept, table, lens, seq_lens, num_kept)


def make_logits(plan: Plan, cols: int, gen) -> torch.Tensor:
    """float32 [B, N, cols]: scores (a few past the fp16 range, to hit the clamp) below each row's compact
    length, NaN past it."""
    batch, next_n = plan.lens.shape
    x = torch.randn(batch, next_n, cols, generator=gen) * 3
    big = torch.rand(batch, next_n, cols, generator=gen) < 0.02
    x = torch.where(big, torch.sign(x) * 1e5, x)
    live = torch.arange(cols)[None, None, :] < plan.lens.long()[:, :, None]
    return torch.where(live, x, float("nan"))


def random_fp16(shape, gen, holes=0.3) -> torch.Tensor:
    x = torch.randn(shape, generator=gen) * 2
    return torch.where(torch.rand(shape, generator=gen) < holes, float("-inf"), x).half()


def make_history(plan: Plan, num_cache_blocks, num_slots, window, gen, alpha=0.3, layers=2, layer=1,
                 seen=True, rows=None, update_rows=None) -> HistoryUpdate:
    """Layer `layer` of a state of `layers` layers: block_max / last_seen are strided column views, as
    SpinIndexer passes them. Distinct random slots from a pool larger than the batch."""
    batch, next_n = plan.lens.shape
    vertical = random_fp16((num_cache_blocks + 1, T), gen)
    block_max = random_fp16((num_cache_blocks + 1, layers), gen)[:, layer]
    diagonal = random_fp16((num_slots, window + 1), gen)
    last_seen = torch.randint(-1, 5, (num_cache_blocks + 1, layers), generator=gen, dtype=torch.int32)[:, layer]
    slots = torch.randperm(num_slots, generator=gen)[:batch].long()
    if update_rows is None:
        update_rows = torch.rand(batch, next_n, generator=gen) < 0.7
    return HistoryUpdate(vertical, block_max, diagonal, slots, plan.kept, plan.seq_lens, update_rows, alpha,
                         window, last_seen if seen else None, torch.tensor([7], dtype=torch.int32),
                         next_n if rows is None else rows)


def clone_history(h: HistoryUpdate) -> HistoryUpdate:
    """A deep copy whose block_max / last_seen stay strided like the original's."""
    def dup(t):
        if t is None or t.dim() != 1 or t.stride(0) == 1:
            return None if t is None else t.clone()
        base = torch.empty(t.shape[0], t.stride(0), dtype=t.dtype)
        base[:, 0] = t
        return base[:, 0]
    vertical = None if h.vertical is None else h.vertical.clone()  # None: block grain
    return dataclasses.replace(h, vertical=vertical, block_max=dup(h.block_max),
                               diagonal=h.diagonal.clone(), last_seen=dup(h.last_seen))


# ----------------------------------------------------------------------------------- the rule, by hand
def ema_loop(old: np.float16, s: np.float32, alpha: float) -> np.float16:
    """V <- s without history (-inf), else alpha * s + (1 - alpha) * V in float32, clamped to fp16's range."""
    o = np.float32(old)
    new = np.float32(s) if not np.isfinite(o) else np.float32(alpha) * np.float32(s) + np.float32(1 - alpha) * o
    return np.float16(min(max(new, np.float32(-FP16_MAX)), np.float32(FP16_MAX)))


def update_loop(h: HistoryUpdate, logits, table, lens):
    """The docstring's rule one observation at a time; returns numpy (vertical, block_max, diagonal, last_seen)."""
    v, d = h.vertical.numpy().copy(), h.diagonal.numpy().copy()
    bmax, seen = h.block_max.numpy().copy(), None if h.last_seen is None else h.last_seen.numpy().copy()
    x = logits.numpy()
    trash = v.shape[0] - 1
    batch, next_n, cols = x.shape
    for b in range(batch):
        touched = set()
        slot = int(h.slot_ids[b])
        for j in range(next_n):  # rows in order: each a separate EMA step
            if not bool(h.update_rows[b, j]):
                continue
            q = int(h.seq_lens[b, j]) - 1
            for c in range(min(int(lens[b, j]), cols)):
                m, t = divmod(c, T)
                p, i = int(table[b, m]), int(h.kept_blocks[b, m]) * T + t
                if not 0 <= p < trash:
                    p = trash  # an id outside the cache addresses only the trash block
                s = x[b, j, c]
                v[p, t] = ema_loop(v[p, t], s, h.alpha)
                if 0 <= q - i < h.window:
                    d[slot, q - i] = ema_loop(d[slot, q - i], s, h.alpha)
                touched.add(p)
        for p in touched:
            bmax[p] = v[p].max()
            if seen is not None:
                seen[p] = int(h.clock[0])
    return v, bmax, d, seen


def assert_state_equal(h: HistoryUpdate, expected, exact=True) -> None:
    """State equal outside the trash block / trash offset (dead lanes of fixed-shape updates land there)."""
    v, bmax, d, seen = expected
    got = (h.vertical, h.block_max, h.diagonal, h.last_seen)
    want = (v, bmax, d, seen)
    for name, g, w in zip(("vertical", "block_max", "diagonal", "last_seen"), got, want):
        if g is None:
            assert w is None
            continue
        g = g.cpu().numpy()[..., :-1] if name == "diagonal" else g.cpu().numpy()[:-1]
        w = w[..., :-1] if name == "diagonal" else w[:-1]
        if exact or name == "last_seen":
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:  # a GPU may fuse the EMA's multiply-add: one fp16 rounding step apart at most
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=1e-3, atol=1e-3,
                                       err_msg=name)


CASES = [  # (lengths, next_n, window)
    ((5 * T + 17, 3 * T, 1), 1, 100),
    ((7 * T + 3, 2 * T + 40), 2, 150),
    ((6 * T, 130, 4), 4, 64),
]
CASE_IDS = ["next_n-1", "next_n-2", "next_n-4"]


# ------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("lengths,next_n,window", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("cut", [False, True], ids=["full-width", "cut-width"])
def test_reference_matches_the_loop(lengths, next_n, window, cut, gen):
    """cut: compact columns stop at the most blocks any request kept (replay's CPU path)."""
    blocks = 24
    plan = make_plan(lengths, next_n, blocks, gen, width=max(-(-L // T) for L in lengths) + 2)
    cols = (int(plan.num_kept.max()) if cut else plan.kept.shape[1]) * T
    logits = make_logits(plan, cols, gen)
    h = make_history(plan, blocks, 5, window, gen)
    expected = update_loop(h, logits, plan.table, plan.lens)
    update_history_ref(h, logits, plan.table, plan.lens)
    assert_state_equal(h, expected)
    assert not torch.isnan(h.vertical[:-1]).any() and not torch.isnan(h.diagonal[:, :-1]).any()


def test_reference_clamps_into_fp16_and_gates_rows(gen):
    """A score past fp16's range lands as +-65504 (never inf) in V and D; rows with update_rows False change
    nothing; the window counts offsets from each row's own query."""
    plan = make_plan((3 * T,), 2, 4, gen, keep_prob=1.0)  # every block kept: compact column = position
    q0 = int(plan.seq_lens[0, 0]) - 1  # row 0's query position (3T - 2)
    logits = torch.zeros(1, 2, 3 * T)
    logits[0, 0, q0 - 2], logits[0, 0, q0 - 3] = 1e6, -1e6
    logits[0, 1] = 1.0
    h = make_history(plan, 4, 2, 10, gen, alpha=0.5, update_rows=torch.tensor([[True, False]]))
    h.vertical.fill_(float("-inf"))
    h.diagonal.fill_(float("-inf"))
    update_history_ref(h, logits, plan.table, plan.lens)
    v = h.vertical[plan.table[0, :3].long()].reshape(-1)  # logical positions 0..3T-1
    assert v[q0 - 2] == FP16_MAX and v[q0 - 3] == -FP16_MAX
    assert torch.isfinite(v[:-1]).all() and (v[:-1].float().abs() != 1.0).all()  # row 0 only: 1.0 never folds in
    assert torch.isneginf(v[-1])  # the newest token is only row 1's, and row 1 does not update
    d = h.diagonal[int(h.slot_ids[0])]  # offsets 0..9 from row 0's query, then the trash cell
    assert d[2] == FP16_MAX and d[3] == -FP16_MAX and (d[[0, 1] + list(range(4, 10))] == 0).all()
    other = h.diagonal[int(1 - h.slot_ids[0])]
    assert torch.isneginf(other[:10]).all()  # another request's window is untouched


def test_reference_sends_ids_outside_the_cache_to_the_trash_block(gen):
    plan = make_plan((4 * T,), 1, 6, gen, keep_prob=1.0)
    plan.table[0, 1], plan.table[0, 2] = 6 + 5, -3  # a corrupt table: live blocks outside the cache
    logits = make_logits(plan, 4 * T, gen)
    h = make_history(plan, 6, 2, 64, gen)
    before = h.vertical.clone()
    expected = update_loop(h, logits, plan.table, plan.lens)
    update_history_ref(h, logits, plan.table, plan.lens)
    assert_state_equal(h, expected)
    inside = [int(plan.table[0, 0]), int(plan.table[0, 3])]
    untouched = [p for p in range(6) if p not in inside]
    assert torch.equal(h.vertical[untouched], before[untouched])


def test_public_op_block_max_out_on_the_reference(gen):
    """ops.update_history(..., block_max_out=) on the CPU: the update plus each row's compact block maxima."""
    plan = make_plan((5 * T + 3, 2 * T), 2, 16, gen)
    width = plan.kept.shape[1]
    logits = make_logits(plan, width * T, gen)
    h = make_history(plan, 16, 3, 100, gen)
    ref = clone_history(h)
    bmax = torch.full((4, width), 123.0)
    update_history(h, logits, plan.table, plan.lens, block_max_out=bmax)
    update_history_ref(ref, logits, plan.table, plan.lens)
    assert_state_equal(h, (ref.vertical.numpy(), ref.block_max.numpy(), ref.diagonal.numpy(), ref.last_seen.numpy()))
    _check_block_max_out(bmax, logits, plan.lens, sentinel=None)


def test_public_op_maxima_only_on_the_reference(gen):
    """history=None on the CPU (the maxima the DeepGEMM step's top-k needs, without an update): block_max_out
    as the Triton twin writes it (its block is T = 64 when no history gives one)."""
    plan = make_plan((5 * T + 3, 2 * T), 2, 16, gen)
    width = plan.kept.shape[1]
    logits = make_logits(plan, width * T, gen)
    bmax = torch.full((4, width), 123.0)
    update_history(None, logits, plan.table, plan.lens, block_max_out=bmax)
    _check_block_max_out(bmax, logits, plan.lens, sentinel=None)


def _check_block_max_out(bmax, logits, lens, sentinel):
    """Entries of blocks below a row's compact length hold that block's max of valid logits; the rest keep
    `sentinel` (None: unspecified)."""
    flat = logits.reshape(-1, logits.shape[-1])
    cols = torch.arange(flat.shape[1])
    masked = torch.where(cols[None, :] < lens.reshape(-1, 1).long(), flat, float("-inf"))
    want = block_max_ref(masked, T)
    defined = torch.arange(want.shape[1])[None, :] * T < lens.reshape(-1, 1).long()
    got = bmax.cpu()[:, :want.shape[1]]
    assert torch.equal(got[defined], want[defined])
    if sentinel is not None:
        assert (got[~defined] == sentinel).all() and (bmax.cpu()[:, want.shape[1]:] == sentinel).all()


def _check_group_max_out(gmax, logits, lens, group, sentinel):
    """The same for the maxima of every `group` columns (group_max_ref; a NaN wins its group, compared as a
    NaN): defined entries equal the reference's, the rest keep `sentinel`."""
    want = group_max_ref(logits.reshape(lens.numel(), -1), lens.reshape(-1), group)
    defined = torch.arange(want.shape[1])[None, :] * group < lens.reshape(-1, 1).long()
    got = gmax.cpu()
    assert torch.equal(got[:, :want.shape[1]][defined].nan_to_num(7.0), want[defined].nan_to_num(7.0))
    assert (got[:, :want.shape[1]][~defined] == sentinel).all() and (got[:, want.shape[1]:] == sentinel).all()
    return got, want, defined


# ----------------------------------------------------------------------------------------- Triton twin
@pytest.mark.interpreter
@pytest.mark.parametrize("lengths,next_n,window", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("seen", [True, False], ids=["last_seen", "no-last_seen"])
def test_triton_twin_matches_reference(lengths, next_n, window, seen, gen, triton_device):
    pytest.importorskip("triton")
    from spin_indexer.ops.history_triton import update_history_triton
    blocks = 24
    plan = make_plan(lengths, next_n, blocks, gen, width=max(-(-L // T) for L in lengths) + 1)
    width = plan.kept.shape[1]
    cols = int(plan.num_kept.max()) * T  # compact columns cut short of W*T (replay)
    logits = make_logits(plan, cols, gen)
    h = make_history(plan, blocks, 4, window, gen, seen=seen)
    ref = clone_history(h)
    update_history_ref(ref, logits, plan.table, plan.lens)
    dev = torch.device(triton_device)
    moved = history_on(h, dev)
    bmax = torch.full((len(lengths) * next_n, width), 123.0, device=dev)
    update_history_triton(moved, logits.to(dev), plan.table.to(dev), plan.lens.to(dev), block_max_out=bmax)
    exp = tuple(None if t is None else t.numpy() for t in (ref.vertical, ref.block_max, ref.diagonal, ref.last_seen))
    assert_state_equal(moved, exp, exact=not dev.type == "cuda")
    _check_block_max_out(bmax, logits, plan.lens, sentinel=123.0)


@pytest.mark.interpreter
@pytest.mark.parametrize("lengths,next_n,window", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("tile", [32, 2], ids=["one-tile", "tiles-of-2"])
def test_pipelined_pass_matches_reference(lengths, next_n, window, tile, gen, triton_device, monkeypatch):
    """The update alone (no maxima: SpinIndexer's side stream) runs the pipelined pass: with tiles of 2 blocks
    each program loops over several tiles of its request (8 programs in all under the interpreter: two or more a
    request); every row updates in order, some rows not at all (guarded); the state is the reference's, and the
    one-tile kernel's."""
    pytest.importorskip("triton")
    from spin_indexer.ops import history_triton
    monkeypatch.setattr(history_triton, "BLOCKS_PER_PROGRAM", tile)
    monkeypatch.setattr(history_triton, "PIPELINED_MIN_BLOCKS", 0)  # (production: large tables only)
    blocks = 24
    plan = make_plan(lengths, next_n, blocks, gen, width=max(-(-L // T) for L in lengths) + 1)
    logits = make_logits(plan, plan.kept.shape[1] * T, gen)
    update_rows = torch.rand(len(lengths), next_n, generator=gen) < 0.7
    update_rows[0, 0], update_rows[-1, :] = True, False  # one request updates, one does not at all
    h = make_history(plan, blocks, 4, window, gen, rows=next_n, update_rows=update_rows)
    ref = clone_history(h)
    update_history_ref(ref, logits, plan.table, plan.lens)
    dev = torch.device(triton_device)
    states = []
    for stages in (history_triton.PIPELINED_STAGES, 1):  # the pipelined pass, then the one-tile kernel
        monkeypatch.setattr(history_triton, "PIPELINED_STAGES", stages)
        moved = history_on(clone_history(h), dev)
        history_triton.update_history_triton(moved, logits.to(dev), plan.table.to(dev), plan.lens.to(dev))
        states.append(moved)
    exp = tuple(t.numpy() for t in (ref.vertical, ref.block_max, ref.diagonal, ref.last_seen))
    for moved in states:
        assert_state_equal(moved, exp, exact=not dev.type == "cuda")
    assert (states[0].vertical.cpu() != h.vertical).any()


@pytest.mark.interpreter
@pytest.mark.parametrize("lengths,next_n,window", CASES, ids=CASE_IDS)
def test_triton_twin_several_tiles_per_request(lengths, next_n, window, gen, triton_device, monkeypatch):
    """Tiles of 2 blocks: each request spans several programs (those past a shorter request's last tile do
    nothing); the state, the block max and the group max are the reference's.
    Compact columns cut at the most blocks kept, so the longest request uses every program of the grid."""
    pytest.importorskip("triton")
    from spin_indexer.ops import history_triton
    monkeypatch.setattr(history_triton, "BLOCKS_PER_PROGRAM", 2)
    blocks = 24
    plan = make_plan(lengths, next_n, blocks, gen, width=max(-(-L // T) for L in lengths) + 1)
    width = plan.kept.shape[1]
    rows = len(lengths) * next_n
    cols = int(plan.num_kept.max()) * T
    logits = make_logits(plan, cols, gen)
    h = make_history(plan, blocks, 4, window, gen)
    ref = clone_history(h)
    update_history_ref(ref, logits, plan.table, plan.lens)
    dev = torch.device(triton_device)
    moved = history_on(h, dev)
    bmax = torch.full((rows, width), 123.0, device=dev)
    gmax = torch.full((rows, cols // 16), 123.0, device=dev)
    history_triton.update_history_triton(moved, logits.to(dev), plan.table.to(dev), plan.lens.to(dev),
                                         block_max_out=bmax, group_max_out=gmax, group=16)
    exp = tuple(t.numpy() for t in (ref.vertical, ref.block_max, ref.diagonal, ref.last_seen))
    assert_state_equal(moved, exp, exact=not dev.type == "cuda")
    _check_block_max_out(bmax, logits, plan.lens, sentinel=123.0)
    _check_group_max_out(gmax, logits, plan.lens, 16, sentinel=123.0)


@pytest.mark.interpreter
@pytest.mark.parametrize("keep_prob,next_n", [(1.0, 1), (0.5, 2)], ids=["every-block", "half-the-blocks"])
def test_tiles_far_from_the_window_skip_it_and_the_near_ones_update_it(keep_prob, next_n, gen, triton_device,
                                                                       monkeypatch):
    """Long requests and a short diagonal window (90 positions) over tiles of 2 blocks: the tiles that do not
    reach the window (history_triton.reaches_window) skip its gathers, the last ones do them; the state (D
    included) is the reference's, in the pipelined pass and in the one-tile kernel."""
    pytest.importorskip("triton")
    from spin_indexer.ops import history_triton
    monkeypatch.setattr(history_triton, "BLOCKS_PER_PROGRAM", 2)
    monkeypatch.setattr(history_triton, "PIPELINED_MIN_BLOCKS", 0)
    blocks = 90
    lengths = (40 * T + 21, 33 * T)
    plan = make_plan(lengths, next_n, blocks, gen, keep_prob=keep_prob, width=41)
    logits = make_logits(plan, plan.kept.shape[1] * T, gen)
    update_rows = torch.ones(len(lengths), next_n, dtype=torch.bool)
    h = make_history(plan, blocks, 4, 90, gen, rows=next_n, update_rows=update_rows)
    ref = clone_history(h)
    update_history_ref(ref, logits, plan.table, plan.lens)
    dev = torch.device(triton_device)
    for stages in (history_triton.PIPELINED_STAGES, 1):  # the pipelined pass, then the one-tile kernel
        monkeypatch.setattr(history_triton, "PIPELINED_STAGES", stages)
        moved = history_on(clone_history(h), dev)
        history_triton.update_history_triton(moved, logits.to(dev), plan.table.to(dev), plan.lens.to(dev))
        assert_state_equal(moved, tuple(t.numpy() for t in (ref.vertical, ref.block_max, ref.diagonal, ref.last_seen)),
                           exact=not dev.type == "cuda")
    assert (ref.diagonal[h.slot_ids] != h.diagonal[h.slot_ids]).any()  # the window was updated


TOPK_UPDATE_CASES = [  # (case, rows, blocks per tile): every case in the threshold launch (row 0 updating), with
    # one tile and (next_n 1, 2: ~12 s more for 4 in the interpreter) several per request; every row updating
    # (the pass after the top-k) once
    pytest.param(*case, "row0", tile, id=f"{cid}-row0-{tile}-block-tiles")
    for case, cid in zip(CASES, CASE_IDS) for tile in (32, 2) if tile == 32 or case[1] < 4
] + [pytest.param(*CASES[1], "every-row", 32, id=f"{CASE_IDS[1]}-every-row")]


@pytest.mark.interpreter
@pytest.mark.parametrize("lengths,next_n,window,rows,tile", TOPK_UPDATE_CASES)
def test_topk_with_the_update_leaves_the_reference_state(lengths, next_n, window, rows, tile, gen, triton_device,
                                                          monkeypatch):
    """topk_triton(update=): the same top-k as without it (best first, or the set), and the history the reference
    update leaves. One
    updating row (row 0): the update's programs run in the threshold launch (with tiles of 2 blocks, several
    per request); every row updating: the pass after the top-k, its rows in order."""
    pytest.importorskip("triton")
    from spin_indexer.ops import history_triton
    from spin_indexer.ops.topk_triton import topk_triton
    monkeypatch.setattr(history_triton, "BLOCKS_PER_PROGRAM", tile)
    blocks = 24
    plan = make_plan(lengths, next_n, blocks, gen, width=max(-(-L // T) for L in lengths) + 1)
    cols = plan.kept.shape[1] * T
    logits = make_logits(plan, cols, gen)
    update_rows = torch.rand(len(lengths), next_n, generator=gen) < 0.7
    if rows == "row0":  # as plan() writes them under the row-0 policy (HistoryUpdate.rows = 1): row 0 only
        update_rows[:, 0], update_rows[:, 1:] = True, False
    h = make_history(plan, blocks, 4, window, gen, rows=1 if rows == "row0" else next_n, update_rows=update_rows)
    ref = clone_history(h)
    update_history_ref(ref, logits, plan.table, plan.lens)
    dev = torch.device(triton_device)
    moved = history_on(h, dev)
    flat = logits.view(-1, cols).to(dev)
    lens = plan.lens.reshape(-1).to(dev)
    k = 40
    order = tile == 32 and rows == "row0"  # best first there; the set (sorted=False) in the other cases
    want = topk_triton(flat, lens, k, kept_blocks=plan.kept.to(dev), next_n=next_n, sorted=order)
    out = torch.full_like(want, 77)  # poisoned
    got = topk_triton(flat, lens, k, kept_blocks=plan.kept.to(dev), next_n=next_n, out=out,
                      update=(moved, plan.table.to(dev)), sorted=order)
    assert got is out and torch.equal(got.cpu(), want.cpu())
    exp = tuple(t.numpy() for t in (ref.vertical, ref.block_max, ref.diagonal, ref.last_seen))
    assert_state_equal(moved, exp, exact=not dev.type == "cuda")


def test_public_topk_positions_with_history_on_the_reference(gen):
    """ops.topk_positions(history=, compact_table=) on the CPU: topk_positions_ref, then the reference update;
    one of the two alone is refused."""
    from spin_indexer.ops import topk_positions, topk_positions_ref
    plan = make_plan((5 * T + 3, 2 * T), 2, 16, gen)
    cols = plan.kept.shape[1] * T
    logits = make_logits(plan, cols, gen)
    h = make_history(plan, 16, 3, 100, gen)
    ref = clone_history(h)
    flat, lens = logits.view(-1, cols), plan.lens.reshape(-1)
    got = topk_positions(flat, lens, 20, kept_blocks=plan.kept, next_n=2, history=h, compact_table=plan.table)
    assert torch.equal(got, topk_positions_ref(flat, lens, 20, kept_blocks=plan.kept, next_n=2))
    update_history_ref(ref, logits, plan.table, plan.lens)
    assert_state_equal(h, tuple(t.numpy() for t in (ref.vertical, ref.block_max, ref.diagonal, ref.last_seen)))
    with pytest.raises(ValueError, match="compact_table"):
        topk_positions(flat, lens, 20, kept_blocks=plan.kept, next_n=2, history=h)
    before = h.vertical.clone()
    with pytest.raises(ValueError, match="compact_table"):  # fewer columns than the logits' blocks
        topk_positions(flat, lens, 20, kept_blocks=plan.kept, next_n=2, history=h, compact_table=plan.table[:, :-1])
    with pytest.raises(TypeError, match="compact_table"):
        topk_positions(flat, lens, 20, kept_blocks=plan.kept, next_n=2, history=h,
                       compact_table=plan.table.long())
    with pytest.raises(TypeError, match="history"):
        topk_positions(flat, lens, 20, kept_blocks=plan.kept, next_n=2, history=(h,), compact_table=plan.table)
    torch.testing.assert_close(h.vertical, before, rtol=0, atol=0, equal_nan=True)  # rejected: no state change


@pytest.mark.interpreter
def test_triton_twin_block_max_only_and_empty(gen, triton_device):
    """history=None: only block_max_out is written; an empty batch or zero columns is a no-op."""
    pytest.importorskip("triton")
    from spin_indexer.ops.history_triton import update_history_triton
    plan = make_plan((3 * T + 5, 70), 2, 8, gen)
    width = plan.kept.shape[1]
    logits = make_logits(plan, width * T, gen)
    dev = torch.device(triton_device)
    bmax = torch.full((4, width), 123.0, device=dev)
    update_history_triton(None, logits.to(dev), plan.table.to(dev), plan.lens.to(dev), block_max_out=bmax)
    _check_block_max_out(bmax, logits, plan.lens, sentinel=123.0)
    empty = make_plan((), 2, 8, gen)
    h = make_history(empty, 8, 2, 64, gen)
    before = h.vertical.clone()
    update_history_triton(h, torch.zeros(0, 2, T), empty.table, empty.lens)
    assert torch.equal(h.vertical, before)


@pytest.mark.interpreter
@pytest.mark.parametrize("group", [8, 16, 32])
def test_triton_twin_group_max_with_the_update(group, gen, triton_device):
    """group_max_out: the max of every `group` columns below each row's compact length (a NaN wins its
    group; past the length nothing is written), from the same pass that applies the update and the block
    max; the update itself is unchanged."""
    pytest.importorskip("triton")
    from spin_indexer.ops.history_triton import update_history_triton
    plan = make_plan((5 * T + 3, 2 * T - 7), 2, 16, gen)
    width = plan.kept.shape[1]
    logits = make_logits(plan, width * T, gen)
    logits[0, 1, 5] = float("nan")  # request 0, row 1: its first group holds a NaN
    h = make_history(plan, 16, 3, 100, gen)
    ref = clone_history(h)
    update_history_ref(ref, logits, plan.table, plan.lens)
    dev = torch.device(triton_device)
    moved = history_on(h, dev)
    gmax = torch.full((4, width * T // group + 3), 123.0, device=dev)
    update_history_triton(moved, logits.to(dev), plan.table.to(dev), plan.lens.to(dev), group_max_out=gmax,
                          group=group)
    got, want, defined = _check_group_max_out(gmax, logits, plan.lens, group, sentinel=123.0)
    assert torch.isnan(got[1, 0]) and not torch.isnan(want[defined]).sum() > 1
    exp = tuple(t.numpy() for t in (ref.vertical, ref.block_max, ref.diagonal, ref.last_seen))
    assert_state_equal(moved, exp, exact=not dev.type == "cuda")
    with pytest.raises(ValueError, match="group"):
        update_history_triton(None, logits.to(dev), plan.table.to(dev), plan.lens.to(dev), group_max_out=gmax,
                              group=24)


def test_public_op_group_max_out_on_the_reference(gen):
    """ops.update_history(None, ..., group_max_out=) on the CPU equals group_max_ref of the masked logits."""
    plan = make_plan((5 * T + 3, 2 * T), 2, 16, gen)
    width = plan.kept.shape[1]
    logits = make_logits(plan, width * T, gen)
    gmax = torch.full((4, width * T // 16), 123.0)
    update_history(None, logits, plan.table, plan.lens, group_max_out=gmax, group=16)
    assert torch.equal(gmax, group_max_ref(logits.reshape(4, -1), plan.lens.reshape(-1), 16))


def logits_with_history_case(next_n, gen, device, rows=1, update_rows=None):
    """A logits call with the EMA update on a compact table, before the call: (full, plan, ref, args, out,
    bmax, moved). Two requests with partial last blocks (8 heads x 32 dims, 3 spare cache blocks), a random plan
    and history (3 slots, window 150; `rows` updating rows, update_rows bool [2, next_n], default row 0 only),
    ref its copy for update_history_ref, args the kernel's (q, cache, weights, compact lens, compact table) on
    `device`, out / bmax NaN-poisoned logits [2 * next_n, W * T] and block max [2 * next_n, W] there, moved the
    history there (on the CPU it aliases the history ref was cloned from)."""
    lengths = (5 * T + 17, 2 * T + 9)
    full = make_paged_inputs(lengths, next_n, 8, 32, gen, spare_blocks=3)
    num_blocks = full.kv_cache.shape[0]
    plan = make_plan(lengths, next_n, num_blocks, gen, width=full.block_table.shape[1])
    if update_rows is None:
        update_rows = torch.zeros(len(lengths), next_n, dtype=torch.bool)
        update_rows[:, 0] = True
    h = make_history(plan, num_blocks, 3, 150, gen, rows=rows, update_rows=update_rows)
    ref = clone_history(h)
    dev = torch.device(device)
    args = [t.to(dev) for t in (full.q_fp8, full.kv_cache, full.weights, plan.lens, plan.table)]
    batch_rows, width = len(lengths) * next_n, plan.table.shape[1]
    out = torch.full((batch_rows, width * T), float("nan"), device=dev)
    bmax = torch.full((batch_rows, width), float("nan"), device=dev)
    return full, plan, ref, args, out, bmax, history_on(h, dev)


def history_on(h, dev):
    """h's tensors on `dev`, block_max and last_seen as strided views (as SpinState's [P + 1, L] columns)."""
    moved = dataclasses.replace(h, **{f: getattr(h, f).to(dev) for f in
                                      ("vertical", "diagonal", "slot_ids", "kept_blocks", "seq_lens",
                                       "update_rows", "clock") if getattr(h, f) is not None})
    moved.block_max = _strided_to(h.block_max, dev)
    moved.last_seen = _strided_to(h.last_seen, dev)
    return moved


def _strided_to(t, dev):
    if t is None:
        return None
    base = torch.empty(t.shape[0], 2, dtype=t.dtype, device=dev)
    base[:, 1] = t.to(dev)
    return base[:, 1]


# --------------------------------------------------------------------------- fused logits epilogue
@pytest.mark.interpreter
@pytest.mark.parametrize("next_n,rows,group", [(1, 1, 0), (2, 1, 0), (3, 1, 0), (4, 1, 0), (3, 1, 4), (4, 1, 1),
                                               (2, 2, 0)],
                         ids=["n1-fused", "n2-row0-fused", "n3-row0-fused", "n4-row0-fused", "n3-row0-fused-g4",
                              "n4-row0-fused-g1", "n2-rows2-after"])
def test_logits_with_history_leave_the_reference_state(next_n, rows, group, gen, triton_device):
    """paged_indexer_logits_triton(history=h) on a compact table: the logits are right and the state equals
    update_history_ref applied to those logits (rows == 1: folded into the kernel's epilogue, row 0 taken from
    its group's MMA: the production config or `group` rows per MMA; rows > 1: the standalone update after it)."""
    pytest.importorskip("triton")
    from spin_indexer.ops.indexer_logits_triton import LogitsConfig, paged_indexer_logits_triton
    update_rows = torch.rand(2, next_n, generator=gen) < 0.8
    if rows == 1:  # the row-0 policy: only row 0 ever updates
        update_rows[:, 1:] = False
        update_rows[:, 0] = True
    case = logits_with_history_case(next_n, gen, triton_device, rows, update_rows)
    full, plan, ref, args, out, bmax, moved = case
    before = ref.vertical.clone()
    paged_indexer_logits_triton(*args, out=out, block_max_out=bmax, history=moved,
                                config=LogitsConfig(group) if group else None)
    expected, magnitude = logits_f64(full.q_fp8, full.kv_cache, full.weights, plan.lens, plan.table)
    assert_logits_close(out, expected, magnitude)
    logits = out.cpu().view(2, next_n, -1)
    update_history_ref(ref, logits, plan.table, plan.lens)
    exp = tuple(t.numpy() for t in (ref.vertical, ref.block_max, ref.diagonal, ref.last_seen))
    assert_state_equal(moved, exp)  # same logits in: bit-equal state, also on CUDA
    assert (moved.vertical.cpu() != before).any()  # the update did happen


@pytest.mark.interpreter
@pytest.mark.parametrize("next_n,prefetch", [(1, 0), (1, 1), (1, 2), (3, 2)])
def test_fused_update_at_every_prefetch_depth_skips_rows_that_do_not_update(next_n, prefetch, gen, triton_device):
    """The fused epilogue with the history loaded in its own iteration (prefetch 0) or a block ahead (1, 2):
    a request whose row 0 does not update keeps its history, the other is updated as the reference does,
    its diagonal window included (bit-equal state from the same logits)."""
    pytest.importorskip("triton")
    from spin_indexer.ops.indexer_logits_triton import CONFIGS, paged_indexer_logits_triton
    update_rows = torch.zeros(2, next_n, dtype=torch.bool)
    update_rows[0, 0] = True
    full, plan, ref, args, out, bmax, moved = logits_with_history_case(next_n, gen, triton_device, 1, update_rows)
    before = tuple(t.clone() for t in (ref.vertical, ref.diagonal))
    paged_indexer_logits_triton(*args, out=out, block_max_out=bmax, history=moved,
                                config=dataclasses.replace(CONFIGS[next_n], prefetch=prefetch))
    update_history_ref(ref, out.cpu().view(2, next_n, -1), plan.table, plan.lens)
    assert_state_equal(moved, tuple(t.numpy() for t in (ref.vertical, ref.block_max, ref.diagonal, ref.last_seen)))
    assert (moved.vertical.cpu() != before[0]).any() and (moved.diagonal.cpu() != before[1]).any()
    assert torch.equal(moved.diagonal.cpu()[moved.slot_ids[1].item()], before[1][moved.slot_ids[1].item()])


@pytest.mark.interpreter
@pytest.mark.parametrize("next_n", [1, 2, 3])
def test_fill_tail_false_leaves_blocks_past_the_lengths_unwritten(next_n, gen, triton_device):
    """fill_tail=False: whole blocks past a request's longest row keep their poison (logits and block max),
    valid columns are right; fill_tail=True writes -inf into every column past a row's length."""
    pytest.importorskip("triton")
    from spin_indexer.ops.indexer_logits_triton import paged_indexer_logits_triton
    lengths = (3 * T + 17, T, 5)
    inputs = make_paged_inputs(lengths, next_n, 8, 32, gen, extra_width=3)
    dev = torch.device(triton_device)
    args = [t.to(dev) for t in inputs.args()]
    rows, width = len(lengths) * next_n, inputs.block_table.shape[1]
    expected, magnitude = logits_f64(*inputs.args())
    lens = inputs.seq_lens.view(-1).long()
    used = ((inputs.seq_lens.amax(dim=1).long() + T - 1) // T).repeat_interleave(next_n)  # [R] blocks in use
    cols = torch.arange(width * T)
    for fill in (False, True):
        out = torch.full((rows, width * T), 7.0, device=dev)
        bmax = torch.full((rows, width), 7.0, device=dev)
        paged_indexer_logits_triton(*args, out=out, block_max_out=bmax, fill_tail=fill)
        got, gbm = out.cpu(), bmax.cpu()
        valid = cols[None, :] < lens[:, None]
        # compared on the device: the tolerance follows its accumulator
        assert_logits_close(torch.where(valid.to(dev), out, float("-inf")), expected, magnitude)
        tail_blocks = torch.arange(width)[None, :] >= used[:, None]  # [R, W]
        tail_cols = tail_blocks.repeat_interleave(T, dim=1)
        if fill:
            assert torch.isneginf(got[~valid]).all() and torch.isneginf(gbm[tail_blocks]).all()
        else:
            assert (got[tail_cols] == 7.0).all() and (gbm[tail_blocks] == 7.0).all()
            assert tail_cols.any()
        live_blocks = ~tail_blocks
        exp_bm = np.where(np.isneginf(expected), -np.inf, expected).reshape(rows, width, T).max(axis=2)
        mag_bm = magnitude.reshape(rows, width, T).max(axis=2)
        assert_logits_close(torch.where(live_blocks.to(dev), bmax, float("-inf")),
                            np.where(live_blocks.numpy(), exp_bm, -np.inf), mag_bm)
