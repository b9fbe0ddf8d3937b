"""paged_indexer_logits_triton (the Triton twin) against an independent float64 recomputation and the torch
reference: odd shapes, blocks per program, compacted block tables, poisoned outputs, fused block max.

Runs under TRITON_INTERPRET=1 on CPU (conftest sets it before this module imports triton); on a CUDA box
the same tests run the compiled kernel.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import (ODD_IDS, ODD_SHAPES, T, assert_logits_close, check_lengths_past_the_table, logits_f64,
                      make_case_inputs, make_paged_inputs, run_logits_poisoned)

pytest.importorskip("triton")
from spin_indexer.ops.indexer_logits import block_max_ref, paged_indexer_logits_ref  # noqa: E402
from spin_indexer.ops.indexer_logits_triton import CONFIGS, LogitsConfig, paged_indexer_logits_triton  # noqa: E402

pytestmark = pytest.mark.interpreter


def _run(inputs, device, **knobs):
    """Launch into NaN-poisoned outputs (on the device, assert_logits_close picks its accumulator's tolerance)."""
    return run_logits_poisoned(paged_indexer_logits_triton, inputs, device, **knobs)


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
@pytest.mark.parametrize("next_n,heads", [(1, 8), (2, 16), (4, 8), (1, 64), (1, 4), (2, 4)])
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


def test_active_width_sizes_programs_not_the_grid(gen, triton_device):
    """active_width (SPIN's kept budget) picks the blocks per program for the columns that hold blocks; the
    grid still covers the whole table, so a row keeping every block (a first step) is scored in full."""
    from spin_indexer.ops.indexer_logits_triton import _pick_chunk
    assert _pick_chunk(8, 1024) == 8 and _pick_chunk(8, 2048) == 16  # 8 x 128K at s = 0.5: twice the programs
    x = make_paged_inputs((40 * T + 3, 11 * T, 2 * T + 7), 1, 16, 32, gen).to(triton_device)
    want = paged_indexer_logits_triton(x.q_fp8, x.kv_cache, x.weights, x.seq_lens, x.block_table)
    for active in (1, 5, 20):  # smaller than the longest row: its blocks past `active` are still scored
        out = torch.full_like(want, 7.0)  # poisoned
        got = paged_indexer_logits_triton(x.q_fp8, x.kv_cache, x.weights, x.seq_lens, x.block_table, out=out,
                                          active_width=active)
        assert torch.equal(got.cpu(), want.cpu()), active
    if triton_device == "cuda":  # the compact launches asked the driver for their resident places
        from spin_indexer.ops.indexer_logits_triton import _SLOTS
        from spin_indexer.ops.occupancy import sm_count
        sms = sm_count(torch.device("cuda", torch.cuda.current_device()))
        assert _SLOTS and all(sms <= places <= 32 * sms for places in _SLOTS.values()), _SLOTS


def test_compact_launch_first_seen_in_a_capture_keeps_the_rule(gen, triton_device, monkeypatch):
    """A compact launch whose resident places were never asked (first seen inside a CUDA-graph capture) does not
    query the driver there: it runs the block-count rule's chunk, its replay equals the eager result, and the places
    cache stays empty for an eager launch to fill."""
    if triton_device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from spin_indexer.ops import indexer_logits_triton as L
    monkeypatch.setattr(L, "_SLOTS", {})
    x = make_paged_inputs((40 * T + 3, 11 * T, 2 * T + 7), 1, 16, 32, gen).to(triton_device)
    # eager first, with the compact launch's configuration and the rule's chunk (4 here): the kernel the capture
    # launches is compiled and loaded outside it
    rule = L._pick_chunk(3, 20, L.COMPACT_TARGET_PROGRAMS, L.COMPACT_MAX_CHUNK)
    want = paged_indexer_logits_triton(x.q_fp8, x.kv_cache, x.weights, x.seq_lens, x.block_table, chunk=rule,
                                       config=L.default_config(1, 3 * 20, compact=True))
    assert not L._SLOTS  # a given chunk never asks
    out = torch.full_like(want, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_indexer_logits_triton(x.q_fp8, x.kv_cache, x.weights, x.seq_lens, x.block_table, validate=False,
                                    out=out, active_width=20)
    graph.replay()
    torch.cuda.synchronize()
    assert not L._SLOTS
    assert torch.equal(out.cpu(), want.cpu())


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


@pytest.mark.parametrize("next_n,chunk", [(1, 3), (2, 3), (2, None)])
def test_lengths_past_the_table_read_as_the_table(next_n, chunk, gen, triton_device):
    """validate=False with rows longer than W x T: the logits of the capped lengths, nothing read or written past
    a row (conftest.check_lengths_past_the_table). chunk 3 over W = 4: the second program's chunk reaches past
    the table; None: the launcher's."""
    check_lengths_past_the_table(paged_indexer_logits_triton, triton_device, next_n, 8, 32, gen, chunk=chunk)


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
# (The production configs, CONFIGS[n], run in every test that passes no config: n = 1 without the prefetch here.)
MTP_CONFIGS = [(n, LogitsConfig(g, prefetch=p)) for n, g, p in (
    (1, 1, False), (2, 1, False), (2, 2, False), (2, 2, True), (3, 1, False), (3, 2, False), (3, 4, False),
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


def test_default_config_prefetches_where_measured_faster():
    """next_n = 1: the scales prefetched on compact (SPIN) tables at every size, on full tables up to
    PREFETCH_MAX_SMALL and from PREFETCH_MIN_LARGE blocks, not between (run 63); compact tables chunked for
    COMPACT_TARGET_PROGRAMS programs (runs 67-68) of at most COMPACT_MAX_CHUNK blocks (run 95); other next_n:
    CONFIGS."""
    from spin_indexer.ops.indexer_logits_triton import (
        COMPACT_MAX_CHUNK, COMPACT_TARGET_PROGRAMS, PREFETCH_MAX_SMALL, PREFETCH_MIN_LARGE, _pick_chunk,
        default_config)
    compact = default_config(1, 8 * 2048, compact=True)
    assert compact.prefetch == 1 and compact.target_programs == COMPACT_TARGET_PROGRAMS
    assert compact.max_chunk == COMPACT_MAX_CHUNK == 32
    # 96 x 512K s = 0.4 (4915 kept blocks a request): 128 a program without the cap, 32 with it; full tables
    # keep doubling to their target (96 x 16384 blocks: 128)
    assert _pick_chunk(96, 4915, COMPACT_TARGET_PROGRAMS) == 128
    assert _pick_chunk(96, 4915, COMPACT_TARGET_PROGRAMS, compact.max_chunk) == 32
    assert _pick_chunk(96, 16384, CONFIGS[1].target_programs, default_config(1, 96 * 16384, False).max_chunk) == 128
    assert default_config(1, 8 * 2048, compact=False).target_programs == CONFIGS[1].target_programs
    # the compact rule's longer chunks: 96 x 1024 kept blocks 16 -> 32 a program, 8 x 1024 unchanged
    assert [_pick_chunk(96, 1024, t) for t in (CONFIGS[1].target_programs, COMPACT_TARGET_PROGRAMS)] == [16, 32]
    assert _pick_chunk(8, 1024, COMPACT_TARGET_PROGRAMS) == _pick_chunk(8, 1024) == 8
    assert [default_config(1, b, compact=False).prefetch for b in
            (PREFETCH_MAX_SMALL, PREFETCH_MAX_SMALL + 1, PREFETCH_MIN_LARGE - 1, PREFETCH_MIN_LARGE)] == [1, 0, 0, 1]
    assert default_config(1, 16384, compact=False) == dataclasses.replace(CONFIGS[1], prefetch=0)
    assert all(default_config(n, 16384, compact=c) == CONFIGS[n] for n in (2, 3, 4) for c in (False, True))


def _waves_simulated(batch: int, blocks: int, chunk: int, slots: int, saturating: int) -> float:
    """The wave model by events: each row's programs of `chunk` blocks (the last what is left) start in the grid's
    order (chunk index, then row) on `slots` places as places free; while n run, each moves at 1 / max(n,
    saturating) blocks a time unit (HBM's one block a unit shared, or a program's own pace below `saturating`
    programs). Returns the finish time."""
    lengths = [min(chunk, blocks - c) for c in range(0, blocks, chunk) for _ in range(batch)]
    now, running = 0.0, []
    while lengths or running:
        while lengths and len(running) < slots:
            running.append(float(lengths.pop(0)))
        rate = 1.0 / max(len(running), saturating)
        step = min(running) / rate
        now += step
        running = [r - step * rate for r in running if r - step * rate > 1e-9]
    return now


@pytest.mark.parametrize("batch,blocks,chunk,slots,saturating", [
    (64, 256, 16, 792, 320), (64, 256, 8, 792, 320), (64, 257, 16, 792, 320), (64, 257, 32, 792, 320),
    (96, 309, 16, 792, 320), (1, 8192, 8, 792, 320), (8, 1229, 32, 792, 320), (5, 3, 8, 792, 320),
    (40, 17, 8, 264, 384), (30, 83, 8, 264, 100), (0, 64, 8, 792, 320)])
def test_wave_cost_is_the_wave_model(batch, blocks, chunk, slots, saturating):
    """wave_cost's closed form equals the model run by events: full programs in waves, each row's short program
    beside the last wave's (a wave under `saturating` programs costs what `saturating` would)."""
    from spin_indexer.ops.indexer_logits_triton import wave_cost
    assert wave_cost(batch, blocks, chunk, slots, saturating) == pytest.approx(
        _waves_simulated(batch, blocks, chunk, slots, saturating))


def test_wave_cost_bounds_short_programs_without_places():
    """Short programs that find no free place beside the last full wave are counted as a wave after it: no less
    than the events, where they start as the first ones leave."""
    from spin_indexer.ops.indexer_logits_triton import wave_cost
    for batch, blocks, chunk, slots in ((200, 20, 8, 264), (50, 33, 16, 60)):
        exact = _waves_simulated(batch, blocks, chunk, slots, 32)
        assert exact <= wave_cost(batch, blocks, chunk, slots, 32) <= 1.5 * exact


def test_wave_chunk_leaves_no_small_last_wave():
    """The compact launch (792 places: 6 prefetching programs an SM on 132 SMs) takes longer programs where the
    block-count rule's grid is one wave and a small one (runs 166-167, H100: 1024 programs 5-8% slower than 512),
    keeps the rule where the model sees no more than WAVE_GAIN, and never takes a shorter chunk."""
    from spin_indexer.ops.indexer_logits_triton import (COMPACT_MAX_CHUNK, COMPACT_TARGET_PROGRAMS, _pick_chunk,
                                                         wave_chunk)

    def chosen(batch, blocks, slots=792):
        rule = _pick_chunk(batch, blocks, COMPACT_TARGET_PROGRAMS, COMPACT_MAX_CHUNK)
        return rule, wave_chunk(batch, blocks, slots, rule, max_chunk=COMPACT_MAX_CHUNK)
    assert chosen(64, 256) == (16, 32)  # 64 x 32K s = 0.5: 1024 programs -> 512 in one wave
    assert chosen(64, 257) == (16, 32)  # the e2e's 513-block table: 1024 full + 64 one-block programs
    assert chosen(32, 256) == (8, 16)  # 32 x 32K s = 0.5: 1024 -> 512
    assert chosen(8, 1024) == (8, 16)  # 8 x 128K s = 0.5
    assert chosen(8, 1639) == (8, 32)  # 8 x 128K s = 0.2: 1640 programs (two waves and 56) -> 416
    assert chosen(64, 308) == (16, 16) and chosen(32, 308) == (8, 8)  # s = 0.4: 1280 / 1248 programs, kept
    assert chosen(96, 1024) == (32, 32) and chosen(96, 1229) == (32, 32)  # large tables: the rule's cap
    assert chosen(8, 8192) == (16, 16)  # 8 x 1M s = 0.5: 4.3% modeled, under the margin (run 167: a tie)
    assert chosen(1, 1024) == (4, 4)  # one request: fewer programs than saturate, the shortest chunk
    assert chosen(64, 256, slots=1056) == (16, 16)  # 8 programs an SM: 1024 programs are one wave
    assert chosen(3, 2) == (4, 4)  # a table shorter than a chunk
    assert wave_chunk(8, 1024, 792, 8, max_chunk=8) == 8  # never past max_chunk


def test_config_groups_and_table():
    """group_rows cuts next_n into at most 4 groups; the table has a config for every next_n the kernel takes
    (next_n 3 included: on CUDA it runs the kernel, not the reference; DeepGEMM takes only 1 and 2)."""
    from spin_indexer.ops.indexer_logits_triton import _kernel_supports
    assert all(_kernel_supports(n, 64, 128, 64) for n in (1, 2, 3, 4)) and not _kernel_supports(5, 64, 128, 64)
    assert _kernel_supports(1, 4, 64, 64) and not _kernel_supports(1, 6, 64, 64)  # 4-8 heads pad to 16 inside
    assert not _kernel_supports(1, 2, 64, 64)  # 1-2 heads: the reference (H = 1 missed the FP8 tolerance, run 63)
    assert LogitsConfig(2).group_rows(3) == (2, 1, 0, 0)
    assert LogitsConfig(4).group_rows(3) == (3, 0, 0, 0)
    assert LogitsConfig(1).group_rows(4) == (1, 1, 1, 1)
    assert sorted(CONFIGS) == [1, 2, 3, 4]
    assert all(sum(CONFIGS[n].group_rows(n)) == n for n in CONFIGS)
    with pytest.raises(ValueError, match="config: expected group"):
        LogitsConfig(3).group_rows(3)


# ------------------------------------------------------------------------- scales two blocks ahead (p2)
# prefetch=2 carries two blocks' ids and scales through the loop (block blk + 2's loaded in iteration blk,
# clamped to the chunk's last block): every group split, on the inputs the other MTP tests use.
PREFETCH2 = [(1, LogitsConfig(1, prefetch=2)), (2, LogitsConfig(2, prefetch=2)), (3, LogitsConfig(2, prefetch=2)),
             (3, LogitsConfig(4, prefetch=2)), (4, LogitsConfig(4, prefetch=2))]
def _config_id_p2(n, cfg):
    return f"n{n}-g{cfg.group}-prefetch{cfg.prefetch}"


@pytest.mark.parametrize("next_n,config", PREFETCH2, ids=[_config_id_p2(*c) for c in PREFETCH2])
def test_prefetch2_matches_float64(next_n, config, gen, triton_device):
    """Odd lengths (a partial last block, one ending on a block edge, one shorter than next_n), garbage table
    entries past the lengths, H = 8 padded to 16-column tiles, 3 blocks per program, NaN-poisoned outputs."""
    inputs = make_paged_inputs((5 * T + 17, 2 * T, 2), next_n, 8, 32, gen, extra_width=2)
    out, bmax = _run(inputs, triton_device, chunk=3, config=config)
    expected, magnitude = logits_f64(*inputs.args())
    assert_logits_close(out, expected, magnitude)
    _check_block_max(bmax, expected, magnitude)


@pytest.mark.parametrize("chunk", [1, 2, None], ids=["chunk-1", "chunk-2", "chunk-default"])
def test_prefetch2_chunk_edges_match_float64(chunk, gen, triton_device):
    """Chunks of 1 and 2 blocks: the two prefetched sets point at the chunk's last block (or, in a chunk past
    the longest row, at nothing: masked), so the clamping of blk + 1 / blk + 2 is what is tested; fill_tail off
    and on."""
    inputs = make_paged_inputs((4 * T + 1, T + 63, 64), 2, 8, 32, gen, extra_width=3)
    expected, magnitude = logits_f64(*inputs.args())
    out, bmax = _run(inputs, triton_device, chunk=chunk, config=LogitsConfig(2, prefetch=2))
    assert_logits_close(out, expected, magnitude)
    _check_block_max(bmax, expected, magnitude)


@pytest.mark.parametrize("next_n,group", [(2, 2), (4, 4)])
def test_prefetch2_compacted_table_matches_float64(next_n, group, gen, triton_device):
    """SPIN's call with prefetch=2: a table of kept blocks only (garbage -1 past them), lengths (n_kept - 1) * T
    + the newest block's tail."""
    full = make_paged_inputs((9 * T + 5, 6 * T + 40), next_n, 16, 32, gen, garbage=False)
    kept = [[0, 2, 3, 6, 9], [1, 4, 6]]
    compact = torch.full_like(full.block_table, -1)
    lens = torch.zeros_like(full.seq_lens)
    for b, blocks in enumerate(kept):
        compact[b, : len(blocks)] = full.block_table[b, blocks]
        lens[b] = (len(blocks) - 1) * T + full.seq_lens[b] - blocks[-1] * T
    compacted = type(full)(full.q_fp8, full.kv_cache, full.weights, lens, compact)
    out, bmax = _run(compacted, triton_device, chunk=2, config=LogitsConfig(group, prefetch=2))
    expected, magnitude = logits_f64(*compacted.args())
    assert_logits_close(out, expected, magnitude)
    _check_block_max(bmax, expected, magnitude)


@pytest.mark.parametrize("pad", [16, 32], ids=["pad16-3d", "pad32-2d"])
def test_prefetch2_padded_pages_match_float64(pad, gen, triton_device):
    """Padded pages (D = 32: 2304-B pages 2320 apart, no whole number of 32-B rows: the 3D key descriptor; 2336
    apart: 73 rows, the 2D one), padding poisoned with NaN bytes, pages 16 bytes into their allocation: the
    scales' addresses follow the page stride, and the padding is never read."""
    from conftest import padded
    inputs = make_paged_inputs((3 * T + 7, T + 1), 3, 8, 32, gen, extra_width=1)
    kv = padded(inputs.kv_cache, pad, lead=16, device=triton_device)  # .to() would drop the padding
    assert kv.stride(0) == 2304 + pad
    q, _, w, lens, table = inputs.args()
    padded_inputs = type(inputs)(q, kv, w, lens, table)
    out, bmax = _run(padded_inputs, triton_device, chunk=2, config=LogitsConfig(2, prefetch=2))
    expected, magnitude = logits_f64(*inputs.args())
    assert_logits_close(out, expected, magnitude)
    _check_block_max(bmax, expected, magnitude)


@pytest.mark.parametrize("next_n,group", [(1, 1), (2, 2), (3, 4)])
def test_prefetch2_with_fused_history_leaves_the_reference_state(next_n, group, gen, triton_device):
    """The row-0 EMA update fused into the epilogue (HIST) with prefetch=2: its history reads use the block id
    carried two blocks ahead; logits right, the state bit-equal to update_history_ref on those logits."""
    from test_history import assert_state_equal, logits_with_history_case

    from spin_indexer.ops.history import update_history_ref
    # the row-0 policy (the default of the case): only row 0 updates, the fused path
    full, plan, ref, args, out, bmax, moved = logits_with_history_case(next_n, gen, triton_device)
    paged_indexer_logits_triton(*args, out=out, block_max_out=bmax, history=moved, chunk=3,
                                config=LogitsConfig(group, prefetch=2))
    expected, magnitude = logits_f64(full.q_fp8, full.kv_cache, full.weights, plan.lens, plan.table)
    assert_logits_close(out, expected, magnitude)
    update_history_ref(ref, out.cpu().view(2, next_n, -1), plan.table, plan.lens)
    assert_state_equal(moved, tuple(t.numpy() for t in (ref.vertical, ref.block_max, ref.diagonal, ref.last_seen)))


def test_prefetch_field_takes_depths_0_to_2():
    """prefetch=True is depth 1 (the run-15 configs), one config and one name; other depths are rejected."""
    assert LogitsConfig(2, prefetch=True) == LogitsConfig(2, prefetch=1)
    assert LogitsConfig(2, prefetch=True).prefetch == 1
    assert hash(LogitsConfig(2, prefetch=True)) == hash(LogitsConfig(2, prefetch=1))
    assert LogitsConfig(2, prefetch=False).prefetch == 0 and CONFIGS[2].prefetch == 1
    for bad in (3, -1, 1.5):
        with pytest.raises(ValueError, match=r"^LogitsConfig.prefetch: expected 0, 1 or 2"):
            LogitsConfig(2, prefetch=bad)


@pytest.mark.parametrize("fill_tail", [True, False])
@pytest.mark.parametrize("next_n,group", [(1, 8), (1, 16), (2, 32), (3, 8), (4, 64)])
def test_fused_group_max_equals_the_max_of_its_logits(next_n, group, fill_tail, gen, triton_device):
    """group_max_out (the top-k's group maxima from the epilogue): for every row, each group of `group`
    columns below the row's length holds exactly the max of the kernel's own logits there (-inf for a group
    past the length inside a scored block); groups of blocks past the longest row are -inf with fill_tail and
    untouched (poison) without. Odd lengths: partial last blocks, a row ending on a block, a 1-token row."""
    from spin_indexer.ops.topk import group_max_ref
    x = make_paged_inputs((5 * T + 17, 3 * T, 1, 2 * T + group // 2), next_n, 16, 32, gen, extra_width=2)
    d = x.to(triton_device)
    rows, width = next_n * 4, d.block_table.shape[1]
    gmax = torch.full((rows, width * T // group + 3), 123.0, device=triton_device)  # poisoned, wider than needed
    out = paged_indexer_logits_triton(d.q_fp8, d.kv_cache, d.weights, d.seq_lens, d.block_table,
                                      fill_tail=fill_tail, group_max_out=gmax, group=group, validate=False)
    lens = d.seq_lens.reshape(-1).cpu()
    want = group_max_ref(out.cpu(), lens, group)  # of the kernel's own logits: exact
    got = gmax.cpu()
    used = (d.seq_lens.amax(dim=1).cpu() + T - 1) // T  # blocks each request scores
    for r in range(rows):
        scored = int(used[r // next_n]) * T // group
        assert torch.equal(got[r, :scored], want[r, :scored]), r
        tail = got[r, scored:width * T // group]
        if fill_tail:
            assert torch.all(tail == float("-inf")), r
        else:
            assert torch.all(tail == 123.0), r
        assert torch.all(got[r, width * T // group:] == 123.0), r  # past W*T/group: never written
    # and it agrees with the float64 recomputation's maxima over the valid columns
    expected, magnitude = logits_f64(*x.args())
    exp_t = torch.from_numpy(expected)
    ref = group_max_ref(torch.where(torch.isfinite(exp_t), exp_t, float("-inf")).float(), lens, group)
    finite = torch.isfinite(ref)
    assert torch.allclose(got[:, :ref.shape[1]][finite], ref[finite], rtol=1e-2, atol=1e-2)


def test_group_max_out_is_checked(gen, triton_device):
    x = make_paged_inputs((100,), 1, 8, 32, gen).to(triton_device)
    args = (x.q_fp8, x.kv_cache, x.weights, x.seq_lens, x.block_table)
    width = x.block_table.shape[1]
    with pytest.raises(ValueError, match="group"):
        paged_indexer_logits_triton(*args, group_max_out=torch.empty(1, width * 8, device=triton_device), group=12)
    with pytest.raises(ValueError, match="group_max_out"):
        paged_indexer_logits_triton(*args, group_max_out=torch.empty(1, width * 8 - 1, device=triton_device),
                                    group=8)
    with pytest.raises(TypeError, match="group_max_out"):
        paged_indexer_logits_triton(*args, group_max_out=torch.empty(1, width * 8, dtype=torch.float64,
                                                                     device=triton_device), group=8)
