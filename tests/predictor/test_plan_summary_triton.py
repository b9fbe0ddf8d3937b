"""The fused step's summary mix (plan_triton.select_layer_triton after plan_step_triton with SpinConfig.summary
> 0) against the torch path (SpinIndexer.plan() + Extensions.select with the same summary scores), under
TRITON_INTERPRET=1 on the CPU or on CUDA.

plan() must reset and advance the state as the torch path does and select only the requests that do not mix
(SpinConfig.summary_below); each layer's select launch must then keep the same blocks for the others. The kernel
standardizes with its own order of sums, so a block whose mixed score sits within float32 rounding of the cut may
flip: a row that differs must be such a near-tie in the float64 recomputation (and at most one row a test may be
one). Random states and lengths come from test_plan_triton's
helpers; workspace outputs are poisoned first."""
import dataclasses

import pytest
import torch

from test_plan_triton import BASE, STATE, T, _Host, _copy_state, _poison, _randomize, _rows, _step_table, _table

from spin_indexer.indexer import SpinIndexer
from spin_indexer.predictor import plan as plan_ref
from spin_indexer.predictor.summary import mixing_requests, summary_scores

pytestmark = pytest.mark.interpreter
MIX = dataclasses.replace(BASE, summary=0.5)
NEAR_TIE = 1e-4  # float64 gap at the cut below which float32 sums in another order may swap two blocks


def _summary(lens, width, gen):
    """float32 [B, W]: random summary scores of the full blocks of row 0, -inf past them and on ~10% holes."""
    x = torch.randn(len(lens), width, generator=gen) * 3
    full = torch.tensor([x // T for x in lens])[:, None]
    hole = torch.rand(len(lens), width, generator=gen) < 0.1
    return torch.where((torch.arange(width)[None, :] < full) & ~hole, x, float("-inf"))


def _ambiguous(cfg, ref, layer, summary, b) -> bool:
    """Whether request b's stage-1 cut is a near-tie of the float64 mixed scores (any prediction row)."""
    meta = ref._step.meta
    hist = plan_ref.layer_scores(cfg, ref.state, layer, meta)
    mixed = summary_scores(hist.double(), summary.double(), meta.valid, cfg.summary)[b]  # [P, W]
    forced = plan_ref.forced_blocks(ref.state, layer, meta)[b]
    need = int(max(int(forced.sum()), int(meta.budget[b] - meta.explore[b])) - forced.sum())
    for row in mixed:
        cand = row[meta.valid[b] & ~forced].sort(descending=True).values
        if 0 < need < len(cand) and float(cand[need - 1] - cand[need]) < NEAR_TIE:
            return True
    return False


def _compare_layer(cfg, ref, got, layer, summary, batch, width) -> int:
    """Rows of `layer` where the two plans differ (each must be a near-tie); returns how many."""
    wr, wg = ref.workspace, _Host(got).workspace
    differ = 0
    for b in range(batch):
        nk = int(wr.num_kept[layer, b])
        same = int(wg.num_kept[layer, b]) == nk and all(
            torch.equal(getattr(wg, name)[layer, b, :nk], getattr(wr, name)[layer, b, :nk])
            for name in ("kept_blocks", "compact_table")) and torch.equal(wg.compact_lens[layer, b],
                                                                         wr.compact_lens[layer, b])
        if not same:
            assert _ambiguous(cfg, ref, layer, summary, b), f"layer {layer}, request {b}: plans differ"
            differ += 1
    return differ


def _run(cfg, final_lens, next_n, gen, dev, steps=2, layers=2, grow=None, accepted=False, bad=False, grid=None,
         stale_tail=False):
    """`steps` steps of plan() + every layer's summary select on both paths from one random state. stale_tail:
    every request has seen its context, and its newest block holds large vertical history past its length
    (what a rejected draft could leave): the mix must mask it out of the statistics, as layer_scores does."""
    from spin_indexer.predictor.plan_triton import plan_step_triton, select_layer_triton, supports
    batch = len(final_lens)
    width = max([-(-x // T) for x in final_lens], default=1) + 2
    assert supports(cfg, width)
    grow = [0] * steps if grow is None else grow
    slots = batch + 3
    cache = sum(-(-x // T) for x in final_lens) + 4
    kw = dict(num_layers=layers, max_batch=max(batch, 1), max_blocks=width, next_n=next_n, max_requests=slots,
              num_cache_blocks=cache, head_dim=16)
    ref, got = SpinIndexer(cfg, **kw), SpinIndexer(cfg, device=dev, **kw)
    for _ in range(slots):
        ref.state.allocate(), got.state.allocate()
    _randomize(ref.state, gen, grid or ("fine" if cfg.reduce.value == "mean" else None))
    ref.state.summarized.copy_(torch.randint(0, 5, ref.state.summarized.shape, generator=gen).int())
    slot_ids = torch.randperm(slots, generator=gen)[:batch]
    table = _table(final_lens, width, cache, gen, bad=bad)
    lens = [max(0, x - sum(grow)) for x in final_lens]
    for b in range(batch):
        ref.state.seen_len[slot_ids[b]] = 0 if b % 3 == 2 else int(torch.randint(lens[b] // 2, lens[b] + 1, (1,),
                                                                                  generator=gen))
        if stale_tail and lens[b] % T:
            ref.state.seen_len[slot_ids[b]] = lens[b]
            phys = int(table[b, lens[b] // T])
            ref.state.vertical[:, phys, lens[b] % T:] = 1000.0
            ref.state.block_max[phys] = ref.state.vertical[:, phys].amax(dim=1)
    _copy_state(got.state, ref.state)
    got.state.summarized.copy_(ref.state.summarized)
    differ = 0
    for s in range(steps):
        seq_lens, step_table = _rows(lens, next_n), _step_table(table, lens)
        acc = torch.randint(0, next_n, (batch,), generator=gen).int() if accepted else None
        summarized_before = ref.state.summarized.clone()
        ref.plan(step_table, seq_lens, slot_ids, num_accepted=acc, validate=not bad)
        _poison(got.workspace)
        got.workspace.summary_first.fill_(-7)
        got.workspace.full_blocks.fill_(-7)
        args = [x.to(dev) if x is not None else None for x in (step_table, seq_lens, slot_ids.long(), acc)]
        plan_step_triton(cfg, got.state, got.workspace, *args, score_block=8)
        host = _Host(got)
        # plan(): the torch path's counters and resets, only the requests that do not mix selected (summary_below),
        # each layer's summary range (none for those)
        assert torch.equal(host.workspace.num_blocks[:batch], ref.workspace.num_blocks[:batch])
        assert torch.equal(host.workspace.guarded[:batch].bool(), ref.workspace.guarded[:batch])
        assert torch.equal(host.workspace.update_rows[:batch].bool(), ref.workspace.update_rows[:batch])
        mixes = mixing_requests(seq_lens, cfg.summary_below)
        assert bool((host.workspace.num_kept[:, :batch][:, mixes] == -7).all()), "plan() selected a mixing request"
        assert bool((host.workspace.num_kept[:, :batch][:, ~mixes] >= 0).all()), "plan() left a request unselected"
        for name in STATE:
            assert torch.equal(getattr(host.state, name), getattr(ref.state, name)), f"state.{name}"
        full = torch.where(mixes, torch.clamp(seq_lens[:, 0] // T, max=width), 0).int()
        assert torch.equal(got.workspace.full_blocks[:batch].cpu(), full)
        assert torch.equal(got.workspace.summary_first[:, :batch].cpu(), summarized_before[:, slot_ids])
        for layer in range(layers):
            summary = _summary(seq_lens[:, 0].tolist(), width, gen)
            ref._plan_of(layer, ref._step, summary=summary)
            cached = layer % 2 == 0  # the live path records the cache's extent, a replay does not
            before = got.state.summarized.clone()
            select_layer_triton(cfg, got.state, got.workspace, layer, *args[:3], summary.to(dev), cached=cached,
                                score_block=8)
            differ += _compare_layer(cfg, ref, got, layer, summary, batch, width)
            expect = before.clone()
            if cached:
                expect[layer, slot_ids] = full.to(expect.device)
            assert torch.equal(got.state.summarized, expect), f"layer {layer}: summarized"
        ref.state.summarized.copy_(got.state.summarized.cpu())
        touched = torch.randperm(cache, generator=gen)[:2 * cache // 3]
        _randomize(ref.state, gen, grid or ("fine" if cfg.reduce.value == "mean" else None), touched)
        for name in ("vertical", "block_max", "diagonal"):
            getattr(got.state, name).copy_(getattr(ref.state, name))
        lens = [x + grow[s] if x else 0 for x in lens]
    assert differ <= 1, f"{differ} rows differ at near-ties: more than float32 rounding explains"


# long (W not a power of two, partial last block), guarded (< 640), keep_all (<= 128), one block, padding
LENS = (37 * T + 5, 400, 100, 64, 0)


@pytest.mark.parametrize("cfg", [
    MIX,
    dataclasses.replace(MIX, exploration="none", gamma=0.0, summary=0.8),
    dataclasses.replace(MIX, combine="sum", summary=1.0),
    dataclasses.replace(MIX, combine="diagonal", diagonal_window=150, summary=0.3),
    dataclasses.replace(MIX, reduce="mean", summary=0.0001),
    dataclasses.replace(MIX, summary_below=2000),  # the long request selects in plan(), the others in run()
    dataclasses.replace(MIX, summary_below=2000, sparsity_profile=(1.5, 0.5)),  # both launches budget by layer
], ids=["max-random", "none-0.8", "sum-1.0", "diagonal", "mean", "below-2000", "below-2000-profile"])
def test_summary_select_matches_torch(cfg, gen, triton_device):
    _run(cfg, LENS, 1, gen, triton_device, grow=[70, 0])


def test_summary_select_without_exploration_in_the_mix(gen, triton_device):
    """SpinConfig.summary_explores=False: the requests that mix (one past the guard: LENS' short ones are all
    guarded) take no exploration in run()'s launch, the long one still explores in plan()'s."""
    cfg = dataclasses.replace(MIX, summary_below=2000, sparsity_profile=(1.5, 0.5), summary_explores=False)
    _run(cfg, (37 * T + 5, 20 * T + 9, 400, 0), 1, gen, triton_device, grow=[70, 0])


@pytest.mark.parametrize("next_n,mtp,accepted,below", [(2, "row-local", True, 0), (4, "row0", False, 0),
                                                       (2, "row-local", True, 300)])
def test_summary_select_next_n(next_n, mtp, accepted, below, gen, triton_device):
    cfg = dataclasses.replace(MIX, mtp=mtp, summary_below=below)
    _run(cfg, LENS[:4] + (3,), next_n, gen, triton_device, grow=[next_n, 0], accepted=accepted)


def test_summary_select_edges(gen, triton_device):
    # every history score tied (one value): the summary alone orders the blocks; then ids outside the cache
    # (validate=False: the trash block, never read outside the state); history past the length; an empty batch
    _run(dataclasses.replace(MIX, dense_below=0), (24 * T + 7, 9 * T, 40 * T), 1, gen, triton_device, layers=1,
         grid="flat")
    _run(MIX, LENS[:4], 2, gen, triton_device, grow=[1, 0], bad=True)
    _run(dataclasses.replace(MIX, summary=0.3), (37 * T + 5, 30 * T + 9, 20 * T + 33), 1, gen, triton_device,
         steps=1, stale_tail=True)
    _run(MIX, (), 1, gen, triton_device)


def test_select_layer_refuses_a_config_without_the_mix(triton_device):
    from spin_indexer.predictor.plan_triton import select_layer_triton
    idx = SpinIndexer(BASE, num_layers=1, max_batch=1, max_blocks=4, num_cache_blocks=8)
    with pytest.raises(ValueError, match="summary"):
        select_layer_triton(BASE, idx.state, idx.workspace, 0, torch.zeros(1, 4, dtype=torch.int32),
                            torch.ones(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                            torch.zeros(1, 4))
