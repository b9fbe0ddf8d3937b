"""SpinIndexer end to end on the CPU reference ops: s = 0 is dense, budgets hold, remapping is right,
the update touches only scored slots, MTP row policies, slot reuse, the history paged beside the cache
(reused and shared physical blocks), the speed guard, one run per layer per step, and every misuse error.

run() returns topk_ref's picks (ties to the lower position) as logical positions, by default in ascending position
order (topk_sorted=True: best first): the expectations are topk_ref itself. The vertical history lives per physical block: tests read it through the
block table."""
import dataclasses

import pytest
import torch

from conftest import ODD_IDS, ODD_SHAPES, cuda_only, make_case_inputs, make_paged_inputs, row_lengths
from spin_indexer.indexer import DenseIndexer, SpinIndexer
from spin_indexer.ops import paged_indexer_logits_ref, topk_ref
from spin_indexer.predictor import SpinConfig

T = 64


def _indexer(cfg, batch, width, next_n=1, layers=2, **kw):
    idx = SpinIndexer(cfg, num_layers=layers, max_batch=max(batch, 1), max_blocks=max(width, 1), next_n=next_n,
                      **kw)
    slots = torch.tensor([idx.state.allocate() for _ in range(batch)], dtype=torch.int32)
    return idx, slots


def vertical_of(idx, layer, table_row, length=None):
    """float32 [W*T] vertical history of one request's logical positions, read through its block table."""
    v = idx.state.vertical[layer][table_row.long()].reshape(-1).float()
    return v if length is None else v[:length]


def _scores(lengths, next_n, width, gen, hot_blocks=None):
    """Random scores float32 [B*N, W*T], -inf past each row's length; hot blocks get +10."""
    seq_lens = row_lengths(lengths, next_n)
    scores = torch.randn(len(lengths) * next_n, width * T, generator=gen)
    if hot_blocks is not None:
        for b, blocks in enumerate(hot_blocks):
            for k in blocks:
                scores[b * next_n:(b + 1) * next_n, k * T:(k + 1) * T] += 10.0
    cols = torch.arange(width * T)
    scores[cols[None, :] >= seq_lens.view(-1, 1)] = float("-inf")
    return seq_lens, scores


@pytest.mark.parametrize("topk_sorted", [False, True])
@pytest.mark.parametrize("case", ODD_SHAPES, ids=ODD_IDS)
def test_sparsity_zero_equals_dense_reference(case, topk_sorted, gen):
    x = make_case_inputs(case, gen)
    idx, slots = _indexer(SpinConfig(sparsity=0.0, topk=case.k), case.batch, x.block_table.shape[1], case.next_n,
                          num_cache_blocks=x.kv_cache.shape[0], topk_sorted=topk_sorted)
    expected = topk_ref(paged_indexer_logits_ref(*x.args()), x.seq_lens.view(-1), case.k, sorted=topk_sorted)
    for _ in range(3):  # later steps run with history, exploration and all
        idx.plan(x.block_table, x.seq_lens, slots)
        for layer in range(2):
            assert torch.equal(idx.run(layer, x.q_fp8, x.kv_cache, x.weights), expected)


@pytest.mark.parametrize("case", ODD_SHAPES, ids=ODD_IDS)
def test_block_grain_at_sparsity_zero_is_dense_and_starts_from_the_block_maxima(case, gen):
    """vertical_grain="block" on every odd shape (empty batch, context shorter than k, one block, partial last
    block, next_n up to 4): s = 0 returns the dense top-k at every step, and the first step leaves the same
    block maxima as slot grain (a first observation is the score itself; the grains part from the second)."""
    x = make_case_inputs(case, gen)
    width = x.block_table.shape[1]
    expected = topk_ref(paged_indexer_logits_ref(*x.args()), x.seq_lens.view(-1), case.k)
    pair = {g: _indexer(SpinConfig(sparsity=0.0, topk=case.k, vertical_grain=g), case.batch, width, case.next_n,
                        num_cache_blocks=x.kv_cache.shape[0], topk_sorted=True) for g in ("slot", "block")}
    assert pair["block"][0].state.vertical is None
    for step in range(3):
        for idx, slots in pair.values():
            idx.plan(x.block_table, x.seq_lens, slots)
            for layer in range(2):
                assert torch.equal(idx.run(layer, x.q_fp8, x.kv_cache, x.weights), expected), (step, layer)
        if step == 0:
            assert torch.equal(pair["slot"][0].state.block_max[:-1], pair["block"][0].state.block_max[:-1])
            assert torch.isfinite(pair["block"][0].state.block_max).any() == (case.batch > 0)  # history recorded


@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_sparse_output_is_the_topk_of_the_kept_blocks(next_n, gen):
    lengths, width, k = (3000, 1100, 4096), 70, 200
    cfg = SpinConfig(sparsity=0.5, topk=k)
    idx, slots = _indexer(cfg, 3, width, next_n)
    for step in range(4):
        seq_lens, scores = _scores([L + step for L in lengths], next_n, width, gen)
        idx.plan(torch.arange(3 * width, dtype=torch.int32).view(3, width), seq_lens, slots)
        out = idx.run_from_scores(1, scores)
        plan = idx.block_plan
        mask = plan.token_mask().repeat_interleave(next_n, 0)
        expected = topk_ref(torch.where(mask, scores, float("-inf")), seq_lens.view(-1), k, sorted=False)
        # rows longer than k: every selected position lies in a kept block and below the row length
        assert torch.equal(out, expected)
        assert ((out < seq_lens.view(-1, 1)) | (out == -1)).all()
        sel = out[out >= 0].long()
        assert (out >= 0).sum(1).tolist() == [min(k, int(n)) for n in (mask & (torch.arange(width * T) < seq_lens.view(-1, 1))).sum(1)]
        assert sel.numel() > 0


def test_budget_newest_and_never_seen_blocks(gen):
    lengths, width = (6400, 3000, 64 * 20 + 5), 101
    cfg = SpinConfig(sparsity=0.4, topk=256, gamma=0.1)
    idx, slots = _indexer(cfg, 3, width)
    n = torch.tensor([-(-L // T) for L in lengths])
    table = torch.arange(3 * width, dtype=torch.int32).view(3, width)
    for step in range(3):
        seq_lens, scores = _scores(lengths, 1, width, gen)
        idx.plan(table, seq_lens, slots)
        idx.run_from_scores(0, scores)
        plan = idx.block_plan
        if step == 0:  # no history anywhere: every block is scored
            assert torch.equal(plan.num_kept.long(), n)
        else:
            budget = torch.clamp(n - torch.floor(n * 0.4 + 1e-9).long(), min=-(-256 // T) + 1)
            assert torch.equal(plan.num_kept.long(), budget)
            assert plan.sparsity().tolist() == pytest.approx((1 - budget / n).tolist())
        assert plan.keep_mask[torch.arange(3), n - 1].all()  # newest block
        assert not plan.keep_mask[torch.arange(width)[None, :] >= n[:, None]].any()


def test_context_not_longer_than_k_selects_everything(gen):
    seq_lens, scores = _scores((500, 64), 1, 8, gen)
    idx, slots = _indexer(SpinConfig(sparsity=0.9, topk=512), 2, 8)
    for _ in range(2):
        idx.plan(torch.arange(16, dtype=torch.int32).view(2, 8), seq_lens, slots)
        out = idx.run_from_scores(0, scores)
        assert torch.equal(out, topk_ref(scores, seq_lens.view(-1), 512, sorted=False))
        assert idx.block_plan.sparsity().tolist() == [0.0, 0.0]


def test_stationary_concentrated_pattern_has_no_miss(gen):
    """Importance lives in a few persistent blocks: after one dense step, SPIN at 50% keeps them all."""
    width, k = 64, 256
    hot = [[3, 10, 11, 40], [0, 1, 20, 33]]
    cfg = SpinConfig(sparsity=0.5, topk=k)
    idx, slots = _indexer(cfg, 2, width)
    dense = DenseIndexer(k)
    for step in range(6):
        seq_lens, scores = _scores([4000 + step, 3500 + step], 1, width, gen, hot_blocks=hot)
        table = torch.arange(2 * width, dtype=torch.int32).view(2, width)
        idx.plan(table, seq_lens, slots)
        dense.plan(table, seq_lens)
        assert torch.equal(idx.run_from_scores(0, scores), dense.run_from_scores(0, scores))
        if step:
            assert (idx.block_plan.sparsity() > 0.45).all()


def test_update_touches_only_scored_slots_with_the_ema_rule(gen):
    """V: kept slots get the EMA rule, the rest keep their value; D: the same rule at offsets q - i inside
    the diagonal window, nothing else written; last_seen stamps the kept blocks with the clock."""
    width, alpha, window = 40, 0.5, 1000
    cfg = SpinConfig(vertical_grain="slot", sparsity=0.5, topk=64, alpha=alpha, exploration="staleness",
                     diagonal_window=window)
    idx, slots = _indexer(cfg, 1, width)
    table = torch.arange(width, dtype=torch.int32)[None]
    slot = int(slots[0])
    seq_lens, s0 = _scores([2500], 1, width, gen)
    idx.plan(table, seq_lens, slots)
    idx.run_from_scores(0, s0)
    v0 = vertical_of(idx, 0, table[0]).clone()
    d0 = idx.state.diagonal[0, slot, :window].float().clone()
    assert torch.equal(v0[:2500], s0[0, :2500].half().float())  # first observation is taken as is
    assert torch.isneginf(v0[2500:]).all()
    assert torch.equal(d0, s0[0, 2499 - torch.arange(window)].half().float())  # offset d <- position 2499 - d
    seq_lens, s1 = _scores([2501], 1, width, gen)
    idx.plan(table, seq_lens, slots)
    idx.run_from_scores(0, s1)
    kept = idx.block_plan.token_mask()[0] & (torch.arange(width * T) < 2501)
    assert 0 < kept.sum() < 2501
    v1 = vertical_of(idx, 0, table[0])
    assert torch.equal(v1[~kept], v0[~kept])
    expected = (alpha * s1[0] + (1 - alpha) * v0).half().float()
    expected[2500] = s1[0, 2500].half().float()  # new slot: no history
    assert torch.allclose(v1[kept], expected[kept], rtol=2e-3, atol=2e-3)
    d1 = idx.state.diagonal[0, slot, :window].float()
    offsets = 2500 - torch.arange(width * T)[kept]
    inside = offsets < window
    hit = torch.zeros(window, dtype=torch.bool)
    hit[offsets[inside]] = True
    assert torch.equal(d1[~hit], d0[~hit])  # offsets of skipped positions keep their value
    off, obs = offsets[inside], s1[0][kept][inside]
    assert torch.allclose(d1[off], (alpha * obs + (1 - alpha) * d0[off].nan_to_num(neginf=0.0))
                          .where(torch.isfinite(d0[off]), obs), rtol=2e-3, atol=2e-3)
    kept_blocks = idx.block_plan.keep_mask[0]
    seen = idx.state.last_seen[table[0].long(), 0]
    assert (seen[kept_blocks] == 2).all() and (seen[~kept_blocks] == 1).all()
    assert idx.state.vertical[1].isneginf().all() and idx.state.diagonal[1].isneginf().all()  # layer 1 saw nothing


def _mtp_step(mtp, num_accepted, gen, next_n=3):
    width = 30
    idx, slots = _indexer(SpinConfig(vertical_grain="slot", sparsity=0.3, topk=64, mtp=mtp), 1, width, next_n)
    seq_lens, scores = _scores([1500], next_n, width, gen)
    table = torch.arange(width, dtype=torch.int32)[None]
    idx.plan(table, seq_lens, slots, num_accepted=num_accepted)
    idx.run_from_scores(0, scores)
    return idx, scores, seq_lens, table


def test_mtp_row0_updates_from_row_zero_only(gen):
    idx, scores, seq_lens, table = _mtp_step("row0", None, gen)
    v = vertical_of(idx, 0, table[0])
    assert torch.equal(v[:1498], scores[0, :1498].half().float())  # row 0's scores, not rows 1-2
    assert torch.isneginf(v[1498:]).all()  # rows 1-2's own new tokens unseen


@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_mtp_row_local_prefix_valid_update(accepted, gen):
    idx, scores, seq_lens, table = _mtp_step("row-local", torch.tensor([accepted], dtype=torch.int32), gen)
    v = vertical_of(idx, 0, table[0], 1500)
    expected = scores[0, :1500].clone()
    for j in range(1, accepted + 1):  # later accepted rows fold in with the EMA rule, in order
        live = torch.arange(1500) < int(seq_lens[0, j])
        fresh = torch.isneginf(expected)
        expected = torch.where(live, torch.where(fresh, scores[j, :1500], 0.5 * scores[j, :1500] + 0.5 * expected),
                               expected)
    assert torch.equal(torch.isneginf(v), torch.isneginf(expected))
    assert torch.allclose(v, expected.half().float(), rtol=3e-3, atol=3e-3)
    assert torch.isneginf(v[1498 + accepted:]).all()


def _seen_before(idx, slot, seen_len):
    """As if the slot had planned a step of `seen_len` tokens and scored every block (no block enters)."""
    idx.state.seen_len[slot] = seen_len
    idx.state.block_max.fill_(0.0)


def test_mtp_row_local_keeps_the_union_of_row_predictions():
    """Each row reads the diagonal history at its own offsets: one hot offset (1000) points row 0 (query
    2023) at block 15 and row 1 (query 2024) at block 16. Budget 4 of 32 blocks: newest + 3 best."""
    width, next_n = 40, 2
    cfg = SpinConfig(sparsity=0.9, topk=64, exploration="none", combine="diagonal", mtp="row-local")
    idx, slots = _indexer(cfg, 1, width, next_n)
    _seen_before(idx, int(slots[0]), 2024)
    diag = torch.full((idx.state.window + 1,), -10.0)
    diag[1000] = 50.0
    idx.state.diagonal[0, int(slots[0])] = diag.half()
    seq_lens = torch.tensor([[2024, 2025]], dtype=torch.int32)  # queries 2023 -> pos 1023 (block 15), 2024 -> 1024 (16)
    idx.plan(torch.arange(width, dtype=torch.int32)[None], seq_lens, slots)
    idx.run_from_scores(0, torch.randn(next_n, width * T))
    keep = idx.block_plan.keep_mask[0]
    assert keep[15] and keep[16]
    row0 = SpinIndexer(dataclasses.replace(cfg, mtp="row0"), 1, 1, width, next_n)
    s0 = torch.tensor([row0.state.allocate()], dtype=torch.int32)
    _seen_before(row0, int(s0[0]), 2024)
    row0.state.diagonal[0, int(s0[0])] = diag.half()
    row0.plan(torch.arange(width, dtype=torch.int32)[None], seq_lens, s0)
    row0.run_from_scores(0, torch.randn(next_n, width * T))
    keep0 = row0.block_plan.keep_mask[0]
    assert keep0[15] and not keep0[16]
    assert keep0.nonzero().flatten().tolist() == [0, 1, 15, 31]  # ties among cold blocks go to low ids
    assert keep.nonzero().flatten().tolist() == [0, 1, 15, 16, 31]


def test_slot_reuse_starts_from_scratch(gen):
    width = 30
    idx, slots = _indexer(SpinConfig(sparsity=0.5, topk=64), 1, width)
    seq_lens, scores = _scores([1800], 1, width, gen)
    table = torch.arange(width, dtype=torch.int32)[None]
    for _ in range(2):
        idx.plan(table, seq_lens, slots)
        idx.run_from_scores(0, scores)
    assert idx.block_plan.sparsity().item() > 0
    idx.state.free(int(slots[0]))
    new = torch.tensor([idx.state.allocate()], dtype=torch.int32)
    assert new.item() == slots.item()
    idx.plan(table, seq_lens, new)
    idx.run_from_scores(0, scores)
    assert idx.block_plan.sparsity().item() == 0.0  # no history: every block scored again


def test_reused_physical_block_never_carries_the_previous_owners_history(gen):
    """Request A scores its blocks and ends; request B (another slot) is given the same physical blocks, in
    another order: B's first plan treats every one as never scored (all kept) and their V is reset before
    B's own scores land. Later, a decode block B grows into that A had scored is reset on entry too."""
    width = 30
    cfg = SpinConfig(vertical_grain="slot", sparsity=0.5, topk=64, exploration="none")
    idx = SpinIndexer(cfg, num_layers=2, max_batch=1, max_blocks=width, max_requests=2, num_cache_blocks=2 * width)
    a = torch.tensor([idx.state.allocate()], dtype=torch.int32)
    table_a = torch.arange(width, dtype=torch.int32)[None]
    seq_lens, scores = _scores([1800], 1, width, gen)
    for _ in range(2):
        idx.plan(table_a, seq_lens, a)
        for layer in range(2):
            idx.run_from_scores(layer, scores)
    assert idx.block_plan.sparsity().item() > 0 and torch.isfinite(idx.state.vertical[:, :29]).any()
    b = torch.tensor([idx.state.allocate()], dtype=torch.int32)
    assert b.item() != a.item()
    idx.state.free(int(a[0]))
    n_b = 20  # B: 20 of A's blocks, reversed, then fresh blocks; its newest (block 19) is A's block 10
    table_b = torch.cat([torch.arange(29, 9, -1), torch.arange(30, 40)]).to(torch.int32)[None]
    lens_b = torch.tensor([[n_b * T - 30]], dtype=torch.int32)
    idx.plan(table_b, lens_b, b)
    assert idx.plans(0).num_kept.item() == n_b and idx.plans(1).num_kept.item() == n_b  # never scored: all kept
    for layer in range(2):
        assert torch.isneginf(idx.state.vertical[layer, table_b[0, :n_b].long()]).all()
        assert torch.isneginf(idx.state.block_max[table_b[0, :n_b].long(), layer]).all()
    assert torch.isfinite(idx.state.vertical[0, :10]).any()  # blocks B does not hold are left alone
    _, sb = _scores([n_b * T - 30], 1, width, gen)
    idx.run_from_scores(0, sb)
    assert torch.equal(vertical_of(idx, 0, table_b[0], n_b * T - 30), sb[0, :n_b * T - 30].half().float())
    # B's next decode block (logical 20) is A's old physical block 5: reset when it enters
    table_b[0, n_b] = 5
    assert torch.isfinite(idx.state.vertical[0, 5]).all()
    idx.plan(table_b, torch.tensor([[n_b * T + 1]], dtype=torch.int32), b)
    assert torch.isneginf(idx.state.vertical[:, 5]).all() and torch.isneginf(idx.state.block_max[5]).all()
    assert idx.plans(0).keep_mask[0, n_b]


def _shared_prefix_run(share: bool, gen):
    """A and B start together; A alone then scores the prefix block 2 very low; B's next plan reads block 2.
    returns (the indexer, slots, B's keep mask at its last plan, B's diagonal before / after A's step)."""
    width, n = 24, 20
    length = n * T - 10
    cfg = SpinConfig(vertical_grain="slot", sparsity=0.5, topk=64, exploration="none", combine="vertical")
    idx = SpinIndexer(cfg, num_layers=1, max_batch=2, max_blocks=width, num_cache_blocks=64)
    slots = torch.tensor([idx.state.allocate(), idx.state.allocate()], dtype=torch.int32)
    table = torch.stack([torch.arange(width), torch.arange(width) + 32]).to(torch.int32)
    table[1, :4] = table[0, :4]  # B's first four logical blocks are A's physical blocks 0-3
    if not share:
        table[0, 2] = 30  # control: A holds a private copy of logical block 2
    seq_lens, scores = _scores([length, length], 1, width, gen)
    scores[1, :4 * T] = scores[0, :4 * T]  # the shared tokens score the same for both
    scores[:, 2 * T:3 * T] += 20.0  # block 2 is hot for both
    idx.plan(table, seq_lens, slots)
    idx.run_from_scores(0, scores)
    d_b = idx.state.diagonal[0, int(slots[1])].clone()
    d_a = idx.state.diagonal[0, int(slots[0])].clone()
    lens_a, s_a = _scores([length + 1], 1, width, gen)
    s_a[0, 2 * T:3 * T] = -1000.0  # A now finds block 2 worthless
    idx.plan(table[:1], lens_a, slots[:1])
    assert idx.plans(0).keep_mask[0, 2]  # A kept (and scored) it: it was hot
    idx.run_from_scores(0, s_a)
    assert not torch.equal(idx.state.diagonal[0, int(slots[0])], d_a)  # A's own window moved
    d_b_after = idx.state.diagonal[0, int(slots[1])].clone()
    idx.plan(table[1:], lens_a, slots[1:])
    return idx, slots, idx.plans(0).keep_mask[0].clone(), d_b, d_b_after, table


def test_shared_prefix_block_shares_vertical_history_not_diagonal(gen):
    """Two requests holding the same physical block share its vertical history by design: what A scored
    there is what B's prediction reads. Their diagonal windows stay their own."""
    idx, slots, keep_b, d_b, d_b_after, table = _shared_prefix_run(True, gen)
    assert not keep_b[2]  # B drops block 2: it reads A's -1000 although its own score there was +20
    assert idx.state.vertical[0, int(table[1, 2])].float().max() < -400  # 0.5 * -1000 + 0.5 * (~20)
    assert torch.equal(d_b_after, d_b)  # A's step wrote nothing into B's window
    _, _, keep_private, _, _, _ = _shared_prefix_run(False, gen)
    assert keep_private[2]  # control: with its own copy of the block, B still keeps it


def test_run_twice_in_one_step_raises(gen):
    x = make_case_inputs(ODD_SHAPES[2], gen)
    idx, slots = _indexer(SpinConfig(vertical_grain="slot", sparsity=0.5, topk=32), 2, x.block_table.shape[1], 2,
                          num_cache_blocks=x.kv_cache.shape[0])
    idx.plan(x.block_table, x.seq_lens, slots)
    first = idx.run(0, x.q_fp8, x.kv_cache, x.weights).clone()
    state = idx.state.vertical.clone()
    with pytest.raises(RuntimeError, match="layer 0 already ran"):
        idx.run(0, x.q_fp8, x.kv_cache, x.weights)
    with pytest.raises(RuntimeError, match="layer 0 already ran"):
        idx.run_from_scores(0, paged_indexer_logits_ref(*x.args()))
    assert torch.equal(idx.state.vertical, state)  # the refused run folded nothing into the history
    idx.run(1, x.q_fp8, x.kv_cache, x.weights)  # other layers still run
    idx.plan(x.block_table, x.seq_lens, slots)  # and a new step runs layer 0 again
    assert idx.run(0, x.q_fp8, x.kv_cache, x.weights).shape == first.shape


def _state_snapshot(st):
    """Every tensor of a SpinState and its host counters (slot pool, generations, epoch)."""
    snap = {name: t.clone() for name, t in vars(st).items() if isinstance(t, torch.Tensor)}
    snap["counters"] = (st.epoch, st.generations(), list(st._free), list(st._in_use))
    return snap


def _assert_same_state(st, before):
    after = _state_snapshot(st)
    assert after.keys() == before.keys()
    for name, t in after.items():
        assert (torch.equal(t, before[name]) if isinstance(t, torch.Tensor) else t == before[name]), name


@pytest.mark.parametrize("bad", ["lengths", "block-id", "free-slot", "dtype"])
def test_rejected_plan_leaves_run_unusable_and_state_unchanged(bad, gen):
    width = 20
    cfg = SpinConfig(sparsity=0.5, topk=64, exploration="block_age")
    idx, slots = _indexer(cfg, 2, width, num_cache_blocks=2 * width, max_requests=3)
    table = torch.arange(2 * width, dtype=torch.int32).view(2, width)
    seq_lens, scores = _scores([1000, 700], 1, width, gen)
    idx.plan(table, seq_lens, slots)
    idx.run_from_scores(0, scores)
    before = _state_snapshot(idx.state)
    lens2 = seq_lens + 1
    with pytest.raises((ValueError, TypeError)):
        if bad == "lengths":
            idx.plan(table, lens2 + width * T, slots)
        elif bad == "block-id":
            bad_table = table.clone()
            bad_table[1, 3] = 2 * width  # outside the cache
            idx.plan(bad_table, lens2, slots)
        elif bad == "free-slot":
            idx.plan(table, lens2, torch.tensor([0, 2], dtype=torch.int32))
        else:
            idx.plan(table.long(), lens2, slots)
    _assert_same_state(idx.state, before)
    with pytest.raises(RuntimeError, match="plan"):
        idx.run_from_scores(1, scores)  # the previous step is not runnable any more
    with pytest.raises(RuntimeError, match="plan"):
        idx.run(1, torch.zeros(2, 1, 8, 32).to(torch.float8_e4m3fn), torch.zeros(1, T, 1, 36, dtype=torch.uint8),
                torch.zeros(2, 8))


def test_guard_scores_every_block_and_keeps_no_history(gen):
    """dense_below above a request's context (longer than K): every block kept, BlockPlan.guarded, no history
    written for it, step after step. A longer request in the same batch runs SPIN as usual."""
    width, k = 80, 64
    cfg = SpinConfig(vertical_grain="slot", sparsity=0.5, topk=k, dense_below=3000)
    idx, slots = _indexer(cfg, 2, width)
    table = torch.arange(2 * width, dtype=torch.int32).view(2, width)
    n = [-(-2000 // T), -(-5000 // T)]
    for step in range(3):
        seq_lens, scores = _scores([2000 + step, 5000 + step], 1, width, gen)
        idx.plan(table, seq_lens, slots)
        for layer in range(2):
            out = idx.run_from_scores(layer, scores)
            plan = idx.plans(layer)
            assert plan.guarded.tolist() == [True, False]
            assert plan.num_kept[0].item() == n[0] and plan.sparsity()[0].item() == 0.0
            if step:
                assert plan.num_kept[1].item() < n[1]  # the long request is sparse once it has history
            mask = plan.token_mask()
            assert torch.equal(out, topk_ref(torch.where(mask, scores, float("-inf")), seq_lens.view(-1), k, sorted=False))
            assert torch.equal(out[0], topk_ref(scores[:1], seq_lens[0], k, sorted=False)[0])  # request 0: dense
    guarded_blocks = table[0, :n[0] + 1].long()
    assert torch.isneginf(idx.state.vertical[:, guarded_blocks]).all()
    assert torch.isneginf(idx.state.block_max[guarded_blocks]).all()
    assert torch.isneginf(idx.state.diagonal[:, int(slots[0]), :-1]).all()  # (the last offset is trash)
    assert torch.isfinite(idx.state.vertical[:, table[1, :n[1]].long()]).any()  # request 1 keeps history
    everything = SpinConfig(vertical_grain="slot", sparsity=0.5, topk=k, dense_below=10**6)
    idx, slots = _indexer(everything, 2, width)
    for _ in range(2):
        seq_lens, scores = _scores([2000, 5000], 1, width, gen)
        idx.plan(table, seq_lens, slots)
        idx.run_from_scores(0, scores)
        assert idx.plans(0).guarded.all() and idx.plans(0).num_kept.tolist() == n
    assert torch.isneginf(idx.state.vertical[:, :-1]).all() and torch.isneginf(idx.state.diagonal[..., :-1]).all()


def test_state_memory_follows_the_cache_not_the_context():
    """For a given cache (num_cache_blocks) the state does not grow with the longest context (max_blocks)
    once that exceeds the diagonal window."""
    cfg = SpinConfig(diagonal_window=2048)
    sizes = [SpinIndexer(cfg, 2, max_batch=4, max_blocks=w, num_cache_blocks=256).state.nbytes()
             for w in (32, 256, 4096)]
    assert sizes[0] == sizes[1] == sizes[2]
    bigger = SpinIndexer(cfg, 2, max_batch=4, max_blocks=32, num_cache_blocks=512).state.nbytes()
    assert bigger > sizes[0]


def test_same_seed_same_plan_other_seed_other_exploration(gen):
    width = 80
    seq_lens, scores = _scores([5000], 1, width, gen)
    table = torch.arange(width, dtype=torch.int32)[None]
    masks = []
    for seed in (1, 1, 2):
        idx, slots = _indexer(SpinConfig(sparsity=0.5, topk=64, gamma=0.2, seed=seed), 1, width)
        for _ in range(3):
            idx.plan(table, seq_lens, slots)
            idx.run_from_scores(0, scores)
        masks.append(idx.block_plan.keep_mask.clone())
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])


def test_empty_batch(gen):
    idx = SpinIndexer(SpinConfig(topk=8), num_layers=2, max_batch=2, max_blocks=4, next_n=2)
    idx.plan(torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int32),
             torch.zeros(0, dtype=torch.int32))
    assert idx.run_from_scores(0, torch.zeros(0, 4 * T)).shape == (0, 8)
    q = torch.zeros(0, 2, 8, 32).to(torch.float8_e4m3fn)
    assert idx.run(1, q, torch.zeros(2, T, 1, 36, dtype=torch.uint8), torch.zeros(0, 8)).shape == (0, 8)


def test_misuse_raises_with_the_argument_named(gen):
    with pytest.raises(TypeError, match="overlap_update: expected a bool, got str"):
        SpinIndexer(SpinConfig(topk=8), num_layers=1, max_batch=2, max_blocks=4, overlap_update="yes")
    idx, slots = _indexer(SpinConfig(topk=8), 2, 4, next_n=2)
    table = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.tensor([[99, 100], [9, 10]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="plan"):
        idx.run_from_scores(0, torch.zeros(4, 256))
    with pytest.raises(TypeError, match="block_table: expected dtype torch.int32"):
        idx.plan(table.long(), lens, slots)
    with pytest.raises(ValueError, match=r"seq_lens: expected shape \[B, next_n\] = \[2, 2\]"):
        idx.plan(table, lens[:, :1], slots)
    with pytest.raises(ValueError, match="W"):
        idx.plan(torch.zeros(2, 5, dtype=torch.int32), lens, slots)
    with pytest.raises(ValueError, match="B"):
        idx.plan(torch.zeros(3, 4, dtype=torch.int32), torch.ones(3, 2, dtype=torch.int32), torch.arange(3))
    with pytest.raises(ValueError, match="seq_lens"):
        idx.plan(table, lens + 300, slots)
    with pytest.raises(ValueError, match="row-to-row"):
        idx.plan(table, lens.flip(1), slots)
    with pytest.raises(ValueError, match="distinct"):
        idx.plan(table, lens, torch.tensor([0, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table"):
        idx.plan(table + idx.state.num_cache_blocks, lens, slots)
    idx.state.free(1)
    with pytest.raises(ValueError, match="free slots"):
        idx.plan(table, lens, slots)
    idx.state.allocate()
    with pytest.raises(ValueError, match="num_accepted"):
        idx.plan(table, lens, slots, num_accepted=torch.tensor([0, 2], dtype=torch.int32))
    idx.plan(table, lens, slots)
    with pytest.raises(ValueError, match="layer"):
        idx.run_from_scores(2, torch.zeros(4, 256))
    with pytest.raises(ValueError, match=r"scores: expected shape \[B\*next_n, W\*T\]"):
        idx.run_from_scores(0, torch.zeros(2, 256))
    q = torch.zeros(2, 1, 8, 32).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"q_fp8: expected shape"):
        idx.run(0, q, torch.zeros(1, 64, 1, 36, dtype=torch.uint8), torch.zeros(2, 8))
    q = torch.zeros(2, 2, 8, 32).to(torch.float8_e4m3fn)
    too_many = idx.state.num_cache_blocks + 1
    with pytest.raises(ValueError, match="kv_cache: expected at most num_cache_blocks"):
        idx.run(0, q, torch.zeros(too_many, 64, 1, 36, dtype=torch.uint8), torch.zeros(4, 8))
    with pytest.raises(TypeError, match="config"):
        SpinIndexer({"sparsity": 0.3}, 1, 1, 1)


def test_a0_keeps_every_block_holding_a_selected_slot(gen):
    """A0's block count is indirect: top m*T slots spread over more than m blocks are all kept."""
    width = 64
    seq_lens, scores = _scores([4000], 1, width, gen)
    table = torch.arange(width, dtype=torch.int32)[None]
    kept = {}
    for pooling in ("a1", "a0"):
        idx, slots = _indexer(SpinConfig(sparsity=0.5, topk=64, pooling=pooling, exploration="none"), 1, width)
        for _ in range(2):
            idx.plan(table, seq_lens, slots)
            idx.run_from_scores(0, scores)
        kept[pooling] = idx.block_plan
    n = -(-4000 // T)
    m = n - int(n * 0.5)
    assert kept["a1"].num_kept.item() == m
    # random scores: the best half of the slots touch nearly every block
    assert kept["a0"].num_kept.item() > kept["a1"].num_kept.item()
    # Step 2 predicts each slot from step 1's scores (V and D both hold them): the kept blocks are exactly
    # those holding one of the m*T best predictions (ties at the threshold included), plus the newest.
    pred = scores[0, :4000].half().float()
    threshold = pred.sort(descending=True).values[m * T - 1]
    holds = torch.zeros(width, dtype=torch.bool)
    holds[:n] = torch.nn.functional.pad(pred >= threshold, (0, n * T - 4000)).view(n, T).any(dim=1)
    holds[n - 1] = True
    assert torch.equal(kept["a0"].keep_mask[0], holds)


@pytest.mark.parametrize("case", [c for c in ODD_SHAPES if c.batch > 0][:4], ids=ODD_IDS[:4])
def test_replay_path_matches_paged_path_and_state(case, gen):
    """run_from_scores (CPU: compact columns cut at the most kept blocks) and run (paged kernel, full W*T
    compact width, EMA folded into the logits op) give the same top-k and leave the same V/block max/D/
    last_seen state, step after step."""
    x = make_case_inputs(case, gen)
    aged = ODD_SHAPES.index(case) % 2 == 1  # every other case explores by block age (keeps last_seen)
    cfg = SpinConfig(vertical_grain="slot", sparsity=0.5, topk=case.k, exploration="block_age" if aged else "random")
    width = x.block_table.shape[1]
    blocks = x.kv_cache.shape[0]
    paged, slots = _indexer(cfg, case.batch, width, case.next_n, num_cache_blocks=blocks)
    replayed, _ = _indexer(cfg, case.batch, width, case.next_n, num_cache_blocks=blocks)
    scores = paged_indexer_logits_ref(*x.args())
    for _ in range(4):
        for idx in (paged, replayed):
            idx.plan(x.block_table, x.seq_lens, slots)
        for layer in range(2):
            assert torch.equal(paged.run(layer, x.q_fp8, x.kv_cache, x.weights),
                               replayed.run_from_scores(layer, scores))
    assert (paged.state.last_seen is not None) == aged
    assert torch.isfinite(paged.state.vertical[:, :-1]).any()
    # the trash block (last row) and each slot's trash offset (last column) are never read
    for name in ("vertical", "block_max", "last_seen"):
        if getattr(paged.state, name) is not None:
            assert torch.equal(getattr(paged.state, name)[..., :-1, :] if name == "vertical" else
                               getattr(paged.state, name)[:-1], getattr(replayed.state, name)[..., :-1, :]
                               if name == "vertical" else getattr(replayed.state, name)[:-1]), name
    assert torch.equal(paged.state.diagonal[..., :-1], replayed.state.diagonal[..., :-1])


def _paged_step(gen, cfg=None, **kw):
    """A two-request step on a random paged cache: (inputs, indexer, slots), planned."""
    x = make_case_inputs(ODD_SHAPES[2], gen)
    idx, slots = _indexer(cfg or SpinConfig(sparsity=0.5, topk=32, exploration="block_age"), 2,
                          x.block_table.shape[1], 2, num_cache_blocks=x.kv_cache.shape[0], max_requests=3, **kw)
    idx.plan(x.block_table, x.seq_lens, slots)
    return x, idx, slots


def _used_max(x):
    used = (x.seq_lens.amax(dim=1).long() + T - 1) // T
    return max(int(x.block_table[b, :int(n)].max()) for b, n in enumerate(used))


def test_run_checks_used_block_ids_against_the_kv_cache_when_the_plan_validated(gen):
    x, idx, slots = _paged_step(gen)
    small = x.kv_cache[:_used_max(x)].contiguous()  # one block short of the largest used id
    before = _state_snapshot(idx.state)
    with pytest.raises(ValueError, match=r"block_table: expected block ids of used blocks in \[0, "):
        idx.run(0, x.q_fp8, small, x.weights)
    _assert_same_state(idx.state, before)
    idx.run(0, x.q_fp8, x.kv_cache, x.weights)  # the rejected run did not use up the layer
    idx.plan(x.block_table, x.seq_lens, slots, validate=False)  # unchecked: no host int to compare against
    idx.run(0, x.q_fp8, small, x.weights)  # (the kernels clamp; correctness is the caller's)


def test_run_checks_the_kv_cache_tokens_per_block(gen):
    x, idx, slots = _paged_step(gen)
    half = x.kv_cache.view(-1, 32, 1, x.kv_cache.shape[3])[: x.kv_cache.shape[0]]
    with pytest.raises(ValueError, match="kv_cache: expected T = SpinConfig.tokens_per_block = 64"):
        idx.run(0, x.q_fp8, half, x.weights)


def test_a_rejected_run_changes_no_state_and_leaves_the_layer_runnable(gen):
    x, idx, slots = _paged_step(gen)
    before = _state_snapshot(idx.state)
    with pytest.raises(ValueError, match="weights"):
        idx.run(0, x.q_fp8, x.kv_cache, x.weights[:1])
    with pytest.raises(TypeError, match="weights"):
        idx.run(0, x.q_fp8, x.kv_cache, x.weights.double())
    _assert_same_state(idx.state, before)
    idx.run(0, x.q_fp8, x.kv_cache, x.weights)


@pytest.mark.parametrize("change", ["free-and-reallocate", "free"])
def test_a_slot_that_changed_owner_after_plan_is_refused(change, gen):
    """Freeing (and re-allocating) a slot between plan() and run() must not hand the old request's plan and
    history update to the new owner: run() and run_from_scores() raise naming slot_ids, and change nothing."""
    x, idx, slots = _paged_step(gen)
    idx.run(0, x.q_fp8, x.kv_cache, x.weights)
    victim = int(slots[1])
    idx.state.free(victim)
    if change == "free-and-reallocate":
        assert idx.state.allocate() == victim  # a new request, same slot
    before = _state_snapshot(idx.state)
    with pytest.raises(RuntimeError, match=rf"slot_ids: slots \[{victim}\] were freed or re-allocated"):
        idx.run(1, x.q_fp8, x.kv_cache, x.weights)
    with pytest.raises(RuntimeError, match="slot_ids"):
        idx.run_from_scores(1, paged_indexer_logits_ref(*x.args()))
    _assert_same_state(idx.state, before)
    if change == "free":
        idx.state.allocate()
    idx.plan(x.block_table, x.seq_lens, slots)  # a new plan adopts the new owner
    idx.run(1, x.q_fp8, x.kv_cache, x.weights)


def test_other_slots_may_change_owner_mid_step(gen):
    x, idx, slots = _paged_step(gen)
    idx.run(0, x.q_fp8, x.kv_cache, x.weights)
    spare = idx.state.allocate()  # the third slot, not in this step
    idx.state.free(spare)
    idx.run(1, x.q_fp8, x.kv_cache, x.weights)


@pytest.mark.parametrize("cfg", [SpinConfig(sparsity=0.5, topk=32, exploration="block_age"),
                                 SpinConfig(sparsity=0.5, topk=32, hybrid=0.5)], ids=["spin", "hybrid"])
def test_requires_grad_inputs_never_attach_a_graph_to_the_state(cfg, gen):
    x, idx, slots = _paged_step(gen, cfg)
    weights = x.weights.clone().requires_grad_()
    for step in range(2):
        for layer in range(2):
            out = idx.run(layer, x.q_fp8, x.kv_cache, weights)
            assert not out.requires_grad
        scores = paged_indexer_logits_ref(*x.args()).requires_grad_()
        idx.plan(x.block_table, x.seq_lens, slots)
        idx.run_from_scores(0, scores)
        idx.plan(x.block_table, x.seq_lens, slots)
    for name, t in vars(idx.state).items():
        if isinstance(t, torch.Tensor):
            assert not t.requires_grad and t.grad_fn is None, name
    for name, t in vars(idx.workspace).items():
        if isinstance(t, torch.Tensor):
            assert not t.requires_grad and t.grad_fn is None, name


@pytest.mark.parametrize("next_n,pad,triton_logits", [
    pytest.param(1, 192, False, id="1-192-reference"), pytest.param(2, 256, False, id="2-256-reference"),
    cuda_only(1, 192, True, id="1-192-triton-logits", why="12 interpreted logits launches, ~12 s; 2-256 runs the "
              "kernel on padded pages here (tests/ops/test_padded_cache.py both strides)"),
    pytest.param(2, 256, True, id="2-256-triton-logits")])
def test_step_on_padded_pages_equals_the_contiguous_copy(next_n, pad, triton_logits, gen, monkeypatch, request):
    """SpinIndexer.run on V4's padded pages (8640 / 8704 B for 8448) gives the top-k and the history of the
    same step on the contiguous cache, step after step at s = 0.5. triton-logits: the logits (and their fused
    history update) come from the Triton kernel: on CUDA the whole step runs there (both caches through the
    Triton logits backend, so the two runs round alike), else the kernel alone runs in the interpreter."""
    from conftest import make_paged_inputs
    from spin_indexer import ops
    dev = "cpu"
    if triton_logits:
        dev = request.getfixturevalue("triton_device")
        if dev == "cuda":
            monkeypatch.setenv("SPIN_INDEXER_LOGITS", "triton")  # DeepGEMM takes contiguous pages only
        else:
            from spin_indexer.ops import indexer_logits_triton
            real = ops._triton_twin

            def twin(module, name, t):  # CPU tensors take the reference: only the logits kernel, interpreted
                if name == "paged_indexer_logits_triton":
                    return indexer_logits_triton.paged_indexer_logits_triton
                return real(module, name, t)
            monkeypatch.setattr(ops, "_triton_twin", twin)
    x = make_paged_inputs((10 * T + 5, 6 * T, 2 * T + 1), next_n, 64, 128, gen, garbage=False).to(dev)
    from conftest import padded  # V4's layout, the padding poisoned with 0xFF (NaN key and scale)
    kv = padded(x.kv_cache, pad)
    cfg = SpinConfig(vertical_grain="slot", sparsity=0.5, topk=256)
    width = x.block_table.shape[1]
    pair = [_indexer(cfg, 3, width, next_n, num_cache_blocks=x.kv_cache.shape[0], device=dev) for _ in range(2)]
    for step in range(3):
        w = torch.randn(x.weights.shape, generator=gen).to(dev)  # the query side moves every step
        outs = []
        for (idx, slots), cache in zip(pair, (x.kv_cache, kv)):
            idx.plan(x.block_table, x.seq_lens, slots.to(dev))
            outs.append([idx.run(layer, x.q_fp8, cache, w) for layer in range(2)])
        assert all(torch.equal(a, b) for a, b in zip(*outs)), step
        assert torch.equal(pair[0][0].block_plan.keep_mask, pair[1][0].block_plan.keep_mask)
    assert torch.equal(pair[0][0].state.vertical, pair[1][0].state.vertical)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the side stream)")
@pytest.mark.parametrize("backend", ["deepgemm", "triton", "cuda"])
@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("in_topk_blocks,grain", [(1 << 20, "slot"), (0, "slot"), (1 << 20, "block"), (0, "block")],
                         ids=["in-topk", "side-stream", "block-grain-in-topk", "block-grain"])
def test_update_overlapped_with_the_topk_equals_the_update_in_series(backend, next_n, graph, in_topk_blocks, grain,
                                                                     gen, monkeypatch):
    """overlap_update=True (up to UPDATE_IN_TOPK_BLOCKS table blocks the update's programs in the top-k's
    threshold launch; else the update pass on a low-priority stream, the top-k on a high-priority one with, on
    DeepGEMM and the CUDA kernel, the maxima pass; off: the update in series, fused into the Triton kernel's
    epilogue or into the maxima pass) leaves the same history and returns the
    same top-k as overlap_update=False, over three steps of three layers, also when the whole step (plan +
    every layer) is captured in one CUDA graph and replayed (the forks and joins are recorded). Block grain: the
    O(blocks) update from the block maxima in the threshold launch or on the side stream, against it in series."""
    from spin_indexer.ops import deepgemm, indexer_logits_cuda
    if backend == "deepgemm" and (not deepgemm.available() or next_n > 2):
        pytest.skip("needs deep_gemm (next_n 1-2)")
    if backend == "cuda" and (torch.cuda.get_device_capability() != (9, 0) or indexer_logits_cuda.load_library() is None):
        pytest.skip("needs SM90 and the CUDA logits library (nvcc)")
    monkeypatch.setenv("SPIN_INDEXER_LOGITS", backend)
    from spin_indexer.indexer import spin
    monkeypatch.setattr(spin, "UPDATE_IN_TOPK_BLOCKS", in_topk_blocks)
    monkeypatch.setattr(spin, "BLOCK_GRAIN_IN_TOPK", in_topk_blocks > 0)
    x = make_paged_inputs([64 * 90 + 17, 64 * 70, 64 * 33 + 5, 64 * 120], next_n, 64, 128, gen).to("cuda")
    batch, width = x.block_table.shape
    layers, k = 3, 96
    runs = {}
    for overlap in (False, True):
        cfg = SpinConfig(sparsity=0.5, topk=k, vertical_grain=grain)
        idx = SpinIndexer(cfg, num_layers=layers, max_batch=batch, max_blocks=width,
                          next_n=next_n, device="cuda", num_cache_blocks=x.kv_cache.shape[0], overlap_update=overlap)
        assert (idx._update_stream is not None) == overlap
        slots = torch.tensor([idx.state.allocate() for _ in range(batch)], device="cuda")
        outs = []

        def step():
            idx.plan(x.block_table, x.seq_lens, slots, validate=False)
            return [idx.run(i, x.q_fp8, x.kv_cache, x.weights) for i in range(layers)]

        if graph and overlap:
            # warm-up on a throwaway indexer: compiles every kernel outside the capture, leaves idx fresh
            warm = SpinIndexer(cfg, num_layers=layers, max_batch=batch,
                               max_blocks=width, next_n=next_n, device="cuda", num_cache_blocks=x.kv_cache.shape[0])
            wslots = torch.tensor([warm.state.allocate() for _ in range(batch)], device="cuda")
            warm.plan(x.block_table, x.seq_lens, wslots, validate=False)
            for i in range(layers):
                warm.run(i, x.q_fp8, x.kv_cache, x.weights)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                captured = step()
            for _ in range(3):
                g.replay()
                outs.append(torch.stack(captured).clone())
        else:
            for _ in range(3):
                outs.append(torch.stack(step()).clone())
        torch.cuda.synchronize()
        runs[overlap] = (outs, idx.state)
    (serial, s0), (overlapped, s1) = runs[False], runs[True]
    for a, b in zip(serial, overlapped):
        assert torch.equal(a, b)
    assert (s0.vertical is None and s1.vertical is None) or torch.equal(s0.vertical, s1.vertical)
    assert torch.equal(s0.block_max, s1.block_max)
    assert torch.equal(s0.diagonal, s1.diagonal)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton top-k reads the hint)")
def test_tau_hint_gives_the_same_steps_and_keeps_a_key_per_layer_and_row(gen):
    """SpinIndexer(tau_hint=True): three steps of three layers return the top-k of tau_hint=False, the
    history ends equal, and every long row's hint holds a 16-bit key afterwards."""
    x = make_paged_inputs([64 * 90 + 17, 64 * 70, 64 * 120], 1, 64, 128, gen).to("cuda")
    batch, width = x.block_table.shape
    layers, k = 3, 96
    runs = []
    for hint in (False, True):
        idx = SpinIndexer(SpinConfig(sparsity=0.5, topk=k), num_layers=layers, max_batch=batch, max_blocks=width,
                          device="cuda", num_cache_blocks=x.kv_cache.shape[0], tau_hint=hint)
        slots = torch.tensor([idx.state.allocate() for _ in range(batch)], device="cuda")
        outs = []
        for _ in range(3):
            idx.plan(x.block_table, x.seq_lens, slots)
            outs.append(torch.stack([idx.run(i, x.q_fp8, x.kv_cache, x.weights) for i in range(layers)]).clone())
        runs.append((outs, idx))
    (a, i0), (b, i1) = runs
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert torch.equal(i0.state.vertical, i1.state.vertical)
    assert bool((i0.workspace.tau_hint == 0).all())
    assert bool((i1.workspace.tau_hint[:, :batch] > 0).all())


@pytest.mark.parametrize("sms,summary", [(0, False), (4, False), (0, True)])
def test_workspace_bytes_needed_is_what_it_allocates(sms, summary):
    from spin_indexer.indexer.workspace import Workspace
    args = (3, 5, 7, 2, 64, 16)
    assert (Workspace(*args, torch.device("cpu"), sms, summary).nbytes()
            == Workspace.bytes_needed(*args, sms, summary))


@pytest.mark.parametrize("next_n", [1, 2])
def test_a_table_narrower_than_max_blocks_runs_as_a_full_width_one(next_n, gen):
    """W < max_blocks (a step's table narrower than the workspace, what the docstring allows): the workspace's
    logits, block maxima and group maxima are handed out as packed [rows, cols] views (Workspace.packed), so run()
    returns what an indexer sized exactly for the table returns, step after step (it once refused the strided
    [:rows, :cols] slice of its own logits buffer)."""
    from conftest import make_paged_inputs
    x = make_paged_inputs((20 * T + 5, 13 * T, 3 * T + 1), next_n, 4, 32, gen, extra_width=1)
    cfg = SpinConfig(sparsity=0.4, topk=64)
    width = x.block_table.shape[1]
    exact, wide = (SpinIndexer(cfg, num_layers=2, max_batch=4, max_blocks=w, next_n=next_n,
                               num_cache_blocks=x.kv_cache.shape[0], topk_sorted=True) for w in (width, width + 5))
    slots = [torch.tensor([i.state.allocate() for _ in range(3)], dtype=torch.int32) for i in (exact, wide)]
    for step in range(3):
        w = x.weights * (1.0 + 0.3 * step)
        for idx, s in zip((exact, wide), slots):
            idx.plan(x.block_table, x.seq_lens, s)
        for layer in range(2):
            assert torch.equal(exact.run(layer, x.q_fp8, x.kv_cache, w), wide.run(layer, x.q_fp8, x.kv_cache, w))


@pytest.mark.parametrize("next_n", [1, 2])
def test_lengths_past_the_table_read_as_the_table(next_n, gen):
    """plan(validate=False) with rows longer than W x T (request 1 by 2 blocks and 7 tokens): every step, the
    top-k, the plans and the history equal those of the same steps with the lengths capped at W x T, for SPIN
    (s = 0.5, history and all) and the dense indexer; the table is a view of a wider one whose extra columns
    hold that request's next used blocks, so a read past a row would change them."""
    x = make_paged_inputs((5 * T, 8 * T + 7), next_n, 8, 32, gen, extra_width=0)
    view = x.block_table[:, :6]
    capped = x.seq_lens.clamp(max=6 * T)
    cfg = SpinConfig(vertical_grain="slot", sparsity=0.5, topk=96, dense_below=0)
    pair = [_indexer(cfg, 2, 6, next_n, num_cache_blocks=x.kv_cache.shape[0]) for _ in range(2)]
    dense = [DenseIndexer(96, next_n=next_n) for _ in range(2)]
    for step in range(3):
        w = torch.randn(x.weights.shape, generator=gen)
        outs = []
        for (idx, slots), dix, lens in zip(pair, dense, (x.seq_lens, capped)):
            table = view if lens is x.seq_lens else view.contiguous()
            idx.plan(table, lens, slots, validate=lens is capped)
            dix.plan(table, lens, validate=lens is capped)
            outs.append([idx.run(layer, x.q_fp8, x.kv_cache, w) for layer in range(2)]
                        + [dix.run(0, x.q_fp8, x.kv_cache, w), idx.block_plan.keep_mask])
        assert all(torch.equal(a, b) for a, b in zip(*outs)), step
    assert torch.equal(pair[0][0].state.vertical, pair[1][0].state.vertical)
    assert torch.equal(pair[0][0].state.diagonal, pair[1][0].state.diagonal)
    assert torch.equal(pair[0][0].state.seen_len, pair[1][0].state.seen_len)
