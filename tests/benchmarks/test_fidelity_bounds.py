"""benchmarks/fidelity_bounds.py: block choices with more information than SPIN, over synthetic traces."""
from __future__ import annotations

import csv

import pytest
import torch

from conftest import import_benchmark
from spin_indexer.traces import synthetic
from spin_indexer.traces.schema import Trace


def _rows(tmp_path, trace, sparsities=(0.3, 0.5)):
    bounds = import_benchmark("fidelity_bounds")
    path = trace.save(tmp_path)
    return bounds, bounds.trace_rows(str(path), sparsities)


@pytest.mark.parametrize("seed", range(3))
def test_ideal_misses_least_on_every_row(tmp_path, seed):
    """Blocks chosen by this step's own top-k counts (the newest forced) miss no more than any other choice on
    every row, and history predictors miss something on a drifting synthetic trace."""
    trace = synthetic.generate("v4-like", seed=seed, context_len=2048, num_steps=6, num_layers=3, k=128)
    _, rows = _rows(tmp_path, trace)
    for s in (0.3, 0.5):
        ideal = torch.tensor(rows[("ideal", s)]).view(6, 3)
        for name in ("prev-step-max", "prev-step-top4", "ema-full-top4", "ema-full-vd-max"):
            other = torch.tensor(rows[(name, s)]).view(5, 3)  # from step 1 on
            assert (ideal[1:] <= other + 1e-7).all(), name
        assert sum(rows[("prev-step-max", 0.5)]) > 0


def test_static_scores_make_history_ideal(tmp_path):
    """Scores that never change (and a context that does not grow): the previous step's top-k counts are this
    step's, so that choice misses exactly what the ideal one misses, and the EMA of equal scores is those scores
    (its max-pooled choice equals the previous step's)."""
    base = synthetic.generate("v4-like", seed=1, context_len=2048, num_steps=4, num_layers=2, k=128)
    steps = base.scores.shape[0]
    scores = base.scores[:1].repeat(steps, 1, 1, 1)
    lens = base.seq_lens[:1].repeat(steps, 1)
    topk = base.topk[:1].repeat(steps, 1, 1, 1)
    trace = Trace(scores=scores, seq_lens=lens, meta=base.meta, topk=topk)
    _, rows = _rows(tmp_path, trace)
    for s in (0.3, 0.5):
        ideal = torch.tensor(rows[("ideal", s)]).view(steps, 2)[1:]
        assert torch.equal(torch.tensor(rows[("prev-step-topk-count", s)]).view(steps - 1, 2), ideal)
        assert rows[("ema-full-max", s)] == rows[("prev-step-max", s)]


def test_main_writes_tables_and_refuses_an_empty_folder(tmp_path):
    bounds = import_benchmark("fidelity_bounds")
    trace = synthetic.generate("v4-like", seed=0, context_len=1024, num_steps=3, num_layers=2, k=64)
    trace.save(tmp_path / "tr")
    assert bounds.main(["--traces", str(tmp_path / "tr"), "--out", str(tmp_path / "out"), "--sparsity", "0.4"]) == 0
    with open(tmp_path / "out" / "bounds.csv", newline="") as f:
        table = list(csv.DictReader(f))
    names = {r["predictor"] for r in table}
    assert {"ideal", "prev-step-max", "ema-full-vd-max", "prev-layer-max"} <= names
    ideal = next(r for r in table if r["predictor"] == "ideal")
    assert int(ideal["rows"]) == 3 * 2 and 0 <= float(ideal["mean_miss"]) <= float(ideal["p99_miss"]) <= 1
    assert "| ideal | 40% |" in (tmp_path / "out" / "bounds.md").read_text()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        bounds.main(["--traces", str(tmp_path / "empty"), "--out", str(tmp_path / "o2")])
