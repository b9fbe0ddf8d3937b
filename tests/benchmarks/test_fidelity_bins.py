"""benchmarks/fidelity_bins.py: the cross-bin tables read the right rows of each summary.csv and check them against
issue #18's targets (a met and a missed cell each side of the bounds)."""
from __future__ import annotations

import csv
import os

import pytest

from conftest import import_benchmark

fb = import_benchmark("fidelity_bins")

COLUMNS = ["trace_set", "indexer", "context", "sparsity_target", "policy", "mean_miss", "p99_miss",
           "realized_sparsity"]


def write(folder, bin_, run, rows):
    os.makedirs(folder / str(bin_) / run, exist_ok=True)
    with open(folder / str(bin_) / run / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerows(rows)


def test_targets_and_sweeps(tmp_path):
    # 4K ruler: 40% mean 3.5% and p99 20% exactly (met: the bounds are inclusive), 50% p99 28.6% (missed);
    # 8K: 40% mean 3.6% (missed), 50% p99 28.5% (met). A per-context row ("4K") must not be read.
    write(tmp_path, 4096, "main-ruler", [
        ["r", "lightning", "4K", "0.4", "spin-default", "0.9", "0.9", "0.4"],
        ["r", "lightning", "all", "0.4", "spin-default", "0.035", "0.20", "0.38"],
        ["r", "lightning", "all", "0.5", "spin-default", "0.1", "0.286", "0.48"]])
    write(tmp_path, 8192, "main-ruler", [
        ["r", "lightning", "all", "0.4", "spin-default", "0.036", "0.10", "0.38"],
        ["r", "lightning", "all", "0.5", "spin-default", "0.1", "0.285", "0.48"]])
    write(tmp_path, 4096, "pooling-ruler", [
        ["r", "lightning", "all", s, p, m, "0.2", "0.4"] for s in ("0.4", "0.5")
        for p, m in (("a0", "0"), ("a1-max", "0.05"), ("a1-top4", "0.04"))])
    (tmp_path / "notes.txt").write_text("not a bin")
    text = fb.render(str(tmp_path))
    lines = text.splitlines()
    assert "| 4K | ruler | lightning | 3.50% | 20.00% | 38.00% | 10.00% | 28.60% | met | missed |" in lines
    assert "| 8K | ruler | lightning | 3.60% | 10.00% | 38.00% | 10.00% | 28.50% | missed | met |" in lines
    assert "| bin | domain | a1-max | a1-top4 |" in lines  # a0 (almost no sparsity realized) left out
    assert "| 4K | ruler | 5.00 / 20.0 ; 5.00 / 20.0 | 4.00 / 20.0 ; 4.00 / 20.0 |" in lines
    assert "exploration" not in text and "spin-layers" not in text  # no layers sweep here: no section
    assert fb.main([str(tmp_path)]) == 0 and (tmp_path / "bins.md").read_text() == fb.render(str(tmp_path))


def test_empty_folder_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no <bin>"):
        fb.render(str(tmp_path))


def test_layers_sweep_gets_its_own_target_table(tmp_path):
    """spin-layers' and spin-layers-mix's rows of a layers sweep are checked against the same targets, each in its
    own section; the sweep's spin-default rows stay out of them (the main sweep's table is spin-default's)."""
    write(tmp_path, 8192, "main-ruler", [
        ["r", "lightning", "all", s, "spin-default", "0.04", "0.22", "0.38"] for s in ("0.4", "0.5")])
    write(tmp_path, 8192, "layers-ruler", [
        ["r", "lightning", "all", s, p, m, q, "0.38"] for s in ("0.4", "0.5")
        for p, m, q in (("spin-default", "0.04", "0.22"), ("spin-layers", "0.03", "0.17"),
                        ("spin-layers-mix", "0.025", "0.16"))])
    lines = fb.render(str(tmp_path)).splitlines()
    head = lines.index("## spin-layers (spin-default with the shipped head's per-layer budgets (calibrated at each "
                       "sparsity)), layers sweep (all 30 layers)")
    assert lines[head + 4] == "| 8K | ruler | lightning | 3.00% | 17.00% | 38.00% | 3.00% | 17.00% | met | met |"
    mix = next(i for i, line in enumerate(lines) if line.startswith("## spin-layers-mix ("))
    assert lines[head + 5:mix] == [""]
    assert lines[mix + 4] == "| 8K | ruler | lightning | 2.50% | 16.00% | 38.00% | 2.50% | 16.00% | met | met |"
    assert lines[mix + 5:] == []
    assert "| 8K | ruler | lightning | 4.00% | 22.00% | 38.00% | 4.00% | 22.00% | missed | met |" in lines[:head]
