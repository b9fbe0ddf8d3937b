"""benchmarks/sparse_mla.py against a float64 masked dense attention, and a CPU dry run of
benchmarks/bench_v32_step.py (Triton under TRITON_INTERPRET=1, tiny shapes, CSV checked).

benchmarks/ is not a package (its modules import `harness` as a top-level module), so it goes on sys.path.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import import_benchmark, run_benchmark_dry

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from sparse_mla import LATENT_DIM, QK_DIM, T, sparse_mla_decode, sparse_mla_dense_ref  # noqa: E402


def _mla_case(lengths, next_n, heads, k, gen, spare_blocks=3):
    """Random bf16 queries, an fp8 latent cache with power-of-two scales, a shuffled block table (every
    column a real block, so the reference can read the whole table) and top-k lists of distinct positions
    below each row's length, -1 padded: row 0 fully padded, others with a random number of -1 at the end."""
    batch, rows = len(lengths), len(lengths) * next_n
    width = max(-(-x // T) for x in lengths)
    num_blocks = batch * width + spare_blocks
    table = torch.randperm(num_blocks, generator=gen)[:batch * width].view(batch, width).to(torch.int32)
    kv_latent = torch.randn(num_blocks * T, QK_DIM, generator=gen).to(torch.float8_e4m3fn)
    kv_scale = torch.exp2(torch.randint(-4, 1, (num_blocks * T,), generator=gen).float())
    q = torch.randn(rows, heads, QK_DIM, generator=gen).to(torch.bfloat16)
    topk = torch.full((rows, k), -1, dtype=torch.int32)
    for r in range(1, rows):
        length = lengths[r // next_n] - next_n + r % next_n + 1
        count = int(torch.randint(1, min(k, length) + 1, (1,), generator=gen))
        topk[r, :count] = torch.randperm(length, generator=gen)[:count].to(torch.int32)
    return q, kv_latent, kv_scale, table, topk


@pytest.mark.parametrize("lengths,next_n,k", [((130, 256, 70), 2, 40), ((64, 64), 1, 64), ((200, 1), 1, 16)],
                         ids=["partial-last-block-n2", "one-block", "one-token"])
def test_sparse_mla_matches_dense_reference(lengths, next_n, k, gen):
    args = _mla_case(lengths, next_n, heads=8, k=k, gen=gen)
    got = sparse_mla_decode(*args)
    want = sparse_mla_dense_ref(*args)
    assert got.dtype == torch.bfloat16 and got.shape == (len(lengths) * next_n, 8, LATENT_DIM)
    assert torch.equal(got[0], torch.zeros_like(got[0])), "a row with only padding must be zero"
    err = (got.double() - want).abs()
    # bf16 keys are exact (fp8 x power of two); scores and probabilities are rounded to bf16 (~0.4% each)
    assert err.max() <= 0.03 * want.abs().max(), f"max error {err.max():.3e}"
    assert err.norm() <= 0.01 * want.norm(), f"relative error {err.norm() / want.norm():.3e}"


def test_sparse_mla_rejects_bad_inputs(gen):
    q, kv_latent, kv_scale, table, topk = _mla_case((100,), 1, heads=4, k=8, gen=gen)
    with pytest.raises(TypeError, match="kv_latent: expected dtype torch.float8_e4m3fn"):
        sparse_mla_decode(q, kv_latent.float(), kv_scale, table, topk)
    with pytest.raises(ValueError, match=r"topk_indices: expected shape \[R, K\]"):
        sparse_mla_decode(q, kv_latent, kv_scale, table, topk[:0])


@pytest.mark.interpreter
def test_bench_v32_step_dry_run(tmp_path):
    """The whole benchmark on CPU at tiny shapes: a fixed and an auto point, dense + one SPIN sparsity."""
    pytest.importorskip("triton")
    proc = run_benchmark_dry("bench_v32_step.py", [
        "--out", tmp_path, "--points", "2x2048,autox1024", "--auto-batches", "1,3", "--layers", "2", "--topk", "128",
        "--index-heads", "8", "--index-dim", "32", "--mla-heads", "4", "--sparsity", "0.5"], timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "auto batch at context 1024: 3" in proc.stdout
    with open(tmp_path / "h200_v32_step.csv") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == ["model_shape", "batch", "context", "config", "layers", "step_ms", "indexer_ms",
                                 "attention_ms", "indexer_vs_dense", "realized_sparsity",
                                 "tokens_per_s_indexer_attention"]
    assert [(r["batch"], r["context"], r["config"]) for r in rows] == [
        ("2", "2048", "dense"), ("2", "2048", "spin-0.5"), ("3", "1024", "dense"), ("3", "1024", "spin-0.5")]
    for r in rows:
        realized = float(r["realized_sparsity"])
        assert r["layers"] == "2"
        if r["config"] == "dense":
            assert realized == 0.0
        else:
            assert 0.0 < realized < 1.0
    saved = json.loads((tmp_path / "h200_v32_step.json").read_text())
    assert saved["env"]["gpu"] == "cpu (dry run)" and len(saved["rows"]) == 4
    assert "| model_shape |" in (tmp_path / "h200_v32_step.md").read_text()


def test_variants_switch_one_part_each_and_restore_it(monkeypatch):
    # the A/B switches of --variants change exactly their part while active and put it back after,
    # also when the body raises; an unknown name is refused naming the option
    from spin_indexer.indexer import SpinIndexer

    v32 = import_benchmark("bench_v32_step")
    monkeypatch.setenv("SPIN_INDEXER_LOGITS", "deepgemm")
    schedule = SpinIndexer._schedule_layers
    with pytest.raises(RuntimeError), v32.variant("no-schedule"):
        assert SpinIndexer._schedule_layers(None, 4, 8) is False
        raise RuntimeError("body")
    assert SpinIndexer._schedule_layers is schedule
    with v32.variant("logits-triton"):
        assert os.environ["SPIN_INDEXER_LOGITS"] == "triton"
    assert os.environ["SPIN_INDEXER_LOGITS"] == "deepgemm"
    monkeypatch.delenv("SPIN_INDEXER_LOGITS")
    with v32.variant("logits-deepgemm"):
        assert os.environ["SPIN_INDEXER_LOGITS"] == "deepgemm"
    assert "SPIN_INDEXER_LOGITS" not in os.environ
    monkeypatch.setenv("SPIN_INDEXER_LOGITS", "deepgemm")
    init = SpinIndexer.__init__
    with pytest.raises(RuntimeError), v32.variant("no-overlap"):
        assert SpinIndexer.__dict__["__init__"].keywords == {"overlap_update": False}
        raise RuntimeError("body")
    assert SpinIndexer.__init__ is init
    with v32.variant("tau-hint"):
        assert SpinIndexer.__dict__["__init__"].keywords == {"tau_hint": True}
    assert SpinIndexer.__init__ is init
    # compact-16k: SPIN's compact tables (not the dense full ones) chunked as a full table again
    from spin_indexer.ops import indexer_logits_triton as ilt
    config = ilt.default_config
    assert config(1, 96 * 1024, True).target_programs == ilt.COMPACT_TARGET_PROGRAMS != 16384
    with pytest.raises(RuntimeError), v32.variant("compact-16k"):
        assert ilt.default_config(1, 96 * 1024, True).target_programs == 16384
        assert ilt.default_config(1, 96 * 1024, True).prefetch == config(1, 96 * 1024, True).prefetch
        assert ilt.default_config(1, 96 * 2048, False) == config(1, 96 * 2048, False)
        raise RuntimeError("body")
    assert ilt.default_config is config
    # compact-uncapped: the compact chunk up to 256 blocks again, nothing else
    with v32.variant("compact-uncapped"):
        assert ilt.default_config(1, 96 * 1024, True) == dataclasses.replace(config(1, 96 * 1024, True), max_chunk=256)
        assert ilt.default_config(1, 96 * 2048, False) == config(1, 96 * 2048, False)
    assert ilt.default_config is config and config(1, 96 * 1024, True).max_chunk == ilt.COMPACT_MAX_CHUNK
    with pytest.raises(SystemExit, match="--variants"), v32.variant("topk-v3"):
        pass


def test_unknown_variant_is_refused_before_any_point(capsys):
    v32 = import_benchmark("bench_v32_step")
    with pytest.raises(SystemExit) as exc:
        v32.main(["--variants", "default,topk-v9", "--points", "1x1024", "--out", "/nonexistent/never-created"])
    assert exc.value.code == 2 and "--variants: unknown ['topk-v9']" in capsys.readouterr().err


def test_timings_are_medians_of_paired_rounds():
    """A drift that moves every graph of a round alike leaves the paired indexer time and ratio exact: rounds with
    attention 5-9 ms and the steps 5 (SPIN) and 10 (dense) ms above it give 5 ms and 0.5 in every round."""
    v32 = import_benchmark("bench_v32_step")
    attention = [5.0, 9.0, 6.0, 8.0, 7.0]
    spin = [a + 5.0 for a in attention]
    dense = [a + 10.0 for a in attention]
    t = v32._times(spin, attention, dense)
    assert t == dict(step_ms=12.0, indexer_ms=5.0, attention_ms=7.0, indexer_vs_dense=0.5)
    assert v32._times(dense, attention, dense)["indexer_vs_dense"] == 1.0


def test_paired_timing_dry_run_calls_each_once(monkeypatch):
    harness = import_benchmark("harness")
    monkeypatch.setattr(harness, "DEVICE", "cpu")
    calls = []
    out = harness.time_graphs_paired(dict(a=lambda: calls.append("a"), b=lambda: calls.append("b")), rounds=3)
    assert calls == ["a", "b"] and set(out) == {"a", "b"} and all(len(v) == 3 for v in out.values())
