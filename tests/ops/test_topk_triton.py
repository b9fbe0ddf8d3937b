"""topk_triton (the Triton twin) against topk_ref, element for element: random and tied values, -0.0/+0.0,
poisoned tails, with and without block maxima, every group size, the candidate-overflow fallback, the chunked
threshold, the sort chunks and the rank, the stage breakdown, the threshold hint.

Runs under TRITON_INTERPRET=1 on CPU (conftest sets it before this module imports triton).
"""
from __future__ import annotations

import pytest
import torch

from conftest import cuda_only, masked_logits

pytest.importorskip("triton")
from spin_indexer.ops.indexer_logits import block_max_ref  # noqa: E402
from spin_indexer.ops.topk import topk_ref  # noqa: E402
from spin_indexer.ops.topk import topk_group  # noqa: E402
from spin_indexer.ops.topk_triton import topk_triton  # noqa: E402

pytestmark = pytest.mark.interpreter


RANDOM_CASES = [(3, 300, 5), (4, 64 * 40, 8), (2, 5000, 16), (2, 100, 200), (1, 1, 1), (5, 129, 64)]


def _block_max(logits, lengths):
    valid = torch.arange(logits.shape[1])[None, :] < lengths.long()[:, None]
    return block_max_ref(torch.where(valid, logits, float("-inf")), 64)


def _check(logits, lengths, k, device, use_block_max=False, **kw):
    bmax = _block_max(logits, lengths).to(device) if use_block_max else None
    stats = torch.full((logits.shape[0],), -7, dtype=torch.int32, device=device)
    got = topk_triton(logits.to(device), lengths.to(device), k, block_max=bmax, stats=stats, **kw).cpu()
    want = topk_ref(logits, lengths, k)
    assert got.dtype == torch.int32 and got.shape == want.shape
    bad = (got != want).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:5]} differ; first: got {got[bad[0], :12].tolist()} want {want[bad[0], :12].tolist()}"
    return stats.cpu()


@pytest.mark.parametrize("rows,cols,k", RANDOM_CASES)
@pytest.mark.parametrize("use_block_max", [False, True])
def test_random_matches_reference(rows, cols, k, use_block_max, gen, triton_device):
    logits, lengths = masked_logits(rows, cols, gen)
    _check(logits, lengths, k, triton_device, use_block_max)


@pytest.mark.parametrize("tile", [16, cuda_only(64, why="16 runs five chunks of the row's 80 groups, 64 two")])
@pytest.mark.parametrize("row0", ["planted", "poisoned"])
def test_threshold_chunked_passes(tile, row0, gen, triton_device, monkeypatch):
    """More group maxima than the threshold program holds in registers: its bisection re-reads them in
    chunks and must pick the same threshold (same top-k, same candidate count as the one-tile path). Row 0
    spans all 80 groups (five chunks of 16, or two of 64, the second partial): "planted", normal values with a
    few NaN, +inf and huge ones among them (NaN and +inf group maxima, the row within the buffer: its count is
    exact), or "poisoned", masked_logits' poisoned tail taken as valid (most group maxima NaN or +inf: massive
    ties, the row overflows)."""
    from spin_indexer.ops import topk_triton as mod
    logits, lengths = masked_logits(3, 64 * 80, gen)
    lengths[0] = 64 * 80
    if row0 == "planted":
        logits[0] = torch.randn(64 * 80, generator=gen)
        logits[0, [70, 2300, 5100]] = float("nan")
        logits[0, 1000] = float("inf")
        logits[0, 4000] = 1e30
    one_tile = _check(logits, lengths, 8, triton_device, use_block_max=True)
    monkeypatch.setattr(mod, "THRESHOLD_TILE_MAX", tile)
    chunked = _check(logits, lengths, 8, triton_device, use_block_max=True)
    assert torch.equal(one_tile, chunked)
    if row0 == "planted":
        assert one_tile[0] <= 32, one_tile  # no overflow: the count compared is the exact candidate count


@pytest.mark.parametrize("groups", [16384, 12000])
def test_widest_register_tile(groups, gen, triton_device):
    """The threshold's widest register tile (THRESHOLD_TILE_MAX = 16384 group maxima: 1M columns at k = 2048;
    here k = 8 with G = 64) in its production launch (THRESHOLD_WARPS: a warp count of its own), both rows
    full or cut, against the reference."""
    from spin_indexer.ops import topk_triton as mod
    cols = 64 * groups
    assert topk_group(cols, 8) == 64 and mod.THRESHOLD_TILE_MAX == 16384
    logits = torch.randn(2, cols, generator=gen)
    lengths = torch.tensor([cols, cols - 64 * 1000 - 5], dtype=torch.int32)
    stats = _check(logits, lengths, 8, triton_device, use_block_max=True)
    assert (stats >= 8).all() and (stats < 32).all(), stats


def test_block_max_path_reads_few_candidates(gen, triton_device):
    """A row with >= 4k blocks is pruned by the block maxima: far fewer candidates than columns."""
    k, cols = 8, 64 * 64
    assert topk_group(cols, k) == 64
    logits = torch.randn(2, cols, generator=gen)
    lengths = torch.tensor([cols, cols - 100], dtype=torch.int32)
    stats = _check(logits, lengths, k, triton_device, use_block_max=True)
    assert (stats >= k).all() and (stats < 4 * k).all(), stats


def test_ties_and_signed_zeros(gen, triton_device):
    """Few distinct values (massive ties, overflowing the candidate buffer) and -0.0 mixed with +0.0."""
    logits, lengths = masked_logits(3, 700, gen, ties=True)
    zero = logits == 0
    logits[zero & (torch.rand(logits.shape, generator=gen) < 0.5)] = -0.0
    stats = _check(logits, lengths, 6, triton_device)
    assert (stats > 32).any(), "expected the overflow fallback to run"


def test_overflow_fallback_with_small_buffer(gen, triton_device):
    cols = 900
    logits, lengths = masked_logits(2, cols, gen)
    lengths[0] = cols
    stats = _check(logits, lengths, 10, triton_device, cap=32)
    assert stats[0] > 32


@pytest.mark.parametrize("k,cap", [(10, 32), (16, 32), (5, 64)])
def test_overflow_merge_zero_ties_and_late_winners(k, cap, gen, triton_device):
    """The e2e proxy's overflowing rows: a ReLU-weighted score that is exactly 0 for most columns, a few
    positives (fewer than k, so zeros at the lowest positions fill the rest) and negatives; winners late in
    the row and runs of rising values, so the merge's entrant buffer fills and sorts several times; lengths
    not a multiple of its step; -0.0 among the zeros."""
    rows, cols = 4, 600
    logits = torch.zeros(rows, cols)
    logits[0, -(k // 2):] = torch.rand(k // 2, generator=gen) + 1  # row 0: the positives at the end
    logits[1, torch.randperm(cols, generator=gen)[:k - 1]] = torch.rand(k - 1, generator=gen)
    logits[1, ::3] = -torch.rand(len(range(0, cols, 3)), generator=gen)
    logits[2] = torch.linspace(-1, 1, cols)  # row 2: rising, every column beats the last kth: many sorts
    logits[2, :cols // 2] = 0.0
    logits[3, 1::2] = -0.0
    lengths = torch.tensor([cols, cols - 7, cols - 1, 257], dtype=torch.int32)
    stats = _check(logits, lengths, k, triton_device, cap=cap)
    assert (stats > cap).sum() >= 3, stats  # the merge ran (row 2's rising half alone may not overflow)


def test_all_tied_row_takes_lowest_positions(triton_device):
    logits = torch.full((2, 300), 1.5)
    lengths = torch.tensor([300, 37], dtype=torch.int32)
    _check(logits, lengths, 20, triton_device)


def test_neg_inf_and_huge_values(gen, triton_device):
    logits = torch.randn(2, 400, generator=gen) * 1e30
    logits[:, ::7] = float("-inf")
    lengths = torch.tensor([400, 250], dtype=torch.int32)
    _check(logits, lengths, 70, triton_device)


def test_zero_lengths_and_empty(gen, triton_device):
    logits, _ = masked_logits(3, 200, gen)
    _check(logits, torch.zeros(3, dtype=torch.int32), 4, triton_device)
    empty = topk_triton(torch.empty(0, 50, device=triton_device), torch.empty(0, dtype=torch.int32,
                        device=triton_device), 4)
    assert empty.shape == (0, 4)
    none = topk_triton(torch.empty(2, 0, device=triton_device), torch.zeros(2, dtype=torch.int32,
                       device=triton_device), 3)
    assert none.tolist() == [[-1] * 3] * 2


def test_bad_block_max_shape_raises(gen, triton_device):
    logits, lengths = masked_logits(2, 200, gen)
    with pytest.raises(ValueError, match="block_max"):
        topk_triton(logits.to(triton_device), lengths.to(triton_device), 4,
                    block_max=torch.zeros(2, 3, device=triton_device))
    with pytest.raises(ValueError, match="lengths"):
        topk_triton(logits.to(triton_device), (lengths + 500).to(triton_device), 4)


@pytest.mark.parametrize("chunk", [16, cuda_only(64, why="~15 s in the interpreter; 16 spans more chunks per row")])
def test_ranks_across_several_sorted_chunks(chunk, gen, triton_device, monkeypatch):
    """With small sort chunks a row's candidates span many chunks (some partly filled, the last ones empty),
    and every rank is a sum of binary searches over them: same results as the reference, ties included."""
    import spin_indexer.ops.topk_triton as topk_module
    monkeypatch.setattr(topk_module, "SORT_CHUNK", chunk)
    logits, lengths = masked_logits(5, 3000, gen)
    _check(logits, lengths, 40, triton_device, use_block_max=True)
    ties, tie_lengths = masked_logits(3, 700, gen, ties=True)
    _check(ties, tie_lengths, 6, triton_device)
    # a value shared by many candidates (the position half of the keys orders them), nothing overflowing
    coarse = torch.randint(0, 40, (4, 900), generator=gen).float() / 4
    coarse_lengths = torch.tensor([900, 899, 640, 65], dtype=torch.int32)
    counts = torch.cat([_check(coarse, coarse_lengths, k, triton_device, cap=1024) for k in (1, 37, 64)])
    assert ((counts > chunk) & (counts <= 1024)).any(), counts  # some row spanned several chunks


def test_group_max_from_the_caller_replaces_the_group_max_pass(gen, triton_device):
    """group_max (the update pass's group maxima at G = topk_group(C, k) < 64) is what the top-k prunes with:
    exact ones give the reference's result, a wrong shape is refused naming it, and a group whose given max
    is -inf is skipped (the maxima are read, not recomputed)."""
    from spin_indexer.ops.topk import group_max_ref
    logits, lengths = masked_logits(3, 2000, gen)
    k = 40
    group = topk_group(2000, k)
    assert group < 64
    gm = group_max_ref(logits, lengths, group)
    dev = triton_device
    got = topk_triton(logits.to(dev), lengths.to(dev), k, group_max=gm.to(dev)).cpu()
    want = topk_ref(logits, lengths, k)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="group_max"):
        topk_triton(logits.to(dev), lengths.to(dev), k, group_max=gm[:, :-1].contiguous().to(dev))
    best = int(want[0, 0])
    hidden = gm.clone()
    hidden[0, best // group] = float("-inf")
    got = topk_triton(logits.to(dev), lengths.to(dev), k, group_max=hidden.to(dev)).cpu()
    assert best not in got[0].tolist() and torch.equal(got[1:], want[1:])


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_group_maxima_past_a_rows_length_are_never_read_as_keys(poison, gen, triton_device):
    """The threshold loads a row's whole allocated width of group maxima (whole vectors) and masks the groups
    past its length after the load: whatever those hold (here NaN or +inf, above every key), the result and
    the live-group count are the reference's."""
    from spin_indexer.ops.topk import group_max_ref
    rows, cols, k = 4, 4096, 24
    logits, lengths = masked_logits(rows, cols, gen)
    lengths[0], lengths[1] = 100, 0  # a row of a few groups and an empty one beside longer ones
    group = topk_group(cols, k)
    gm = group_max_ref(logits, lengths, group)
    valid = torch.arange(gm.shape[1])[None, :] < ((lengths.long() + group - 1) // group)[:, None]
    poisoned = torch.where(valid, gm, poison)
    dev = triton_device
    stats = torch.zeros(rows, dtype=torch.int32, device=dev)
    got = topk_triton(logits.to(dev), lengths.to(dev), k, group_max=poisoned.to(dev), stats=stats).cpu()
    assert torch.equal(got, topk_ref(logits, lengths, k))
    clean = torch.zeros(rows, dtype=torch.int32, device=dev)
    topk_triton(logits.to(dev), lengths.to(dev), k, group_max=gm.to(dev), stats=clean)
    assert torch.equal(stats.cpu(), clean.cpu())


@pytest.mark.parametrize("rows", [3, cuda_only(20, why="20 rows x 1500 in the interpreter, ~10 s")])
def test_stage_breakdown(rows, gen, triton_device):
    """_stages < 5 (profile_step's breakdown) stops after the threshold (which fills out with -1), the gather
    or the chunk sort: no rank writes a position; _stages = 5 is the whole top-k."""
    logits, lengths = masked_logits(rows, 1500, gen)
    dev = triton_device
    for stages in (2, 3, 4):
        out = torch.full((rows, 12), -7, dtype=torch.int32, device=dev)
        topk_triton(logits.to(dev), lengths.to(dev), 12, out=out, _stages=stages)
        assert (out.cpu() == -1).all(), stages
    _check(logits, lengths, 12, dev, _stages=5)


def test_tau_hint_never_changes_the_result_and_converges_to_the_rows_key(triton_device, gen):
    """The threshold with a hint: whatever the hint (the row's own key, near it, far off, negative, above
    16 bits), the top-k equals the reference and the hint written back is the same key the search finds from
    zeros; rows too short for a threshold (fewer than k groups) leave their hint as it was."""
    rows, cols, k = 6, 2048, 64
    logits = torch.randn(rows, cols, generator=gen)
    # long rows search a threshold; 100 columns are fewer than k groups (no search); an empty row
    lengths = torch.tensor([cols, cols, cols - 7, 100, cols // 2, 0], dtype=torch.int32)
    logits = torch.where(torch.arange(cols)[None, :] < lengths.long()[:, None], logits, float("nan"))  # poisoned tails
    want = topk_ref(logits, lengths, k)
    x, n = logits.to(triton_device), lengths.to(triton_device)
    short = (-(-lengths.long() // topk_group(cols, k))) < k

    def run(hint):
        h = hint.to(torch.int32).to(triton_device)
        got = topk_triton(x, n, k, tau_hint=h).cpu()
        assert torch.equal(got, want)
        return h.cpu()

    key = run(torch.zeros(rows))
    assert torch.equal(key[short], torch.zeros(int(short.sum()), dtype=torch.int32))
    assert ((key[~short] > 0) & (key[~short] <= 65535)).all()
    garbage = torch.randint(-100000, 100000, (rows,), generator=gen)
    for hint in (key, key + 1, key - 31, key + 40, key - 4000, garbage, torch.full((rows,), 70000)):
        after = run(hint)
        assert torch.equal(after[~short], key[~short])
        assert torch.equal(after[short], hint.to(torch.int32)[short])


def test_tau_hint_of_the_wrong_shape_is_refused_by_name(triton_device, gen):
    logits, lengths = masked_logits(2, 300, gen)
    with pytest.raises(ValueError, match="tau_hint"):
        topk_triton(logits.to(triton_device), lengths.to(triton_device), 8,
                    tau_hint=torch.zeros(3, dtype=torch.int32, device=triton_device))
    # also where no threshold would run (no columns): refused before the output is touched
    out = torch.full((2, 8), 7, dtype=torch.int32, device=triton_device)
    with pytest.raises(ValueError, match="tau_hint"):
        topk_triton(torch.zeros(2, 0, device=triton_device), torch.zeros(2, dtype=torch.int32, device=triton_device),
                    8, out=out, tau_hint=torch.zeros(3, dtype=torch.int32, device=triton_device))
    assert bool((out == 7).all())


@pytest.mark.parametrize("group", [1, 8, 16, 64])
def test_any_group_gives_the_reference_result_and_prunes_tighter_when_finer(group, gen, triton_device):
    """`group` (SPIN's step picks it by the kept columns, not the buffer's width) changes only how tightly the
    threshold prunes: the result equals the reference at every group, with the caller's group maxima at that
    group or the top-k's own; rows that fill a third of the columns admit no more candidates at a finer group
    than at topk_group(C, k)'s. A group that is no power of two <= 64 is refused naming it."""
    from spin_indexer.ops.topk import group_max_ref
    dev = triton_device
    logits, _ = masked_logits(4, 3000, gen)
    lengths = torch.full((4,), 1000, dtype=torch.int32)  # a third of the columns, as compact rows at s = 0.67
    k = 24
    gm = group_max_ref(logits, lengths, group) if group < 64 else None
    stats = torch.zeros(4, dtype=torch.int32, device=dev)
    got = topk_triton(logits.to(dev), lengths.to(dev), k, group=group, stats=stats,
                      group_max=None if gm is None else gm.to(dev)).cpu()
    assert torch.equal(got, topk_ref(logits, lengths, k))
    wide = torch.zeros(4, dtype=torch.int32, device=dev)
    topk_triton(logits.to(dev), lengths.to(dev), k, stats=wide)
    if group <= topk_group(1000, k):
        assert (stats.cpu() <= wide.cpu()).all(), (stats.tolist(), wide.tolist())
    for bad in (3, 128, 0):
        with pytest.raises(ValueError, match="group"):
            topk_triton(logits.to(dev), lengths.to(dev), k, group=bad)


@pytest.mark.parametrize("use_block_max,sorted_", [(False, True), (True, True), (False, False)])
def test_lengths_past_the_row_read_as_the_row(use_block_max, sorted_, gen, triton_device, monkeypatch):
    """validate=False with lengths past C (a caller that skipped the check): a row reads as its C columns, never
    the row below (its values would win) or past the tensor's end: the result of the clamped lengths, and
    topk_ref's. Sorted (the rank launch), unsorted (the set select, forced at 3 rows), and the overflow merge
    of both (row 2: every value tied, more candidates than the buffer holds)."""
    import spin_indexer.ops.topk_triton as topk_module
    monkeypatch.setattr(topk_module, "SET_SELECT_MIN_ROWS", 1)
    cols = 64 * 20
    logits = torch.randn(3, cols, generator=gen)
    logits[1] += 100.0  # a read past row 0 would take these
    logits[2] = 0.5
    lengths = torch.tensor([cols + 5, cols, 50 * cols], dtype=torch.int32)
    bmax = _block_max(logits, lengths.clamp(max=cols)).to(triton_device) if use_block_max else None
    stats = torch.zeros(3, dtype=torch.int32, device=triton_device)
    got = topk_triton(logits.to(triton_device), lengths.to(triton_device), 40, validate=False, block_max=bmax,
                      sorted=sorted_, stats=stats).cpu()
    assert int(stats[2]) > topk_module.candidate_cap(40, None)  # row 2 took the overflow merge
    want = topk_ref(logits, lengths.clamp(max=cols), 40, sorted=sorted_)
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values) if not sorted_ else torch.equal(got, want)
    assert torch.equal(topk_ref(logits, lengths, 40, validate=False, sorted=sorted_), want)
