"""Dry run of the end-to-end decoding benchmark (benchmarks/bench_e2e.py) on the CPU with a tiny random model:
the code path the H200 run takes (prefill, batch fill by copy, all-keep and SPIN greedy steps), nothing timed."""
from __future__ import annotations

import csv
import os

import pytest
import torch

from conftest import import_benchmark

if not torch.cuda.is_available():
    os.environ.setdefault("SPIN_BENCH_DEVICE", "cpu")  # harness reads it at import


@pytest.fixture(scope="module")
def bench_e2e():
    return import_benchmark("bench_e2e")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dry run (the GPU run is the benchmark itself)")
def test_dry_run_spin_at_zero_sparsity_decodes_like_all_keep(bench_e2e, tmp_path):
    assert bench_e2e.main(["--tiny", "--points", "3x300", "--configs", "all-keep", "spin-0.0-sorted", "spin-0.5",
                           "dense",
                           "--steps", "3", "--warmup", "1", "--distinct", "2", "--k", "32",
                           "--out", str(tmp_path)]) == 0
    with open(tmp_path / "h200_e2e.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(bench_e2e.COLUMNS)
    assert [r["config"] for r in rows] == ["all-keep", "spin-0.0-sorted", "spin-0.5", "dense"]
    with open(tmp_path / "h200_e2e_detail.csv") as f:
        detail = {r["config"]: r for r in csv.DictReader(f)}
    # keeping every block, SPIN selects exactly the all-keep top-k, so greedy decoding cannot differ
    assert float(detail["spin-0.0-sorted"]["agree_all_keep"]) == 1.0
    assert float(detail["spin-0.0-sorted"]["realized_sparsity"]) == 0.0
    assert float(detail["dense"]["realized_sparsity"]) == 0.0
    assert 0.3 <= float(detail["spin-0.5"]["realized_sparsity"]) <= 0.6  # 5 blocks per request at 300 tokens


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dry run (the GPU run is the benchmark itself)")
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_dry_run_with_an_indexer_of_another_shape(bench_e2e, tmp_path, dtype):
    """--indexer-shape swaps in a random head of that many heads x dims: the step's keys are D + 4 bytes a token
    (the cache the logits kernels read) and SPIN still keeps exactly the dense top-k at s = 0. --indexer-dtype
    sets its projections' dtype (default the model's: float32 on the CPU), never its rotary tables'."""
    namespace = bench_e2e.argparse.Namespace(tiny=True, indexer_shape=(8, 32), indexer_dtype=dtype)
    model, indexer, _, _ = bench_e2e.load(namespace, 64, 64)
    assert (indexer.cfg.num_heads, indexer.cfg.head_dim) == (8, 32)
    expected = torch.bfloat16 if dtype else torch.float32
    assert {p.dtype for p in indexer.layers.parameters()} == {expected}
    assert indexer.rope.cos.dtype == torch.float32
    assert bench_e2e.main(["--tiny", "--indexer-shape", "8x32", "--points", "2x300", "--configs", "dense",
                           "spin-0.0", "spin-0.5", "--steps", "2", "--warmup", "1", "--distinct", "2", "--k", "32",
                           "--out", str(tmp_path)] + (["--indexer-dtype", dtype] if dtype else [])) == 0
    with open(tmp_path / "h200_e2e_detail.csv") as f:
        detail = {r["config"]: r for r in csv.DictReader(f)}
    assert float(detail["spin-0.0"]["agree_all_keep"]) == 1.0  # the same top-k as dense, so the same tokens
    assert 0.3 <= float(detail["spin-0.5"]["realized_sparsity"]) <= 0.6


def test_indexer_shape_parses_and_rejects(bench_e2e, capsys):
    assert bench_e2e.parse_indexer_shape("64x128") == (64, 128)
    for bad in ("64", "64x", "3x128", "64x16", "48x128", "axb"):
        with pytest.raises(bench_e2e.argparse.ArgumentTypeError):
            bench_e2e.parse_indexer_shape(bad)
    with pytest.raises(SystemExit, match="--indexer-shape: only with"):  # the GGUF model: the shipped head only
        bench_e2e.main(["--indexer-shape", "64x128", "--points", "1x256"])
    with pytest.raises(SystemExit):
        bench_e2e.main(["--tiny", "--indexer-shape", "3x128"])
    assert "argument --indexer-shape: expected powers of two" in capsys.readouterr().err


def test_points_parse_and_reject(bench_e2e):
    assert bench_e2e.parse_points("32x16384, 96x32768") == [(32, 16384), (96, 32768)]
    with pytest.raises(SystemExit, match="BATCHxCONTEXT"):
        bench_e2e.parse_points("32by16384")


def test_configs_parse_and_reject(bench_e2e):
    assert bench_e2e.parse_config("all-keep") is None
    assert bench_e2e.parse_config("dense") == "dense"
    assert bench_e2e.parse_config("spin-0.4") == (0.4, True, "auto", False)
    assert bench_e2e.parse_config("spin-0.5-serial") == (0.5, False, "auto", False)
    assert bench_e2e.parse_config("spin-0.4-block") == (0.4, True, "block", False)
    assert bench_e2e.parse_config("spin-0.5-slot-sorted") == (0.5, True, "slot", True)
    assert bench_e2e.parse_config("spin-0.5-block-sorted-serial") == (0.5, False, "block", True)
    for bad in ("spin-x", "spin-1.5", "dense-0.5", "spin-0.5-fast", "spin-0.5-serial-block", "spin-block",
                "spin-0.5-sorted-slot"):
        with pytest.raises(SystemExit, match="--configs"):
            bench_e2e.parse_config(bad)


def test_each_config_resets_the_batch_before_every_configuration(bench_e2e):
    """each_config (profile_e2e.py, topk_candidates.py): every configuration starts from the prefill: the cache
    lengths as filled, a fresh copy of the first tokens, the selector that configuration names."""
    import argparse
    args = argparse.Namespace(tiny=True, random_weights=False, distinct=2, task="niah_single_2", k=32,
                              configs=["all-keep", "spin-0.5", "spin-0.4"])
    model, indexer, tok, _ = bench_e2e.load(args, 300 + 12, 300)
    seen = []
    for batch, context, config, caches, selector, token in bench_e2e.each_config(args, model, indexer, tok,
                                                                                  [(2, 300)], 4):
        seen.append((config, selector is None, caches.lengths.clone(), token.clone()))
        caches.lengths.add_(5)  # what a decode step would do to the shared batch
        token.fill_(-1)
    assert [s[0] for s in seen] == args.configs and [s[1] for s in seen] == [True, False, False]
    for _, _, lengths, token in seen[1:]:
        assert torch.equal(lengths, seen[0][2]) and torch.equal(token, seen[0][3]) and (token >= 0).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU dry run")
def test_topk_candidates_summary_counts_rows_over_the_buffer(tmp_path):
    tc = import_benchmark("topk_candidates")
    calls = [dict(cols=640, k=8, group=4, cap=32, counts=[10, 40, 12]), dict(cols=640, k=8, group=4, cap=32,
                                                                            counts=[33, 9, 11])]
    line = tc.summary("x", calls)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:5] == ["x", "2", "640-640", "4", "12"] and cells[6] == "40" and cells[7] == "33.3%"
    assert tc.main(["--tiny", "--points", "2x256", "--configs", "all-keep", "--k", "32", "--out", str(tmp_path)]) == 0
    assert "| all-keep B=2 L=256 | 0 |" in (tmp_path / "topk_candidates.md").read_text()  # CPU: no Triton top-k


def test_profile_e2e_bound_counts_only_the_indexer_logits_kernels():
    """profile_e2e's limit line: logits 26 of 100 us of kernels (the Triton and the CUDA kernel's names; attention
    and the top-k are not logits) -> at 50% 1 / (1 - 0.13) = 1.149x, at 40% 1 / (1 - 0.104) = 1.116x."""
    prof = import_benchmark("profile_e2e")
    rows = [(20.0, 30.0, "_paged_indexer_logits_kernel"), (6.0, 1.0, "void paged_logits_kernel<2>(Params)"),
            (50.0, 30.0, "_topk_attention_kernel"), (24.0, 30.0, "_threshold_kernel")]
    line = prof.logits_bound(rows)
    assert "indexer logits 0.03 of 0.10 ms of kernels (26.0%)" in line
    assert "40% 1.116x" in line and "50% 1.149x" in line
    assert "(0.0%)" in prof.logits_bound([(5.0, 1.0, "_topk_attention_kernel")])
