"""Replay of SpinIndexer over traces: exactness at s = 0, zero miss on stationary patterns, batching and
layer folding that change nothing but the random stream."""
import dataclasses

import pytest
import torch

from spin_indexer.predictor import SpinConfig
from spin_indexer.traces.replay import group_traces, replay
from spin_indexer.traces.schema import Trace, TraceMeta
from spin_indexer.traces.synthetic import SyntheticSpec, generate

SMALL = dict(context_len=1500, num_steps=10, num_layers=3, k=128)
QUIET = dict(background=0.0, segment=0.0, noise=0.0, drift=0.0, num_verticals=0, sink_tokens=0, birth_rate=0.0,
             death_rate=0.0, local_window=0)


def _cat(d):
    return torch.cat([v.reshape(-1) for v in d.values()])


@pytest.mark.parametrize("preset,next_n", [("v4-like", 1), ("shift", 2), ("v32-like", 3)])
def test_zero_sparsity_is_dense(preset, next_n):
    traces = [generate(preset, seed=i, next_n=next_n, **SMALL) for i in range(2)]
    res = replay(traces, SpinConfig(sparsity=0.0))
    assert _cat(res.miss).abs().max() == 0 and _cat(res.sparsity).abs().max() == 0
    assert set(res.miss) == {t.name for t in traces}
    assert res.miss[traces[0].name].shape == (10, 3, next_n)
    assert res.row_layer_steps == 2 * 10 * 3 * next_n


def _stationary_trace(steps=8, layers=2, context=1500, k=128, hot=(2, 5)):
    """Identical scores every step: high in blocks `hot`, low elsewhere (newest tokens included)."""
    g = torch.Generator().manual_seed(0)
    max_len = context + steps
    base = torch.rand(max_len, generator=g)
    for b in hot:
        base[b * 64:(b + 1) * 64] += 10.0
    lens = (context + 1 + torch.arange(steps)).to(torch.int32)[:, None]
    scores = base.expand(steps, layers, 1, max_len).clone()
    scores = scores.masked_fill(torch.arange(max_len) >= lens[:, None, :, None].long(), float("-inf")).half()
    meta = TraceMeta(model="hand", indexer="hand", prompt_id="stationary", task="t", context_len=context, k=k)
    return Trace(scores, lens, meta)


@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.8])
@pytest.mark.parametrize("policy", [dict(), dict(exploration="none", gamma=0.0), dict(pooling="a2"),
                                    dict(reduce="mean"), dict(exploration="block_age")])
def test_stationary_pattern_never_misses(sparsity, policy):
    res = replay(_stationary_trace(), SpinConfig(sparsity=sparsity, **policy))
    miss, sp = res.miss["stationary"], res.sparsity["stationary"]
    assert miss.abs().max() == 0
    assert float(sp[0].max()) == 0.0  # step 0: no history, every block is scored
    assert float(sp[1:].min()) >= sparsity - 0.05  # afterwards the target (minus forced blocks) is met


def test_stationary_verticals_never_miss():
    spec = SyntheticSpec(**{**SMALL, **QUIET, "num_verticals": 8, "vertical_width": 4, "k": 32})
    res = replay(generate(spec, seed=4, prompt_id="v"), SpinConfig(sparsity=0.5))
    assert res.miss["v"].abs().max() == 0 and float(res.sparsity["v"][1:].mean()) > 0.4


def test_moving_pattern_does_miss():
    res = replay(generate("shift", seed=0, **{**SMALL, "num_steps": 12, "shift_steps": (6,)}, prompt_id="s"),
                 SpinConfig(sparsity=0.5, exploration="none", gamma=0.0))
    assert float(res.miss["s"][6].mean()) > 0.05  # the shift step: history points at the old pattern


def test_folded_layers_and_batching_change_nothing_without_randomness():
    # block_age / staleness break ties with the (layer, slot)-keyed hash, so only "none" is bit-exact.
    traces = [generate("v4-like", seed=i, next_n=2, **{**SMALL, "context_len": 1400 + 90 * i,
                                                         "num_steps": 4 + 2 * i}) for i in range(3)]
    cfg = SpinConfig(sparsity=0.4, exploration="none", gamma=0.0)
    folded = replay(traces, cfg, fold_layers=True)
    unfolded = replay(traces, cfg, fold_layers=False)
    alone = {t.name: replay(t, cfg) for t in traces}
    for t in traces:
        assert folded.miss[t.name].shape == (t.num_steps, 3, 2)
        assert torch.equal(folded.miss[t.name], unfolded.miss[t.name])
        assert torch.equal(folded.sparsity[t.name], unfolded.sparsity[t.name])
        assert torch.equal(folded.miss[t.name], alone[t.name].miss[t.name])
        assert torch.equal(folded.num_kept[t.name], alone[t.name].num_kept[t.name])


def test_recorded_topk_is_used_and_recomputed_when_missing():
    t = generate("v4-like", seed=1, **SMALL)
    cfg = SpinConfig(sparsity=0.5)
    with_topk = replay(t, cfg)
    bare = Trace(t.scores, t.seq_lens, dataclasses.replace(t.meta, prompt_id="bare"))
    assert torch.equal(replay(bare, cfg).miss["bare"], with_topk.miss[t.name])
    # a recorded top-k pointing at other positions changes the miss: the recorded one is what counts
    shifted = Trace(t.scores, t.seq_lens, dataclasses.replace(t.meta, prompt_id="shifted"),
                    torch.where(t.topk >= 64, t.topk - 64, t.topk))
    assert not torch.equal(replay(shifted, cfg).miss["shifted"], with_topk.miss[t.name])


def test_group_traces_and_errors():
    a = generate("v4-like", seed=0, **{**SMALL, "context_len": 1000})
    b = generate("v4-like", seed=1, **{**SMALL, "context_len": 1100})
    c = generate("v4-like", seed=2, **{**SMALL, "context_len": 3000})
    d = generate("v4-like", seed=3, **{**SMALL, "context_len": 1000, "next_n": 2})
    groups = group_traces([c, a, d, b], max_batch=4)
    assert sorted([sorted(t.name for t in g) for g in groups]) == sorted([[a.name, b.name], [c.name], [d.name]])
    with pytest.raises(ValueError, match="distinct prompt_id"):
        replay([a, a], SpinConfig())
    with pytest.raises(TypeError, match="config: expected a SpinConfig"):
        replay(a, {"sparsity": 0.3})


def test_a2_max_equals_a1_max_under_max_combine():
    # max over a block of max(V, D) = max(max V, max D): the two poolings differ only when V and D are summed.
    t = generate("v4-like", seed=2, prompt_id="p", **SMALL)
    base = dict(sparsity=0.5, exploration="none", gamma=0.0)
    a1 = replay(t, SpinConfig(pooling="a1", **base))
    a2 = replay(t, SpinConfig(pooling="a2", **base))
    assert torch.equal(a1.miss["p"], a2.miss["p"])
    a1s = replay(t, SpinConfig(pooling="a1", combine="sum", **base))
    a2s = replay(t, SpinConfig(pooling="a2", combine="sum", **base))
    assert not torch.equal(a1s.miss["p"], a2s.miss["p"])


def test_hybrid_configs_replay_layer_by_layer():
    t = generate("v4-like", seed=3, prompt_id="h", **SMALL)
    cfg = SpinConfig(sparsity=0.4, exploration="none", gamma=0.0, hybrid=0.5)
    auto = replay(t, cfg)
    assert torch.equal(auto.miss["h"], replay(t, cfg, fold_layers=False).miss["h"])
    with pytest.raises(ValueError, match="fold_layers: expected False"):
        replay(t, cfg, fold_layers=True)


def test_summary_replay_follows_the_recorded_summaries():
    """SpinConfig.summary replays from Trace.summary: on a stationary trace (hot blocks 2 and 5), summaries that
    point at the hot blocks miss nothing, summaries that point elsewhere make the weight-1 mix skip them; folding
    the layers changes nothing (exploration off)."""
    t = _stationary_trace(steps=8, context=1500, k=128)
    steps, layers, _, cols = t.scores.shape
    width = -(-cols // 64)

    def with_summary(hot, name, cold=()):
        s = torch.ones(steps, layers, 1, width)
        s[..., list(hot)] = 5.0
        s[..., list(cold)] = 0.0
        meta = dataclasses.replace(t.meta, prompt_id=name, extra={"summary_parts": [4]})
        return Trace(t.scores, t.seq_lens, meta, summary=s)

    cfg = SpinConfig(sparsity=0.5, exploration="none", gamma=0.0, summary=1.0, summary_parts=4)
    right, wrong = with_summary((2, 5), "right"), with_summary((9, 11), "wrong", cold=(2, 5))
    res = replay([right, wrong], cfg)
    assert res.miss["right"].max() == 0
    assert res.miss["wrong"][2:].min() > 0  # the hot blocks skipped once the summary alone decides
    assert replay([right, wrong], dataclasses.replace(cfg, summary=0.0)).miss["wrong"].max() == 0
    unfolded = replay([right, wrong], cfg, fold_layers=False)
    for name in ("right", "wrong"):
        assert torch.equal(res.miss[name], unfolded.miss[name])
