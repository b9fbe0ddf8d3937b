"""paged_indexer_logits_ws (the experimental warp-specialized kernel, issue #17) against the float64
recomputation: next_n 1-4 (3: a padded second group), partial last blocks, blocks per program that cut requests
unevenly, a request shorter than its rows' table, the tail written or left, poisoned outputs, and the shapes it
rejects.

Under TRITON_INTERPRET=1 the loop runs unsplit (the interpreter ignores warp_specialize); on the H200 the same
tests run the specialized kernel (h200_step.sh mtp).
"""
from __future__ import annotations

import pytest
import torch

from conftest import T, assert_logits_close, logits_f64, make_paged_inputs, run_logits_poisoned

pytest.importorskip("triton")
from spin_indexer.ops.indexer_logits_ws import paged_indexer_logits_ws, supports  # noqa: E402

pytestmark = pytest.mark.interpreter


def _run(inputs, device, **knobs):
    return run_logits_poisoned(paged_indexer_logits_ws, inputs, device, **knobs)


@pytest.mark.parametrize("chunk", [None, 1, 3], ids=["chunk-default", "chunk-1", "chunk-3"])
@pytest.mark.parametrize("next_n,heads", [(1, 16), (2, 16), (3, 16), (4, 16), (2, 32)])
def test_matches_float64_with_the_tail_written(next_n, heads, chunk, gen, triton_device):
    # a partial last block, a request ending exactly on a block, a 1-token request; two spare table columns
    inputs = make_paged_inputs((4 * T + 17, 2 * T, 1), next_n, heads, 32, gen, extra_width=2)
    out, bmax = _run(inputs, triton_device, chunk=chunk)
    expected, magnitude = logits_f64(*inputs.args())
    assert_logits_close(out, expected, magnitude)
    rows, cols = expected.shape
    want_bmax = torch.from_numpy(expected.reshape(rows, cols // T, T).max(axis=2)).float()
    got_bmax = bmax.cpu()
    assert torch.equal(torch.isneginf(got_bmax), torch.isneginf(want_bmax))
    live = torch.isfinite(want_bmax)
    # the fused max is the max of the written logits, exactly
    written = out.cpu().view(rows, cols // T, T).amax(dim=2)
    assert torch.equal(got_bmax[live], written[live])


def test_tail_left_unwritten(gen, triton_device):
    """fill_tail=False: blocks past the request's longest row keep the caller's values (the poison)."""
    inputs = make_paged_inputs((3 * T + 5, T), 2, 16, 32, gen, extra_width=2)
    out, bmax = _run(inputs, triton_device, fill_tail=False, chunk=2)
    expected, magnitude = logits_f64(*inputs.args())
    rows, cols = expected.shape
    blocks = torch.tensor([-(-int(x) // T) for x in inputs.seq_lens.amax(dim=1)])
    past = torch.arange(cols // T)[None, :] >= blocks.repeat_interleave(2)[:, None]  # [rows, W]
    assert torch.isnan(bmax.cpu()[past]).all() and not torch.isnan(bmax.cpu()[~past]).any()
    cells = past.repeat_interleave(T, dim=1)
    assert torch.isnan(out.cpu()[cells]).all()
    keep = ~cells.numpy()
    expected[~keep], magnitude[~keep] = 0.0, 0.0
    got = torch.where(cells, torch.zeros(()), out.cpu())
    assert_logits_close(got, expected, magnitude)


def test_empty_batch_and_rejected_shapes(gen, triton_device):
    empty = make_paged_inputs((), 2, 16, 32, gen)
    args = [t.to(triton_device) for t in empty.args()]
    assert paged_indexer_logits_ws(*args).shape == (0, args[4].shape[1] * T)
    for next_n, heads in ((5, 16), (2, 8), (4, 256)):  # next_n 5; H < 16; 2 H > 256
        inputs = make_paged_inputs((T + 3,), next_n, heads, 32, gen)
        args = [t.to(triton_device) for t in inputs.args()]
        assert not supports(args[0], args[1])
        with pytest.raises(ValueError, match="q_fp8 / kv_cache"):
            paged_indexer_logits_ws(*args)


def test_bad_output_buffer_is_rejected(gen, triton_device):
    inputs = make_paged_inputs((T + 3,), 1, 16, 32, gen)
    args = [t.to(triton_device) for t in inputs.args()]
    with pytest.raises(ValueError, match=r"block_max_out: expected shape \[B\*next_n, W\]"):
        paged_indexer_logits_ws(*args, block_max_out=torch.zeros(1, 1, device=triton_device))
