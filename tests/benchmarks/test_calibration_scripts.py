"""benchmarks/calibration_prompts.py (the pydoc calibration text) and profile_objectives.py's allocation."""
from __future__ import annotations

import pytest
import torch

from conftest import import_benchmark

prompts = import_benchmark("calibration_prompts")
objectives = import_benchmark("profile_objectives")


def test_calibration_documents_cover_every_topic_once_in_order():
    import pydoc_data.topics

    docs = prompts.documents(5)
    assert [d["id"] for d in docs] == [f"pydoc-{i}" for i in range(5)]
    names = [line.removeprefix("# topic: ") for d in docs for line in d["text"].splitlines()
             if line.startswith("# topic: ")]
    assert names == sorted(pydoc_data.topics.topics)
    assert prompts.documents(5) == docs  # deterministic


@pytest.mark.parametrize("lo, hi", [(0, 8), (1, 6)])
def test_objective_allocation_on_a_sub_menu_is_the_brute_force_optimum(lo, hi):
    import itertools

    gen = torch.Generator().manual_seed(lo)
    menu = objectives.MENU
    rows = [[torch.rand(5, generator=gen) for _ in range(3)] for _ in menu]  # [menu][layer] row misses
    cost = objectives.OBJECTIVES["mean"]
    choice = objectives.allocate(rows, 0.4, cost, lo, hi)
    assert all(lo <= i < hi for i in choice)
    assert sum(menu[i] for i in choice) == pytest.approx(0.4 * 3)
    best = min(sum(cost(rows[i][layer]) for layer, i in enumerate(c))
               for c in itertools.product(range(lo, hi), repeat=3) if abs(sum(menu[i] for i in c) - 1.2) < 1e-9)
    assert sum(cost(rows[i][layer]) for layer, i in enumerate(choice)) == pytest.approx(best)
