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
