"""SpinIndexer end to end on the CPU reference ops: s = 0 is dense, budgets hold, remapping is right,
the update touches only scored slots, MTP row policies, slot reuse, and every misuse error."""
import dataclasses

import pytest
import torch

from conftest import ODD_IDS, ODD_SHAPES, make_case_inputs, row_lengths
from spin_indexer.indexer import DenseIndexer, SpinIndexer
from spin_indexer.ops import paged_indexer_logits_ref, topk_ref
from spin_indexer.predictor import SpinConfig

T = 64


def _indexer(cfg, batch, width, next_n=1, layers=2):
    idx = SpinIndexer(cfg, num_layers=layers, max_batch=max(batch, 1), max_blocks=max(width, 1), next_n=next_n)
    slots = torch.tensor([idx.state.allocate() for _ in range(batch)], dtype=torch.int32)
    return idx, slots


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


@pytest.mark.parametrize("case", ODD_SHAPES, ids=ODD_IDS)
def test_sparsity_zero_equals_dense_reference(case, gen):
    x = make_case_inputs(case, gen)
    idx, slots = _indexer(SpinConfig(sparsity=0.0, topk=case.k), case.batch, x.block_table.shape[1], case.next_n)
    expected = topk_ref(paged_indexer_logits_ref(*x.args()), x.seq_lens.view(-1), case.k)
    for _ in range(3):  # later steps run with history, exploration and all
        idx.plan(x.block_table, x.seq_lens, slots)
        for layer in range(2):
            assert torch.equal(idx.run(layer, x.q_fp8, x.kv_cache, x.weights), expected)


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
        expected = topk_ref(torch.where(mask, scores, float("-inf")), seq_lens.view(-1), k)
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
    for step in range(3):
        seq_lens, scores = _scores(lengths, 1, width, gen)
        idx.plan(torch.zeros(3, width, dtype=torch.int32), seq_lens, slots)
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
        idx.plan(torch.zeros(2, 8, dtype=torch.int32), seq_lens, slots)
        out = idx.run_from_scores(0, scores)
        assert torch.equal(out, topk_ref(scores, seq_lens.view(-1), 512))
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
    width, alpha = 40, 0.5
    idx, slots = _indexer(SpinConfig(sparsity=0.5, topk=64, alpha=alpha), 1, width)
    table = torch.arange(width, dtype=torch.int32)[None]
    seq_lens, s0 = _scores([2500], 1, width, gen)
    idx.plan(table, seq_lens, slots)
    idx.run_from_scores(0, s0)
    v0 = idx.state.vertical[0, 0, :width * T].float().clone()
    d0 = idx.state.diagonal[0, 0, :width * T].float().clone()
    assert torch.allclose(v0[:2500], s0[0, :2500].half().float())  # first observation is taken as is
    seq_lens, s1 = _scores([2501], 1, width, gen)
    idx.plan(table, seq_lens, slots)
    idx.run_from_scores(0, s1)
    kept = idx.block_plan.token_mask()[0] & (torch.arange(width * T) < 2501)
    v1 = idx.state.vertical[0, 0, :width * T].float()
    assert torch.equal(v1[~kept], v0[~kept])
    expected = (alpha * s1[0] + (1 - alpha) * v0).half().float()
    expected[2500] = s1[0, 2500].half().float()  # new slot: no history
    assert torch.allclose(v1[kept], expected[kept], rtol=2e-3, atol=2e-3)
    d1 = idx.state.diagonal[0, 0, :width * T].float()
    offsets = 2500 - torch.arange(width * T)[kept]
    assert torch.allclose(d1[offsets], (alpha * s1[0][kept] + (1 - alpha) * d0[offsets].nan_to_num(neginf=0.0))
                          .where(torch.isfinite(d0[offsets]), s1[0][kept]), rtol=2e-3, atol=2e-3)
    assert (idx.state.last_seen[0, 0, :width][idx.block_plan.keep_mask[0]] == 2).all()
    assert idx.state.vertical[1].isneginf().all()  # the other layer saw nothing


def _mtp_step(mtp, num_accepted, gen, next_n=3):
    width = 30
    idx, slots = _indexer(SpinConfig(sparsity=0.3, topk=64, mtp=mtp), 1, width, next_n)
    seq_lens, scores = _scores([1500], next_n, width, gen)
    idx.plan(torch.arange(width, dtype=torch.int32)[None], seq_lens, slots, num_accepted=num_accepted)
    idx.run_from_scores(0, scores)
    return idx, scores, seq_lens


def test_mtp_row0_updates_from_row_zero_only(gen):
    idx, scores, seq_lens = _mtp_step("row0", None, gen)
    v = idx.state.vertical[0, 0, :1500].float()
    assert torch.allclose(v, scores[0, :1500].half().float())  # row 0's scores, not rows 1-2
    assert torch.isneginf(idx.state.vertical[0, 0, 1500:1502]).all()  # rows 1-2's own new tokens unseen


@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_mtp_row_local_prefix_valid_update(accepted, gen):
    idx, scores, seq_lens = _mtp_step("row-local", torch.tensor([accepted], dtype=torch.int32), gen)
    v = idx.state.vertical[0, 0, :1502].float()
    expected = scores[0, :1502].clone()
    for j in range(1, accepted + 1):  # later accepted rows fold in with the EMA rule, in order
        live = torch.arange(1502) < int(seq_lens[0, j])
        fresh = torch.isneginf(expected)
        expected = torch.where(live, torch.where(fresh, scores[j, :1502], 0.5 * scores[j, :1502] + 0.5 * expected),
                               expected)
    assert torch.equal(torch.isneginf(v), torch.isneginf(expected))
    assert torch.allclose(v, expected.half().float(), rtol=3e-3, atol=3e-3)
    assert torch.isneginf(v[1500 + accepted:]).all()


def test_mtp_row_local_keeps_the_union_of_row_predictions():
    """Each row reads the diagonal history at its own offsets: one hot offset (1000) points row 0 (query
    2023) at block 15 and row 1 (query 2024) at block 16. Budget 4 of 32 blocks: newest + 3 best."""
    width, next_n = 40, 2
    cfg = SpinConfig(sparsity=0.9, topk=64, exploration="none", combine="diagonal", mtp="row-local")
    idx, slots = _indexer(cfg, 1, width, next_n)
    idx.state.last_seen.fill_(0)
    diag = torch.full((width * T + 1,), -10.0)
    diag[1000] = 50.0
    idx.state.diagonal[0, 0] = diag.half()
    seq_lens = torch.tensor([[2024, 2025]], dtype=torch.int32)  # queries 2023 -> pos 1023 (block 15), 2024 -> 1024 (16)
    idx.plan(torch.arange(width, dtype=torch.int32)[None], seq_lens, slots)
    idx.run_from_scores(0, torch.randn(next_n, width * T))
    keep = idx.block_plan.keep_mask[0]
    assert keep[15] and keep[16]
    row0 = SpinIndexer(dataclasses.replace(cfg, mtp="row0"), 1, 1, width, next_n)
    s0 = torch.tensor([row0.state.allocate()], dtype=torch.int32)
    row0.state.last_seen.fill_(0)
    row0.state.diagonal[0, 0] = diag.half()
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
    idx = SpinIndexer(SpinConfig(topk=8), num_layers=1, max_batch=2, max_blocks=4, next_n=2)
    idx.plan(torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int32),
             torch.zeros(0, dtype=torch.int32))
    assert idx.run_from_scores(0, torch.zeros(0, 4 * T)).shape == (0, 8)


def test_misuse_raises_with_the_argument_named(gen):
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
    assert kept["a1"].num_kept.item() == n - int(n * 0.5)
    # random scores: the best half of the slots touch nearly every block
    assert kept["a0"].num_kept.item() > kept["a1"].num_kept.item()
    v = kept["a0"]
    assert torch.equal(v.keep_mask, v.predicted_mask)


@pytest.mark.parametrize("case", [c for c in ODD_SHAPES if c.batch > 0][:4], ids=ODD_IDS[:4])
def test_replay_path_matches_paged_path_and_state(case, gen):
    """run_from_scores (CPU: compact columns cut at the most kept blocks) and run (paged kernel, full W*T
    compact width) give the same top-k and leave the same V/D/last_seen state, step after step."""
    x = make_case_inputs(case, gen)
    cfg = SpinConfig(sparsity=0.5, topk=case.k)
    width = x.block_table.shape[1]
    paged, slots = _indexer(cfg, case.batch, width, case.next_n)
    replayed, _ = _indexer(cfg, case.batch, width, case.next_n)
    scores = paged_indexer_logits_ref(*x.args())
    for _ in range(4):
        for idx in (paged, replayed):
            idx.plan(x.block_table, x.seq_lens, slots)
        for layer in range(2):
            assert torch.equal(paged.run(layer, x.q_fp8, x.kv_cache, x.weights),
                               replayed.run_from_scores(layer, scores))
    for name in ("vertical", "diagonal", "last_seen"):  # the last column is each slot's trash cell (unread)
        assert torch.equal(getattr(paged.state, name)[..., :-1], getattr(replayed.state, name)[..., :-1]), name
