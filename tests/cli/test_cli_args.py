"""Bad arguments fail with one line naming the option, before any model load or trace read; every option has
help text and shows its default; `bench` is not offered."""
from __future__ import annotations

import json
import re

import pytest

from spin_indexer.cli import main as cli


def _one_line_error(capsys, command: str, *needles: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"spin-indexer {command}: error:"), err[0]
    assert "Traceback" not in err[0]
    for needle in needles:
        assert needle in err[0], err[0]
    return err[0]


@pytest.fixture
def no_model_load(monkeypatch):
    """The model 'is installed' but loading it fails the test: argument errors must come first."""
    from spin_indexer.model import loader, ruler

    def load_model(*a, **kw):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loader, "missing_reason", lambda: None)
    monkeypatch.setattr(ruler, "missing_reason", lambda: None)
    monkeypatch.setattr(loader, "load_model", load_model)


# --- help -------------------------------------------------------------------------------------------------------

def test_bench_is_not_offered(capsys):
    assert "bench" not in cli.SUBCOMMANDS
    parser, _ = cli.build_parser([])
    assert not re.search(r"\bbench\b", parser.format_help())
    with pytest.raises(SystemExit):
        cli.main(["bench"])
    assert "invalid choice: 'bench'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_every_option_has_help_and_the_module_exists(name):
    parser, chosen = cli.build_parser([name])
    assert chosen == name  # the module loads (no subcommand is listed without one)
    sub = next(a for a in parser._actions if a.dest == "command").choices[name]
    for action in sub._actions:
        assert action.help, f"{name} {action.option_strings or action.dest}: no help text"
    sub.format_help()  # every %(default)s expands


@pytest.mark.parametrize("name, option, default", [
    ("eval", "--out", "runs/eval"), ("eval", "--sweep", "main"), ("capture", "--k", "256"),
    ("capture", "--steps", "64"), ("capture", "--context", "4096"), ("distill", "--minutes", "3.5"),
    ("capture", "--seed", "0"), ("quality", "--out", "results/quality"), ("quality", "--out", "runs/quality-report")])
def test_defaults_are_shown(name, option, default):
    parser, _ = cli.build_parser([name])
    sub = next(a for a in parser._actions if a.dest == "command").choices[name]
    entry = re.search(rf"\n  {option}[ ,].*?(?=\n  -|\Z)", sub.format_help(), re.S).group(0)  # the option's help
    entry = " ".join(entry.split())
    assert f"default: {default})" in entry or f"default {default})" in entry, entry


def test_report_lists_no_ignored_option():
    parser, _ = cli.build_parser(["report"])
    sub = next(a for a in parser._actions if a.dest == "command").choices["report"]
    flags = {f for a in sub._actions for f in a.option_strings}
    assert flags == {"-h", "--help", "--out", "--no-plots", "--debug"}


# --- eval -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, option", [
    (["--max-steps", "0"], "--max-steps"), (["--max-steps", "-1"], "--max-steps"), (["--prompts", "0"], "--prompts"),
    (["--layer-stride", "0"], "--layer-stride"), (["--batch", "0"], "--batch"), (["--steps", "0"], "--steps"),
    (["--name", "a", "--name", "b"], "--name"), (["--table1-steps", "1"], "--table1-steps")])
def test_eval_rejects_bad_numbers(tmp_path, capsys, argv, option):
    code = cli.main(["eval", "--synthetic", "v4-like", "--out", str(tmp_path / "ev"), "--quiet", *argv])
    assert code != 0
    _one_line_error(capsys, "eval", option)
    assert not (tmp_path / "ev").exists()


def test_eval_rejects_an_unwritable_out(capsys):
    assert cli.main(["eval", "--synthetic", "v4-like", "--out", "/dev/null/x", "--quiet"]) != 0
    _one_line_error(capsys, "eval", "--out", "/dev/null")


# --- report -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, needle", [
    ("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object"), ('{"table1": []}', "missing 'summary'"),
    ('{"summary": {"a": 1}}', "summary: expected a list"), ('{"summary": [3]}', "summary[0]: expected an object"),
    ('{"summary": [{"trace_set": "x"}]}', "summary[0]: missing field(s) indexer"),
    ('{"summary": [{"trace_set": "x", "indexer": "o", "context": "all", "sparsity_target": "0.3", "policy": "p", '
     '"mean_miss": 0, "p99_miss": 0, "realized_sparsity": 0, "rows": 1}]}', "sparsity_target: expected a number"),
    ('{"summary": [], "run": [1]}', "run: expected an object")])
def test_report_names_the_bad_file(tmp_path, capsys, text, needle):
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "rows.json").write_text(text)
    assert cli.main(["report", str(tmp_path), "--no-plots"]) != 0
    _one_line_error(capsys, "report", str(tmp_path / "run1" / "rows.json"), needle)
    assert not (tmp_path / "summary.csv").exists()


def test_report_writes_to_out(tmp_path, capsys):
    row = {"trace_set": "x", "indexer": "oracle", "context": "all", "sparsity_target": 0.3, "policy": "spin-default",
           "mean_miss": 0.01, "p99_miss": 0.1, "realized_sparsity": 0.3, "rows": 12}
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "rows.json").write_text(json.dumps({"summary": [row], "table1": [], "run": {}}))
    assert cli.main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "merged"), "--no-plots"]) == 0
    assert (tmp_path / "merged" / "summary.csv").is_file() and not (tmp_path / "runs" / "summary.csv").exists()


# --- capture ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["--layers", "x"], "--layers: expected comma-separated"), (["--layers", "0-99"], "--layers: expected indices in"),
    (["--layers", "5-2"], "--layers"), (["--layers", "0-8:0"], "--layers"), (["--k", "0"], "--k"),
    (["--steps", "-1"], "--steps"), (["--prompts", "0"], "--prompts"), (["--context", "10"], "--context"),
    (["--next-n", "0"], "--next-n"), (["--out", "/dev/null/x"], "--out"), (["--task", "nope"], "task"),
    (["--indexer", "lightning", "--weights", "/no/such.safetensors"], "--weights"),
    (["--summary-parts", "3"], "--summary-parts: expected divisors"), (["--summary-parts", "128"], "--summary-parts")])
def test_capture_rejects_before_loading(no_model_load, tmp_path, capsys, argv, needle):
    out = ["--out", str(tmp_path / "tr")] if "--out" not in argv else []
    assert cli.main(["capture", "--indexer", "oracle", "--quiet", *out, *argv]) != 0
    _one_line_error(capsys, "capture", needle)
    assert not (tmp_path / "tr").exists()


def test_capture_layers_parse():
    from spin_indexer.cli.capture import _parse_layers

    assert _parse_layers("0-29:4") == [0, 4, 8, 12, 16, 20, 24, 28]
    assert _parse_layers("8, 0,8") == [0, 8]
    assert _parse_layers(None) is None


# --- demo -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["--topk", "0"], "--topk"), (["--new-tokens", "0"], "--new-tokens"), (["--out", "/dev/null/x"], "--out"),
    (["--task", "nope"], "task"), (["--policy", "nope"], "--policy")])
def test_demo_rejects_before_loading(no_model_load, monkeypatch, tmp_path, capsys, argv, needle):
    import spin_indexer.cli.demo as demo

    monkeypatch.setattr(demo, "missing", lambda: None)
    out = ["--out", str(tmp_path / "d")] if "--out" not in argv else []
    assert cli.main(["demo", "--quiet", *out, *argv]) != 0
    _one_line_error(capsys, "demo", needle)


def test_out_dir_check(tmp_path):
    (tmp_path / "file").write_text("x")
    assert cli.check_out_dir("--out", tmp_path / "a" / "b") == tmp_path / "a" / "b"
    with pytest.raises(ValueError, match="--out: .*not a directory"):
        cli.check_out_dir("--out", tmp_path / "file" / "x")
    with pytest.raises(ValueError, match="--out: .*not a directory"):
        cli.check_out_dir("--out", tmp_path / "file")


def test_loading_line_says_the_first_load_is_slow(monkeypatch, tmp_path):
    from spin_indexer.model import loader

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    monkeypatch.setattr(loader, "find_gguf", lambda: gguf)
    monkeypatch.setenv("SPIN_INDEXER_CACHE", str(tmp_path / "cache"))
    line = cli.loading_line(" on cpu")
    assert line.startswith("loading SmolLM2") and "on cpu ..." in line and "first load converts the GGUF, ~50 s" in line
    cache = loader.cache_dir(gguf)
    cache.mkdir(parents=True)
    (cache / "model.safetensors").write_bytes(b"")
    assert "first load" not in cli.loading_line()
