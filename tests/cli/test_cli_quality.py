"""`spin-indexer quality` end to end on a tiny random Llama and a fake tokenizer (the loader and the RULER
generator are replaced; the runner, scoring, files and resume logic are the real ones)."""
from __future__ import annotations

import csv
import json

import pytest
import torch

from conftest import tiny_llama
from spin_indexer.cli import main as cli
from spin_indexer.eval.quality import CSV_COLUMNS
from spin_indexer.model import loader, ruler


class FakeTokenizer:
    """Words 'w<i>' <-> ids i (vocab 40); id 39 is EOS."""

    eos_token_id = 39

    def __call__(self, text, add_special_tokens=False):
        ids = [int(w[1:]) % 40 for w in text.split() if w.startswith("w") and w[1:].isdigit()]
        return type("Enc", (), {"input_ids": ids})()

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


@pytest.fixture
def fake_model(monkeypatch):
    model = tiny_llama(max_len=2048)
    calls = []

    def make_prompt(task, context, seed, tok):
        calls.append((task, context, seed))
        g = torch.Generator().manual_seed(seed)
        words = torch.randint(0, 39, (context - 40,), generator=g).tolist()
        return " ".join(f"w{i}" for i in words), ["w7"]  # an answer the model may or may not produce

    monkeypatch.setattr(loader, "missing_reason", lambda: None)
    monkeypatch.setattr(ruler, "missing_reason", lambda: None)
    monkeypatch.setattr(loader, "load_model", lambda **kw: (model, FakeTokenizer()))
    monkeypatch.setattr(ruler, "make_prompt", make_prompt)
    return calls


def _csv(path):
    with open(path) as f:
        return list(csv.reader(f))


def test_quality_tiny_end_to_end(fake_model, tmp_path, capsys):
    out = tmp_path / "q"
    argv = ["quality", "--tasks", "niah_single_1", "vt", "--contexts", "600", "--samples", "2", "--topk", "64",
            "--indexer", "oracle", "--configs", "dense", "spin-0.4", "mtp2-spin-0.3", "--out", str(out), "--quiet"]
    assert cli.main(argv) == 0
    rows = _csv(out / "ruler.csv")
    assert tuple(rows[0]) == CSV_COLUMNS
    cells = {(r[0], r[2]): r for r in rows[1:]}
    # 2 tasks + the pooled "all" row; all-keep was added as the MTP draft source and is reported too
    assert set(cells) == {(t, c) for t in ("niah_single_1", "vt", "all")
                          for c in ("dense", "all-keep", "spin-0.4", "mtp2-spin-0.3")}
    assert cells[("vt", "all-keep")][5:] == ["0.000000", "0.000000"]
    assert all(r[1] == "600" for r in rows[1:])
    assert cells[("vt", "dense")][3] == "2" and cells[("all", "dense")][3] == "4"
    assert cells[("vt", "dense")][5] == "-"  # dense has no indexer: no miss
    for task in ("niah_single_1", "vt"):
        mean, p99 = float(cells[(task, "spin-0.4")][5]), float(cells[(task, "spin-0.4")][6])
        assert 0.0 <= mean <= p99 <= 1.0
        assert 0.0 <= float(cells[(task, "dense")][4]) <= 100.0
    detail = _csv(out / "ruler_detail.csv")
    assert detail[0][-5:] == ["ci_low", "ci_high", "sparsity", "acceptance", "steps"]
    acc = {(r[0], r[2]): r[10] for r in detail[1:]}
    assert 1.0 <= float(acc[("vt", "mtp2-spin-0.3")]) <= 2.0 and acc[("vt", "dense")] == "-"
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    # all-keep is added for the MTP draft; 2 tasks x 2 seeds x 4 configs
    assert len(samples) == 16 and {s["config"] for s in samples} == {"dense", "spin-0.4", "mtp2-spin-0.3", "all-keep"}
    readme = (out / "README.md").read_text()
    assert "spin-indexer quality" in readme and "oracle" in readme and "<!-- notes -->" in readme
    assert len(fake_model) == 4
    # resume: nothing left to do, no prompt rebuilt; notes after the marker survive
    (out / "README.md").write_text(readme + "\nhand-written note\n")
    assert cli.main(argv) == 0 and len(fake_model) == 4
    assert "hand-written note" in (out / "README.md").read_text()
    assert len((out / "samples.jsonl").read_text().splitlines()) == 16
    # a new config on the same prompts only runs that config
    assert cli.main(argv[:-4] + ["--configs", "dense", "spin-0.2-noexp", "--out", str(out), "--quiet"]) == 0
    assert len((out / "samples.jsonl").read_text().splitlines()) == 20


def test_quality_report_only(fake_model, tmp_path, capsys):
    out = tmp_path / "q"
    argv = ["quality", "--tasks", "niah_single_1", "--contexts", "300", "--samples", "1", "--topk", "64",
            "--indexer", "oracle", "--configs", "all-keep", "--out", str(out), "--quiet", "--shard", "x"]
    assert cli.main(argv) == 0 and (out / "samples-x.jsonl").is_file()
    (out / "ruler.csv").unlink()
    readme = (out / "README.md").read_text()
    (out / "README.md").write_text(readme + "\nmy note\n")
    before = {f.name: f.read_text() for f in out.iterdir()}
    # by default --report-only writes elsewhere and leaves the samples folder (the committed results) alone
    report = tmp_path / "report"
    assert cli.main(["quality", "--report-only", "--from", str(out), "--out", str(report)]) == 0
    assert _csv(report / "ruler.csv")[1][:4] == ["niah_single_1", "300", "all-keep", "1"]
    assert "| all-keep |" in capsys.readouterr().out
    assert {f.name: f.read_text() for f in out.iterdir()} == before
    text = (report / "README.md").read_text()
    assert "my note" in text and f"--report-only --from {out} --out {report}" in text  # notes carried over
    # the old spelling (--out = the samples folder) is refused instead of mixing folders
    assert cli.main(["quality", "--report-only", "--from", str(report), "--out", str(out)]) == 1
    assert "holds samples" in capsys.readouterr().err
    assert cli.main(["quality", "--report-only", "--from", str(out), "--out", str(out)]) == 1
    assert "--update-results" in capsys.readouterr().err
    # rewriting the committed tables takes --update-results
    assert cli.main(["quality", "--report-only", "--from", str(out), "--update-results"]) == 0
    assert _csv(out / "ruler.csv")[1][:4] == ["niah_single_1", "300", "all-keep", "1"]
    assert "my note" in (out / "README.md").read_text()


def test_quality_report_only_default_out(tmp_path, monkeypatch, capsys):
    from spin_indexer.cli import quality

    monkeypatch.chdir(tmp_path)
    src = tmp_path / "samples"
    src.mkdir()
    (src / "samples.jsonl").write_text(json.dumps({"task": "vt", "context": 300, "seed": 0, "config": "dense",
                                                   "indexer": "oracle", "topk": 64, "score": 1.0, "steps": 1,
                                                   "text": "w7"}) + "\n")
    assert cli.main(["quality", "--report-only", "--from", str(src), "--quiet"]) == 0
    assert (tmp_path / quality.REPORT_OUT / "ruler.csv").is_file() and not (src / "ruler.csv").exists()


def test_quality_report_reads_xz_samples_once(tmp_path):
    import lzma

    from spin_indexer.cli import quality

    def row(seed, config, score):
        return json.dumps({"task": "vt", "context": 300, "seed": seed, "config": config, "indexer": "oracle",
                           "topk": 64, "score": score, "steps": 1, "text": "w7"}) + "\n"
    src = tmp_path / "samples"
    src.mkdir()
    packed = row(0, "all-keep", 1.0) + row(1, "all-keep", 0.0)
    (src / "samples-a.jsonl.xz").write_bytes(lzma.compress(packed.encode()))
    (src / "samples-b.jsonl").write_text(row(2, "all-keep", 1.0))

    def counted():
        assert cli.main(["quality", "--report-only", "--from", str(src), "--out", str(tmp_path / "r"), "--quiet"]) == 0
        with open(tmp_path / "r" / "ruler.csv") as f:
            return {r["task"]: (r["samples"], r["score"]) for r in csv.DictReader(f)}
    samples, score = counted()["all"]
    assert samples == "3" and float(score) == pytest.approx(200 / 3)  # the archive's rows and the plain file's
    # `xz -dk` beside the archive, one row appended since: every row once
    (src / "samples-a.jsonl").write_text(packed + row(3, "all-keep", 1.0))
    assert counted()["all"][0] == "4"
    # a run resumed from the archive: its new row alone in the plain file, the archive's rows still counted
    (src / "samples-a.jsonl").write_text(row(3, "all-keep", 1.0))
    assert counted()["all"][0] == "4"
    assert len(list(quality._lines(src))) == 4 and len(quality._done_keys(src, "oracle", 64)) == 4


def test_quality_report_only_without_samples(tmp_path, capsys):
    assert cli.main(["quality", "--report-only", "--from", str(tmp_path), "--out", str(tmp_path / "r")]) == 1
    assert "no samples" in capsys.readouterr().err
    assert cli.main(["quality", "--report-only", "--from", str(tmp_path / "none")]) == 1
    assert "--from" in capsys.readouterr().err


def test_quality_report_options_need_report_only(tmp_path, capsys):
    assert cli.main(["quality", "--update-results", "--out", str(tmp_path)]) == 1
    assert "--update-results: only with --report-only" in capsys.readouterr().err


def test_quality_refuses_mixed_settings(fake_model, tmp_path, capsys):
    out = tmp_path / "q"
    base = ["quality", "--tasks", "niah_single_1", "--contexts", "300", "--samples", "1", "--indexer", "oracle",
            "--configs", "all-keep", "--out", str(out), "--quiet"]
    assert cli.main(base + ["--topk", "64"]) == 0
    assert cli.main(base + ["--topk", "32"]) == 1  # same folder, another top-k: refused before any work
    assert "mixes settings" in capsys.readouterr().err and len(fake_model) == 1
    # a dense row of another setting pairs (dense never runs the indexer), and the report names the folder's
    with open(out / "samples-y.jsonl", "w") as f:
        f.write(json.dumps({"task": "niah_single_1", "context": 300, "seed": 0, "config": "dense",
                            "indexer": "lightning", "topk": 32, "indexer_weights": "sha256:0123456789ab",
                            "score": 1.0, "steps": 1, "text": "x"}) + "\n")
    assert cli.main(["quality", "--report-only", "--from", str(out), "--out", str(out.parent / "r")]) == 0
    readme = (out.parent / "r" / "README.md").read_text()
    assert "| niah_single_1 | 300 | dense | 1 |" in readme and "0123456789ab" not in readme and "top-k = 64" in readme
    with open(out / "samples-z.jsonl", "w") as f:  # a foreign row of a config that reads the indexer: refused
        f.write(json.dumps({"task": "vt", "context": 300, "seed": 0, "config": "all-keep", "indexer": "lightning",
                            "topk": 64, "score": 0.0, "steps": 1}) + "\n")
    assert cli.main(["quality", "--report-only", "--from", str(out), "--out", str(out.parent / "r2")]) == 1
    assert "mixes settings" in capsys.readouterr().err


def test_paired_table():
    from spin_indexer.cli.quality import paired_table

    def s(seed, cfg, text, score):
        return {"task": "vt", "context": 300, "seed": seed, "config": cfg, "text": text, "score": score}
    rows = [s(0, "all-keep", "a", 1.0), s(0, "spin-0.4", "a", 1.0), s(1, "all-keep", "b", 0.0),
            s(1, "spin-0.4", "c", 0.5), s(2, "all-keep", "d", 1.0), s(2, "spin-0.4", "e", 0.0), s(3, "spin-0.4", "f", 1.0)]
    table = paired_table(rows, ["all-keep", "spin-0.4"])
    diffs = [0.0, 50.0, -100.0]  # spin-0.4 minus all-keep on seeds 0-2 (seed 3 has no pair)
    mean = sum(diffs) / 3
    half = 1.959964 * (sum((d - mean) ** 2 for d in diffs) / 2 / 3) ** 0.5
    assert f"| 300 | spin-0.4 | 3 | 1 | 1 | 1 | -16.67 | {mean - half:+.2f} to {mean + half:+.2f} | +-2 | no |" in table
    assert "| all-keep |" not in table
    one = paired_table(rows[:2], ["all-keep", "spin-0.4"])  # one pair: no interval, no verdict
    assert "| 300 | spin-0.4 | 1 | 1 | 0 | 0 | +0.00 | - | +-2 | - |" in one
    named = paired_table([dict(r, config="spin-layers-mix@0.3") if r["config"] == "spin-0.4" else r for r in rows],
                         ["all-keep", "spin-layers-mix@0.3"])  # a named policy at 30%: #18's 1-point bound
    ci = f"{mean - half:+.2f} to {mean + half:+.2f}"
    assert f"| 300 | spin-layers-mix@0.3 | 3 | 1 | 1 | 1 | -16.67 | {ci} | +-1 | no |" in named
    other = paired_table(rows + [dict(r, context=600) for r in rows[:2]], ["all-keep", "spin-0.4"])
    assert "| 600 | spin-0.4 | 1 | 1 | 0 | 0 | +0.00 | - | +-2 | - |" in other  # each length paired on its own
    dense = paired_table([dict(r, config="dense") if r["config"] == "spin-0.4" else r for r in rows],
                         ["dense", "all-keep"])
    assert "| 300 | dense | 3 | 1 | 1 | 1 | -16.67 |" in dense and dense.rstrip().endswith("| - | - |")


def test_quality_with_named_indexer_weights(fake_model, tmp_path, capsys):
    """--indexer-weights: the rows name the file (and hash); a folder of the shipped head refuses them."""
    from spin_indexer.model.indexer_head import Indexer, IndexerConfig

    torch.manual_seed(1)
    head = Indexer(IndexerConfig(dim=32, num_layers=2, num_heads=2, head_dim=16, q_rank=8, rope_dim=8,
                                 rope_yarn=False), max_len=400)
    weights = tmp_path / "long.safetensors"
    head.save(weights)
    out = tmp_path / "q"
    base = ["quality", "--tasks", "niah_single_1", "--contexts", "300", "--samples", "1", "--topk", "64",
            "--indexer", "lightning", "--configs", "all-keep", "spin-0.5", "--quiet"]
    assert cli.main(base + ["--indexer-weights", str(weights), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and {r["indexer"] for r in rows} == {"lightning"}
    assert {r["indexer_weights"] for r in rows} == {f"sha256:{_sha12(weights)}"}
    readme = (out / "README.md").read_text()
    assert f"sha256:{_sha12(weights)}" in readme and "--indexer-weights" in readme
    # the same folder with the shipped head (another setting) is refused before any work
    calls = len(fake_model)
    assert cli.main(base + ["--out", str(out)]) == 1
    assert "mixes settings" in capsys.readouterr().err and len(fake_model) == calls
    assert cli.main(base + ["--indexer-weights", str(tmp_path / "none.safetensors"), "--out", str(out)]) == 1
    assert "--indexer-weights: no file" in capsys.readouterr().err


def _sha12(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def test_quality_batched_equals_per_prompt(fake_model, tmp_path, capsys):
    """--batch 3 decodes the prompts of a context together: the same samples (text, score, steps) as --batch 1,
    the rows say the batch size, and the paired table comes out as for a per-prompt run."""
    common = ["quality", "--tasks", "niah_single_1", "qa_1", "--contexts", "500", "--samples", "2", "--topk", "64",
              "--indexer", "oracle", "--configs", "all-keep", "dense", "spin-0.5-noexp", "--quiet"]
    assert cli.main(common + ["--out", str(tmp_path / "one")]) == 0
    assert cli.main(common + ["--out", str(tmp_path / "three"), "--batch", "3"]) == 0

    def rows(name):
        lines = (tmp_path / name / "samples.jsonl").read_text().splitlines()
        return {(r["task"], r["seed"], r["config"]): r for r in map(json.loads, lines)}

    one, three = rows("one"), rows("three")
    assert set(one) == set(three) and len(one) == 12
    for key, r in one.items():
        assert (three[key]["text"], three[key]["score"], three[key]["steps"]) == (r["text"], r["score"], r["steps"])
        assert three[key]["batch"] in (3, 1) and "batch" not in r  # 4 prompts: a group of 3, then 1
        if key[2] == "spin-0.5-noexp":
            assert three[key]["miss_values"] == pytest.approx(r["miss_values"], abs=1e-5)
    readme = (tmp_path / "three" / "README.md").read_text()
    assert "--batch 3" in readme and "| 500 | spin-0.5-noexp | 4 |" in readme


def test_quality_batch_refuses_mtp(fake_model, tmp_path, capsys):
    argv = ["quality", "--contexts", "500", "--configs", "all-keep", "mtp3-all-keep", "--batch", "4", "--out",
            str(tmp_path / "q"), "--quiet"]
    assert cli.main(argv) == 1
    assert "--configs: mtp3-all-keep not with --batch > 1" in capsys.readouterr().err
