"""topk_positions: the reference against sorted(topk_ref) as a set, and the Triton twin (one launch, no sort)
against the reference element for element: random and tied rows, k > length, empty rows and batches, block
maxima, kept_blocks mapping (next_n 1/2/4), the candidate-overflow path, signed zeros, -inf, huge values,
NaN past each length, poisoned outputs, bad arguments.

The twin runs under TRITON_INTERPRET=1 on CPU (conftest sets it before this module imports triton).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import masked_logits
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
    """Independent of topk_positions_ref: sorted(topk_ref) per row, mapped through kept in Python."""
    best = topk_ref(logits, lengths, k)
    rows = []
    for r in range(logits.shape[0]):
        cols = sorted(c for c in best[r].tolist() if c >= 0)
        if kept is not None:
            cols = [int(kept[r // next_n, c // tokens]) * tokens + c % tokens for c in cols]
        rows.append(cols + [-1] * (k - len(cols)))
    return torch.tensor(rows, dtype=torch.int32).reshape(logits.shape[0], k)


def _twin(logits, lengths, k, device, use_block_max=False, kept=None, next_n=1, tokens=64, **kw):
    """The Triton twin on `device` into a sentinel-poisoned out=, with stats; checked against the reference."""
    from spin_indexer.ops.topk_select_triton import topk_positions_triton
    bmax = _block_max(logits, lengths, tokens).to(device) if use_block_max else None
    out = torch.full((logits.shape[0], k), SENTINEL, dtype=torch.int32, device=device)
    stats = torch.full((logits.shape[0],), SENTINEL, dtype=torch.int32, device=device)
    got = topk_positions_triton(logits.to(device), lengths.to(device), k, block_max=bmax,
                                kept_blocks=None if kept is None else kept.to(device), next_n=next_n,
                                tokens_per_block=tokens, out=out, stats=stats, **kw)
    assert got is out
    want = topk_positions_ref(logits, lengths, k, kept_blocks=kept, next_n=next_n, tokens_per_block=tokens)
    got = got.cpu()
    bad = (got != want).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:5]} differ; first: got {got[bad[0], :12].tolist()} want {want[bad[0], :12].tolist()}"
    return stats.cpu()


# ------------------------------------------------------------------------------------------ reference
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(0, 5), cols=st.integers(0, 200),
       k=st.integers(1, 220), ties=st.booleans(), next_n=st.sampled_from([1, 2]), mapped=st.booleans())
def test_reference_is_the_sorted_topk_set(seed, rows, cols, k, ties, next_n, mapped):
    gen = torch.Generator().manual_seed(seed)
    rows -= rows % next_n
    logits, lengths = masked_logits(rows, cols, gen, ties=ties)
    tokens = 16
    kept = _kept(rows, -(-cols // tokens), gen, next_n) if mapped else None
    got = topk_positions_ref(logits, lengths, k, kept_blocks=kept, next_n=next_n, tokens_per_block=tokens)
    assert got.dtype == torch.int32 and got.shape == (rows, k)
    assert torch.equal(got, _expected(logits, lengths, k, kept, next_n, tokens))


def test_dispatch_and_out_on_cpu(gen):
    logits, lengths = masked_logits(3, 150, gen)
    out = torch.full((3, 10), SENTINEL, dtype=torch.int32)
    assert topk_positions(logits, lengths, 10, out=out) is out
    assert torch.equal(out, _expected(logits, lengths, 10))


# ------------------------------------------------------------------------------------------ triton twin
@pytest.fixture(params=[0, 128], ids=["one-program", "multi-seg128"])
def seg(request):
    """The twin's path: 0 = the one-program kernel, 128 = the three-launch path with 128 columns per program
    (so that a few hundred columns span several programs under the interpreter)."""
    return request.param


@pytest.mark.interpreter
@pytest.mark.parametrize("rows,cols,k", [(3, 300, 5), (4, 64 * 40, 8), (2, 3000, 16), (2, 100, 200), (1, 1, 1),
                                         (5, 129, 64), (2, 700, 64)])
@pytest.mark.parametrize("use_block_max", [False, True])
def test_twin_random(rows, cols, k, use_block_max, gen, triton_device, seg):
    logits, lengths = masked_logits(rows, cols, gen)
    lengths[0] = cols  # a full row (partial last block unless cols % 64 == 0)
    _twin(logits, lengths, k, triton_device, use_block_max, seg=seg)


@pytest.mark.interpreter
def test_block_max_prunes_to_few_candidates(gen, triton_device, seg):
    """A row with >= k blocks reads only the blocks whose max reaches the threshold: few candidates."""
    logits = torch.randn(2, 64 * 48, generator=gen)
    lengths = torch.tensor([64 * 48, 64 * 30 + 5], dtype=torch.int32)
    stats = _twin(logits, lengths, 8, triton_device, use_block_max=True, seg=seg)
    assert (stats >= 8).all() and (stats < 32).all(), stats


@pytest.mark.interpreter
@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_twin_kept_blocks_mapping(next_n, gen, triton_device, seg):
    rows, cols, tokens = 4, 40 * 16, 16
    logits, lengths = masked_logits(rows, cols, gen)
    kept = _kept(rows, cols // tokens, gen, next_n)
    _twin(logits, lengths, 12, triton_device, kept=kept, next_n=next_n, tokens=tokens, seg=seg)
    lengths[0] = cols  # 40 blocks >= 4k: pruned by the block maxima
    _twin(logits, lengths, 9, triton_device, use_block_max=True, kept=kept, next_n=next_n, tokens=tokens, seg=seg)
    assert torch.equal(topk_positions_ref(logits, lengths, 12, kept_blocks=kept, next_n=next_n, tokens_per_block=16),
                       _expected(logits, lengths, 12, kept, next_n, 16))


@pytest.mark.interpreter
@pytest.mark.parametrize("use_block_max", [False, True])
def test_ties_overflow_small_buffer(use_block_max, gen, triton_device, seg):
    """Few distinct values, -0.0 mixed with +0.0: far more candidates than a 32-entry buffer holds, so the
    exact streaming path runs; ties go to the lower column."""
    logits, lengths = masked_logits(3, 1500, gen, ties=True)
    lengths[0] = 1500
    zero = logits == 0
    logits[zero & (torch.rand(logits.shape, generator=gen) < 0.5)] = -0.0
    stats = _twin(logits, lengths, 6, triton_device, use_block_max, cap=32, seg=seg)
    assert stats[0] > 32, "expected the overflow path to run"
    flat = torch.full((2, 300), 1.5)
    stats = _twin(flat, torch.tensor([300, 37], dtype=torch.int32), 20, triton_device, use_block_max, cap=32, seg=seg)
    assert stats[0] > 32


@pytest.mark.interpreter
def test_neg_inf_huge_and_nan_inside(gen, triton_device, seg):
    logits = torch.randn(3, 400, generator=gen) * 1e30
    logits[:, ::7] = float("-inf")
    logits[1, :] = float("-inf")  # a row of -inf only: still its first k columns
    logits[2, 3::11] = float("nan")  # NaN inside the length ranks by its bits, as in order_keys
    logits[0, 5] = float("inf")
    lengths = torch.tensor([400, 250, 399], dtype=torch.int32)
    _twin(logits, lengths, 70, triton_device, seg=seg)
    _twin(logits[:2], lengths[:2], 70, triton_device, use_block_max=True, seg=seg)


@pytest.mark.interpreter
def test_zero_lengths_one_column_and_empty_batch(gen, triton_device, seg):
    logits, _ = masked_logits(3, 200, gen)
    _twin(logits, torch.zeros(3, dtype=torch.int32), 4, triton_device, use_block_max=True, seg=seg)
    _twin(torch.randn(2, 1, generator=gen), torch.tensor([1, 0], dtype=torch.int32), 3, triton_device, True, seg=seg)
    _twin(torch.empty(2, 0), torch.zeros(2, dtype=torch.int32), 3, triton_device, seg=seg)
    _twin(torch.empty(0, 50), torch.empty(0, dtype=torch.int32), 4, triton_device, True,
          kept=torch.empty(0, 1, dtype=torch.int32), next_n=2, seg=seg)


@pytest.mark.interpreter
def test_twin_dispatch_matches_public_signature(gen, triton_device):
    from spin_indexer.ops.topk_select_triton import topk_positions_triton
    logits, lengths = masked_logits(2, 90, gen)
    got = topk_positions_triton(logits.to(triton_device), lengths.to(triton_device), 5, validate=False)
    assert torch.equal(got.cpu(), topk_positions(logits, lengths, 5))


# ------------------------------------------------------------------------------------------ bad arguments
BAD = [
    (dict(logits=torch.zeros(2, 10, dtype=torch.float16)), TypeError, "logits"),
    (dict(lengths=torch.zeros(2, dtype=torch.int64)), TypeError, "lengths"),
    (dict(lengths=torch.full((2,), 11, dtype=torch.int32)), ValueError, "lengths"),
    (dict(k=0), ValueError, "k"),
    (dict(k=2.0), TypeError, "k"),
    (dict(block_max=torch.zeros(2, 3)), ValueError, "block_max"),
    (dict(kept_blocks=torch.zeros(2, 1, dtype=torch.int32), tokens_per_block=4), ValueError, "kept_blocks"),
    (dict(kept_blocks=torch.zeros(2, 1, dtype=torch.int64)), TypeError, "kept_blocks"),
    (dict(kept_blocks=torch.zeros(1, 1, dtype=torch.int32), next_n=3), ValueError, "next_n"),
    (dict(tokens_per_block=48), ValueError, "tokens_per_block"),
    (dict(out=torch.zeros(2, 4, dtype=torch.int32)), ValueError, "out"),
    (dict(out=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "out"),
]


@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize("bad,exc,name", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_arguments_name_the_argument(bad, exc, name, twin):
    args = dict(logits=torch.zeros(2, 10), lengths=torch.tensor([3, 10], dtype=torch.int32), k=3)
    args.update(bad)
    if twin:
        pytest.importorskip("triton")
        from spin_indexer.ops.topk_select_triton import topk_positions_triton as fn
    else:
        fn = topk_positions_ref
    with pytest.raises(exc, match=name):
        fn(**args)


# ------------------------------------------------------------------------------------------ multi-program path
@pytest.mark.interpreter
@pytest.mark.parametrize("rows,cols,k,seg_cols", [(3, 300, 5, 16), (2, 1000, 40, 32), (2, 64 * 24 + 7, 16, 128),
                                                  (4, 97, 200, 16), (1, 2000, 1, 256)])
@pytest.mark.parametrize("use_block_max", [False, True])
def test_multi_segments(rows, cols, k, seg_cols, use_block_max, gen, triton_device):
    """Random rows over many segments (partial last segment and block, k > length, k = 1), with and without
    the block maxima that let the collect pass skip blocks."""
    logits, lengths = masked_logits(rows, cols, gen)
    lengths[0] = cols
    _twin(logits, lengths, k, triton_device, use_block_max, seg=seg_cols)


@pytest.mark.interpreter
@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_multi_kept_blocks_and_ties(next_n, gen, triton_device):
    """kept_blocks mapping (next_n 1/2/4) on the register path with massive ties: few distinct values and
    -0.0 mixed with +0.0, so the k-th key's bucket holds many equal keys across segment boundaries; the
    first ties in column order win."""
    rows, cols, tokens = 4, 30 * 16, 16
    logits, lengths = masked_logits(rows, cols, gen, ties=True)
    lengths[0] = cols
    logits[(logits == 0) & (torch.rand(logits.shape, generator=gen) < 0.5)] = -0.0
    kept = _kept(rows, cols // tokens, gen, next_n)
    for use_block_max in (False, True):
        stats = _twin(logits, lengths, 25, triton_device, use_block_max, kept=kept, next_n=next_n, tokens=tokens,
                      seg=32, cap=512)
        assert (stats <= 512).all(), "expected the register path (no overflow)"


@pytest.mark.interpreter
def test_multi_winners_in_one_segment_and_overflow(gen, triton_device):
    """All winners inside one segment (its region fills to min(SEG, CAP)); a flat row overflows a small
    buffer (streaming fallback); -inf rows and -inf blocks; huge values."""
    logits = torch.randn(3, 640, generator=gen)
    logits[0, 256:320] += 100.0  # the whole top-64 in segment 4 of 64 columns
    logits[1, :] = 2.5  # flat: every key is in the k-th key's bucket
    logits[2, :] = float("-inf")
    logits[2, 100:140] = torch.randn(40, generator=gen) * 1e30
    lengths = torch.tensor([640, 600, 639], dtype=torch.int32)
    stats = _twin(logits, lengths, 64, triton_device, True, seg=64, cap=128)
    assert stats[0] <= 128 and stats[1] == 600, stats
    _twin(logits, lengths, 64, triton_device, False, seg=64, cap=128)
    _twin(logits, lengths, 100, triton_device, True, seg=64, cap=64)  # overflow on every row


@pytest.mark.interpreter
def test_multi_auto_path_and_clean_workspace(gen, triton_device):
    """seg=None takes the multi-program path once C > CAP; the histogram workspace is zero after every call
    (the next call adds into it); rows of different lengths in one batch."""
    from spin_indexer.ops import topk_select_parts as parts, topk_select_triton as mod
    logits, lengths = masked_logits(5, 300, gen)
    for _ in range(2):
        _twin(logits, lengths, 7, triton_device, True)
        assert all(int(ws.abs().sum()) == 0 for ws in parts._HIST_WORKSPACE.values())
    assert mod.auto_seg(1, 128 * 1024) == 2048 and mod.auto_seg(96, 256 * 1024) == 8192


@pytest.mark.parametrize("bad", [dict(seg=48), dict(seg=8), dict(seg=65536), dict(cap=24), dict(cap=8)])
def test_bad_seg_and_cap(bad):
    pytest.importorskip("triton")
    from spin_indexer.ops.topk_select_triton import topk_positions_triton
    with pytest.raises(ValueError, match=next(iter(bad))):
        topk_positions_triton(torch.zeros(2, 10), torch.tensor([3, 10], dtype=torch.int32), 3, **bad)
