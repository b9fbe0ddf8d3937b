"""benchmarks/update_overlap.py and update_pass_configs.py, the EMA update's experiments: every variant runs in a
CPU dry run, and each patch of the production modules is in force inside its block and undone after it (the
variants share one process on the H200, so a patch that leaked would time the next variant with it)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import import_benchmark, run_benchmark_dry


@pytest.mark.interpreter
def test_every_variant_runs_in_a_dry_run(tmp_path):
    pytest.importorskip("triton")
    variants = ("spin,block,blocktopk,topk_first,no_update,fused,onetile,st2,stg4,prog8,pipe,thr4,sel8,gat4096,ltp64,"
                "lch32,lpf2,"
                "after_thr,after_gat,gpass,wchunk,wave")
    proc = run_benchmark_dry("update_overlap.py", ["--out", tmp_path, "--points", "2x8192x1", "--sparsities", "0.4",
                                                   "--variants", variants, "--rounds", "2"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (result,) = json.loads((tmp_path / "update_overlap.json").read_text())
    assert set(variants.split(",")) <= set(result["us"])
    assert result["env"]["gpu"] == "cpu (dry run)" and result["env"]["commit"]  # what ran it, named
    assert {"update_alone", "update_alone_prog8", "update_alone_pipe", "dense_gpass"} <= set(result["us"])


def test_variants_patch_inside_their_block_only():
    pytest.importorskip("triton")
    overlap = import_benchmark("update_overlap")
    from spin_indexer import ops
    from spin_indexer.ops import history_triton, topk_triton
    from spin_indexer.ops import indexer_logits_triton as ilt
    cpu = torch.device("cpu")
    def state():
        return (ops.writes_group_max("cuda", 16), topk_triton.threshold_warps(8192), topk_triton.set_select_warps(4096),
                history_triton.PIPELINED_MIN_BLOCKS, history_triton.pass_programs(cpu), topk_triton.GATHER_VALUES,
                ilt.COMPACT_TARGET_PROGRAMS, ilt.default_config(1, 1 << 20, True),
                ilt.default_config(1, 1 << 20, False))
    before = state()
    checks = {"thr4": lambda: topk_triton.threshold_warps(8192) == 4 and topk_triton.threshold_warps(16384) == 4,
              "sel8": lambda: topk_triton.set_select_warps(4096) == 8,
              "pipe": lambda: history_triton.PIPELINED_MIN_BLOCKS == 0,
              "prog100": lambda: history_triton.pass_programs(cpu) == 100,
              "gat4096": lambda: topk_triton.GATHER_VALUES == 4096,
              "ltp16384": lambda: ilt.default_config(1, 1 << 20, True).target_programs == 16384,
              "lch256": lambda: ilt.default_config(1, 1 << 20, True).max_chunk == 256,
              "gpass": lambda: not ops.writes_group_max("cuda", 16) and ops.writes_group_max("triton", 16),
              "lpf2": lambda: ilt.default_config(1, 1 << 20, True).prefetch == 2
              and ilt.default_config(1, 1 << 20, False) == before[-1]}
    for name, inside in checks.items():
        with overlap.variant(None, name):
            assert inside(), name
        after = state()
        assert after == before, name


def test_chunk_variants_patch_inside_their_block_only(monkeypatch):
    """wchunk: the CUDA kernel's wrapper called without active_width (the table's width chunks it); wave:
    makespan_chunk replaced by wave_chunk (the whole-wave rule); both undone after the block."""
    overlap = import_benchmark("update_overlap")
    from spin_indexer.ops import indexer_logits_cuda as C
    calls = []
    monkeypatch.setattr(C, "paged_indexer_logits_cuda", lambda *a, **kw: calls.append((a, kw)))
    recorder, makespan = C.paged_indexer_logits_cuda, C.makespan_chunk
    with overlap.variant(None, "wchunk"):
        C.paged_indexer_logits_cuda(1, 2, active_width=5, chunk=3)
    assert calls == [((1, 2), {"chunk": 3})] and C.paged_indexer_logits_cuda is recorder
    with overlap.variant(None, "wave"):
        assert C.makespan_chunk(8, 4096, 132) == 256 and makespan(8, 4096, 132) == 249
    assert C.makespan_chunk is makespan


def test_the_update_reroutes_patch_inside_their_block_only():
    """topk_first / no_update replace ops.update_history and the indexer's top-k inside the block; after it the
    package's function is back and the indexer holds no attribute of its own."""
    pytest.importorskip("triton")
    overlap = import_benchmark("update_overlap")
    from spin_indexer import ops

    class Indexer:
        def _topk(self):
            return "top-k"
    idx, original = Indexer(), ops.update_history
    for name in ("topk_first", "no_update"):
        with overlap.variant(idx, name):
            assert ops.update_history is not original and "_topk" in vars(idx), name
            assert ops.update_history(object(), None) is None  # held back (topk_first) or dropped (no_update)
        assert ops.update_history is original and "_topk" not in vars(idx) and idx._topk() == "top-k", name


def test_pass_configs_patch_inside_their_block_only():
    pytest.importorskip("triton")
    configs = import_benchmark("update_pass_configs")
    from spin_indexer.ops import history_triton as ht
    names = ("BLOCKS_PER_PROGRAM", "PIPELINED_STAGES", "NUM_WARPS", "PASS_PROGRAMS_PER_SM")
    before = [getattr(ht, n) for n in names]
    with configs.config("16:2:8:1"):
        assert [getattr(ht, n) for n in names] == [16, 2, 8, 1]
    assert [getattr(ht, n) for n in names] == before
    assert "update_pass_configs" in sys.modules  # (update_overlap is imported by the tests above it, if they ran)
