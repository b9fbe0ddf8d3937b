"""The DeepGEMM logits backend: skipped cleanly where deep_gemm does not import (CI, the CPU), chosen only on
SM90 CUDA inputs, and equal to the reference where it runs (the H200 with the kit of ../shared/deepgemm)."""
from __future__ import annotations

import pytest
import torch

from conftest import make_paged_inputs
from spin_indexer import ops
from spin_indexer.ops import deepgemm


def test_backend_choice_without_deepgemm_on_cpu(monkeypatch):
    q = torch.zeros(1, 1, 64, 128).to(torch.float8_e4m3fn)
    kv = torch.zeros(2, 64, 1, 132, dtype=torch.uint8)
    assert isinstance(deepgemm.available(), bool)
    assert not deepgemm.supports(q, kv) and not deepgemm.supports(q, kv, history=True)
    assert ops.logits_backend(q, kv) == "reference" and ops.logits_backend(q, kv, True) == "reference"
    monkeypatch.setenv("SPIN_INDEXER_LOGITS", "deepgemm")  # forcing cannot pick it without CUDA and deep_gemm
    assert not deepgemm.supports(q, kv)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and deepgemm.available()), reason="needs CUDA and deep_gemm")
@pytest.mark.parametrize("next_n", [1, 2])
def test_deepgemm_matches_reference(next_n, gen):
    x = make_paged_inputs([3000, 700, 65], next_n, 64, 128, gen).to("cuda")
    want = ops.paged_indexer_logits_ref(x.q_fp8, x.kv_cache, x.weights, x.seq_lens, x.block_table)
    got = deepgemm.paged_indexer_logits_deepgemm(x.q_fp8, x.kv_cache, x.weights, x.seq_lens, x.block_table)
    live = torch.isfinite(want)
    err = (got[live] - want[live]).norm() / want[live].norm()
    assert err < 5e-3, err
