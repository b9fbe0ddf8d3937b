"""Beyond the paper: adaptive budgets (audits, probes, level controller) and the hybrid predictor."""
import dataclasses

import pytest
import torch

from spin_indexer.indexer import SpinIndexer
from spin_indexer.predictor import SpinConfig
from spin_indexer.predictor.adaptive import (AdaptiveConfig, audit_mask, prediction_miss, probe_miss,
                                             update_levels_)
from spin_indexer.predictor.hybrid import hybrid_scores, percentile

T = 64


@pytest.mark.parametrize("kwargs, words", [
    ({"target_miss": 1.5}, "AdaptiveConfig.target_miss"),
    ({"menu": (0.3, 0.2)}, "AdaptiveConfig.menu"),
    ({"menu": (0.0, 1.0)}, "AdaptiveConfig.menu"),
    ({"audit_every": 1}, "AdaptiveConfig.audit_every"),
    ({"patience": 0}, "AdaptiveConfig.patience"),
])
def test_adaptive_config_validation(kwargs, words):
    with pytest.raises(ValueError, match=words):
        AdaptiveConfig(**kwargs)
    with pytest.raises(TypeError, match="SpinConfig.adaptive"):
        SpinConfig(adaptive={"target_miss": 0.1})
    with pytest.raises(ValueError, match="SpinConfig.hybrid"):
        SpinConfig(hybrid=1.5)


def test_audits_are_staggered_over_layers_and_slots():
    step = torch.tensor([5, 5, 5, 5])
    slots = torch.tensor([0, 1, 2, 3])
    assert audit_mask(step, slots, 3, 4).tolist() == [True, False, False, False]
    assert audit_mask(step, slots, 0, 4).tolist() == [False, False, False, True]


def test_prediction_and_probe_miss_on_a_hand_case():
    topk = torch.tensor([[0, 70, 130, 200, -1]], dtype=torch.int32)  # blocks 0, 1, 2, 3
    predicted = torch.tensor([[True, False, True, False, False, False]])
    assert prediction_miss(topk, predicted, 1, T).tolist() == [0.5]
    explored = torch.tensor([[False, True, False, False, False, False]])
    valid = torch.ones(1, 6, dtype=torch.bool)
    # 1 hit in 1 explored block; 4 unpredicted blocks -> 4 estimated hits among 4 valid top-k entries
    assert probe_miss(topk, explored, predicted, valid, 1, T).tolist() == [1.0]
    assert probe_miss(topk, torch.zeros_like(explored), predicted, valid, 1, T).tolist() == [0.0]


def test_level_controller_rules():
    cfg = AdaptiveConfig(target_miss=0.1, menu=(0.0, 0.2, 0.4), patience=2, raise_below=0.5)
    level = torch.tensor([1, 1, 2, 0], dtype=torch.int32)
    calm = torch.tensor([0, 1, 1, 0], dtype=torch.int32)
    slots = torch.tensor([0, 1, 2, 3])
    audited = torch.tensor([True, True, True, False])
    miss = torch.tensor([0.2, 0.01, 0.0, 0.5])
    update_levels_(level, calm, slots, audited, miss, cfg)
    # over target -> down; quiet twice -> up; already at the top -> stays; not audited -> untouched
    assert level.tolist() == [0, 2, 2, 0] and calm.tolist() == [0, 0, 0, 0]


def _drive(cfg, scores_of_step, steps, width=64, layers=1):
    idx = SpinIndexer(cfg, layers, 1, width)
    slots = torch.tensor([idx.state.allocate()], dtype=torch.int32)
    plans = []
    for step in range(steps):
        scores = scores_of_step(step)
        length = int(torch.isfinite(scores).sum())
        idx.plan(torch.arange(width, dtype=torch.int32)[None], torch.tensor([[length]], dtype=torch.int32), slots)
        for layer in range(layers):
            idx.run_from_scores(layer, scores)
            plans.append(idx.block_plan.clone())
    return idx, plans


def _concentrated(hot, width=64, length=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, width * T, generator=g)
    for b in hot:
        s[0, b * T:(b + 1) * T] += 20.0
    s[0, length:] = float("-inf")
    return s


def test_adaptive_goes_sparser_on_an_easy_pattern_and_audits_see_everything():
    easy = _concentrated([2, 9, 30])
    cfg = SpinConfig(sparsity=0.2, topk=128, adaptive=AdaptiveConfig(target_miss=0.05, audit_every=4, patience=1))
    idx, plans = _drive(cfg, lambda s: easy, 24)
    assert idx.state.level[0, 0].item() > AdaptiveConfig().start_level(0.2)  # moved to a sparser level
    audits = [p for p in plans if p.audit.any()]
    assert audits and all(bool((p.keep_mask | ~(torch.arange(64) < 63)).all()) for p in audits)
    assert all(not torch.equal(p.keep_mask, p.predicted_mask) for p in audits[1:])
    assert [p for p in plans if not p.audit.any()][-1].sparsity().item() > 0.5


def test_adaptive_goes_denser_when_importance_moves():
    def moving(step):  # the hot blocks jump every step: history is always wrong
        return _concentrated([(7 * step) % 60, (7 * step + 23) % 60, (7 * step + 41) % 60], seed=step)
    cfg = SpinConfig(sparsity=0.6, topk=128, exploration="none",
                     adaptive=AdaptiveConfig(target_miss=0.05, audit_every=2, probe=False))
    idx, _ = _drive(cfg, moving, 16)
    assert idx.state.level[0, 0].item() < AdaptiveConfig().start_level(0.6)


def test_probe_schedules_an_audit_after_a_surprise():
    before, after = _concentrated([2, 9, 30]), _concentrated([40, 50, 55], seed=1)
    cfg = SpinConfig(sparsity=0.5, topk=128, gamma=0.3,
                     adaptive=AdaptiveConfig(target_miss=0.05, audit_every=1000, patience=1, probe=True))
    idx, plans = _drive(cfg, lambda s: before if s < 6 else after, 9)
    audited_steps = [i for i, p in enumerate(plans) if p.audit.any()]
    assert any(s in audited_steps for s in (7, 8)), audited_steps


def test_percentile_and_hybrid_mix():
    valid = torch.tensor([[True, True, True, False]])
    assert percentile(torch.tensor([[1.0, 3.0, 2.0, 9.0]]), valid).tolist() == [[pytest.approx(1 / 3), 1.0,
                                                                                 pytest.approx(2 / 3), 0.0]]
    hist = torch.tensor([[[3.0, 2.0, 1.0, 0.0]]])
    prev = torch.tensor([[float("-inf"), 1.0, 5.0, 0.0]])
    mixed = hybrid_scores(hist, prev, valid, 1.0)
    # block 0 unseen by the previous layer keeps its own percentile (1); blocks 1, 2 take the previous one
    assert mixed[0, 0, :3].tolist() == pytest.approx([1.0, 1 / 2, 1.0])
    assert torch.equal(hybrid_scores(hist, prev, valid, 0.0).argsort(-1), percentile(hist, valid[:, None]).argsort(-1))


def test_hybrid_lets_the_previous_layer_steer_this_one():
    """Layer 0's indexer sees block 40 matter (its history says so too); layer 1's history points at
    blocks 2 and 9 only. With hybrid weight 0.9 layer 1 also scores block 40 this step."""
    width = 64
    old, new = _concentrated([2, 9]), _concentrated([40], seed=1)
    keep = {}
    for w in (0.0, 0.9):
        cfg = SpinConfig(sparsity=0.9, topk=128, exploration="none", hybrid=w)
        idx = SpinIndexer(cfg, 2, 1, width)
        slots = torch.tensor([idx.state.allocate()], dtype=torch.int32)
        table = torch.arange(width, dtype=torch.int32)[None]
        for step in range(3):
            idx.plan(table, torch.tensor([[4000]], dtype=torch.int32), slots)
            idx.run_from_scores(0, new)
            idx.run_from_scores(1, old)
        keep[w] = idx.block_plan.keep_mask[0]
    assert keep[0.0][2] and keep[0.0][9] and not keep[0.0][40]
    assert keep[0.9][40]


def test_curve_controller_measures_every_level_and_picks_the_sparsest_within_target():
    from spin_indexer.predictor.adaptive import curve_miss, update_curve_
    # top-k in blocks 0, 1, 2, 5; predicted order: block 5 first, then 0, 1, 2, 3, 4
    topk = torch.tensor([[0, 70, 130, 330]], dtype=torch.int32)
    pred_rank = torch.tensor([[1, 2, 3, 4, 5, 0]])
    budgets = torch.tensor([[1, 2, 3, 6]])
    miss = curve_miss(topk, pred_rank, budgets, 1, T)
    assert miss.tolist() == [[0.75, 0.5, 0.25, 0.0]]
    cfg = AdaptiveConfig(target_miss=0.3, menu=(0.0, 0.2, 0.4, 0.6), controller="curve", decay=0.5)
    level = torch.zeros(2, dtype=torch.int32)
    curve = torch.zeros(2, 4)
    update_curve_(level, curve, torch.tensor([1]), torch.tensor([True]), miss.flip(1), cfg)
    # levels ordered dense -> sparse: misses [0, .25, .5, .75] -> sparsest within 0.3 is level 1
    assert level.tolist() == [0, 1] and curve[1].tolist() == [0.0, 0.25, 0.5, 0.75]
    update_curve_(level, curve, torch.tensor([1]), torch.tensor([True]), torch.zeros(1, 4), cfg)
    assert curve[1].tolist() == [0.0, 0.125, 0.25, 0.375] and level.tolist() == [0, 2]  # decayed max
    with pytest.raises(ValueError, match="AdaptiveConfig.controller"):
        AdaptiveConfig(controller="pid")
