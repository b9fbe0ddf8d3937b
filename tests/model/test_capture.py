"""Trace capture on a tiny random model: the trace validates, round-trips, and holds the live scores."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_indexer, tiny_model
from spin_indexer.model.decode import Caches, decode_one_step, prefill
from spin_indexer.traces.capture import capture_trace, trace_bytes
from spin_indexer.traces.schema import load_trace


@pytest.mark.parametrize("mode", ["oracle", "lightning"])
def test_capture_roundtrip_and_contents(tmp_path, mode):
    model, idx = tiny_model(max_len=512), tiny_indexer(max_len=512)
    prompt = torch.randint(0, 97, (150,))
    trace, generated = capture_trace(model, prompt, 6, mode, 32, idx if mode == "lightning" else None,
                                     prompt_id="p0", task="unit")
    assert trace.scores.shape == (6, 2, 1, 156) and trace.scores.dtype == torch.float16
    assert trace.seq_lens[:, 0].tolist() == list(range(151, 157))
    assert trace.topk.shape == (6, 2, 1, 32) and generated.shape == (6,)
    path = trace.save(tmp_path)
    back = load_trace(path)  # validates -inf past lengths, top-k in range
    assert torch.equal(back.scores, trace.scores) and back.meta.indexer == mode and back.meta.context_len == 150
    # replay the same decode by hand: step 3, layer 1 scores must be the ones recorded
    seen = {}
    caches = Caches.allocate(model, 1, 160, idx if mode == "lightning" else None)
    logits = prefill(model, caches, 0, prompt, idx)
    for s in range(4):
        tok = logits.argmax(-1).view(1, 1)
        assert int(tok) == int(generated[s])
        logits = decode_one_step(model, caches, tok, mode, 32, idx,
                                 observer=lambda layer, sc, tk, _: seen.__setitem__((s, layer), (sc, tk)))[0, -1]
    sc, tk = seen[(3, 1)]
    n = 154
    torch.testing.assert_close(trace.scores[3, 1, 0, :n].float(), sc[0, :n], rtol=1e-3, atol=1e-3)
    assert torch.equal(trace.topk[3, 1, 0], tk[0])


def test_capture_rejects_dense_and_sizes():
    model = tiny_model(max_len=128)
    with pytest.raises(ValueError, match="mode"):
        capture_trace(model, torch.zeros(5, dtype=torch.int64), 2, "dense", 4, prompt_id="x")
    # 32K context x 256 steps x 30 layers, K = 256: ~507 MB of fp16 scores + 7.9 MB of top-k
    assert trace_bytes(256, 30, 32768, 256) == 256 * 30 * ((32768 + 256) * 2 + 256 * 4) + 256 * 4


def test_capture_layer_subset_matches_full_trace():
    model = tiny_model(max_len=256)
    prompt = torch.randint(0, 97, (70,))
    full, gen_full = capture_trace(model, prompt, 3, "oracle", 8, prompt_id="a")
    part, gen_part = capture_trace(model, prompt, 3, "oracle", 8, prompt_id="b", layers=[1])
    assert part.scores.shape == (3, 1, 1, 73) and part.meta.extra["layers"] == [1]
    assert torch.equal(part.scores[:, 0], full.scores[:, 1]) and torch.equal(gen_part, gen_full)
    with pytest.raises(ValueError, match="layers"):
        capture_trace(model, prompt, 1, "oracle", 8, prompt_id="c", layers=[2])


def test_cli_layer_parser():
    from spin_indexer.cli.capture import _parse_layers
    assert _parse_layers("0-29:4") == [0, 4, 8, 12, 16, 20, 24, 28]
    assert _parse_layers("3,5-6") == [3, 5, 6] and _parse_layers(None) is None


# ---- speculative decoding (next_n > 1): drafts verified per step, every row recorded ----

def _setup(mode, max_len=512):
    model = tiny_model(max_len=max_len)
    idx = tiny_indexer(max_len=max_len) if mode == "lightning" else None
    return model, idx, torch.randint(0, 97, (150,))


def _row_lengths(trace):
    """Expected seq_lens: L_s + j + 1, L_s = prompt + the tokens the earlier steps emitted."""
    n = trace.next_n
    emitted = torch.ones(trace.num_steps, dtype=torch.long) if trace.accepted is None else trace.accepted.long() + 1
    before = torch.cat([torch.zeros(1, dtype=torch.long), emitted.cumsum(0)[:-1]])
    return (trace.meta.context_len + before[:, None] + 1 + torch.arange(n)[None, :]).to(torch.int32)


@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
def test_capture_mtp_shapes_lengths_and_tokens(next_n):
    model, _, prompt = _setup("oracle")
    steps = 5
    plain, greedy = capture_trace(model, prompt, steps * next_n, "oracle", 16, prompt_id="plain")
    trace, generated = capture_trace(model, prompt, steps, "oracle", 16, prompt_id="mtp", next_n=next_n)
    assert trace.scores.shape[:3] == (steps, 2, next_n) and trace.topk.shape == (steps, 2, next_n, 16)
    assert trace.meta.next_n == next_n and torch.equal(trace.seq_lens, _row_lengths(trace))
    assert trace.max_len == int(trace.seq_lens.max())
    if next_n == 1:
        assert trace.accepted is None and "draft" not in trace.meta.extra
    else:
        assert trace.accepted.dtype == torch.int32 and trace.accepted.shape == (steps,)
        assert 0 <= int(trace.accepted.min()) and int(trace.accepted.max()) <= next_n - 1
        assert trace.meta.extra["draft"].startswith("greedy all-keep")
        mean_accepted = float(trace.accepted.double().mean())
        assert trace.meta.extra["acceptance_rate"] == pytest.approx(mean_accepted / (next_n - 1))
    # speculative decoding emits exactly the plain greedy tokens; the valid rows consumed sum(accepted + 1)
    last_accepted = 0 if trace.accepted is None else int(trace.accepted[-1])
    assert generated.numel() == int(trace.seq_lens[-1, 0]) - 150 + last_accepted
    assert torch.equal(generated, greedy[:generated.numel()])


def _assert_valid_rows_match_plain(trace, plain):
    """Every valid row (j <= accepted) of the MTP trace sees the same cache as one step of the plain
    capture: same length, same scores (fp16, up to the batched-row matmul rounding), same top-k."""
    context = trace.meta.context_len
    for s in range(trace.num_steps):
        for j in range(int(trace.accepted[s]) + 1):
            n = int(trace.seq_lens[s, j])
            p = n - context - 1  # the plain step that had this row's length
            assert int(plain.seq_lens[p, 0]) == n
            torch.testing.assert_close(trace.scores[s, :, j, :n].float(), plain.scores[p, :, 0, :n].float(),
                                       rtol=1e-3, atol=1e-3)
            assert torch.equal(trace.topk[s, :, j], plain.topk[p, :, 0])


@pytest.mark.parametrize("mode", ["oracle", "lightning"])
def test_capture_mtp_own_greedy_draft_is_fully_accepted(mode):
    model, idx, prompt = _setup(mode)
    steps, next_n = 4, 3
    plain, greedy = capture_trace(model, prompt, steps * next_n, mode, 32, idx, prompt_id="plain")
    trace, generated = capture_trace(model, prompt, steps, mode, 32, idx, prompt_id="mtp", next_n=next_n)
    # the draft is the verifier's own greedy continuation: with these numerics every draft is accepted
    assert trace.accepted.tolist() == [next_n - 1] * steps and trace.meta.extra["acceptance_rate"] == 1.0
    assert torch.equal(generated, greedy) and trace.seq_lens[:, 0].tolist() == [151, 154, 157, 160]
    _assert_valid_rows_match_plain(trace, plain)
    # rows are not only valid ones here: row 0 of step s is plain step s * next_n
    torch.testing.assert_close(trace.scores[:, :, 0].float(), plain.scores[::next_n, :, 0, :trace.max_len].float(),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mode", ["oracle", "lightning"])
def test_capture_mtp_rejected_draft_rolls_back_the_cache(mode):
    model, idx, prompt = _setup(mode)
    steps, next_n = 6, 3
    plain, greedy = capture_trace(model, prompt, steps * next_n, mode, 32, idx, prompt_id="plain")
    draft = greedy.clone()
    draft[2] = (draft[2] + 1) % 97  # step 0 verifies drafts for tokens 1, 2: token 2's is wrong
    draft[9] = (draft[9] + 5) % 97
    trace, generated = capture_trace(model, prompt, steps, mode, 32, idx, prompt_id="mtp", next_n=next_n,
                                     draft=draft)
    assert int(trace.accepted[0]) == 1 and int(trace.accepted.min()) < next_n - 1
    assert trace.meta.extra["draft"] == "given" and trace.meta.extra["acceptance_rate"] < 1.0
    assert torch.equal(trace.seq_lens, _row_lengths(trace))
    # the rejected rows were scored (finite up to their length) but left no trace in the cache: every later
    # valid row, and the emitted tokens, equal plain greedy decoding
    assert bool(torch.isfinite(trace.scores[0, :, 2, :int(trace.seq_lens[0, 2])]).all())
    assert torch.equal(generated, greedy[:generated.numel()])
    _assert_valid_rows_match_plain(trace, plain)
    # a draft past its end proposes token 0, which the tiny model rarely predicts: short drafts still verify
    short, gen_short = capture_trace(model, prompt, 3, mode, 32, idx, prompt_id="short", next_n=2,
                                     draft=greedy[:2])
    assert torch.equal(gen_short, greedy[:gen_short.numel()])


def test_capture_mtp_roundtrip_and_replay(tmp_path):
    from spin_indexer.predictor import SpinConfig
    from spin_indexer.predictor.config import MtpPolicy
    from spin_indexer.traces.replay import replay

    model, idx, prompt = _setup("lightning")
    greedy = capture_trace(model, prompt, 15, "lightning", 32, idx, prompt_id="plain")[1]
    draft = greedy.clone()
    draft[4] = (draft[4] + 1) % 97  # one rejection, so accepted is not constant
    trace, _ = capture_trace(model, prompt, 5, "lightning", 32, idx, prompt_id="mtp3", next_n=3, draft=draft,
                             extra={"seed": 0})
    back = load_trace(trace.save(tmp_path))  # validates -inf past every row's length and top-k in range
    assert back.next_n == 3 and back.meta.extra["seed"] == 0 and back.meta.extra["draft"] == "given"
    assert torch.equal(back.scores, trace.scores) and torch.equal(back.topk, trace.topk)
    assert torch.equal(back.seq_lens, trace.seq_lens) and torch.equal(back.accepted, trace.accepted)
    for policy in MtpPolicy:
        result = replay(back, SpinConfig(sparsity=0.5, mtp=policy, exploration="none", gamma=0.0))
        miss = result.miss["mtp3"]
        assert miss.shape == (5, 2, 3) and bool(((miss >= 0) & (miss <= 1)).all())
        assert result.eligible["mtp3"].shape == (5, 3)
    # replay at s = 0 keeps every block: nothing of the dense top-k is missed
    assert float(replay(back, SpinConfig(sparsity=0.0)).miss["mtp3"].max()) == 0.0


def test_trace_bytes_mtp():
    # 32K x 256 steps x 30 layers at next_n = 3: 3 rows of up to 32768 + 768 columns, ~1.55 GB of scores
    assert trace_bytes(256, 30, 32768, 256, next_n=3) == 256 * 30 * 3 * ((32768 + 768) * 2 + 256 * 4) + 256 * 3 * 4


def test_capture_mtp_accepts_a_prefix_only():
    """A draft that the verifier would accept after a rejected one is still rejected (prefix acceptance)."""
    model, _, prompt = _setup("oracle")
    greedy = capture_trace(model, prompt, 6, "oracle", 32, prompt_id="plain")[1]
    wrong = (greedy[1] + 1) % 97
    caches = Caches.allocate(model, 1, 160)
    prefill(model, caches, 0, prompt)
    logits = decode_one_step(model, caches, torch.stack([greedy[0], wrong]).view(1, 2), "oracle", 32)[0, -1]
    draft = torch.stack([greedy[0], wrong, logits.argmax()])  # draft 2 is what the model says after `wrong`
    trace, generated = capture_trace(model, prompt, 2, "oracle", 32, prompt_id="mtp", next_n=3, draft=draft)
    assert trace.accepted.tolist()[0] == 0 and torch.equal(generated, greedy[:generated.numel()])


def test_cli_rejects_bad_next_n(capsys):
    from spin_indexer.cli.capture import main
    assert main(["--next-n", "0", "--device", "cpu"]) == 2
    assert "--next-n: expected >= 1, got 0" in capsys.readouterr().err


def test_capture_mtp_draft_noise_rejects_and_still_decodes_greedily():
    from spin_indexer.traces.capture import corrupt_draft

    draft = torch.arange(400) % 97
    noisy = corrupt_draft(draft, 0.3, 97, seed=5)
    changed = noisy != draft
    assert 0.2 < float(changed.float().mean()) < 0.4 and bool((noisy >= 0).all() & (noisy < 97).all())
    assert torch.equal(corrupt_draft(draft, 0.3, 97, seed=5), noisy)  # seeded
    assert torch.equal(corrupt_draft(draft, 0.0, 97, seed=5), draft)
    model, _, prompt = _setup("oracle")
    plain, greedy = capture_trace(model, prompt, 24, "oracle", 16, prompt_id="plain")
    trace, generated = capture_trace(model, prompt, 8, "oracle", 16, prompt_id="noisy", next_n=3, draft_noise=0.5)
    assert trace.meta.extra["acceptance_rate"] < 1.0 and "probability 0.5" in trace.meta.extra["draft"]
    assert torch.equal(generated, greedy[:generated.numel()])  # rejections never change what is emitted
    with pytest.raises(ValueError, match="draft_noise"):
        capture_trace(model, prompt, 2, "oracle", 16, prompt_id="bad", next_n=2, draft_noise=1.5)


def test_capture_records_block_summaries_that_replay_reads(tmp_path):
    """summary_parts records ops.block_summary_scores of the live step (checked against a hand decode), the trace
    round-trips with them, and a summary-mix replay reads them (refused on a trace without them)."""
    from spin_indexer import ops
    from spin_indexer.predictor import SpinConfig
    from spin_indexer.traces.replay import replay

    model, idx = tiny_model(max_len=512), tiny_indexer(max_len=512)
    prompt = torch.randint(0, 97, (300,))
    trace, generated = capture_trace(model, prompt, 5, "lightning", 32, idx, prompt_id="p0", summary_parts=(4, 16))
    width = -(-305 // 64)
    assert trace.summary.shape == (5, 2, 2, width) and trace.meta.extra["summary_parts"] == [4, 16]
    seen = {}
    caches = Caches.allocate(model, 1, 320, idx)
    logits = prefill(model, caches, 0, prompt, idx)
    for s in range(3):
        tok = logits.argmax(-1).view(1, 1)
        logits = decode_one_step(model, caches, tok, "lightning", 32, idx,
                                 observer=lambda layer, sc, tk, x: seen.__setitem__(
                                     layer, ops.block_summary_scores(*x, parts=16)))[0, -1]
    torch.testing.assert_close(trace.summary_of(16)[2, 1], seen[1][0, :width])
    assert torch.isfinite(trace.summary).all()  # every block holds tokens from step 0 (301 > 4 x 64)
    back = load_trace(trace.save(tmp_path))
    assert torch.equal(back.summary, trace.summary) and back.meta.extra["summary_parts"] == [4, 16]
    cfg = SpinConfig(sparsity=0.5, topk=32, summary=0.7, summary_parts=4)
    assert replay(back, cfg).miss["p0"].shape == (5, 2, 1)
    with pytest.raises(ValueError, match="summary_parts = 8.*has \\[4, 16\\]"):
        replay(back, SpinConfig(sparsity=0.5, summary=0.7, summary_parts=8))
    bare, _ = capture_trace(model, prompt, 2, "lightning", 32, idx, prompt_id="bare")
    assert bare.summary is None
    with pytest.raises(ValueError, match="trace bare: .*none"):
        replay(bare, cfg)
    with pytest.raises(ValueError, match="summary_parts"):
        capture_trace(model, prompt, 2, "oracle", 32, None, prompt_id="o", summary_parts=(4,))
    with pytest.raises(ValueError, match="summary_parts"):
        capture_trace(model, prompt, 2, "lightning", 32, idx, prompt_id="o", summary_parts=(3,))
