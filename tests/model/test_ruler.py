"""RULER prompts from nvidia-long-context-eval's generators (skipped when the package is absent).

A whitespace tokenizer stands in for SmolLM2's, so these tests need no model."""
from __future__ import annotations

import pytest

from spin_indexer.model import ruler

pytestmark = pytest.mark.skipif(ruler.missing_reason() is not None, reason=str(ruler.missing_reason()))


class _Ids:
    def __init__(self, ids):
        self.input_ids = ids


class WordTokenizer:
    """Counts whitespace-separated words as tokens (the generators only count tokens)."""

    def __call__(self, text, add_special_tokens=True):
        return _Ids(text.split())


TOK = WordTokenizer()


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_2", "niah_multivalue", "vt"])
def test_prompt_fits_contains_answers_and_is_deterministic(task):
    prompt, answers = ruler.make_prompt(task, 600, seed=3, tokenizer=TOK)
    budget = 600 - ruler.TOKENS_TO_GENERATE[ruler.TASKS[task][0]]
    n = len(prompt.split())
    assert n <= budget and n > 0.8 * budget, (n, budget)  # filled close to the budget, never past it
    assert answers and all(a in prompt for a in answers)
    assert prompt.rstrip().endswith(("are", "is", "they are:"))  # the answer prefix closes the prompt
    assert ruler.make_prompt(task, 600, seed=3, tokenizer=TOK) == (prompt, answers)
    other, other_answers = ruler.make_prompt(task, 600, seed=4, tokenizer=TOK)
    assert other != prompt


def test_niah_essay_haystack_uses_the_essays_and_needle_sentence():
    prompt, answers = ruler.make_prompt("niah_single_2", 800, seed=1, tokenizer=TOK)
    assert "One of the special magic number for" in prompt or "One of the special magic numbers for" in prompt
    assert f"is: {answers[0]}." in prompt
    assert "The grass is green" not in prompt


def test_score_and_errors():
    assert ruler.score_answer("niah_multivalue", "1, 22 and 333", ["1", "22", "333", "4444"]) == 0.75
    assert ruler.score_answer("vt", "", []) == 0.0
    with pytest.raises(ValueError, match="task: expected one of"):
        ruler.make_prompt("nope", 100, 0, TOK)


def test_regex_sentence_splitter():
    assert ruler.split_sentences("It works. Does it? Yes! e.g. this one.  Next") == [
        "It works.", "Does it?", "Yes! e.g. this one.", "Next"]


# sha256 of json.dumps([prompt, answers]) at 600 tokens, computed before fwe/qa were added: the existing
# tasks' prompts must stay byte-identical
_PINNED = {("niah_single_2", 3): "899b718bd3d6aca44408c113c93e2270d1e7d5803ee15509173e5d96bef66c5b",
           ("vt", 0): "4f28fceb65b6adfef0ad603d017f447453e513c25b4061c7326182c628a80c34",
           ("cwe", 3): "1c7c126178751fe024ebc9f2f1b3c110732c0ed19448171612ffe8c3e80e6a7c"}


@pytest.mark.parametrize("task,seed", sorted(_PINNED))
def test_existing_prompts_unchanged(task, seed, monkeypatch):
    import hashlib
    import json

    monkeypatch.delenv(ruler.PROMPT_CACHE_ENV, raising=False)
    prompt, answers = ruler.make_prompt(task, 600, seed, TOK)
    assert hashlib.sha256(json.dumps([prompt, answers]).encode()).hexdigest() == _PINNED[task, seed]


def test_tokens_to_generate_match_the_package_constants():
    import importlib.util

    path = ruler.package_dir() / "data" / "synthetic" / "constants.py"
    spec = importlib.util.spec_from_file_location("_ruler_constants_test", path)
    constants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(constants)
    for task, (script, _) in ruler.TASKS.items():
        assert ruler.TOKENS_TO_GENERATE[script] == constants.TASKS[script]["tokens_to_generate"], task
    assert {"fwe", "qa_1", "qa_2"} <= set(ruler.TASKS)


@pytest.mark.parametrize("context", [600, 3000])
def test_fwe_answers_are_the_three_most_frequent_coded_words(context, monkeypatch):
    from collections import Counter

    monkeypatch.delenv(ruler.PROMPT_CACHE_ENV, raising=False)
    prompt, answers = ruler.make_prompt("fwe", context, seed=2, tokenizer=TOK)
    budget = context - ruler.TOKENS_TO_GENERATE["freq_words_extraction"]
    n = len(prompt.split())
    assert 0.9 * budget < n <= budget, (n, budget)
    assert prompt.endswith("the three most frequently appeared words are:")
    body = prompt.split("three most frequently appeared coded words. ", 1)[1].split("\nQuestion:")[0]
    counts = Counter(w for w in body.split() if w != "...")
    assert counts.most_common(1)[0][1] > 3 * counts.most_common(4)[3][1] / 2  # a clear frequency ranking
    assert answers == [w for w, _ in counts.most_common(3)]  # in order, all in the text
    assert all(len(a) == 6 and a.isalpha() for a in answers)
    assert ruler.make_prompt("fwe", context, seed=2, tokenizer=TOK) == (prompt, answers)
    other, other_answers = ruler.make_prompt("fwe", context, seed=5, tokenizer=TOK)
    assert other != prompt and other_answers != answers


@pytest.mark.parametrize("task,context", [("qa_1", 1200), ("qa_2", 2500)])
def test_qa_prompt_holds_the_questions_own_documents(task, context, monkeypatch):
    monkeypatch.delenv(ruler.PROMPT_CACHE_ENV, raising=False)
    g = ruler._generator(task, TOK)
    budget = context - ruler.TOKENS_TO_GENERATE["qa"]
    questions = set()
    for seed in (1, 4):
        prompt, answers = ruler.make_prompt(task, context, seed, TOK)
        qa = g["QAS"][seed]
        n = len(prompt.split())
        assert 0.75 * budget < n <= budget, (n, budget)
        assert prompt.endswith(f"Question: {qa['query']} Answer:")
        assert answers == qa["outputs"] and answers and all(isinstance(a, str) for a in answers)
        docs = [g["DOCS"][i] for i in qa["context"]]
        assert all(d in prompt for d in docs)  # the question's own documents are always there
        assert len(qa["context"]) < prompt.count("Document ")  # "Document i:" headers: more than its own
        if task == "qa_1":  # SQuAD answers are spans of their paragraph (HotpotQA's may be yes/no)
            assert all(a in docs[0] for a in answers)
        assert ruler.make_prompt(task, context, seed, TOK) == (prompt, answers)
        questions.add(qa["query"])
    assert len(questions) == 2
    # the seed picks question seed mod the number of questions; the documents drawn still differ
    wrapped, wrapped_answers = ruler.make_prompt(task, context, 1 + len(g["QAS"]), TOK)
    assert wrapped.endswith(f"Question: {g['QAS'][1]['query']} Answer:") and wrapped_answers == g["QAS"][1]["outputs"]
    assert wrapped != ruler.make_prompt(task, context, 1, TOK)[0]


def test_qa_all_documents_leaves_the_dataset_unshuffled():
    g = ruler._generator("qa_1", TOK)
    before = list(g["_all_docs"])
    first = ruler._generate("qa_1", len(before), 7, 10**7, g)
    assert ruler._generate("qa_1", len(before), 7, 10**7, g) == first
    assert list(g["_all_docs"]) == before and first[0].count("Document ") == len(before)


def test_qa_too_small_context_raises(monkeypatch):
    monkeypatch.delenv(ruler.PROMPT_CACHE_ENV, raising=False)
    with pytest.raises(ValueError, match="context_tokens: qa_2 seed 0 needs"):
        ruler.make_prompt("qa_2", 300, 0, TOK)  # HotpotQA's 10 own paragraphs do not fit


def test_qa_scores_any_answer_others_all_answers():
    refs = ["Denver Broncos", "the Broncos", "Broncos"]
    assert ruler.score_answer("qa_1", " The BRONCOS won.", refs) == 1.0
    assert ruler.score_answer("qa_2", " Carolina Panthers", refs) == 0.0
    assert ruler.score_answer("qa_1", "", []) == 0.0
    assert ruler.score_answer("fwe", " abcdef, ghijkl", ["abcdef", "ghijkl", "mnopqr"]) == pytest.approx(2 / 3)
    assert ruler.score_answer("niah_single_1", " The BRONCOS won.", refs) == pytest.approx(2 / 3)
