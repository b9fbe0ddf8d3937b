"""Prompt files (traces/prompt_file.py): plain text with '---' separators, JSONL, fitting, errors naming --prompts."""
from __future__ import annotations

import hashlib
import json

import pytest

from spin_indexer.traces.prompt_file import MIN_TOKENS, file_stem, fit_tokens, read_prompt_file, score_text


def test_plain_text_one_document_and_separators(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("  a single document\nwith --- inside a line\n\n")
    docs = read_prompt_file(one)
    assert [(d.doc_id, d.text) for d in docs] == [("doc0", "a single document\nwith --- inside a line")]
    many = tmp_path / "many.md"
    many.write_text("first\n---\n\n  ---  \nsecond\nline\n---\n")  # blank documents are skipped
    docs = read_prompt_file(many)
    assert [(d.doc_id, d.text, d.answers) for d in docs] == [("doc0", "first", []), ("doc1", "second\nline", [])]
    assert docs[1].sha256 == hashlib.sha256(b"second\nline").hexdigest()


def test_jsonl_ids_answers_and_blank_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"text": "alpha", "id": "a/1"}, {"text": "beta", "answer": "B", "extra": 1}, {"text": "gamma", "id": 7,
                                                                                       "answer": ["x", "y"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    docs = read_prompt_file(path)
    assert [(d.doc_id, d.text, d.answers) for d in docs] == [("a/1", "alpha", []), ("line2", "beta", ["B"]),
                                                             ("7", "gamma", ["x", "y"])]


@pytest.mark.parametrize("name, content, needle", [
    ("empty.txt", "", "holds no document"), ("blank.txt", "\n \n---\n", "holds no document"),
    ("empty.jsonl", "\n", "holds no document"),
    ("p.jsonl", '{"id": "a"}\n', 'line 1: expected a non-empty "text" string, got no "text" field'),
    ("p.jsonl", '{"text": "ok"}\n{"text": ""}\n', "line 2: expected a non-empty \"text\" string"),
    ("p.jsonl", '{"text": 3}\n', '"text" = 3'),
    ("p.jsonl", "[1, 2]\n", "line 1: expected a JSON object"), ("p.jsonl", "{nope\n", "line 1: not valid JSON"),
    ("p.jsonl", '{"text": "t", "answer": 3}\n', '"answer": expected a string or a list of strings'),
    ("p.jsonl", '{"text": "t", "id": ""}\n', '"id": expected a non-empty string'),
    ("p.jsonl", '{"text": "t", "id": "x"}\n{"text": "u", "id": "x"}\n', "id 'x' appears twice")])
def test_bad_files_name_the_argument_and_the_line(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match="^--prompts: ") as err:
        read_prompt_file(path)
    assert needle in str(err.value) and str(path) in str(err.value)


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(ValueError, match="--prompts: no file .*absent.txt"):
        read_prompt_file(tmp_path / "absent.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="--prompts: .*bin.txt is not UTF-8"):
        read_prompt_file(tmp_path / "bin.txt")


def test_fit_cuts_or_refuses_and_refuses_short_documents():
    ids = list(range(1000))
    assert fit_tokens(ids, 600, "cut", "d") == (ids[:600], True)
    assert fit_tokens(ids, 1000, "refuse", "d") == (ids, False)
    assert fit_tokens(ids[:MIN_TOKENS], 4096, "cut", "d") == (ids[:MIN_TOKENS], False)  # shorter: used whole
    with pytest.raises(ValueError, match=r"--prompts: document 'd' has 1000 tokens, more than --context 600 "
                                         r"\(--fit refuse"):
        fit_tokens(ids, 600, "refuse", "d")
    with pytest.raises(ValueError, match=f"--prompts: document 'tiny' has 255 tokens, fewer than the minimum "
                                         f"context of {MIN_TOKENS}"):
        fit_tokens(ids[:255], 600, "cut", "tiny")
    with pytest.raises(ValueError, match="--fit"):
        fit_tokens(ids, 600, "wrap", "d")


def test_score_and_file_stem():
    assert score_text("The Answer is 42", ["answer", "42", "7"]) == pytest.approx(2 / 3)
    assert score_text("anything", []) is None
    assert file_stem("a/b c:d.py") == "a_b_c_d.py" and file_stem("///") == "_"
