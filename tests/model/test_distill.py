"""Distillation pieces on a tiny random model: targets, the KL loss, a few steps that lower it, recall."""
from __future__ import annotations

import json

import torch

from helpers import tiny_indexer, tiny_model
from spin_indexer.model.distill import (DistillConfig, attention_target, decode_perplexity, indexer_scores, kl_loss,
                                        topk_recall, train)


def test_attention_target_is_the_head_mean_of_causal_softmax():
    b, s, hq, hkv, d = 2, 9, 4, 2, 8
    q, k = torch.randn(b, s, hq, d), torch.randn(b, s, hkv, d)
    got = attention_target(q, k)
    for bi in range(b):
        want = torch.zeros(s, s, dtype=torch.float64)
        for h in range(hq):
            logits = q[bi, :, h].double() @ k[bi, :, h // 2].double().T / d ** 0.5
            logits = logits.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            want += torch.softmax(logits, -1) / hq
        torch.testing.assert_close(got[bi].double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.ones(b, s))


def test_kl_is_zero_at_the_target_and_positive_elsewhere():
    s = 12
    logits = torch.randn(1, s, s).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(logits, -1)
    assert abs(float(kl_loss(p, logits + 3.0, min_row=0))) < 1e-5  # a constant shift is the same distribution
    assert float(kl_loss(p, logits.flip(-1).tril(), min_row=2)) > 1e-3
    # only rows >= min_row count
    bad = logits.clone()
    bad[0, :4] = torch.randn(4, s).masked_fill(torch.ones(4, s, dtype=torch.bool).triu(1), float("-inf"))
    assert abs(float(kl_loss(p, bad, min_row=4))) < 1e-5


def test_indexer_scores_are_causal_and_match_per_pair_formula():
    idx = tiny_indexer()
    h = torch.randn(1, 20, 64)
    sc = indexer_scores(idx, 1, h)
    assert torch.isneginf(sc[0].triu(1)[torch.ones(20, 20, dtype=torch.bool).triu(1)]).all()
    pos = torch.arange(20)
    q, w = idx.layers[1].queries(h, pos, idx.rope)
    k = idx.layers[1].keys(h, pos, idx.rope)
    t, s = 17, 5
    want = (w[0, t] * torch.relu(q[0, t] @ k[0, s])).sum()
    torch.testing.assert_close(sc[0, t, s], want, rtol=1e-5, atol=1e-6)


def test_a_few_steps_lower_the_loss():
    torch.manual_seed(0)
    model, idx = tiny_model(max_len=256), tiny_indexer(max_len=256)
    tokens = torch.randint(0, 97, (4000,))
    batch = tokens[:128].view(1, 128)

    def loss_now():
        _, saved = model.forward_dense(batch, return_attn_inputs=True)
        with torch.no_grad():
            return sum(float(kl_loss(attention_target(q, k), indexer_scores(idx, i, h), 16))
                       for i, (h, q, k) in enumerate(saved))

    before = loss_now()
    log = train(model, idx, tokens, DistillConfig(seq_len=128, batch=2, lr=1e-2, warmup_steps=1, time_budget_s=60,
                                                  max_steps=12, min_row=16, log_every=5), log_fn=lambda *a: None)
    assert log.steps == 12 and log.history and log.history[0]["step"] == 1
    after = loss_now()
    assert after < 0.8 * before, (before, after)
    assert not any(p.requires_grad for p in idx.parameters())


def test_recall_and_perplexity_report_shapes():
    model, idx = tiny_model(max_len=256), tiny_indexer(max_len=256)
    tokens = torch.randint(0, 97, (1, 96))
    rec = topk_recall(model, idx, tokens, 8, slice(48, 96))
    assert set(rec) == {"lightning", "oracle", "random"}
    assert len(rec["lightning"]) == model.cfg.num_layers
    assert all(0 <= r <= 1 for r in rec["lightning"] + rec["oracle"])
    full = topk_recall(model, None, tokens, 96, slice(48, 96))
    assert full["oracle"] == [1.0, 1.0] and full["random"] == 1.0
    dense = decode_perplexity(model, tokens, 80, "dense", 0)
    same = decode_perplexity(model, tokens, 80, "oracle", 4096)
    assert abs(dense - same) < 1e-3 * dense


def test_max_target_is_renormalised_head_max():
    b, s, hq, hkv, d = 1, 7, 4, 2, 8
    q, k = torch.randn(b, s, hq, d) * 3, torch.randn(b, s, hkv, d)
    got = attention_target(q, k, "max")
    probs = []
    for h in range(hq):
        logits = (q[0, :, h] @ k[0, :, h // 2].T) / d ** 0.5
        probs.append(torch.softmax(logits.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")), -1))
    top = torch.stack(probs).amax(0)
    torch.testing.assert_close(got[0], top / top.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    import pytest
    with pytest.raises(ValueError, match="reduce"):
        attention_target(q, k, "median")


def _distill_cli_setup(tmp_path, monkeypatch, yarn_factor=1.0, heldout=128):
    """The distill CLI on the tiny model (loader patched), a random token corpus and tiny init weights."""
    from spin_indexer.cli import distill as cli_distill
    from spin_indexer.model import loader

    model = tiny_model(max_len=300, yarn_factor=yarn_factor)
    monkeypatch.setattr(loader, "load_model", lambda *a, **kw: (model, None))
    torch.manual_seed(0)
    data = tmp_path / "corpus.pt"
    torch.save({"train": torch.randint(0, 97, (3000,), dtype=torch.int32),
                "heldout": torch.randint(0, 97, (1, heldout), dtype=torch.int32)}, data)
    init = tmp_path / "init.safetensors"
    tiny_indexer(max_len=300).save(init)
    return cli_distill, data, init


def test_distill_cli_fine_tunes_from_init_with_plain_rope(tmp_path, monkeypatch):
    """`spin-indexer distill --init W --indexer-rope plain`: starts from W's weights and shape (not the
    --heads default), trains with plain RoPE even though the model runs YaRN x2, saves rope_yarn=False."""
    from spin_indexer.model.indexer_head import Indexer

    cli_distill, data, init = _distill_cli_setup(tmp_path, monkeypatch, yarn_factor=2.0)
    common = ["--data", str(data), "--seq-len", "256", "--batch", "1", "--device", "cpu", "--no-eval", "--quiet",
              "--init", str(init), "--indexer-rope", "plain"]
    assert cli_distill.main(common + ["--max-steps", "0", "--out", str(tmp_path / "zero")]) == 0
    start, zero = Indexer.load(init), Indexer.load(tmp_path / "zero" / "smollm2_indexer.safetensors")
    assert zero.cfg.num_heads == 2 and zero.cfg.rope_yarn is False and start.cfg.rope_yarn is True
    for (name, a), b in zip(start.state_dict().items(), zero.state_dict().values()):
        torch.testing.assert_close(b, a, msg=name)  # no step: the init comes back unchanged
    assert cli_distill.main(common + ["--max-steps", "3", "--lr", "0.5", "--out", str(tmp_path / "three")]) == 0
    three = Indexer.load(tmp_path / "three" / "smollm2_indexer.safetensors")
    assert any(not torch.equal(a, b) for a, b in zip(start.state_dict().values(), three.state_dict().values()))
    log = json.loads((tmp_path / "three" / "training_log.json").read_text())
    assert log["steps"] == 3 and "--init" in log["command"]


def test_distill_cli_eval_only_reports_the_init_weights(tmp_path, monkeypatch):
    """--eval-only: no training, no weights written; the report names the evaluated file and keeps its
    rotary setting. Without --init it is refused with the argument named."""
    import hashlib

    import pytest

    cli_distill, data, init = _distill_cli_setup(tmp_path, monkeypatch, heldout=160)
    monkeypatch.setattr(cli_distill, "REPORT_K", (8, 16))  # the real 64 / 256 need longer documents
    argv = ["--data", str(data), "--eval-len", "160", "--eval-docs", "1", "--ppl-tokens", "8", "--device", "cpu",
            "--quiet", "--out", str(tmp_path / "ev")]
    assert cli_distill.main(argv + ["--eval-only", "--init", str(init)]) == 0
    report = json.loads((tmp_path / "ev" / "distill_report.json").read_text())
    assert report["weights_sha256"] == hashlib.sha256(init.read_bytes()).hexdigest()
    assert report["eval_len"] == 160 and 0.0 <= report["recall_mean_lightning_k8"] <= 1.0
    assert report["ppl_dense"] > 1.0 and not (tmp_path / "ev" / "smollm2_indexer.safetensors").exists()
    with pytest.raises(ValueError, match="--eval-only"):
        cli_distill.main(argv + ["--eval-only"])
