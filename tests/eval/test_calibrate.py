"""eval/calibrate.py and `spin-indexer calibrate` / `eval --sparsity-profile`: the per-layer allocation is the
optimum on the menu's grid, and replaying the profile gives the per-layer misses it was chosen from."""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from spin_indexer.cli import main as cli
from spin_indexer.eval.ablations import run_sweep
from spin_indexer.eval.calibrate import allocate, calibrate, layer_miss
from spin_indexer.predictor.policies import get_policy, load_profiles
from spin_indexer.traces.schema import save_trace
from spin_indexer.traces.synthetic import generate


def _traces():
    # two prompts, 3 layers whose patterns differ (the preset's layers draw their own verticals)
    return [generate("v4-like", seed=s, prompt_id=f"p{s}", context_len=4096, num_steps=8, num_layers=3, k=256)
            for s in (1, 2)]


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_the_brute_force_optimum(seed):
    gen = torch.Generator().manual_seed(seed)
    menu, layers = [0.2, 0.3, 0.4, 0.5], 4
    miss = torch.rand(len(menu), layers, generator=gen, dtype=torch.float64).sort(dim=0).values  # rising with s
    for target in (0.3, 0.35, 0.4, 0.45):
        choice = allocate(miss, menu, target)
        assert sum(menu[i] for i in choice) == pytest.approx(target * layers)
        best = min(sum(float(miss[i, layer]) for layer, i in enumerate(c))
                   for c in itertools.product(range(len(menu)), repeat=layers)
                   if abs(sum(menu[i] for i in c) - target * layers) < 1e-9)
        assert sum(float(miss[i, layer]) for layer, i in enumerate(choice)) == pytest.approx(best)


def test_allocation_refuses_a_mean_off_the_grid():
    miss = torch.zeros(3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="sparsity: expected a mean the menu"):
        allocate(miss, [0.2, 0.3, 0.4], 0.6)
    with pytest.raises(ValueError, match="sparsity: expected a mean the menu"):
        allocate(miss, [0.2, 0.3, 0.4], 0.33)  # 0.66 over 2 layers is not on the 0.1 grid


def test_the_profile_replays_the_misses_it_was_chosen_from():
    # without exploration the folded (uniform) and unfolded (profile) replays choose the same blocks, so the
    # profile's per-layer miss is exactly the menu replay's at each layer's sparsity
    traces = _traces()
    config = get_policy("explore-none", 0.4)
    result = calibrate(traces, config, 0.4, [0.2, 0.3, 0.4, 0.5, 0.6])
    assert sum(result.profile) / 3 == pytest.approx(1.0)
    replayed = layer_miss(traces, dataclasses.replace(config, sparsity_profile=tuple(result.profile)))
    assert replayed.tolist() == pytest.approx(result.chosen_miss, abs=1e-12)
    uniform = result.miss[result.menu.index(0.4)]
    assert sum(result.chosen_miss) <= sum(uniform) + 1e-12  # uniform 0.4 is one of the allocations


def test_calibrate_refuses_bad_menus_and_targets():
    traces, config = _traces(), get_policy("spin-default", 0.4)
    with pytest.raises(ValueError, match="menu: expected evenly spaced"):
        calibrate(traces, config, 0.4, [0.2, 0.3, 0.5])
    with pytest.raises(ValueError, match="menu: expected evenly spaced"):
        calibrate(traces, config, 0.4, [0.4])
    with pytest.raises(ValueError, match="sparsity"):
        calibrate(traces, config, 0.0, [0.1, 0.2])
    with pytest.raises(TypeError, match=r"menu\[1\]"):
        calibrate(traces, config, 0.4, [0.3, "0.4"])


def test_cli_calibrate_then_eval_with_the_profile(tmp_path, capsys):
    for tr in _traces():
        save_trace(tr, tmp_path / "traces")
    out = tmp_path / "cal"
    code = cli.main(["calibrate", "--traces", str(tmp_path / "traces"), "--sparsity", "0.4", "0.3",
                     "--policy", "explore-none", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    record = json.loads((out / "profile.json").read_text())
    assert sorted(record["profiles"]) == ["0.3", "0.4"] and record["policy"] == "explore-none"
    assert all(len(p) == 3 for p in record["profiles"].values())
    assert record["calibrations"]["0.4"]["menu"] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    assert record["calibrations"]["0.3"]["menu"] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert record["traces"] == ["p1", "p2"] and record["command"].startswith("spin-indexer calibrate")
    assert "predicted mean miss" in capsys.readouterr().out
    profiles = load_profiles(str(out / "profile.json"))
    rows = run_sweep({"syn": _traces()}, [("explore-none", 0.4)], profile=(profiles, "p.json"))
    every = [r for r in rows if r["context"] == "all"][0]
    assert every["policy"] == "explore-none+profile"
    assert every["config"]["sparsity_profile"] == pytest.approx(record["profiles"]["0.4"])
    chosen = record["calibrations"]["0.4"]["chosen_miss"]
    assert every["mean_miss"] == pytest.approx(sum(chosen) / 3, rel=0.2)  # rows weigh steps alike
    with pytest.raises(ValueError, match="no profile calibrated at sparsity 0.5"):
        run_sweep({"syn": _traces()}, [("explore-none", 0.5)], profile=(profiles, "p.json"))
    code = cli.main(["eval", "--traces", str(tmp_path / "traces"), "--sweep", "smoke", "--policy", "explore-none",
                     "--sparsity", "0.4", "0.3", "--sparsity-profile", str(out / "profile.json"), "--no-table1",
                     "--no-plots", "--quiet", "--out", str(tmp_path / "ev")])
    assert code == 0, capsys.readouterr().err
    summary = (tmp_path / "ev" / "summary.csv").read_text()
    assert "explore-none+profile" in summary


def test_cli_calibrate_names_a_bad_argument(tmp_path, capsys):
    code = cli.main(["calibrate", "--traces", str(tmp_path / "none"), "--out", str(tmp_path / "o")])
    assert code == 1 and "--traces" in capsys.readouterr().err
    code = cli.main(["calibrate", "--traces", str(tmp_path), "--policy", "nope", "--out", str(tmp_path / "o")])
    assert code == 1 and "policy" in capsys.readouterr().err


def test_cli_quality_profile_configs_need_the_file(tmp_path, capsys):
    code = cli.main(["quality", "--configs", "all-keep", "spin-0.4-profile", "--out", str(tmp_path / "q")])
    err = capsys.readouterr().err
    assert code == 1 and "spin-0.4-profile need --sparsity-profile" in err
