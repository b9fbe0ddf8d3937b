"""sorted=False: the top-k as a set, in no particular order (the reference writes it in ascending position order;
the Triton select `_select_set_kernel`, one launch instead of a sort and a rank, in its candidate buffer's order).
The reference against a plain-Python mapping; the Triton path against it as sets (each row sorted), into poisoned
outputs: random rows, ties that only the position digits split, -0.0/+0.0, NaN, -inf, k past the length, one
column, empty rows and batches, kept_blocks mapping with next_n 1/2/4, the candidate-overflow path (the rank path's
streaming merge), hypothesis-drawn shapes, and the few-row path (the sort and
rank's best-first order serves as the set below SET_SELECT_MIN_ROWS).

The Triton path runs under TRITON_INTERPRET=1 on CPU (conftest sets it before this module imports triton).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import masked_logits
from spin_indexer.ops import topk_positions
from spin_indexer.ops.topk import ascending, topk_positions_ref, topk_ref

POISON = 12345


def _kept(rows: int, width: int, gen, next_n: int = 1) -> torch.Tensor:
    """Strictly ascending kept-block lists int32 [rows // next_n, width] (as SPIN's plans write them)."""
    if rows == 0:
        return torch.zeros(0, width, dtype=torch.int32)
    return torch.stack([torch.randperm(3 * width + 2, generator=gen)[:width].sort().values
                        for _ in range(rows // next_n)]).to(torch.int32)


def _want(logits, lengths, k, kept=None, next_n=1):
    """Independent of the sorted=False code: topk_ref's best-first picks, mapped and sorted in Python."""
    best = topk_ref(logits, lengths, k)
    rows = []
    for r in range(logits.shape[0]):
        cols = [c for c in best[r].tolist() if c >= 0]
        if kept is not None:
            cols = [int(kept[r // next_n, c // 64]) * 64 + c % 64 for c in cols]
        rows.append(sorted(cols) + [-1] * (k - len(cols)))
    return torch.tensor(rows, dtype=torch.int32).reshape(logits.shape[0], k)


@pytest.fixture(autouse=True)
def select_every_row_count(monkeypatch):
    """The select at every row count (production takes it from SET_SELECT_MIN_ROWS rows on)."""
    from spin_indexer.ops import topk_triton as mod
    monkeypatch.setattr(mod, "SET_SELECT_MIN_ROWS", 1)


def _triton(logits, lengths, k, device, kept=None, next_n=1, **kw):
    from spin_indexer.ops.topk_triton import topk_triton

    out = torch.full((logits.shape[0], k), POISON, dtype=torch.int32, device=device)
    got = topk_triton(logits.to(device), lengths.to(device), k, sorted=False, out=out, next_n=next_n,
                      kept_blocks=None if kept is None else kept.to(device), **kw)
    assert got.data_ptr() == out.data_ptr()
    want = _want(logits, lengths, k, kept, next_n)
    got = ascending(got.cpu())  # any order of the set compares equal
    bad = (got != want).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:5]} differ; first: got {got[bad[0], :12].tolist()} want {want[bad[0], :12].tolist()}"


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(0, 4), cols=st.integers(1, 300), k=st.integers(1, 200),
       ties=st.booleans(), next_n=st.sampled_from([1, 2]), mapped=st.booleans())
def test_reference_is_the_sorted_set_in_column_order(seed, rows, cols, k, ties, next_n, mapped):
    gen = torch.Generator().manual_seed(seed)
    rows = rows * next_n
    logits, lengths = masked_logits(rows, cols, gen, ties=ties)
    kept = _kept(rows, -(-cols // 64), gen, next_n) if mapped else None
    got = topk_positions_ref(logits, lengths, k, kept_blocks=kept, next_n=next_n, sorted=False)
    assert torch.equal(got, _want(logits, lengths, k, kept, next_n))
    # and the public op dispatches it on the CPU
    assert torch.equal(topk_positions(logits, lengths, k, kept_blocks=kept, next_n=next_n, sorted=False), got)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows,cols,k", [(3, 300, 5), (4, 64 * 40, 8), (2, 100, 200), (1, 1, 1), (5, 129, 64),
                                         (2, 6000, 40)])
def test_triton_random(rows, cols, k, gen, triton_device):
    logits, lengths = masked_logits(rows, cols, gen)
    _triton(logits, lengths, k, triton_device)


@pytest.mark.interpreter
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 3), cols=st.integers(1, 700), k=st.integers(1, 80),
       ties=st.booleans())
def test_triton_drawn_shapes(seed, rows, cols, k, ties, triton_device):
    gen = torch.Generator().manual_seed(seed)
    logits, lengths = masked_logits(rows, cols, gen, ties=ties)
    _triton(logits, lengths, k, triton_device)


@pytest.mark.interpreter
def test_ties_that_only_positions_split(triton_device):
    """Equal values (zeros, and -0.0 / +0.0) fill the k-th bucket: the select must go on to the position
    digits and take the lowest positions (a buffer large enough that no row overflows)."""
    logits = torch.zeros(3, 300)
    logits[1, ::2] = -0.0
    logits[2, 100:] = 1.0  # 200 ones, k = 37 of them
    lengths = torch.tensor([300, 257, 300], dtype=torch.int32)
    _triton(logits, lengths, 37, triton_device, cap=1024)


@pytest.mark.interpreter
def test_nan_inf_and_huge_values(gen, triton_device):
    logits = torch.randn(2, 3000, generator=gen)
    logits[0, ::7] = float("-inf")
    logits[1, 5] = float("nan")
    logits[1, 9] = float("inf")
    logits[1, 11] = -3e38
    _triton(logits, torch.tensor([3000, 2999], dtype=torch.int32), 50, triton_device)


@pytest.mark.interpreter
@pytest.mark.parametrize("cap", [64, 1024])
def test_overflow_rows_take_the_lowest_tied_positions(cap, triton_device):
    """More tied candidates than the buffer (cap = 64): the streaming merge (the position half of the keys
    splits the ties). With room for them (1024) the same rows take the buffer."""
    logits = torch.zeros(2, 600)
    logits[1, 400:] = 2.0
    stats = torch.zeros(2, dtype=torch.int32, device=triton_device)
    _triton(logits, torch.tensor([600, 500], dtype=torch.int32), 32, triton_device, cap=cap, stats=stats)
    assert ((stats.cpu() > cap) == (cap == 64)).all(), stats  # the path each case means to take


@pytest.mark.interpreter
@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_kept_blocks_mapping(next_n, gen, triton_device):
    rows, cols, k = 2 * next_n, 64 * 40, 8
    logits, lengths = masked_logits(rows, cols, gen)
    _triton(logits, lengths, k, triton_device, kept=_kept(rows, 40, gen, next_n), next_n=next_n)


@pytest.mark.interpreter
def test_zero_lengths_k_past_length_and_empty_batch(gen, triton_device):
    logits, lengths = masked_logits(3, 300, gen)
    lengths[1], lengths[2] = 0, 7
    _triton(logits, lengths, 10, triton_device)
    _triton(torch.zeros(0, 64), torch.zeros(0, dtype=torch.int32), 4, triton_device)


@pytest.mark.interpreter
def test_few_rows_take_the_sort_and_rank(gen, triton_device, monkeypatch):
    """Below SET_SELECT_MIN_ROWS rows the best-first chain's output is the set (its order is one of them)."""
    from spin_indexer.ops import topk_triton as mod
    monkeypatch.setattr(mod, "SET_SELECT_MIN_ROWS", 4)
    logits, lengths = masked_logits(3, 900, gen)
    got = mod.topk_triton(logits.to(triton_device), lengths.to(triton_device), 20, sorted=False).cpu()
    assert torch.equal(got, topk_ref(logits, lengths, 20))  # best first, exactly
    _triton(logits, lengths, 20, triton_device)


def test_sorted_must_be_a_bool(gen):
    logits, lengths = masked_logits(2, 50, gen)
    with pytest.raises(TypeError, match="sorted"):
        topk_positions(logits, lengths, 4, sorted=1)
    with pytest.raises(TypeError, match="sorted"):
        topk_ref(logits, lengths, 4, sorted="no")
