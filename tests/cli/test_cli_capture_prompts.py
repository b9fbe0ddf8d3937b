"""`spin-indexer capture --prompts FILE` on a tiny random Llama (the loader patched, as in test_cli_demo): each
document of a text or JSONL file becomes one trace with its domain, source and sha256 in the meta; bad files
fail with one line naming --prompts, before the model loads where they can."""
from __future__ import annotations

import hashlib
import json

import pytest

from conftest import tiny_llama
from spin_indexer.cli import main as cli
from spin_indexer.traces.schema import list_traces, load_trace


class CharTokenizer:
    """One token per character (ids 0..38), no special tokens; id 39 is EOS."""
    eos_token_id = 39

    def __call__(self, text, add_special_tokens=True):
        return type("Enc", (), {"input_ids": [ord(c) % 39 for c in text]})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.fixture
def tiny(monkeypatch):
    """The model 'is installed': load_model returns a tiny random Llama and the character tokenizer."""
    from spin_indexer.model import loader, ruler

    model = tiny_llama(max_len=1024)
    loads = []
    monkeypatch.setattr(loader, "missing_reason", lambda: None)
    monkeypatch.setattr(ruler, "missing_reason", lambda: "RULER generators absent (test)")  # files need none
    monkeypatch.setattr(loader, "load_model", lambda *a, **kw: loads.append(1) or (model, CharTokenizer()))
    return loads


def _capture(tmp_path, *argv):
    return cli.main(["capture", "--indexer", "oracle", "--context", "300", "--steps", "3", "--k", "16", "--device",
                     "cpu", "--quiet", "--out", str(tmp_path / "tr"), *argv])


def _metas(tmp_path):
    return {p.stem: load_trace(p).meta for p in list_traces(tmp_path / "tr")}  # load_trace validates each


def test_text_file_with_separator_cuts_long_documents(tiny, tmp_path):
    long_doc, short_doc = "x" * 700, "the second document " * 14  # 700 and 279 tokens (one per character)
    path = tmp_path / "notes.txt"
    path.write_text(f"{long_doc}\n---\n{short_doc}\n")
    assert _capture(tmp_path, "--prompts", str(path)) == 0
    metas = _metas(tmp_path)
    assert set(metas) == {"notes_doc0_300_oracle_s0", "notes_doc1_300_oracle_s0"}
    first, second = metas["notes_doc0_300_oracle_s0"], metas["notes_doc1_300_oracle_s0"]
    assert (first.context_len, first.extra["cut"], first.extra["document_tokens"]) == (300, True, 700)
    assert (second.context_len, second.extra["cut"], second.extra["document_tokens"]) == (279, False, 279)
    for meta, text in ((first, long_doc), (second, short_doc.strip())):
        assert meta.task == "notes" and meta.extra["domain"] == "notes" and meta.extra["source_file"] == "notes.txt"
        assert meta.extra["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()
        assert meta.extra["fit"] == "cut" and meta.extra["score"] is None and meta.extra["answers"] == []
    assert first.extra["doc_id"] == "doc0" and second.extra["doc_id"] == "doc1"


def test_jsonl_ids_answers_and_domain(tiny, tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"id": "q/1", "text": "y" * 290, "answer": "a"}) + "\n" +
                    json.dumps({"text": "z" * 300}) + "\n")
    assert _capture(tmp_path, "--prompts", str(path), "--domain", "code", "--next-n", "2") == 0
    metas = _metas(tmp_path)
    assert set(metas) == {"code_q_1_300_oracle_mtp2_s0", "code_line2_300_oracle_mtp2_s0"}
    meta = metas["code_q_1_300_oracle_mtp2_s0"]
    assert meta.extra["domain"] == "code" and meta.task == "code" and meta.extra["doc_id"] == "q/1"
    assert meta.extra["source_file"] == "qa.jsonl" and meta.extra["answers"] == ["a"] and meta.next_n == 2
    assert meta.extra["score"] in (0.0, 1.0)


def test_ruler_traces_say_domain_ruler(tiny, tmp_path, monkeypatch):
    from spin_indexer.model import ruler

    monkeypatch.setattr(ruler, "missing_reason", lambda: None)
    monkeypatch.setattr(ruler, "make_prompt", lambda task, context, seed, tok: ("w" * 280, ["q"]))
    assert _capture(tmp_path, "--prompts", "2", "--seed", "5") == 0
    metas = _metas(tmp_path)
    assert set(metas) == {"niah_single_1_300_oracle_s5", "niah_single_1_300_oracle_s6"}
    assert all(m.extra["domain"] == "ruler" and m.task == "niah_single_1" for m in metas.values())


def _one_line(capsys, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spin-indexer capture: error:"), err
    for needle in needles:
        assert needle in err[0], err[0]


@pytest.mark.parametrize("name, content, extra, needles", [
    (None, None, [], ["--prompts: no file", "absent.txt"]),
    ("empty.txt", "", [], ["--prompts:", "holds no document"]),
    ("p.jsonl", '{"text": "' + "a" * 300 + '"}\n{"id": "b"}\n', [], ["--prompts:", "line 2", '"text"']),
    ("p.txt", "a" * 300, ["--task", "vt"], ["--task: not used with --prompts FILE"]),
    ("p.txt", "a" * 300, ["--domain", "ruler"], ["--domain: expected a non-empty name other than 'ruler'"])])
def test_bad_files_fail_before_the_model_loads(tiny, tmp_path, capsys, name, content, extra, needles):
    path = tmp_path / (name or "absent.txt")
    if content is not None:
        path.write_text(content)
    assert _capture(tmp_path, "--prompts", str(path), *extra) != 0
    _one_line(capsys, *needles)
    assert not tiny and not (tmp_path / "tr").exists()


def test_domain_needs_a_file(tiny, tmp_path, capsys):
    assert _capture(tmp_path, "--prompts", "2", "--domain", "code") != 0
    _one_line(capsys, "--domain: only with --prompts FILE")


@pytest.mark.parametrize("docs, extra, needles", [
    (["a" * 400, "b" * 100], [], ["--prompts: document 'doc1' has 100 tokens, fewer than the minimum context of 256"]),
    (["a" * 400], ["--fit", "refuse"], ["--prompts: document 'doc0' has 400 tokens, more than --context 300"])])
def test_documents_that_do_not_fit_fail_before_any_trace(tiny, tmp_path, capsys, docs, extra, needles):
    path = tmp_path / "p.txt"
    path.write_text("\n---\n".join(docs))
    assert _capture(tmp_path, "--prompts", str(path), *extra) != 0
    _one_line(capsys, *needles)
    assert not (tmp_path / "tr").exists()  # every document is checked before the first decodes
