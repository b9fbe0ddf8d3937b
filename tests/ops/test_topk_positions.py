"""topk_positions: the decode step's top-k (topk_ref's picks, best first) written as logical positions through
SPIN's kept blocks. The reference against a plain-Python mapping of topk_ref, and the Triton path (topk_triton
with the map fused into its final write) against the reference element for element: random and tied rows,
k > length, empty rows and batches, block maxima, kept_blocks mapping (next_n 1/2/4), the candidate-overflow
path, NaN past each length, poisoned outputs, bad arguments.

The Triton path runs under TRITON_INTERPRET=1 on CPU (conftest sets it before this module imports triton).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import cuda_only, masked_logits
from spin_indexer.ops import topk_positions
from spin_indexer.ops.indexer_logits import block_max_ref
from spin_indexer.ops.topk import topk_positions_ref, topk_ref

SENTINEL = -7


def _block_max(logits, lengths, tokens=64):
    valid = torch.arange(logits.shape[1])[None, :] < lengths.long()[:, None]
    return block_max_ref(torch.where(valid, logits, float("-inf")), tokens)


def _kept(rows: int, width: int, gen, next_n: int = 1) -> torch.Tensor:
    """Random strictly ascending kept-block lists int32 [rows // next_n, width + 1] (the extra column holds
    garbage that must never be read)."""
    kept = torch.stack([torch.randperm(3 * width + 2, generator=gen)[:width].sort().values
                        for _ in range(rows // next_n)]) if rows else torch.zeros(0, width, dtype=torch.int64)
    return torch.cat([kept, torch.full((kept.shape[0], 1), 2**31 - 1)], dim=1).to(torch.int32)


def _expected(logits, lengths, k, kept=None, next_n=1, tokens=64):
    """Independent of topk_positions_ref: topk_ref per row, mapped through kept in Python."""
    best = topk_ref(logits, lengths, k)
    rows = []
    for r in range(logits.shape[0]):
        cols = [c for c in best[r].tolist() if c >= 0]
        if kept is not None:
            cols = [int(kept[r // next_n, c // tokens]) * tokens + c % tokens for c in cols]
        rows.append(cols + [-1] * (k - len(cols)))
    return torch.tensor(rows, dtype=torch.int32).reshape(logits.shape[0], k)


def _triton(logits, lengths, k, device, use_block_max=False, kept=None, next_n=1, **kw):
    """The Triton path on `device` into a sentinel-poisoned out=, checked against the reference."""
    from spin_indexer.ops.topk_triton import topk_triton

    bmax = _block_max(logits, lengths).to(device) if use_block_max else None
    out = torch.full((logits.shape[0], k), SENTINEL, dtype=torch.int32, device=device)
    got = topk_triton(logits.to(device), lengths.to(device), k, block_max=bmax,
                      kept_blocks=None if kept is None else kept.to(device), next_n=next_n, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    want = topk_positions_ref(logits, lengths, k, kept_blocks=kept, next_n=next_n)
    got = got.cpu()
    bad = (got != want).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:5]} differ; first: got {got[bad[0], :12].tolist()} want {want[bad[0], :12].tolist()}"


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(0, 5), cols=st.integers(1, 400), k=st.integers(1, 300),
       ties=st.booleans(), next_n=st.sampled_from([1, 2, 4]), mapped=st.booleans())
def test_reference_is_topk_ref_mapped(seed, rows, cols, k, ties, next_n, mapped):
    gen = torch.Generator().manual_seed(seed)
    rows = rows * next_n
    logits, lengths = masked_logits(rows, cols, gen, ties=ties)
    kept = _kept(rows, -(-cols // 64), gen, next_n) if mapped else None
    got = topk_positions_ref(logits, lengths, k, kept_blocks=kept, next_n=next_n)
    assert torch.equal(got, _expected(logits, lengths, k, kept, next_n))


def test_dispatch_and_out_on_cpu(gen):
    logits, lengths = masked_logits(3, 200, gen)
    out = torch.full((3, 20), SENTINEL, dtype=torch.int32)
    got = topk_positions(logits, lengths, 20, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, _expected(logits, lengths, 20))


RANDOM_CPU_CASES = [(3, 300, 5), (2, 100, 200), (1, 1, 1)]  # k > length, one column


@pytest.mark.interpreter
@pytest.mark.parametrize("rows,cols,k", [
    case if case in RANDOM_CPU_CASES else cuda_only(*case, why="the same kernels as test_topk_triton's random "
                                                    "matrix (unmapped), 2-6 s each in the interpreter")
    for case in [(3, 300, 5), (4, 64 * 40, 8), (2, 5000, 16), (2, 100, 200), (1, 1, 1), (5, 129, 64)]])
@pytest.mark.parametrize("use_block_max", [False, True])
def test_triton_random(rows, cols, k, use_block_max, gen, triton_device):
    """Unmapped, into a poisoned out=: test_topk_triton's random matrix through topk_positions' reference."""
    logits, lengths = masked_logits(rows, cols, gen)
    _triton(logits, lengths, k, triton_device, use_block_max)


@pytest.mark.interpreter
@pytest.mark.parametrize("next_n", [1, 2, 4])
@pytest.mark.parametrize("use_block_max", [False, True])
def test_triton_kept_blocks_mapping(next_n, use_block_max, gen, triton_device):
    rows, cols, k = 2 * next_n, 64 * 40, 8
    logits, lengths = masked_logits(rows, cols, gen)
    _triton(logits, lengths, k, triton_device, use_block_max, kept=_kept(rows, 40, gen, next_n), next_n=next_n)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [3, 20, cuda_only(60, why="~5 s in the interpreter; 20 rows cover the same "
                                                   "launch shapes")])
def test_triton_few_and_many_rows_with_mapping(rows, gen, triton_device):
    """A few rows and many: each must map exactly."""
    logits, lengths = masked_logits(rows, 300, gen)
    _triton(logits, lengths, 12, triton_device, kept=_kept(rows, 5, gen))


@pytest.mark.interpreter
def test_triton_ties_overflow_small_buffer_mapped(gen, triton_device):
    logits, lengths = masked_logits(2, 700, gen, ties=True)
    _triton(logits, lengths, 6, triton_device, kept=_kept(2, 11, gen), cap=32)


@pytest.mark.interpreter
def test_zero_lengths_and_empty_batch(gen, triton_device):
    logits, lengths = masked_logits(3, 300, gen)
    lengths[1] = 0
    _triton(logits, lengths, 10, triton_device, kept=_kept(3, 5, gen))
    _triton(torch.zeros(0, 64), torch.zeros(0, dtype=torch.int32), 4, triton_device)


def _bad(kind):
    logits, lengths = torch.randn(4, 128), torch.full((4,), 128, dtype=torch.int32)
    kwargs = {}
    if kind == "kept-dtype":
        kwargs = dict(kept_blocks=torch.zeros(4, 2, dtype=torch.int64))
    elif kind == "kept-shape":
        kwargs = dict(kept_blocks=torch.zeros(4, 1, dtype=torch.int32))
    elif kind == "next-n":
        kwargs = dict(kept_blocks=torch.zeros(1, 2, dtype=torch.int32), next_n=3)
    elif kind == "block-max":
        kwargs = dict(block_max=torch.zeros(4, 3))
    elif kind == "out":
        kwargs = dict(out=torch.zeros(4, 5, dtype=torch.int64))
    elif kind == "lengths":
        lengths = lengths.clone()
        lengths[0] = 129
    return logits, lengths, kwargs


@pytest.mark.parametrize("kind,exc,name", [("kept-dtype", TypeError, "kept_blocks"),
                                           ("kept-shape", ValueError, "kept_blocks"),
                                           ("next-n", ValueError, "next_n"), ("block-max", ValueError, "block_max"),
                                           ("out", TypeError, "out"), ("lengths", ValueError, "lengths")])
def test_bad_arguments_name_the_argument(kind, exc, name):
    logits, lengths, kwargs = _bad(kind)
    with pytest.raises(exc, match=name):
        topk_positions(logits, lengths, 5, **kwargs)


def test_a_bad_group_is_refused_by_name_on_every_path():
    logits = torch.randn(2, 300)
    lengths = torch.full((2,), 300, dtype=torch.int32)
    for bad in (3, 128, 0, 2.0):
        with pytest.raises((ValueError, TypeError), match="group"):
            topk_positions_ref(logits, lengths, 8, group=bad)
