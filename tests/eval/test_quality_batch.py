"""The batched quality runner (eval/quality_batch.py) on a tiny random Llama: B prompts decoded together give the
per-prompt runner's outputs, scores, stops and (without exploration) the same SPIN misses; prefill_batch equals
per-prompt prefill."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_llama
from spin_indexer.eval import quality as q
from spin_indexer.eval.quality_batch import BatchedQualityRunner
from spin_indexer.model.decode import Caches, prefill, prefill_batch
from spin_indexer.model.indexer_head import Indexer, IndexerConfig


def _text(ids):
    return " ".join(f"t{i}" for i in ids)


def _score(text, answers):
    return sum(a in text.split() for a in answers) / len(answers)


def _prompts(lengths, answers=("t999",), max_new=6):
    out = []
    for i, n in enumerate(lengths):
        g = torch.Generator().manual_seed(100 + i)
        out.append(q.Prompt("niah_single_1", 700, i, torch.randint(0, 40, (n,), generator=g), list(answers), max_new))
    return out


def _indexer(model):
    torch.manual_seed(7)
    cfg = IndexerConfig(dim=model.cfg.dim, num_layers=model.cfg.num_layers, num_heads=2, head_dim=16, q_rank=16,
                        rope_dim=8, rope_theta=model.cfg.rope_theta, max_position=model.cfg.max_position)
    return Indexer(cfg, max_len=model.max_len).eval().requires_grad_(False)


def test_prefill_batch_equals_prefill_per_prompt():
    model = tiny_llama(max_len=512)
    idx = _indexer(model)
    prompts = [torch.randint(0, 40, (n,)) for n in (130, 64, 201)]
    one = Caches.allocate(model, 3, 256, idx)
    many = Caches.allocate(model, 4, 256, idx)
    want = torch.stack([prefill(model, one, r, ids, idx, chunk=64) for r, ids in enumerate(prompts)])
    got = prefill_batch(model, many, 1, prompts, idx, chunk=64)  # requests 1..3 of 4
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert many.lengths.tolist() == [0, 130, 64, 201]
    for r, ids in enumerate(prompts):
        n = ids.shape[0]
        for layer in range(model.cfg.num_layers):
            torch.testing.assert_close(many.k[layer][r + 1, :n], one.k[layer][r, :n], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(many.v[layer][r + 1, :n], one.v[layer][r, :n], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="first_request"):
        prefill_batch(model, many, 2, prompts, idx)


@pytest.mark.parametrize("mode", ["oracle", "lightning"])
def test_batched_runner_matches_the_per_prompt_runner(mode):
    model = tiny_llama(max_len=1024)
    idx = _indexer(model) if mode == "lightning" else None
    names = ["dense", "all-keep", "spin-0", "spin-0.5-noexp", "spin-0.4"]
    configs = [q.parse_config(c) for c in names]
    prompts = _prompts((700, 523, 640), max_new=7)
    single = q.QualityRunner(model, _text, mode=mode, indexer=idx, k=64)
    batched = BatchedQualityRunner(model, _text, mode=mode, indexer=idx, k=64, prefill_group=2)
    seen = []
    got = batched.run_batch(prompts, configs, _score, on_config=seen.append)
    assert seen == names and len(got) == len(prompts)
    for prompt, rows in zip(prompts, got):
        want = single.run(prompt, configs, _score)
        assert [r["config"] for r in rows] == names
        for a, b in zip(rows, want):
            assert (a["text"], a["score"], a["steps"], a["tokens"]) == (b["text"], b["score"], b["steps"], b["tokens"])
            if a["config"] in ("dense", "all-keep"):
                assert a["mean_miss"] == b["mean_miss"] or (math.isnan(a["mean_miss"]) and math.isnan(b["mean_miss"]))
            else:
                assert a["miss_rows"] == b["miss_rows"] > 0 and 0.0 <= a["mean_miss"] <= a["p99_miss"] <= 1.0
                assert a["sparsity"] == pytest.approx(b["sparsity"], abs=0.02)
        for name in ("spin-0", "spin-0.5-noexp"):  # no exploration: the same plans as at B = 1
            a, b = rows[names.index(name)], want[names.index(name)]
            torch.testing.assert_close(a["miss_values"], b["miss_values"], rtol=0, atol=1e-6)
            assert a["sparsity"] == pytest.approx(b["sparsity"], abs=1e-6)


def test_batched_runner_stops_each_request_where_the_per_prompt_runner_does():
    """Answers found at different steps: every row is cut at its own stop, the batch ends once all stopped."""
    model = tiny_llama(max_len=1024, seed=2)
    single = q.QualityRunner(model, _text, mode="oracle", k=64)
    base = _prompts((600, 610, 620), max_new=30)
    firsts = [single.run(p, [q.parse_config("dense")], _score)[0]["text"].split() for p in base]
    prompts = [q.Prompt(p.task, p.context, p.seed, p.ids, [f[i + 1]], 30) for i, (p, f) in enumerate(zip(base, firsts))]
    runner = BatchedQualityRunner(model, _text, mode="oracle", k=64, check_every=2)
    rows = runner.run_batch(prompts, [q.parse_config("dense"), q.parse_config("spin-0.3")], _score)
    for i, (prompt, (dense, spin)) in enumerate(zip(prompts, rows)):
        want = single.run(prompt, [q.parse_config("dense")], _score)[0]
        assert dense["text"] == want["text"] and dense["steps"] == want["steps"]
        assert dense["score"] == 1.0 and dense["steps"] <= i + 1  # stopped once its answer appeared
        assert spin["miss_values"].numel() == spin["miss_rows"]


def test_batched_runner_with_the_summary_mix_matches_the_per_prompt_runner():
    """spin-<s>-sum<w> (lightning only): its summary cache is per request and per layer, so B prompts decoded
    together make the per-prompt runner's plans (no exploration); the mix changes the plans of spin-0.5-noexp;
    oracle mode refuses it up front."""
    model = tiny_llama(max_len=1024)
    idx = _indexer(model)
    names = ["spin-0.5-noexp", "spin-0.5-sum1-noexp", "spin-0.5-sum0.6-noexp"]
    configs = [q.parse_config(c) for c in names]
    prompts = _prompts((700, 523), max_new=7)
    single = q.QualityRunner(model, _text, mode="lightning", indexer=idx, k=64)
    got = BatchedQualityRunner(model, _text, mode="lightning", indexer=idx, k=64).run_batch(prompts, configs, _score)
    for prompt, rows in zip(prompts, got):
        want = single.run(prompt, configs, _score)
        for a, b in zip(rows, want):
            assert a["text"] == b["text"] and a["miss_rows"] == b["miss_rows"] > 0
            torch.testing.assert_close(a["miss_values"], b["miss_values"], rtol=0, atol=1e-6)
        assert not torch.equal(rows[1]["miss_values"], rows[0]["miss_values"])
    refused = "spin-0.5-sum1-noexp.*expected mode 'lightning'"
    with pytest.raises(ValueError, match=refused):
        q.QualityRunner(model, _text, mode="oracle", k=64).run(prompts[0], configs, _score)
    with pytest.raises(ValueError, match=refused):
        BatchedQualityRunner(model, _text, mode="oracle", k=64).run_batch(prompts, configs, _score)


def test_batched_runner_refuses_mtp_and_adaptive():
    runner = BatchedQualityRunner(tiny_llama(), _text, mode="oracle", k=64)
    for name in ("mtp3-all-keep", "adaptive-0.1"):
        with pytest.raises(ValueError, match=f"{name}.*--batch 1"):
            runner.run_batch(_prompts((300,)), [q.parse_config(name)], _score)
    assert runner.run_batch([], [q.parse_config("dense")], _score) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ["oracle", "lightning"])
def test_batched_runner_graphs_replay_the_eager_steps(mode):
    """On CUDA: one captured step replayed gives the eager batched decoding (same kernels, same shapes), miss
    records included; and the per-prompt runner's outputs."""
    model = tiny_llama(max_len=1024)
    idx = _indexer(model).cuda() if mode == "lightning" else None
    model = model.cuda()
    configs = [q.parse_config(c) for c in ("dense", "all-keep", "spin-0.5-noexp", "spin-0.3")]
    prompts = [q.Prompt(p.task, p.context, p.seed, p.ids.cuda(), p.answers, 12) for p in _prompts((700, 523, 640))]
    graphs = BatchedQualityRunner(model, _text, mode=mode, indexer=idx, k=64, graphs=True, check_every=4)
    eager = BatchedQualityRunner(model, _text, mode=mode, indexer=idx, k=64, graphs=False, check_every=4)
    single = q.QualityRunner(model, _text, mode=mode, indexer=idx, k=64)
    got, want = graphs.run_batch(prompts, configs, _score), eager.run_batch(prompts, configs, _score)
    for prompt, g_rows, e_rows in zip(prompts, got, want):
        for a, b in zip(g_rows, e_rows):
            assert (a["text"], a["steps"]) == (b["text"], b["steps"]) and a["tokens"] == 12
            if "miss_values" in b:
                torch.testing.assert_close(a["miss_values"], b["miss_values"])
        one = single.run(prompt, configs[:3], _score)
        assert [r["text"] for r in one] == [r["text"] for r in g_rows[:3]]
