"""topk_triton (the Triton twin) against topk_ref, element for element: random and tied values, -0.0/+0.0,
poisoned tails, with and without block maxima, every group size, the candidate-overflow fallback; the v2 chain
in its one-launch (small batch) and two-launch (large batch) select forms, every run / window
shape of its rank, its stage breakdown, and the v1 chain (TOPK_CHAIN = "v1", production again since run 17).

Runs under TRITON_INTERPRET=1 on CPU (conftest sets it before this module imports triton).
"""
from __future__ import annotations

import pytest
import torch

from conftest import FULL_CASES, cuda_only, masked_logits

pytest.importorskip("triton")
from spin_indexer.ops.indexer_logits import block_max_ref  # noqa: E402
from spin_indexer.ops.topk import topk_ref  # noqa: E402
from spin_indexer.ops.topk import topk_group  # noqa: E402
from spin_indexer.ops.topk_triton import topk_triton  # noqa: E402

pytestmark = pytest.mark.interpreter


@pytest.fixture(params=["v2", "v1"])
def chain(request, monkeypatch):
    """Both kernel chains (topk_triton.TOPK_CHAIN) for the edge-case tests."""
    from spin_indexer.ops import topk_triton as mod
    monkeypatch.setattr(mod, "TOPK_CHAIN", request.param)
    return request.param


@pytest.fixture
def v2(monkeypatch):
    """The v2 chain, whichever is production: for the tests of its own shape (runs, rank windows, probes)."""
    from spin_indexer.ops import topk_triton as mod
    monkeypatch.setattr(mod, "TOPK_CHAIN", "v2")


def _other_chain() -> str:
    from spin_indexer.ops import topk_triton as mod
    return "v2" if mod.TOPK_CHAIN == "v1" else "v1"


# The random matrix runs the production chain (TOPK_CHAIN: v1 again since run 17); the other chain on three of
# its cases (the interpreter makes every case seconds: both chains on all of them doubled the suite's top-k time).
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


OTHER_CPU_CASES = [(4, 64 * 40, 8, True), (2, 5000, 16, False), (5, 129, 64, True)]


@pytest.mark.parametrize("rows,cols,k,use_block_max", [
    case if case in OTHER_CPU_CASES else cuda_only(*case, why="the chain that is not production on three of the "
                                                   "random cases in the interpreter, ~2-5 s each")
    for case in ((*c, b) for c in RANDOM_CASES for b in (False, True))])
def test_other_chain_random_matches_reference(rows, cols, k, use_block_max, gen, triton_device, monkeypatch):
    from spin_indexer.ops import topk_triton as mod
    monkeypatch.setattr(mod, "TOPK_CHAIN", _other_chain())
    logits, lengths = masked_logits(rows, cols, gen)
    _check(logits, lengths, k, triton_device, use_block_max)


CHUNKED_WHY = "(1, 64) and (3, 16) run both probe widths and both chunkings (2 and 5 chunks) in the interpreter"


@pytest.mark.parametrize("probes,tile", [
    (1, 64), (3, 16),
    cuda_only(1, 16, why=CHUNKED_WHY), cuda_only(3, 64, why=CHUNKED_WHY)])
@pytest.mark.parametrize("row0", ["planted", cuda_only("poisoned", why="its overflow merge streams 5120 columns "
                                                       "through a 32-key buffer, ~25 s a top-k in the interpreter")])
def test_threshold_chunked_passes(tile, probes, row0, gen, triton_device, monkeypatch, v2):
    """More group maxima than the threshold program holds in registers: its bisection re-reads them in
    chunks and must pick the same threshold (same top-k, same candidate count as the one-tile path), with
    binary (1 probe) and 4-way (3 probes per reduction) steps. Row 0 spans all 80 groups (two chunks of 64,
    the second partial, or five of 16): "planted", normal values with a few NaN, +inf and huge ones among them
    (NaN and +inf group maxima, the row within the buffer: its count is exact), or "poisoned", masked_logits'
    poisoned tail taken as valid (most group maxima NaN or +inf: massive ties, the row overflows)."""
    from spin_indexer.ops import topk_triton as mod
    monkeypatch.setattr(mod, "SELECT_PROBES", probes)
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


def test_ties_and_signed_zeros(gen, triton_device, chain):
    """Few distinct values (massive ties, overflowing the candidate buffer) and -0.0 mixed with +0.0. (On the
    CPU 300 columns instead of 700: the overflow merge streams the row, ~2 s per 400 columns interpreted.)"""
    logits, lengths = masked_logits(3, 700 if FULL_CASES else 300, gen, ties=True)
    zero = logits == 0
    logits[zero & (torch.rand(logits.shape, generator=gen) < 0.5)] = -0.0
    stats = _check(logits, lengths, 6, triton_device)
    assert (stats > 32).any(), "expected the overflow fallback to run"


def test_overflow_fallback_with_small_buffer(gen, triton_device, chain):
    cols = 900 if FULL_CASES else 400  # (the overflow merge streams the row: ~2 s per 400 columns interpreted)
    logits, lengths = masked_logits(2, cols, gen)
    lengths[0] = cols
    stats = _check(logits, lengths, 10, triton_device, cap=32)
    assert stats[0] > 32


def test_all_tied_row_takes_lowest_positions(triton_device, chain):
    logits = torch.full((2, 300), 1.5)
    lengths = torch.tensor([300, 37], dtype=torch.int32)
    _check(logits, lengths, 20, triton_device)


def test_neg_inf_and_huge_values(gen, triton_device, chain):
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


@pytest.mark.parametrize("chunk", [16, cuda_only(64, why="v1 (not production), ~15 s in the interpreter; 16 "
                                                    "spans more chunks per row")])
def test_ranks_across_several_sorted_chunks(chunk, gen, triton_device, monkeypatch):
    """(v1's chunk sort + rank.)"""
    """With small sort chunks a row's candidates span many chunks (some partly filled, the last ones empty),
    and every rank is a sum of binary searches over them: same results as the reference, ties included."""
    import spin_indexer.ops.topk_triton as topk_module
    monkeypatch.setattr(topk_module, "TOPK_CHAIN", "v1")
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


# The interpreter's cost of _v2_cases: the tied rows' overflow merge grows with their length, the select's
# gather and run sort with the buffer: on the CPU 300 columns (still overflowing) and cap = 128 (runs of 64
# slots at P = 2, 16 windows each) instead of 700 and 1024 (~55 s saved).
TIE_COLS, COARSE_CAP = (700, 1024) if FULL_CASES else (300, 128)


def _v2_cases(gen):
    """Random rows (lengths 0 .. C, poisoned tails), tied rows (overflowing the default buffer), rows of one
    coarse value per many candidates (nothing overflowing at cap = COARSE_CAP), -inf and huge values."""
    logits, lengths = masked_logits(5, 3000, gen)
    ties, tie_lengths = masked_logits(3, TIE_COLS, gen, ties=True)
    coarse = torch.randint(0, 40, (4, 900), generator=gen).float() / 4
    coarse_lengths = torch.tensor([900, 899, 640, 65], dtype=torch.int32)
    huge = torch.randn(2, 400, generator=gen) * 1e30
    huge[:, ::7] = float("-inf")
    return [("random", logits, lengths, 40, {}), ("ties", ties, tie_lengths, 6, {}),
            ("coarse", coarse, coarse_lengths, 37, dict(cap=COARSE_CAP)),
            ("coarse", coarse, coarse_lengths, 64, dict(cap=COARSE_CAP)),
            ("huge", huge, torch.tensor([400, 250], dtype=torch.int32), 70, {})]


@pytest.mark.parametrize("progs,window", [
    (2, 4), cuda_only(1, 32, why="~1 min in the interpreter; 2 x 4 runs several runs and windows"),
    cuda_only(16, 8, why="~1.5 min in the interpreter; 2 x 4 runs several runs and windows")])
def test_v2_runs_and_rank_windows(progs, window, gen, triton_device, monkeypatch, v2):
    """The v2 rank sums, over the P sorted runs of a row, a splitter count (one key per window) and a search
    inside the window: every P (one run: the whole buffer; 16 runs of few keys) and window (4: many splitters
    per run) gives the reference's result, in the one-launch and two-launch select forms alike."""
    from spin_indexer.ops import topk_triton as mod
    monkeypatch.setattr(mod, "SELECT_PROGRAMS_SMALL", progs)
    monkeypatch.setattr(mod, "SELECT_PROGRAMS_LARGE", progs)
    monkeypatch.setattr(mod, "RANK_WINDOW", window)
    coarse = []
    for name, logits, lengths, k, kw in _v2_cases(gen):
        fused = _check(logits, lengths, k, triton_device, **kw)
        monkeypatch.setattr(mod, "SMALL_BATCH_ROWS", 0)  # the large-batch form: threshold launch, then gather + sort
        split = _check(logits, lengths, k, triton_device, **kw)
        monkeypatch.setattr(mod, "SMALL_BATCH_ROWS", 16)
        assert torch.equal(fused, split)
        if name == "coarse":
            coarse.append(fused)
    counts = torch.cat(coarse)  # the coarse rows filled several runs without overflowing
    assert (counts <= COARSE_CAP).all() and (counts > 64).any(), counts


def test_v2_hot_span_spreads_over_the_runs(gen, triton_device, v2):
    """A contiguous span of winners (a passage every query attends to): the live groups are dealt round-robin
    to the select programs, so the span's 96 candidates (six consecutive groups of 16) land in six runs of 32
    slots instead of overflowing one: the row stays off the overflow merge (its count is below the buffer)."""
    from spin_indexer.ops import topk_triton as mod
    k, cols, cap = 64, 4096, 256
    assert topk_group(cols, k) == 16
    logits = torch.randn(2, cols, generator=gen)
    logits[:, 1024:1120] += 8.0
    lengths = torch.tensor([cols, cols - 3], dtype=torch.int32)
    stats = _check(logits, lengths, k, triton_device, cap=cap)
    p, run, _ = mod._select_shape(2, cap)
    assert run < 96 and (stats <= cap).all() and (stats > 96).all(), (stats, run)


@pytest.mark.parametrize("rows,small_batch_rows", [
    (3, None), (5, 4),
    cuda_only(20, None, why="20 rows x 1500 in the interpreter, ~10 s: 5 rows above SMALL_BATCH_ROWS = 4 take the "
              "same large-batch form")])
def test_v2_stage_breakdown(rows, small_batch_rows, gen, triton_device, monkeypatch, v2):
    """_stages < 5 (profile_step's breakdown) runs the select launch(es) only: out holds the -1 fill (the
    large-batch form's stage 2 is its threshold launch alone, which leaves out as it was), no rank;
    _stages = 5 is the whole top-k. small_batch_rows: SMALL_BATCH_ROWS lowered (None: as shipped)."""
    from spin_indexer.ops import topk_triton as mod
    if small_batch_rows is not None:
        monkeypatch.setattr(mod, "SMALL_BATCH_ROWS", small_batch_rows)
    logits, lengths = masked_logits(rows, 1500, gen)
    dev = triton_device
    for stages in (2, 3, 4):
        out = torch.full((rows, 12), -7, dtype=torch.int32, device=dev)
        topk_triton(logits.to(dev), lengths.to(dev), 12, out=out, _stages=stages)
        untouched = stages == 2 and rows > mod.SMALL_BATCH_ROWS
        assert (out.cpu() == (-7 if untouched else -1)).all(), stages
    _check(logits, lengths, 12, dev, _stages=5)


def test_tau_hint_never_changes_the_result_and_converges_to_the_rows_key(triton_device, gen, monkeypatch):
    """v1's threshold with a hint: whatever the hint (the row's own key, near it, far off, negative, above
    16 bits), the top-k equals the reference and the hint written back is the same key the search finds from
    zeros; rows too short for a threshold (fewer than k groups) leave their hint as it was."""
    from spin_indexer.ops import topk_triton as mod
    monkeypatch.setattr(mod, "TOPK_CHAIN", "v1")
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
