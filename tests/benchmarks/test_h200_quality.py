"""CPU dry runs of the issue-18 H200 stages (benchmarks/h200_quality.py and .sh): distill32k (curriculum with
the row-chunked long stage), capture (traces on two domains + replay) and quality (batched runner), each on the
tiny random model through the real CLI code paths."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from spin_indexer.model import loader, ruler

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import h200_quality  # noqa: E402


@pytest.fixture
def dry(monkeypatch):
    """Run a stage in this process; dry_run.install's patches are undone afterwards."""
    for mod, names in ((loader, ("load_model", "load_tokenizer", "missing_reason")),
                       (ruler, ("missing_reason", "make_prompt"))):
        for name in names:
            monkeypatch.setattr(mod, name, getattr(mod, name))
    monkeypatch.setenv("SPIN_BENCH_DEVICE", "cpu")
    return lambda stage, out, *extra: h200_quality.main([stage, "--dry-run", "--out", str(out), *extra])


def test_distill32k_dry_run_trains_every_stage_from_the_one_before(dry, tmp_path):
    assert dry("distill32k", tmp_path) == 0
    summary = json.loads((tmp_path / "distill_summary.json").read_text())
    assert [s["seq_len"] for s in summary] == [128, 256, 512] and all(s["steps"] == 2 for s in summary)
    last = json.loads((tmp_path / "s512" / "training_log.json").read_text())
    assert "--init" in last["command"] and "s256" in last["command"]
    assert last["distill_config"]["row_chunk"] == 32 and last["distill_config"]["rows_per_seq"] == 96
    assert json.loads((tmp_path / "s256" / "training_log.json").read_text())["distill_config"]["rows_per_seq"] == 96
    assert json.loads((tmp_path / "s128" / "training_log.json").read_text())["distill_config"]["rows_per_seq"] == 0
    assert summary[0]["init"] is None and summary[2]["init"].endswith("s256/smollm2_indexer.safetensors")
    assert (tmp_path / "head32k.safetensors").read_bytes() == (tmp_path / "s512" / "smollm2_indexer.safetensors").read_bytes()


def test_distill32k_dry_run_from_init_skips_stages_of_zero_minutes(dry, tmp_path):
    """DISTILL_INIT: the first stage that runs starts from the given head; --minutes 0 skips a stage."""
    assert dry("distill32k", tmp_path / "a") == 0
    init = tmp_path / "a" / "head32k.safetensors"
    assert dry("distill32k", tmp_path / "b", "--init", str(init), "--minutes", "0,0.05,0.05") == 0
    summary = json.loads((tmp_path / "b" / "distill_summary.json").read_text())
    assert [s["seq_len"] for s in summary] == [256, 512] and summary[0]["init"] == str(init)
    assert not (tmp_path / "b" / "s128").exists()
    # --deadline-s: a stage that would run past it is shortened (here the first), the rest are not started
    assert dry("distill32k", tmp_path / "d", "--minutes", "0.05,0.05,0.05", "--deadline-s", "5",
               "--reserve-s", "0.5", "--max-steps", "100000") == 0
    short = json.loads((tmp_path / "d" / "distill_summary.json").read_text())
    assert short[0]["seq_len"] == 128 and sum(s["seconds"] for s in short) < 5
    with pytest.raises(SystemExit, match="--minutes: expected 3 comma-separated values"):
        h200_quality.main(["distill32k", "--dry-run", "--out", str(tmp_path / "c"), "--minutes", "1,2"])


def test_capture_dry_run_traces_two_domains_and_replays_them(dry, tmp_path):
    assert dry("capture", tmp_path) == 0
    for ctx in (384, 512):
        for name in ("ruler", "python_stdlib"):
            traces = sorted((tmp_path / "traces" / f"{name}-{ctx}").glob("*.json"))
            metas = [json.loads(t.read_text()) for t in traces]
            assert sorted(m["indexer"] for m in metas) == ["lightning", "lightning", "oracle", "oracle"]
            assert {m["extra"]["domain"] for m in metas} == {name}
            for sweep, policies in (("main", {"spin-default"}), ("pooling", {"a0", "a1-top4"}),
                                    ("exploration", {"explore-none", "explore-random"})):
                with open(tmp_path / "fid" / str(ctx) / f"{sweep}-{name}" / "summary.csv") as f:
                    rows = list(csv.DictReader(f))
                assert policies <= {r["policy"] for r in rows} and {r["indexer"] for r in rows} == {"lightning", "oracle"}
            # the summary mix: lightning traces only (they record block summaries; the oracle's do not)
            with open(tmp_path / "fid" / str(ctx) / f"summary-{name}" / "summary.csv") as f:
                rows = list(csv.DictReader(f))
            mixed = {r["indexer"] for r in rows if r["policy"].startswith("summary")}
            assert mixed == {"lightning"} and {float(r["sparsity_target"]) for r in rows} == {0.4, 0.5}
            # spin-layers holds the proxy's 30 layers: the dry run's 2-layer traces replay spin-default alone
            with open(tmp_path / "fid" / str(ctx) / f"layers-{name}" / "summary.csv") as f:
                assert {r["policy"] for r in csv.DictReader(f)} == {"spin-default"}
    timing = json.loads((tmp_path / "capture_timing.json").read_text())
    assert len(timing["captures"]) == 4 and all(r["traces"] == 4 and r["rc"] == 0 for r in timing["captures"].values())
    assert all(r["done"] == len(h200_quality.REPLAYS) for r in timing["replays"].values())


def test_capture_dry_run_in_worker_processes_stops_at_its_deadlines(dry, tmp_path):
    """--jobs 2: every capture and replay in its own worker process (logged); the same tables as in one
    process. --budget-s 0: nothing is captured, so nothing is replayed, and the stage still exits 0."""
    assert dry("capture", tmp_path / "one", "--contexts", "384") == 0
    assert dry("capture", tmp_path / "two", "--contexts", "384", "--jobs", "2") == 0
    for name in ("main-ruler", "pooling-python_stdlib"):
        one, two = ((tmp_path / d / "fid" / "384" / name / "summary.csv").read_text() for d in ("one", "two"))
        assert one == two
    assert "capture --task niah_single_2" in (tmp_path / "two" / "logs" / "capture_ruler-384.log").read_text()
    assert dry("capture", tmp_path / "late", "--contexts", "384", "--jobs", "2", "--budget-s", "0") == 0
    timing = json.loads((tmp_path / "late" / "capture_timing.json").read_text())
    assert all(r["rc"] is None and r["traces"] == 0 for r in timing["captures"].values()) and timing["replays"] == {}


def test_capture_sweeps_chooses_the_replays(tmp_path):
    """--sweeps main: each trace set's replay chain is the main sweep alone (the same argv as in the full chain)."""
    from types import SimpleNamespace

    h = h200_quality
    args = SimpleNamespace(weights=None, steps=4, k=8, indexers="lightning", device="cpu", contexts=[384, 512],
                           prompts=2, prompt_file=tmp_path / "p.jsonl", domain="d", out=tmp_path,
                           sweeps=[sweep for sweep, _ in h.REPLAYS])
    full = h.capture_chains(args, tmp_path / "traces")[1]
    main = h.capture_chains(SimpleNamespace(**{**vars(args), "sweeps": ["main"]}), tmp_path / "traces")[1]
    assert [label for label, _ in main] == [label for label, _ in full] and len(full[0][1]) == len(h.REPLAYS)
    assert all(chain == [argvs[0]] and "main" in argvs[0] for (_, chain), (_, argvs) in zip(main, full))


def test_quality_dry_run_batches_prompts_and_pairs_configs(dry, tmp_path):
    assert dry("quality", tmp_path) == 0
    rows = [json.loads(line) for line in (tmp_path / "quality" / "samples-h200-384.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 3 and {r["batch"] for r in rows} == {3, 1}  # 4 prompts: batches of 3 and 1
    with open(tmp_path / "quality" / "ruler.csv") as f:
        assert {r["config"] for r in csv.DictReader(f)} == {"dense", "all-keep", "spin-0.4"}
    assert "Paired with all-keep" in (tmp_path / "quality" / "README.md").read_text()


def test_quality_dry_run_passes_the_sparsity_profile(dry, tmp_path, capsys):
    """--sparsity-profile / --profile-from reach the quality CLI: a spin-<s>-profile config runs with the file's
    profile (one that names no such sparsity is refused, so the file was read), and a config given is kept."""
    layers = 2  # the dry run's tiny model (benchmarks/dry_run.py); a profile of another length is refused
    good = tmp_path / "profile.json"
    good.write_text(json.dumps({"profiles": {"0.4": [1.0] * layers}}))
    assert dry("quality", tmp_path / "a", "--configs", "all-keep", "spin-0.4-profile", "--sparsity-profile", str(good),
               "--profile-from", "100") == 0
    with open(tmp_path / "a" / "quality" / "ruler.csv") as f:
        assert {r["config"] for r in csv.DictReader(f)} == {"all-keep", "spin-0.4-profile"}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"profiles": {"0.3": [1.0] * layers}}))
    assert dry("quality", tmp_path / "b", "--configs", "spin-0.4-profile", "--sparsity-profile", str(other)) != 0
    assert "no profile calibrated at sparsity 0.4" in capsys.readouterr().err


@pytest.mark.parametrize("stage, tgzs", [("quality", ("quality",)), ("capture+quality", ("capture", "quality"))])
def test_shell_dry_run_packs_one_tgz_per_stage(tmp_path, stage, tgzs):
    """DRY=1 bash benchmarks/h200_quality.sh STAGE: each stage's log and tables come back in one .tgz;
    capture+quality runs both at once and packs both."""
    import os

    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # python3 = this one
    env = {"DRY": "1", "OUT": str(tmp_path), "PATH": path}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "h200_quality.sh"), stage], cwd=ROOT,
                          env=dict(os.environ, **env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for name in tgzs:
        with tarfile.open(tmp_path / f"{name}.tgz") as tar:
            names = tar.getnames()
        assert f"{name}.log" in names
        assert any(n.endswith("ruler.csv") for n in names) if name == "quality" else \
            any(n.endswith("main-python_stdlib/summary.csv") for n in names)
