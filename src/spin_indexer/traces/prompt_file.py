"""Prompts read from a file, for `spin-indexer capture --prompts FILE`: one document per prompt.

Two formats, told apart by the suffix:
  * `.jsonl`: one JSON object per non-blank line, with a "text" string, an optional "id" (default
    `line<n>`, n counted from 1) and an optional "answer" (a string or a list of strings, scored like
    RULER's string_match_all: the fraction found in the generated text, case-insensitive). Other keys
    are ignored.
  * anything else, as UTF-8 plain text: the whole file is one document, or several separated by lines
    holding only `---` (surrounding blank space ignored); ids `doc0`, `doc1`, ... in file order.

Each document is tokenized by the caller and fitted with `fit_tokens`: at least MIN_TOKENS tokens
(else refused), and at most `context` tokens: a longer one is cut to its first `context` tokens
(fit="cut", the default) or refused (fit="refuse"). A shorter one is used whole, so the trace's
context_len is then the document's length. Every error is a ValueError naming the argument (`--prompts`)
and, where it applies, the line or the document id.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

MIN_TOKENS = 256  # the smallest --context capture accepts
SEPARATOR = "---"
FITS = ("cut", "refuse")


@dataclass(frozen=True)
class Document:
    """One prompt: `doc_id` (unique in its file), `text` (stripped), expected `answers` (maybe empty),
    `sha256` (hex digest of text encoded as UTF-8)."""
    doc_id: str
    text: str
    answers: list[str] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def read_prompt_file(path: str | Path, name: str = "--prompts") -> list[Document]:
    """Documents of a plain-text or JSONL prompt file (formats in the module docstring), in file order.

    raises ValueError naming `name` and the file: missing, not UTF-8, no document, a JSONL line that is not
    an object with a non-empty "text" string, a bad "id"/"answer", or a repeated id."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{name}: no file {path}")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{name}: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    docs = _read_jsonl(raw, path, name) if path.suffix == ".jsonl" else _read_text(raw)
    if not docs:
        raise ValueError(f"{name}: {path} holds no document (empty, blank, or only '{SEPARATOR}' lines)")
    seen = set()
    for doc in docs:
        if doc.doc_id in seen:
            raise ValueError(f"{name}: {path}: id {doc.doc_id!r} appears twice (ids name the traces)")
        seen.add(doc.doc_id)
    return docs


def _read_text(raw: str) -> list[Document]:
    parts, current = [], []
    for line in raw.splitlines():
        if line.strip() == SEPARATOR:
            parts.append("\n".join(current))
            current = []
        else:
            current.append(line)
    parts.append("\n".join(current))
    texts = [p.strip() for p in parts if p.strip()]
    return [Document(f"doc{i}", text) for i, text in enumerate(texts)]


def _read_jsonl(raw: str, path: Path, name: str) -> list[Document]:
    docs = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}: {path} line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object with a \"text\" field, got {type(obj).__name__}")
        text = obj.get("text")
        if not isinstance(text, str) or not text.strip():
            got = "no \"text\" field" if "text" not in obj else f"\"text\" = {text!r:.40}"
            raise ValueError(f"{where}: expected a non-empty \"text\" string, got {got}")
        doc_id = obj.get("id", f"line{number}")
        if not isinstance(doc_id, (str, int)) or isinstance(doc_id, bool) or not str(doc_id).strip():
            raise ValueError(f"{where}: \"id\": expected a non-empty string or an int, got {doc_id!r}")
        answers = obj.get("answer", [])
        answers = [answers] if isinstance(answers, str) else answers
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise ValueError(f"{where}: \"answer\": expected a string or a list of strings, got {answers!r:.40}")
        docs.append(Document(str(doc_id).strip(), text.strip(), list(answers)))
    return docs


def fit_tokens(ids: list[int], context: int, fit: str, doc_id: str, name: str = "--prompts") -> tuple[list[int], bool]:
    """(ids, cut): the document's token ids fitted to `context` tokens, and whether they were cut.

    ids: the document's token ids; fit: "cut" keeps the first `context` ids of a longer document,
    "refuse" raises instead. A document of fewer than MIN_TOKENS ids is always refused (ValueError)."""
    if fit not in FITS:
        raise ValueError(f"--fit: expected one of {', '.join(FITS)}, got {fit!r}")
    if len(ids) < MIN_TOKENS:
        raise ValueError(f"{name}: document {doc_id!r} has {len(ids)} tokens, fewer than the minimum context "
                         f"of {MIN_TOKENS}")
    if len(ids) <= context:
        return list(ids), False
    if fit == "refuse":
        raise ValueError(f"{name}: document {doc_id!r} has {len(ids)} tokens, more than --context {context} "
                         f"(--fit refuse; --fit cut keeps the first {context})")
    return list(ids[:context]), True


def score_text(text: str, answers: list[str]) -> float | None:
    """Fraction of `answers` found in `text` (case-insensitive), or None when there are none to find."""
    if not answers:
        return None
    low = text.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


def file_stem(text: str) -> str:
    """`text` made safe for a trace's file name: runs of anything but letters, digits, '.', '-' -> '_'."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", text).strip("_") or "_"
