"""SPIN's EMA update under block grain (SpinConfig.vertical_grain = "block": no per-slot V, block_max is the
history): the torch reference against a plain-python loop over the rule, and the Triton twin
(history_block_triton.py) against the reference, fed the block maxima or computing them, through the public ops
(update_history, topk_positions(history=), paged_indexer_logits(history=)).

The loop shares no code with the ops: per (request, row) in order and compact block, it takes the largest score
of the row's columns in the block by hand and applies the EMA in numpy float32; D per column as with slot grain.
Inputs as tests/ops/test_history.py makes them (-inf holes, NaN past the compact lengths, garbage past num_kept,
rows gated by update_rows, strided block_max / last_seen columns, ids outside the cache).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import T
from spin_indexer import ops
from spin_indexer.ops import update_history
from spin_indexer.ops.history import update_history_ref
from spin_indexer.ops.indexer_logits import block_max_ref
from test_history import (CASE_IDS, CASES, clone_history, ema_loop, history_on, logits_with_history_case,
                          make_history, make_logits, make_plan)


@pytest.fixture
def twin_device(triton_device, monkeypatch) -> torch.device:
    """The device the ops' Triton twins run on; on the CPU (TRITON_INTERPRET=1) every op dispatches to its
    twin, interpreted, instead of the reference (which CPU tensors take otherwise)."""
    if triton_device == "cpu":
        import importlib
        monkeypatch.setattr(ops, "_triton_twin",
                            lambda module, name, t: getattr(importlib.import_module(f"{ops.__name__}.{module}"), name))
    return torch.device(triton_device)


def block_history(h):
    """h under block grain: no vertical table (its T kept as tokens)."""
    return dataclasses.replace(h, vertical=None, tokens=T)


def block_update_loop(h, logits, table, lens):
    """The rule one (request, row, block) at a time; returns numpy (block_max, diagonal, last_seen)."""
    d = h.diagonal.numpy().copy()
    bmax, seen = h.block_max.numpy().copy(), None if h.last_seen is None else h.last_seen.numpy().copy()
    x = logits.numpy()
    trash = bmax.shape[0] - 1
    batch, next_n, cols = x.shape
    for b in range(batch):
        slot = int(h.slot_ids[b])
        for j in range(next_n):  # rows in order: each a separate EMA step
            if not bool(h.update_rows[b, j]):
                continue
            q = int(h.seq_lens[b, j]) - 1
            best = {}
            for c in range(min(int(lens[b, j]), cols)):
                m, t = divmod(c, T)
                s, i = x[b, j, c], int(h.kept_blocks[b, m]) * T + t
                if not np.isfinite(s):
                    continue
                best[m] = max(best.get(m, -np.inf), s)
                if 0 <= q - i < h.window:
                    d[slot, q - i] = ema_loop(d[slot, q - i], s, h.alpha)
            for m, s in best.items():
                p = int(table[b, m])
                if not 0 <= p < trash:
                    p = trash  # an id outside the cache addresses only the trash block
                bmax[p] = ema_loop(bmax[p], s, h.alpha)
                if seen is not None:
                    seen[p] = int(h.clock[0])
    return bmax, d, seen


def assert_block_state_equal(h, expected) -> None:
    """block_max, diagonal and last_seen equal outside the trash block / trash offset."""
    for name, g, w in zip(("block_max", "diagonal", "last_seen"), (h.block_max, h.diagonal, h.last_seen), expected):
        if g is None:
            assert w is None
            continue
        g = g.cpu().numpy()
        g, w = (g[..., :-1], w[..., :-1]) if name == "diagonal" else (g[:-1], w[:-1])
        np.testing.assert_array_equal(g, w, err_msg=name)


def expected_of(ref):
    return tuple(None if t is None else t.numpy() for t in (ref.block_max, ref.diagonal, ref.last_seen))


def make_case(lengths, next_n, window, gen, blocks=24, seen=True):
    plan = make_plan(lengths, next_n, blocks, gen, width=max(-(-L // T) for L in lengths) + 1)
    cols = int(plan.num_kept.max()) * T  # compact columns cut short of W*T (replay)
    logits = make_logits(plan, cols, gen)
    h = block_history(make_history(plan, blocks, 4, window, gen, seen=seen))
    return plan, logits, h


def twin_case(lengths, next_n, window, gen, seen=True):
    """make_case's (plan, logits, history), the reference's state after the update (a copy) and the rows' block
    maxima float32 [B*N, X/T] (-inf past each row's compact length), as the logits kernel writes them."""
    plan, logits, h = make_case(lengths, next_n, window, gen, seen=seen)
    ref = clone_history(h)
    update_history_ref(ref, logits, plan.table, plan.lens)
    rows, cols = len(lengths) * next_n, logits.shape[2]
    live = torch.arange(cols)[None, :] < plan.lens.reshape(-1, 1).long()
    maxima = block_max_ref(torch.where(live, logits.reshape(rows, cols), float("-inf")), T)
    return plan, logits, h, ref, maxima


@pytest.mark.parametrize("lengths,next_n,window", CASES, ids=CASE_IDS)
def test_reference_matches_the_loop(lengths, next_n, window, gen):
    plan, logits, h = make_case(lengths, next_n, window, gen)
    want = block_update_loop(h, logits, plan.table, plan.lens)
    update_history_ref(h, logits, plan.table, plan.lens)
    assert_block_state_equal(h, want)


def test_a_block_scored_whole_takes_the_ema_of_its_max_and_others_are_untouched(gen):
    """One request, one row, every column live: block_max[p] = EMA(old, max of the block's scores) exactly;
    blocks not kept keep their value; a block without history takes the observation."""
    plan = make_plan((4 * T,), 1, 8, gen, keep_prob=0.5)
    logits = make_logits(plan, int(plan.num_kept[0]) * T, gen).clamp(-100, 100)
    h = block_history(make_history(plan, 8, 2, 10, gen, update_rows=torch.ones(1, 1, dtype=torch.bool)))
    h.block_max[int(plan.table[0, 0])] = float("-inf")
    before = h.block_max.clone()
    update_history_ref(h, logits, plan.table, plan.lens)
    kept = {int(plan.table[0, m]): m for m in range(int(plan.num_kept[0]))}
    for p in range(8):
        if p in kept:
            obs = logits[0, 0, kept[p] * T:(kept[p] + 1) * T].max()
            old = before[p].float()
            want = obs if not torch.isfinite(old) else h.alpha * obs + (1 - h.alpha) * old
            assert h.block_max[p] == want.half(), p
        else:
            assert torch.equal(h.block_max[p], before[p]), p


@pytest.mark.interpreter
@pytest.mark.parametrize("lengths,next_n,window", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("seen", [True, False], ids=["last_seen", "no-last_seen"])
@pytest.mark.parametrize("given", [True, False], ids=["maxima-given", "maxima-computed"])
def test_triton_twin_matches_reference(lengths, next_n, window, seen, given, gen, twin_device, monkeypatch):
    """Through ops.update_history: with the block maxima given (block_max_in, as the step passes the logits
    kernel's) or computed first into block_max_out; two blocks a program so requests span several programs."""
    from spin_indexer.ops import history_block_triton
    monkeypatch.setattr(history_block_triton, "BLOCKS_PER_PROGRAM", 2)
    monkeypatch.setattr(history_block_triton, "DIAGONAL_BLOCKS", 2)
    plan, logits, h, ref, maxima = twin_case(lengths, next_n, window, gen, seen=seen)
    dev = twin_device
    moved = history_on(h, dev)
    out = torch.full((maxima.shape[0], plan.table.shape[1]), 123.0, device=dev)
    if given:
        update_history(moved, logits.to(dev), plan.table.to(dev), plan.lens.to(dev), block_max_in=maxima.to(dev))
    else:
        update_history(moved, logits.to(dev), plan.table.to(dev), plan.lens.to(dev), block_max_out=out)
        got = out[:, :maxima.shape[1]].cpu()
        used = torch.arange(maxima.shape[1])[None, :] * T < plan.lens.reshape(-1, 1).long()
        assert torch.equal(torch.where(used, got, 0), torch.where(used, maxima, 0))
    assert_block_state_equal(moved, expected_of(ref))


@pytest.mark.interpreter
@pytest.mark.parametrize("lengths,next_n,window", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("whole_row", [False, True], ids=["window-mid-tile", "window-whole-row"])
def test_triton_twin_with_the_window_inside_a_tile_matches_reference(lengths, next_n, window, whole_row, gen,
                                                                      twin_device, monkeypatch):
    """Eight blocks a program, two a diagonal program: a row's blocks in one tile, its window (1-3 blocks, or
    longer than the row) ending inside it, so the window's programs start inside the tile (or before the row's
    first block) and must leave the state the reference leaves."""
    from spin_indexer.ops import history_block_triton
    monkeypatch.setattr(history_block_triton, "BLOCKS_PER_PROGRAM", 8)
    monkeypatch.setattr(history_block_triton, "DIAGONAL_BLOCKS", 2)
    plan, logits, h, ref, maxima = twin_case(lengths, next_n, 1000 if whole_row else window, gen)
    dev = twin_device
    moved = history_on(h, dev)
    update_history(moved, logits.to(dev), plan.table.to(dev), plan.lens.to(dev), block_max_in=maxima.to(dev))
    assert_block_state_equal(moved, expected_of(ref))


@settings(max_examples=300, deadline=None)
@given(q=st.integers(0, 5000), window=st.integers(0, 3000), log_t=st.integers(0, 7), blocks=st.integers(1, 200),
       per_program=st.sampled_from([1, 2, 8, 32]))
def test_window_programs_cover_every_block_of_the_window(q, window, log_t, blocks, per_program):
    """The window's programs start window_programs x per_program compact blocks below the row's compact length:
    enough for every logical block holding one of the `window` positions before the query (kept blocks in logical
    order, the query's block last), and never more programs than the whole table needs."""
    from spin_indexer.ops.history_block_triton import window_programs
    t = 1 << log_t
    reaching = len({p // t for p in range(max(q - window + 1, 0), q + 1)}) if window else 0
    programs = window_programs(window, t, blocks, per_program)
    assert programs * per_program >= min(reaching, blocks)
    assert programs <= -(-blocks // per_program)


@pytest.mark.interpreter
def test_triton_twin_empty_batch_and_no_columns(gen, twin_device):
    plan, logits, h = make_case((3 * T,), 1, 50, gen)
    dev = twin_device
    moved = history_on(h, dev)
    before = moved.block_max.clone()
    update_history(moved, torch.empty(0, 1, 0, device=dev), plan.table[:0].to(dev), plan.lens[:0].to(dev))
    update_history(moved, logits[:, :, :0].to(dev), plan.table.to(dev), plan.lens.to(dev))
    assert torch.equal(moved.block_max, before)


@pytest.mark.parametrize("on_triton", [False, True], ids=["reference", "triton"])
def test_topk_positions_with_a_block_history_leaves_the_reference_state(on_triton, gen, request):
    """topk_positions(history=) under block grain: the top-k of the reference, then the O(blocks) update."""
    dev = request.getfixturevalue("twin_device") if on_triton else torch.device("cpu")
    plan, logits, h = make_case((5 * T + 17, 3 * T), 1, 100, gen)
    logits = torch.nan_to_num(logits, nan=float("-inf"))
    ref = clone_history(h)
    update_history_ref(ref, logits, plan.table, plan.lens)
    want = ops.topk_positions(logits.reshape(2, -1), plan.lens.reshape(-1), 32, kept_blocks=plan.kept)
    moved = history_on(h, dev)
    x = logits.reshape(2, -1).to(dev)
    maxima = block_max_ref(x.cpu(), T).to(dev)
    got = ops.topk_positions(x, plan.lens.reshape(-1).to(dev), 32, block_max=maxima, kept_blocks=plan.kept.to(dev),
                             history=moved, compact_table=plan.table.to(dev))
    assert torch.equal(got.cpu().sort(dim=1).values, want.sort(dim=1).values)
    assert_block_state_equal(moved, expected_of(ref))


@pytest.mark.interpreter
@pytest.mark.parametrize("lengths,next_n,window,rows", [
    pytest.param(*case, "row0", id=f"{cid}-row0") for case, cid in zip(CASES, CASE_IDS)
] + [pytest.param(*CASES[1], "every-row", id=f"{CASE_IDS[1]}-every-row")])
def test_topk_with_the_block_update_leaves_the_reference_state(lengths, next_n, window, rows, gen, triton_device,
                                                               monkeypatch):
    """topk_triton(update=, block_max=) under block grain: the same top-k as without the update (poisoned out), and
    the state the reference leaves. Row 0 updating: the update's programs in the threshold launch, four blocks a
    program (several a request); every row updating: update_block_history_triton after the top-k, rows in order."""
    from spin_indexer.ops import history_block_triton
    from spin_indexer.ops.topk_triton import topk_triton
    monkeypatch.setattr(history_block_triton, "BLOCKS_PER_PROGRAM", 4)
    monkeypatch.setattr(history_block_triton, "DIAGONAL_BLOCKS", 2)
    blocks = 24
    plan = make_plan(lengths, next_n, blocks, gen, width=max(-(-L // T) for L in lengths) + 1)
    cols = plan.kept.shape[1] * T
    logits = torch.nan_to_num(make_logits(plan, cols, gen), nan=float("-inf"))
    update_rows = torch.rand(len(lengths), next_n, generator=gen) < 0.7
    if rows == "row0":  # as plan() writes them under the row-0 policy (HistoryUpdate.rows = 1): row 0 only
        update_rows[:, 0], update_rows[:, 1:] = True, False
    h = block_history(make_history(plan, blocks, 4, window, gen, rows=1 if rows == "row0" else next_n,
                                   update_rows=update_rows))
    ref = clone_history(h)
    update_history_ref(ref, logits, plan.table, plan.lens)
    dev = torch.device(triton_device)
    moved = history_on(h, dev)
    flat, lens = logits.view(-1, cols), plan.lens.reshape(-1)
    live = torch.arange(cols)[None, :] < lens[:, None].long()
    maxima = block_max_ref(torch.where(live, flat, float("-inf")), T).to(dev)
    args = (flat.to(dev), lens.to(dev), 40)
    want = topk_triton(*args, block_max=maxima, kept_blocks=plan.kept.to(dev), next_n=next_n)
    out = torch.full_like(want, 77)  # poisoned
    got = topk_triton(*args, block_max=maxima, kept_blocks=plan.kept.to(dev), next_n=next_n, out=out,
                      update=(moved, plan.table.to(dev)))
    assert got is out and torch.equal(got.cpu(), want.cpu())
    assert_block_state_equal(moved, expected_of(ref))


@pytest.mark.interpreter
@pytest.mark.parametrize("next_n", [1, 2])
def test_logits_with_a_block_history_leave_the_reference_state(next_n, gen, twin_device):
    """paged_indexer_logits(history=) under block grain on the Triton kernel: the logits as without history,
    then the update from the block maxima it wrote, equal to logits + update_history_ref."""
    full, plan, ref, args, out, bmax, moved = logits_with_history_case(next_n, gen, twin_device)
    ref.vertical, moved.vertical, ref.tokens, moved.tokens = None, None, T, T
    logits = ops.paged_indexer_logits(*args, validate=False, out=out, block_max_out=bmax, fill_tail=False,
                                      history=moved, backend="triton")
    want = ops.paged_indexer_logits(*[a.cpu() for a in args], validate=False, backend="reference")
    batch = args[0].shape[0]
    update_history_ref(ref, want.view(batch, next_n, -1), plan.table, plan.lens)
    live = torch.arange(want.shape[1])[None, :] < plan.lens.reshape(-1, 1).long()
    torch.testing.assert_close(torch.where(live, logits.cpu(), 0), torch.where(live, want, 0), rtol=2e-2, atol=2e-2)
    exp = expected_of(ref)
    # block maxima from fp8-MMA logits: equal to the reference's up to the kernel's rounding
    np.testing.assert_allclose(moved.block_max.cpu().numpy()[:-1].astype(np.float32), exp[0][:-1].astype(np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.interpreter
def test_slot_grain_kernels_refuse_a_block_history(gen, triton_device):
    """The slot-grain pass, and the top-k's update= without the block maxima, name the argument instead of failing
    inside a kernel."""
    from spin_indexer.ops.history_triton import update_history_triton
    from spin_indexer.ops.topk_triton import topk_triton
    plan, logits, h = make_case((3 * T,), 1, 50, gen)
    dev = torch.device(triton_device)
    moved = history_on(h, dev)
    x = torch.nan_to_num(logits, nan=float("-inf")).to(dev)
    with pytest.raises(ValueError, match="history: expected a slot-grain history"):
        update_history_triton(moved, x, plan.table.to(dev), plan.lens.to(dev))
    with pytest.raises(ValueError, match="block_max: expected the block maxima"):  # what its update reads
        topk_triton(x.reshape(1, -1), plan.lens.reshape(-1).to(dev), 16, update=(moved, plan.table.to(dev)))
    with pytest.raises(ValueError, match="a block-grain history"):
        from spin_indexer.ops.history_block_triton import update_block_history_triton
        update_block_history_triton(dataclasses.replace(moved, vertical=torch.zeros(1)), x, x, plan.table.to(dev),
                                    plan.lens.to(dev))
