"""The RULER prompt cache (SPIN_INDEXER_PROMPT_CACHE): read before generating, written after."""
from __future__ import annotations

import json

import pytest

from spin_indexer.model import ruler


class _WordTokenizer:
    class _Ids:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text, add_special_tokens=True):
        return self._Ids(text.split())


def test_cached_prompt_is_returned_without_generators(tmp_path, monkeypatch):
    monkeypatch.setenv(ruler.PROMPT_CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(ruler, "generators_missing", lambda: "generators absent (test)")
    (tmp_path / "vt_4096_7.json").write_text(json.dumps({"text": "the prompt", "answers": ["A", "B"]}))
    assert ruler.missing_reason() is None  # a cache folder is enough to start
    assert ruler.make_prompt("vt", 4096, 7, tokenizer=None) == ("the prompt", ["A", "B"])
    with pytest.raises(RuntimeError, match=r"generators absent \(test\) and .*vt_4096_8\.json does not exist"):
        ruler.make_prompt("vt", 4096, 8, tokenizer=None)


def test_without_cache_missing_generators_are_reported(monkeypatch):
    monkeypatch.delenv(ruler.PROMPT_CACHE_ENV, raising=False)
    monkeypatch.setattr(ruler, "generators_missing", lambda: "generators absent (test)")
    assert ruler.missing_reason() == "generators absent (test)"
    with pytest.raises(RuntimeError, match=r"generators absent \(test\)$"):
        ruler.make_prompt("vt", 4096, 0, tokenizer=None)


@pytest.mark.skipif(ruler.generators_missing() is not None, reason=str(ruler.generators_missing()))
def test_generated_prompt_is_written_and_reread(tmp_path, monkeypatch):
    monkeypatch.setenv(ruler.PROMPT_CACHE_ENV, str(tmp_path))
    tok = _WordTokenizer()
    ruler.cache_prompts(["niah_single_1"], [600], [3], tok, progress=False)
    path = tmp_path / "niah_single_1_600_3.json"
    rec = json.loads(path.read_text())
    monkeypatch.delenv(ruler.PROMPT_CACHE_ENV)
    assert ruler.make_prompt("niah_single_1", 600, 3, tok) == (rec["text"], rec["answers"])  # same as fresh
    monkeypatch.setenv(ruler.PROMPT_CACHE_ENV, str(tmp_path))
    path.write_text(json.dumps({"text": "edited", "answers": ["x"]}))
    assert ruler.make_prompt("niah_single_1", 600, 3, tok) == ("edited", ["x"])  # the cache wins
