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
                                 observer=lambda layer, sc, tk: seen.__setitem__((s, layer), (sc, tk)))[0, -1]
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
