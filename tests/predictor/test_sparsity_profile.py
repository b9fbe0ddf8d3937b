"""SpinConfig.sparsity_profile: a sparsity a layer (sparsity x the layer's entry), on the torch path of the step and
in replay; refused where it cannot apply. The fused planner's twin: test_plan_triton.py (the "profile" configs)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import row_lengths
from spin_indexer.indexer import SpinIndexer
from spin_indexer.predictor import SpinConfig
from spin_indexer.predictor.adaptive import AdaptiveConfig
from spin_indexer.traces.replay import replay

T = 64


def _step_counts(cfg, layers, lengths, width, steps, gen):
    """Kept blocks a request [layers, B] after `steps` steps of random scores, and every layer's top-k."""
    batch = len(lengths)
    idx = SpinIndexer(cfg, num_layers=layers, max_batch=batch, max_blocks=width)
    slots = torch.tensor([idx.state.allocate() for _ in range(batch)], dtype=torch.int32)
    table = torch.arange(batch * width, dtype=torch.int32).view(batch, width)
    outs = []
    for step in range(steps):
        seq_lens = row_lengths([n + step for n in lengths], 1)
        scores = torch.randn(batch, width * T, generator=gen)
        idx.plan(table, seq_lens, slots)
        outs.append([idx.run_from_scores(layer, scores).clone() for layer in range(layers)])
    return torch.stack([idx.plans(layer).num_kept.long() for layer in range(layers)]), outs


def test_each_layer_keeps_its_own_budget(gen):
    lengths, width, s = (6400, 3000, 64 * 20 + 5), 101, 0.4
    profile = (0.5, 1.0, 1.75)
    cfg = SpinConfig(sparsity=s, topk=256, sparsity_profile=profile)
    kept, _ = _step_counts(cfg, 3, lengths, width, 3, gen)
    n = torch.tensor([-(-(L + 2) // T) for L in lengths])
    for layer, p in enumerate(profile):
        budget = torch.clamp(n - torch.floor(n * (s * p) + 1e-9).long(), min=-(-256 // T) + 1)
        assert torch.equal(kept[layer], budget), layer
    assert (kept[0] > kept[2]).all()  # the profile moved budget, not only relabelled it


def test_requests_shorter_than_profile_from_keep_the_uniform_budget(gen):
    lengths, width, s = (6400, 3000), 101, 0.4
    profile = (0.5, 1.75)
    cfg = SpinConfig(sparsity=s, topk=256, sparsity_profile=profile, profile_from=4000)
    kept, _ = _step_counts(cfg, 2, lengths, width, 3, gen)
    n = torch.tensor([-(-(L + 2) // T) for L in lengths])
    for layer, p in enumerate(profile):
        sparsity = torch.tensor([s * p, s], dtype=torch.float64)  # 6402 tokens >= 4000: the profile; 3002: not
        budget = torch.clamp(n - torch.floor(n * sparsity + 1e-9).long(), min=-(-256 // T) + 1)
        assert torch.equal(kept[layer], budget), layer
    with pytest.raises(ValueError, match="profile_from"):
        SpinConfig(profile_from=-1)


def test_a_flat_profile_is_the_paper_step():
    lengths, width = (5000, 2600), 80
    kept_a, out_a = _step_counts(SpinConfig(sparsity=0.45, topk=256, sparsity_profile=(1.0, 1.0)), 2, lengths, width,
                                 4, torch.Generator().manual_seed(3))
    kept_b, out_b = _step_counts(SpinConfig(sparsity=0.45, topk=256), 2, lengths, width, 4,
                                 torch.Generator().manual_seed(3))
    assert torch.equal(kept_a, kept_b)
    for a, b in zip(out_a, out_b):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.parametrize("bad, error, words", [
    ("0.5,1.5", TypeError, "tuple or list"),
    ((1.0, -0.1), ValueError, "sparsity_profile[1]"),
    ((1.0, float("nan")), ValueError, "sparsity_profile[1]"),
    ((1.0, float("inf")), ValueError, "sparsity_profile[1]"),
    ((1.0, 2.5), ValueError, "layer 1"),  # 0.4 x 2.5 = 1: no block left to skip from
    ((1.0, True), TypeError, "sparsity_profile[1]"),
])
def test_bad_profiles_are_refused_with_the_entry_named(bad, error, words):
    with pytest.raises(error, match="sparsity_profile") as info:
        SpinConfig(sparsity=0.4, sparsity_profile=bad)
    assert words in str(info.value)


def test_profile_refuses_adaptive_budgets_and_a_wrong_layer_count():
    with pytest.raises(ValueError, match="adaptive"):
        SpinConfig(sparsity=0.2, sparsity_profile=(1.0, 1.0), adaptive=AdaptiveConfig())
    cfg = SpinConfig(sparsity=0.4, sparsity_profile=(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match=r"^config: expected a sparsity_profile of num_layers = 2 entries .*got 3$"):
        SpinIndexer(cfg, num_layers=2, max_batch=1, max_blocks=4)


def test_replay_runs_layers_apart_and_budgets_each():
    from spin_indexer.traces.synthetic import generate

    trace = generate("v4-like", seed=1, prompt_id="p", context_len=4096, num_steps=6, num_layers=3, k=256)
    cfg = SpinConfig(sparsity=0.4, sparsity_profile=(0.25, 1.0, 1.75))
    with pytest.raises(ValueError, match="sparsity_profile"):
        replay(trace, cfg, fold_layers=True)
    sparsity = replay(trace, cfg).sparsity["p"]  # [steps, layers]
    late = sparsity[2:].mean(0)  # past the first steps' never-scored blocks
    assert late[0] < late[1] < late[2]
    assert late.tolist() == pytest.approx([0.1, 0.4, 0.7], abs=0.03)


def test_the_shipped_profiles_keep_the_mean_and_fit_the_head():
    from spin_indexer.predictor.policies import PROFILE_FROM, get_policy

    for s in (0.2, 0.3, 0.4, 0.5):
        cfg = get_policy("spin-layers", s, topk=256)
        assert len(cfg.sparsity_profile) == 30 and cfg.profile_from == PROFILE_FROM  # the shipped head's layers
        assert sum(cfg.layer_sparsity(i) for i in range(30)) / 30 == pytest.approx(s)  # the same key bytes
        assert get_policy("spin-default", s, topk=256) == dataclasses.replace(cfg, sparsity_profile=(),
                                                                              profile_from=0)
    with pytest.raises(ValueError, match=r"no profile calibrated at sparsity 0.45 \(it has 0.2, 0.3, 0.4, 0.5\)"):
        get_policy("spin-layers", 0.45)


def test_vllm_settings_refuse_the_proxy_profile():
    from spin_indexer.integrations import settings

    with pytest.raises(ValueError, match="proxy model's per-layer budgets"):
        settings.SpinVllmSettings(policy="spin-layers")


def test_spin_layers_mix_is_spin_layers_from_profile_from_and_the_mix_below():
    """The policy spin-layers-mix: from PROFILE_FROM tokens on it plans exactly as spin-layers (the history, the
    shipped budgets, random exploration), below it as the summary mix (16 sub-blocks, weight 0.8) without
    exploration under the budgets at half strength (a profile 1 + (p - 1) / 2 for every length), step after step
    over the 30 layers (replayed scores)."""
    from spin_indexer.predictor.policies import PROFILE_FROM, get_policy

    gen = torch.Generator().manual_seed(3)
    mix = get_policy("spin-layers-mix", 0.4, topk=128)
    twins = {PROFILE_FROM + 100: get_policy("spin-layers", 0.4, topk=128),
             PROFILE_FROM - 2100: dataclasses.replace(get_policy("summary16-0.8-noexp", 0.4, topk=128),
                                                      sparsity_profile=[1 + 0.5 * (p - 1)
                                                                        for p in mix.sparsity_profile])}
    for length, twin in twins.items():
        width = -(-(length + T + 11) // T)
        table = torch.arange(2 * width, dtype=torch.int32).view(2, width)
        idx = [SpinIndexer(c, num_layers=30, max_batch=2, max_blocks=width, num_cache_blocks=2 * width,
                           topk_sorted=True) for c in (mix, twin)]
        slots = [torch.tensor([i.state.allocate() for _ in range(2)], dtype=torch.int32) for i in idx]
        differs = False
        for step in range(4):
            lens = torch.tensor([[length + step], [length + T + 7 + step]], dtype=torch.int32)
            for i, s in zip(idx, slots):
                i.plan(table, lens, s)
            for layer in range(30):
                scores = torch.randn(2, width * T, generator=gen)
                summary = torch.randn(2, width, generator=gen)
                keeps = []
                for i in idx:
                    i.run_from_scores(layer, scores, summary if i.config.summary > 0 else None)
                    keeps.append(i.block_plan.keep_mask.clone())
                assert torch.equal(keeps[0], keeps[1]), (length, step, layer)
                differs |= bool((~keeps[0][:, :width - 1]).any())
        assert differs  # blocks were skipped: the plans compared real choices
