"""Policies, sweeps, report files and the eval/report CLIs on tiny synthetic traces."""
import argparse
import csv
import json

import pytest
import torch

from spin_indexer.cli import eval as eval_cli
from spin_indexer.cli import report as report_cli
from spin_indexer.eval.ablations import SUMMARY_COLUMNS, TABLE1_COLUMNS, get_sweep, run_sweep, summarize, table1
from spin_indexer.predictor.policies import POLICIES, get_policy
from spin_indexer.eval.report import load_runs, markdown, write_run
from spin_indexer.predictor.config import Exploration, MtpPolicy, Pooling, Reduce
from spin_indexer.traces.replay import ReplayResult
from spin_indexer.traces.synthetic import generate


def test_policies_map_to_configs():
    d = get_policy("spin-default", 0.4, topk=512)
    assert (d.pooling, d.reduce, d.exploration, d.gamma, d.sparsity, d.topk) == (
        Pooling.A1, Reduce.MAX, Exploration.RANDOM, 0.05, 0.4, 512)
    assert get_policy("a0", 0.3).pooling is Pooling.A0
    assert get_policy("a2-max", 0.3).pooling is Pooling.A2
    assert get_policy("a1-top4", 0.3).reduce is Reduce.TOP4
    assert get_policy("explore-none", 0.3).exploration is Exploration.NONE
    assert get_policy("explore-block-age", 0.3).exploration is Exploration.BLOCK_AGE
    assert get_policy("mtp-row-local", 0.3).mtp is MtpPolicy.ROW_LOCAL
    for name in POLICIES:
        get_policy(name, 0.25)  # every registered policy is a valid SpinConfig
    with pytest.raises(ValueError, match="expected one of spin-default, a0, .*got 'a9'"):
        get_policy("a9", 0.3)


def test_sweeps():
    assert get_sweep("main") == [("spin-default", s) for s in (0.2, 0.3, 0.4, 0.5)]
    assert get_sweep("pooling", sparsities=(0.5,))[0] == ("a0", 0.5)
    assert get_sweep("main", policies=("a0",)) == [("a0", s) for s in (0.2, 0.3, 0.4, 0.5)]
    with pytest.raises(ValueError, match="sweep: expected one of smoke, main"):
        get_sweep("nope")
    with pytest.raises(ValueError, match="policy: expected one of"):
        get_sweep("main", policies=("bogus",))


def test_summarize_counts_only_eligible_rows():
    res = ReplayResult(get_policy("spin-default", 0.3))
    res.miss["a"] = torch.tensor([[[0.5]], [[0.1]], [[0.3]]])  # [S=3, L=1, N=1]
    res.eligible["a"] = torch.tensor([[False], [True], [True]])
    res.sparsity["a"] = torch.tensor([[0.0], [0.4], [0.2]])
    out = summarize(res, ["a"])
    assert out["mean_miss"] == pytest.approx(0.2) and out["p99_miss"] == pytest.approx(0.3)
    assert out["realized_sparsity"] == pytest.approx(0.3) and out["rows"] == 2


def _tiny_sets():
    return {"tiny": [generate("v4-like", seed=i, prompt_id=f"t{i}", context_len=1200 + 2000 * i, num_steps=6,
                              num_layers=2, k=128) for i in range(2)]}


def test_run_sweep_rows_and_bins():
    sets = _tiny_sets()
    rows = run_sweep(sets, [("spin-default", 0.0), ("a1-max", 0.4), ("explore-none", 0.4)])
    assert {r["context"] for r in rows} == {"1K", "4K", "all"}
    zero = [r for r in rows if r["sparsity_target"] == 0.0]
    assert all(r["mean_miss"] == 0 and r["p99_miss"] == 0 and r["realized_sparsity"] == 0 for r in zero)
    by = {(r["policy"], r["context"]): r for r in rows if r["sparsity_target"] == 0.4}
    assert by[("a1-max", "all")]["rows"] == by[("a1-max", "1K")]["rows"] + by[("a1-max", "4K")]["rows"]
    assert by[("a1-max", "all")]["realized_sparsity"] > 0.3
    assert set(SUMMARY_COLUMNS) <= set(rows[0])
    t1 = table1(sets, max_steps=4)
    assert {r["predictor"] for r in t1} == {"random", "prev-layer", "prev-layer-best5", "prev-iteration"}


def test_report_files_round_trip(tmp_path):
    sets = _tiny_sets()
    rows = run_sweep(sets, [("spin-default", 0.3), ("a1-mean", 0.3)])
    t1 = table1(sets, max_steps=3)
    write_run(tmp_path / "run1", rows, t1, {"command": "x", "seconds": 1.0, "throughput": 2.0})
    with open(tmp_path / "run1" / "summary.csv") as f:
        lines = list(csv.reader(f))
    assert tuple(lines[0]) == SUMMARY_COLUMNS and len(lines) == len(rows) + 1
    with open(tmp_path / "run1" / "table1.csv") as f:
        assert tuple(next(csv.reader(f))) == TABLE1_COLUMNS
    # a second run replacing one row: the later one wins
    newer = [dict(rows[0], mean_miss=0.123)]
    write_run(tmp_path / "run2", newer, [], {"command": "y", "seconds": 1.0, "throughput": 2.0})
    summary, t1_back, runs = load_runs(tmp_path)
    assert len(summary) == len(rows) and len(runs) == 2 and len(t1_back) == len(t1)
    md = markdown(summary, t1_back, runs)
    assert "Table 1" in md and "Tables 3/5" in md and "a1-mean" in md and "1.92% / 13.48%" in md


def _parse(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def test_eval_and_report_cli(tmp_path, capsys):
    out = tmp_path / "ev"
    rc = eval_cli.run(_parse(eval_cli, ["--synthetic", "v4-like", "--context", "1500", "--steps", "5",
                                        "--num-layers", "2", "--prompts", "1", "--sweep", "smoke", "--quiet",
                                        "--name", "mine", "--out", str(out)]))
    assert rc == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("eval: 1 runs over 1 traces") and "worst p99 miss" in line
    data = json.loads((out / "rows.json").read_text())
    assert data["summary"][0]["policy"] == "spin-default" and data["run"]["command"].startswith("spin-indexer")
    assert {r["trace_set"] for r in data["summary"]} == {"mine"}
    assert (out / "plots" / "fig1_mine.png").stat().st_size > 1000
    assert report_cli.run(_parse(report_cli, [str(tmp_path), "--no-plots"])) == 0
    assert (tmp_path / "summary.csv").is_file() and (tmp_path / "REPORT.md").is_file()


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert eval_cli.run(_parse(eval_cli, ["--out", str(tmp_path)])) == 2
    assert "expected --traces DIR or --synthetic PRESET" in capsys.readouterr().err
    assert eval_cli.run(_parse(eval_cli, ["--synthetic", "v9", "--out", str(tmp_path)])) == 2
    assert "preset: expected one of" in capsys.readouterr().err
    assert eval_cli.run(_parse(eval_cli, ["--traces", str(tmp_path), "--out", str(tmp_path)])) == 2
    assert "no <name>.safetensors" in capsys.readouterr().err
    assert report_cli.run(_parse(report_cli, [str(tmp_path / "none")])) == 2
    assert "not a directory" in capsys.readouterr().err


def test_eval_cli_on_saved_traces_with_subsampling(tmp_path, capsys):
    traces_dir = tmp_path / "traces"
    for i, ctx in enumerate((1300, 1500)):
        t = generate("v4-like", seed=i, prompt_id=f"p{i}", context_len=ctx, num_steps=6, num_layers=4, k=128)
        t.meta.indexer = "oracle" if i == 0 else "lightning"
        t.save(traces_dir)
    out = tmp_path / "ev"
    rc = eval_cli.run(_parse(eval_cli, ["--traces", str(traces_dir), "--name", "real", "--layer-stride", "2",
                                        "--max-steps", "4", "--sweep", "smoke", "--quiet", "--no-plots",
                                        "--out", str(out)]))
    assert rc == 0, capsys.readouterr().err
    rows = json.loads((out / "rows.json").read_text())["summary"]
    assert {(r["trace_set"], r["indexer"]) for r in rows} == {("real", "oracle"), ("real", "lightning")}
    assert all(r["layers"] == 2 and r["steps"] == 4 for r in rows)  # layers 0 and 2 of 4, first 4 steps


def test_later_run_wins_by_date_not_path(tmp_path):
    row = {"trace_set": "s", "indexer": "i", "context": "all", "sparsity_target": 0.3, "policy": "a0",
           "mean_miss": 0.1, "p99_miss": 0.2, "realized_sparsity": 0.3, "rows": 1}
    write_run(tmp_path / "b", [row], [], {"command": "old", "seconds": 1.0, "throughput": 1.0,
                                          "date": "2026-11-29 12:00 UTC"})
    write_run(tmp_path / "a", [dict(row, mean_miss=0.05)], [], {"command": "new", "seconds": 1.0,
                                                                 "throughput": 1.0, "date": "2026-11-29 13:00 UTC"})
    summary, _, _ = load_runs(tmp_path)
    assert len(summary) == 1 and summary[0]["mean_miss"] == 0.05


def test_pooled_rows_dropped_when_runs_cover_several_contexts(tmp_path):
    base = {"trace_set": "s", "indexer": "i", "sparsity_target": 0.3, "policy": "a0", "p99_miss": 0.2,
            "realized_sparsity": 0.3, "rows": 1}
    info = {"command": "c", "seconds": 1.0, "throughput": 1.0, "date": "2026-11-29 12:00 UTC"}
    write_run(tmp_path / "4k", [dict(base, context="4K", mean_miss=0.1), dict(base, context="all", mean_miss=0.1)],
              [], info)
    summary, _, _ = load_runs(tmp_path)
    assert sorted(r["context"] for r in summary) == ["4K", "all"]  # one context: its pool stays
    write_run(tmp_path / "8k", [dict(base, context="8K", mean_miss=0.3), dict(base, context="all", mean_miss=0.3)],
              [], dict(info, date="2026-11-29 13:00 UTC"))
    summary, _, _ = load_runs(tmp_path)
    # the 8K run's 'all' (0.3) is not the pool of 4K + 8K: no pooled row rather than a wrong one
    assert sorted(r["context"] for r in summary) == ["4K", "8K"]


def test_run_sweep_parallel_jobs_equal_serial():
    sets = _tiny_sets()
    pairs = [("spin-default", 0.3), ("a1-max", 0.3), ("a1-mean", 0.5), ("explore-none", 0.4)]  # a1-max aliases
    seen = []
    serial = run_sweep(sets, pairs)
    parallel = run_sweep(sets, pairs, jobs=2, on_step=seen.append)
    drop = ("seconds", "throughput")
    assert [{k: v for k, v in r.items() if k not in drop} for r in parallel] == \
        [{k: v for k, v in r.items() if k not in drop} for r in serial]
    # progress: one report per distinct config (3 here), each the config's full rows x layers x steps
    work = sum(t.num_steps * t.num_layers * t.next_n for t in sets["tiny"])
    assert seen == [work] * 3
    with pytest.raises(ValueError, match="jobs"):
        run_sweep(sets, pairs, jobs=0)


@pytest.mark.parametrize("jobs", [1, 2])
def test_summary_policies_replay_only_traces_with_summaries(jobs):
    """In a set where one trace recorded block summaries (at S = 4 and 8) and one did not, a summary policy
    replays the first alone (its rows count only its prompts), other policies both; S = 16 has no rows at all."""
    import dataclasses

    from spin_indexer.traces.schema import Trace

    plain = generate("v4-like", seed=0, prompt_id="plain", num_steps=6, num_layers=2, context_len=1000, k=128)
    other = generate("v4-like", seed=1, prompt_id="rich", num_steps=6, num_layers=2, context_len=1000, k=128)
    width = -(-other.max_len // 64)
    lens = other.seq_lens.long().amax(dim=1)
    past = torch.arange(width)[None, :] >= -(-lens[:, None] // 64)
    summary = torch.where(past[:, None, None, :], float("-inf"), torch.randn(6, 2, 2, width))
    meta = dataclasses.replace(other.meta, extra={**other.meta.extra, "summary_parts": [4, 8]})
    rich = Trace(other.scores, other.seq_lens, meta, other.topk, other.accepted, summary)
    rows = run_sweep({"s": [plain, rich]}, [("spin-default", 0.4), ("summary4-0.5", 0.4), ("summary16-0.8", 0.4)],
                     jobs=jobs)
    prompts = {r["policy"]: r["prompts"] for r in rows if r["context"] == "all"}
    assert prompts == {"spin-default": 2, "summary4-0.5": 1}
