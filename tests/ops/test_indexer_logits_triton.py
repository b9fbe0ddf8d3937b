"""paged_indexer_logits_triton (the Triton twin) against an independent float64 recomputation and the torch
reference: odd shapes, blocks per program, compacted block tables, poisoned outputs, fused block max.

Runs under TRITON_INTERPRET=1 on CPU (conftest sets it before this module imports triton); on a CUDA box
the same tests run the compiled kernel.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import ODD_IDS, ODD_SHAPES, T, assert_logits_close, logits_f64, make_case_inputs, make_paged_inputs

pytest.importorskip("triton")
from spin_indexer.ops.indexer_logits import block_max_ref, paged_indexer_logits_ref  # noqa: E402
from spin_indexer.ops.indexer_logits_triton import CONFIGS, LogitsConfig, paged_indexer_logits_triton  # noqa: E402

pytestmark = pytest.mark.interpreter


def _run(inputs, device, **knobs):
    """Launch into NaN-poisoned outputs so an element the kernel skips cannot pass."""
    args = [t.to(device) for t in inputs.args()]
    rows = args[0].shape[0] * args[0].shape[1]
    width = args[4].shape[1]
    out = torch.full((rows, width * T), float("nan"), device=device)
    bmax = torch.full((rows, width), float("nan"), device=device)
    got = paged_indexer_logits_triton(*args, out=out, block_max_out=bmax, **knobs)
    assert got is out
    return out, bmax  # on the device: assert_logits_close picks the tolerance of its accumulator


def _check_block_max(bmax: torch.Tensor, expected: np.ndarray, magnitude: np.ndarray) -> None:
    """The fused max equals the max of the expected logits of each block (within the logits tolerance)."""
    rows, cols = expected.shape
    exp_blocks = expected.reshape(rows, cols // T, T).max(axis=2)
    mag_blocks = magnitude.reshape(rows, cols // T, T).max(axis=2)
    assert_logits_close(bmax, exp_blocks, mag_blocks)


@pytest.mark.parametrize("case", ODD_SHAPES, ids=ODD_IDS)
def test_odd_shapes_match_float64(case, gen, triton_device):
    inputs = make_case_inputs(case, gen)
    out, bmax = _run(inputs, triton_device)
    expected, magnitude = logits_f64(*inputs.args())
    assert_logits_close(out, expected, magnitude)
    _check_block_max(bmax, expected, magnitude)


CHUNKS = [None, 1, 2, 3, 64]  # blocks per program: the default pick, and splits that cut requests unevenly


@pytest.mark.parametrize("chunk", CHUNKS, ids=[f"chunk-{c}" for c in CHUNKS])
@pytest.mark.parametrize("next_n,heads", [(1, 8), (2, 16), (4, 8), (1, 64)])
def test_chunks_match_float64(chunk, next_n, heads, gen, triton_device):
    # lengths cover: a partial last block, a request that ends exactly on a block, a 1-token request
    inputs = make_paged_inputs((5 * T + 17, 3 * T, 1), next_n, heads, 32, gen, extra_width=2)
    out, bmax = _run(inputs, triton_device, chunk=chunk)
    expected, magnitude = logits_f64(*inputs.args())
    assert_logits_close(out, expected, magnitude)
    _check_block_max(bmax, expected, magnitude)


@pytest.mark.parametrize("next_n", [2, 3, 4])
def test_compacted_table_matches_reference(next_n, gen, triton_device):
    """SPIN's call: a table listing only kept blocks (newest last) and lengths (n_kept - 1) * T + tail."""
    full = make_paged_inputs((9 * T + 5, 6 * T + 40), next_n, 16, 32, gen, garbage=False)
    table = full.block_table
    kept = [[0, 2, 3, 6, 9], [1, 4, 6]]  # logical blocks kept per request (newest block included)
    width = table.shape[1]
    compact = torch.full_like(table, -1)
    lens = torch.zeros_like(full.seq_lens)
    for b, blocks in enumerate(kept):
        compact[b, : len(blocks)] = table[b, blocks]
        tail = full.seq_lens[b] - blocks[-1] * T  # rows' tokens in the newest block
        lens[b] = (len(blocks) - 1) * T + tail
    compacted = type(full)(full.q_fp8, full.kv_cache, full.weights, lens, compact)
    out, bmax = _run(compacted, triton_device)
    ref = paged_indexer_logits_ref(*compacted.args())
    expected, magnitude = logits_f64(*compacted.args())
    assert_logits_close(out, expected, magnitude)
    assert torch.equal(torch.isfinite(bmax.cpu()), torch.isfinite(block_max_ref(ref, T)))
    assert out.shape == (2 * next_n, width * T)


def test_returns_new_buffers_and_validates(gen, triton_device):
    inputs = make_paged_inputs((100,), 1, 8, 32, gen)
    args = [t.to(triton_device) for t in inputs.args()]
    out = paged_indexer_logits_triton(*args)
    expected, magnitude = logits_f64(*inputs.args())
    assert_logits_close(out, expected, magnitude)
    with pytest.raises(ValueError, match="out"):
        paged_indexer_logits_triton(*args, out=torch.empty(3, 3, device=triton_device))
    with pytest.raises(ValueError, match="block_max_out"):
        paged_indexer_logits_triton(*args, block_max_out=torch.empty(1, 1, device=triton_device))
    bad_lens = args[3].clone() + 10**6
    with pytest.raises(ValueError, match="seq_lens"):
        paged_indexer_logits_triton(args[0], args[1], args[2], bad_lens, args[4])


@pytest.mark.parametrize("next_n,dim", [(3, 16), (5, 32)])
def test_unsupported_shape_falls_back_to_reference(next_n, dim, gen, triton_device):
    """D = 16 has no MMA tile, next_n > 4 no group split: same results through the reference, into the given
    buffers."""
    inputs = make_paged_inputs((70, 130), next_n, 8, dim, gen)
    out, bmax = _run(inputs, triton_device)
    expected, magnitude = logits_f64(*inputs.args())
    assert_logits_close(out, expected, magnitude)
    _check_block_max(bmax, expected, magnitude)


def test_unchecked_bad_block_ids_never_read_outside_the_cache(gen, triton_device):
    """validate=False skips the id check: ids past the cache (or negative) are clamped into it, so the kernel
    computes something for them but never reads outside (the interpreter raises on any such read)."""
    x = make_paged_inputs([130, 64], 1, 8, 32, gen)
    table = x.block_table.clone()
    table[0, 0], table[0, 1] = x.kv_cache.shape[0] + 1000, -7
    d = x.to(triton_device)
    out = paged_indexer_logits_triton(d.q_fp8, d.kv_cache, d.weights, d.seq_lens, table.to(triton_device),
                                      validate=False)
    expected, magnitude = logits_f64(*x.args())
    assert torch.isfinite(out[0, :130]).all()  # clamped ids: some block's keys, finite
    assert_logits_close(out[1:2, :64], expected[1:2, :64], magnitude[1:2, :64])  # the untouched request


@pytest.mark.parametrize("what", ["weights", "q_fp8"])
def test_non_finite_inputs_are_rejected_when_validating(what, gen):
    x = make_paged_inputs([130], 1, 8, 32, gen)
    args = dict(zip(["q_fp8", "kv_cache", "weights", "seq_lens", "block_table"], x.args()))
    if what == "weights":
        args["weights"] = args["weights"].clone()
        args["weights"][0, 3] = float("nan")
    else:
        q = args["q_fp8"].clone().view(torch.uint8)
        q[0, 0, 1, 5] = 0xFF  # an fp8 e4m3 NaN
        args["q_fp8"] = q.view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=rf"{what}: expected finite values"):
        paged_indexer_logits_ref(**args)


# ------------------------------------------------------------------------------------------- MTP rows
# Launch configurations that take different code paths: rows per MMA (one group, groups of 2 with a shorter last
# group, one group of 4 padded with a zero row at next_n = 3), the hand prefetch of the next block's scales.
# Warps, register caps and chunk targets change only the compiled schedule (the GPU run covers them).
# (The production configs, CONFIGS[n], run in every test that passes no config.)
MTP_CONFIGS = [(n, LogitsConfig(g, prefetch=p)) for n, g, p in (
    (1, 1, True), (2, 1, False), (2, 2, False), (2, 2, True), (3, 1, False), (3, 2, False), (3, 4, False),
    (3, 2, True), (4, 1, False), (4, 2, False), (4, 4, False), (4, 4, True))]


def _config_id(n, cfg):
    return f"n{n}-g{cfg.group}" + ("-prefetch" if cfg.prefetch else "")


@pytest.mark.parametrize("next_n,config", MTP_CONFIGS, ids=[_config_id(*c) for c in MTP_CONFIGS])
def test_mtp_configs_match_float64(next_n, config, gen, triton_device):
    """Every next_n in 1..4 under each group split: a partial last block, a request ending on a block edge, a
    request shorter than next_n (empty rows), garbage table entries, H = 8 padded to 16-column MMA tiles, and
    3 blocks per program (programs that start mid-request); outputs NaN-poisoned."""
    inputs = make_paged_inputs((5 * T + 17, 2 * T, 2), next_n, 8, 32, gen, extra_width=2)
    out, bmax = _run(inputs, triton_device, chunk=3, config=config)
    expected, magnitude = logits_f64(*inputs.args())
    assert_logits_close(out, expected, magnitude)
    _check_block_max(bmax, expected, magnitude)


@pytest.mark.parametrize("next_n", [3, 4])
def test_mtp_production_heads_match_float64(next_n, gen, triton_device):
    """H = 64 (the N = 2H / 4H MMA tiles of the production configs), D = 64, the default config and chunk."""
    inputs = make_paged_inputs((2 * T + 9, T - 1), next_n, 64, 64, gen)
    out, bmax = _run(inputs, triton_device)
    expected, magnitude = logits_f64(*inputs.args())
    assert_logits_close(out, expected, magnitude)
    _check_block_max(bmax, expected, magnitude)


def test_config_groups_and_table():
    """group_rows cuts next_n into at most 4 groups; the table has a config for every next_n the kernel takes
    (next_n 3 included: on CUDA it runs the kernel, not the reference; DeepGEMM takes only 1 and 2)."""
    from spin_indexer.ops.indexer_logits_triton import _kernel_supports
    assert all(_kernel_supports(n, 64, 128, 64) for n in (1, 2, 3, 4)) and not _kernel_supports(5, 64, 128, 64)
    assert LogitsConfig(2).group_rows(3) == (2, 1, 0, 0)
    assert LogitsConfig(4).group_rows(3) == (3, 0, 0, 0)
    assert LogitsConfig(1).group_rows(4) == (1, 1, 1, 1)
    assert sorted(CONFIGS) == [1, 2, 3, 4]
    assert all(sum(CONFIGS[n].group_rows(n)) == n for n in CONFIGS)
    with pytest.raises(ValueError, match="config: expected group"):
        LogitsConfig(3).group_rows(3)
