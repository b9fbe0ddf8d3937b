"""Synthetic trace generator: determinism, schema validity, and that each pattern does what it says."""
import pytest
import torch

from spin_indexer.eval.metrics import dense_topk, table1_rows, topk_recall_rows
from spin_indexer.traces.schema import validate_trace
from spin_indexer.traces.synthetic import PRESETS, SyntheticSpec, generate, get_spec

SMALL = dict(context_len=1500, num_steps=8, num_layers=3, k=128)
QUIET = dict(background=0.0, segment=0.0, noise=0.0, drift=0.0, num_verticals=0, sink_tokens=0, birth_rate=0.0,
             death_rate=0.0, local_window=0)


def test_deterministic_by_seed():
    a = generate("v4-like", seed=5, **SMALL)
    b = generate("v4-like", seed=5, **SMALL)
    c = generate("v4-like", seed=6, **SMALL)
    assert torch.equal(a.scores, b.scores) and torch.equal(a.topk, b.topk)
    assert not torch.equal(a.scores, c.scores)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("next_n", [1, 3])
def test_valid_trace_and_consistent_topk(preset, next_n):
    t = generate(preset, seed=1, next_n=next_n, **SMALL)
    validate_trace(t, read_data=True)
    steps, layers, rows, cols = t.scores.shape
    assert (steps, layers, rows) == (8, 3, next_n) and t.meta.k == 128
    flat = t.scores.float().reshape(steps * layers * rows, cols)
    lens = t.seq_lens[:, None, :].expand(steps, layers, rows).reshape(-1)
    assert torch.equal(dense_topk(flat, lens, 128), t.topk.reshape(-1, 128))


def test_lengths_follow_the_engine_convention():
    t = generate("v4-like", seed=2, next_n=3, **SMALL)
    lens, acc = t.seq_lens.long(), t.accepted.long()
    assert torch.equal(lens[:, 1:] - lens[:, :-1], torch.ones(8, 2, dtype=torch.long))  # row j = L - N + j + 1
    assert int(lens[0, -1]) == 1500 + 3
    assert torch.equal(lens[1:, 0] - lens[:-1, 0], acc[:-1] + 1)  # the cache advances by accepted + 1
    assert int(acc.min()) >= 0 and int(acc.max()) <= 2
    one = generate("v4-like", seed=2, **SMALL)
    assert one.accepted is None and torch.equal(one.seq_lens[:, 0], torch.arange(1501, 1509, dtype=torch.int32))


def test_local_diagonal_alone_selects_the_newest_tokens():
    t = generate(SyntheticSpec(**{**SMALL, **QUIET, "local_window": 50, "local_strength": 1.0}))
    for s in range(8):
        newest = int(t.seq_lens[s, 0])
        assert set(t.topk[s, 0, 0].tolist()) == set(range(newest - 128, newest))


def test_verticals_alone_persist_and_sinks_lead():
    spec = SyntheticSpec(**{**SMALL, **QUIET, "num_verticals": 40, "sink_tokens": 4, "sink_strength": 50.0})
    t = generate(spec, seed=3)
    for l in range(3):
        first = t.topk[0, l, 0]
        assert set(first[:4].tolist()) == {0, 1, 2, 3}  # sinks are the strongest
        for s in range(1, 8):  # no births or deaths: the same scores every step, apart from the new token
            assert torch.equal(t.scores[s, l, 0, :1501], t.scores[0, l, 0, :1501])


def test_shift_breaks_prev_iteration_only_at_the_shift_step():
    t = generate("shift", seed=0, **{**SMALL, "num_steps": 10, "shift_steps": (6,)})
    cur = t.scores[:, 0, 0].float()
    recall = topk_recall_rows(cur[:-1], t.topk[1:, 0, 0], t.seq_lens[1:, 0])  # predictor: step s-1
    at_shift = float(recall[5])  # predicting step 6 from step 5
    others = torch.cat([recall[:5], recall[6:]])
    assert at_shift < 0.3 < float(others.min())


def test_presets_order_table1_like_the_paper():
    for preset in ("v32-like", "v4-like"):
        t = generate(preset, seed=0, context_len=4096, num_steps=6, num_layers=6, k=256)
        out = table1_rows(t.scores, t.seq_lens, t.meta.k, t.topk)
        r = {name: out[name]["topk_recall"] for name in out}
        assert r["random"] < r["prev-layer"] <= r["prev-layer-best5"] < r["prev-iteration"]
        assert out["prev-iteration"]["pearson"] > 0.8


def test_bad_spec_and_unknown_preset():
    with pytest.raises(ValueError, match="SyntheticSpec.layer_share"):
        SyntheticSpec(layer_share=1.5)
    with pytest.raises(TypeError, match="SyntheticSpec.k"):
        SyntheticSpec(k=2.0)
    with pytest.raises(ValueError, match="shift, v32-like, v4-like"):
        get_spec("v5-like")
