"""The out-of-domain corpus (model/offline_text.py, `distill --corpus ood`): deterministic, recorded, and free of
the RULER sources the evaluation uses (essays, SQuAD, RULER prompts); its prose is HotpotQA's Wikipedia
paragraphs (here a small file of the same form); the python_stdlib domain is held out of it."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from spin_indexer.model import offline_text, ruler

# distinctive lines of the RULER sources: two Paul Graham essays, two SQuAD contexts, three RULER templates
RULER_SUBSTRINGS = ("So I inverted the 5 regrets", "they're also too young to be left",
                    "The Normans (Norman: Nourmands", "Ersatzschulen are ordinary primary or secondary schools",
                    "special magic", "Answer the question based on the given documents",
                    "Memorize and track the chain")


def _question(i, paras):
    return {"_id": f"q{i}", "question": f"Question {i} that must not be trained?", "answer": f"answer{i}",
            "context": [[title, sentences] for title, sentences in paras]}


HOTPOT = [  # the form of RULER's hotpotqa.json; question 1 repeats one paragraph of question 0, question 2 only it
    _question(0, [("Alpha", ["Alpha is a town.", " It has a river."]), ("Beta", ["Beta was a painter."])]),
    _question(1, [("Beta", ["Beta was a painter."]), ("Gamma", ["Gamma is a lake", " in the north."]),
                  ("Empty", ["  "])]),
    _question(2, [("Alpha", ["Alpha is a town.", " It has a river."])]),
    _question(3, [("Delta", ["Delta is a moon of a planet far away."])]),
]


@pytest.fixture(scope="module")
def hotpot(tmp_path_factory):
    path = tmp_path_factory.mktemp("ruler") / "hotpotqa.json"
    path.write_text(json.dumps(HOTPOT))
    return path


@pytest.fixture(scope="module")
def docs(hotpot):
    return offline_text.ood_documents(prose_file=hotpot)


def test_prose_documents_are_new_paragraphs_per_question_until_the_budget(hotpot):
    prose = offline_text.prose_documents(path=hotpot)
    assert [src.path for src, _ in prose] == ["hotpotqa.json[0]:q0", "hotpotqa.json[1]:q1", "hotpotqa.json[3]:q3"]
    assert prose[0][1] == "Alpha\nAlpha is a town. It has a river.\n\nBeta\nBeta was a painter."
    assert prose[1][1] == "Gamma\nGamma is a lake in the north."  # Beta seen in q0, Empty has no text
    assert all(src.kind == "prose" and src.package == "hotpotqa.json" for src, _ in prose)
    text = "\n".join(t for _, t in prose)
    assert "must not be trained" not in text and "answer0" not in text  # questions and answers stay out
    first = offline_text.prose_documents(prose_bytes=1, path=hotpot)  # the document that passes the budget is whole
    assert [t for _, t in first] == [prose[0][1]]
    assert offline_text.prose_documents(prose_bytes=0, path=hotpot) == []


def test_ood_documents_are_deterministic_and_recorded(docs, hotpot):
    again = offline_text.manifest(offline_text.ood_documents(prose_file=hotpot))
    record = offline_text.manifest(docs)
    assert again == record and set(record["bytes"]) == {"docs", "metadata", "code", "prose"}
    assert "prose_source" in record and [src.kind for src, _ in docs][-3:] == ["prose"] * 3
    for src, text in docs:
        assert src.bytes == len(text.encode()) and src.sha256 == hashlib.sha256(text.encode()).hexdigest()
    digest = hashlib.sha256(b"".join(text.encode() + b"\0" for _, text in docs)).hexdigest()
    assert record["text_sha256"] == digest and len(record["documents"]) == len(docs)
    code = [src.path for src, _ in docs if src.kind == "code"]
    assert code == sorted(code) and offline_text.CODE_BYTES <= record["bytes"]["code"]
    other_seed = [src.path for src, _ in offline_text.code_documents(seed=1)]
    assert other_seed != code  # the seed picks the files


def test_ood_text_holds_out_ruler_sources_and_the_domain_packages(docs):
    for src, _ in docs:
        if src.kind == "code":
            parts = src.path.split("/")
            assert parts[0].removesuffix(".py") not in offline_text.DOMAIN_PACKAGES, src.path
            assert not set(parts[:-1]) & set(offline_text.EXCLUDED_DIRS), src.path
        if src.kind == "metadata":
            assert src.package not in offline_text.EXCLUDED_DISTRIBUTIONS
    text = "\n".join(t for _, t in docs)
    needles = list(RULER_SUBSTRINGS)
    if ruler.package_dir() is not None:  # the real files, where installed: windows spread over each
        essays, paras = ruler.haystack_text(), ruler.wiki_paragraphs()
        assert offline_text.prose_path().is_file()
        needles += [essays[i:i + 60] for i in range(0, len(essays), len(essays) // 20)]
        needles += [p[:60] for p in paras[::max(1, len(paras) // 20)]]
    # a window of blank lines (an empty wiki paragraph) names no source: only windows with text count
    found = [n for n in needles if len(n.strip()) >= 20 and n in text]
    assert not found


def test_domain_documents_are_the_held_out_packages(docs):
    records = offline_text.domain_documents(chars=5000)
    want = [name for pkg in offline_text.DOMAIN_PACKAGES for name in (pkg, f"{pkg}-2")]
    assert [r["id"] for r in records] == want
    trained = {src.path for src, _ in docs}
    for rec in records:
        package = rec["id"].split("-")[0]
        assert 0 < len(rec["text"]) <= 5000 and rec["text"].startswith(f"# file: {package}/")
        assert rec["files"] and all(f.startswith(package + "/") and f not in trained for f in rec["files"])
    for first, second in zip(records[::2], records[1::2]):  # the second starts at a file after the first's end
        assert second["files"][0] > first["files"][-1] or second["files"][0] not in first["files"]
    one = offline_text.domain_documents(chars=5000, parts=1)
    assert [r["text"] for r in one] == [r["text"] for r in records[::2]]


class ByteTokenizer:
    eos_token_id = 256

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": list(text.encode("utf-8"))})()


def test_build_corpus_ood_holds_out_the_essays_and_records_its_sources(tmp_path, monkeypatch, hotpot):
    from spin_indexer.cli.distill import build_corpus
    from spin_indexer.model import loader

    essays = "An essay sentence that must never be trained on. " * 400  # 20,000 characters, 5% held out
    small = (offline_text.docs_documents()[:3] + offline_text.code_documents(code_bytes=20_000)
             + offline_text.prose_documents(path=hotpot))
    monkeypatch.setattr(loader, "load_tokenizer", lambda: ByteTokenizer())
    monkeypatch.setattr(ruler, "haystack_text", lambda: essays)
    monkeypatch.setattr(ruler, "wiki_paragraphs", lambda: pytest.fail("SQuAD read for the ood corpus"))
    monkeypatch.setattr(ruler, "make_prompt", lambda *a: pytest.fail("RULER prompt made for the ood corpus"))
    monkeypatch.setattr(offline_text, "ood_documents", lambda: small)
    first = build_corpus(tmp_path / "a" / "corpus.pt", seq_len=256, kind="ood")
    second = build_corpus(tmp_path / "b" / "corpus.pt", seq_len=256, kind="ood")
    assert torch.equal(first["train"], second["train"]) and first["train_sha256"] == second["train_sha256"]
    assert first["train"].dtype == torch.uint16  # every id < 2**16: half the bytes of int32
    ids = first["train"].long()
    assert hashlib.sha256(ids.to(torch.int32).numpy().tobytes()).hexdigest() == first["train_sha256"]
    assert first["corpus"] == "ood" and first["manifest"] == offline_text.manifest(small)
    train_text = bytes(int(t) for t in ids if t < 256).decode()
    assert "must never be trained" not in train_text and small[0][1] in train_text
    assert "Gamma\nGamma is a lake in the north." in train_text and "HotpotQA" in first["sources"]
    held = essays[int(len(essays) * 0.95):].encode()
    assert first["heldout"].shape == (len(held) // 256, 256)
    assert bytes(first["heldout"].flatten().tolist()) == held[:first["heldout"].numel()]
    side = json.loads((tmp_path / "a" / "corpus.sources.json").read_text())
    assert side["documents"] == first["manifest"]["documents"] and side["train_sha256"] == first["train_sha256"]
    assert side["train_tokens"] == ids.numel() and side["train_dtype"] == "uint16"
    assert "held out: PaulGrahamEssays.json[95%:]" in first["sources"] and first["sources"].startswith("ood:")
    loaded = torch.load(tmp_path / "a" / "corpus.pt")  # weights_only: plain types only
    assert loaded["manifest"]["text_sha256"] == first["manifest"]["text_sha256"]
    assert torch.equal(loaded["train"].long(), ids)


def test_distill_refuses_a_corpus_file_of_the_other_kind(tmp_path, monkeypatch):
    from spin_indexer.cli import distill
    from spin_indexer.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **kw: pytest.fail("model loaded"))
    data = tmp_path / "corpus.pt"
    torch.save({"train": torch.zeros(10, dtype=torch.int32), "heldout": torch.zeros(1, 8, dtype=torch.int32)}, data)
    with pytest.raises(ValueError, match=r"--data: .*corpus.pt holds the ruler corpus, not the --corpus ood one"):
        distill.main(["--data", str(data), "--corpus", "ood", "--device", "cpu", "--quiet", "--out",
                      str(tmp_path / "out")])
