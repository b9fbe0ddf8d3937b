"""row_maxima_triton (maxima_triton.py) against group_max_ref and the masked block max: random rows and lengths,
NaN, rows shorter than a tile, columns that are not a multiple of T, several tiles per program (the loop and
its prefetch of the next tile), outputs poisoned past the lengths, bad arguments.

Runs under TRITON_INTERPRET=1 on CPU (conftest sets it before this module imports triton).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("triton")
from spin_indexer.ops import maxima_triton  # noqa: E402
from spin_indexer.ops.occupancy import sm_count  # noqa: E402
from spin_indexer.ops.topk import group_max_ref  # noqa: E402

pytestmark = pytest.mark.interpreter
T = 64
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the triton_device fixture, for the @given test
POISON = 123.0


def _block_max_want(x: torch.Tensor, lengths: torch.Tensor, group: int) -> torch.Tensor:
    """The block max the kernel writes: the max over the block's group maxima, a NaN group skipped unless every
    group of the block is NaN (PTX max returns the other operand of a NaN)."""
    gm = group_max_ref(x, lengths, group)
    pad = -gm.shape[1] % (T // group)
    gm = torch.nn.functional.pad(gm, (0, pad), value=float("-inf")).view(gm.shape[0], -1, T // group)
    all_nan = torch.isnan(gm).all(dim=2)
    return torch.where(all_nan, float("nan"), torch.where(torch.isnan(gm), float("-inf"), gm).amax(dim=2))


def _check(x, lengths, group, tiles, programs, triton_device, monkeypatch, block=True):
    monkeypatch.setattr(maxima_triton, "TILE_UNITS", tiles)
    monkeypatch.setattr(maxima_triton, "PROGRAMS_PER_SM", programs)  # x 4 "SMs" off CUDA: few programs per row
    rows, cols = x.shape
    dev = torch.device(triton_device)
    gmax = torch.full((rows, -(-cols // group) + 2), POISON, device=dev)
    bmax = torch.full((rows, -(-cols // T) + 1), POISON, device=dev) if block else None
    maxima_triton.row_maxima_triton(x.to(dev), lengths.to(dev), gmax, group, bmax, T)
    gmax, want = gmax.cpu(), group_max_ref(x, lengths, group)
    live_g = torch.arange(gmax.shape[1])[None, :] * group < lengths.long()[:, None]
    assert torch.equal(gmax[~live_g], torch.full_like(gmax[~live_g], POISON))  # nothing past a row's length
    torch.testing.assert_close(gmax[:, :want.shape[1]][live_g[:, :want.shape[1]]], want[live_g[:, :want.shape[1]]],
                               rtol=0, atol=0, equal_nan=True)
    if block:
        bmax, bwant = bmax.cpu(), _block_max_want(x, lengths, group)
        live_b = torch.arange(bmax.shape[1])[None, :] * T < lengths.long()[:, None]
        assert torch.equal(bmax[~live_b], torch.full_like(bmax[~live_b], POISON))
        torch.testing.assert_close(bmax[:, :bwant.shape[1]][live_b[:, :bwant.shape[1]]],
                                   bwant[live_b[:, :bwant.shape[1]]], rtol=0, atol=0, equal_nan=True)


@given(rows=st.integers(1, 5), units=st.integers(1, 12), tail=st.sampled_from([0, 0, 1, 37]),
       group=st.sampled_from([1, 2, 8, 16, 64]), tiles=st.sampled_from([1, 2, 4]), programs=st.integers(1, 3),
       data=st.data())
def test_matches_the_reference(rows, units, tail, group, tiles, programs, data):
    """Random rows (ties and NaN included) at random lengths; tiles of 1-4 units and 1-3 programs per row, so that
    one program loops over several tiles and the last tile is partial."""
    cols = units * T + tail
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 8, (rows, cols), generator=g).float()  # ties inside and across groups
    nan = torch.rand(rows, cols, generator=g) < 0.01
    x[nan] = float("nan")
    lengths = torch.randint(0, cols + 1, (rows,), generator=g, dtype=torch.int32)
    lengths[0] = cols
    with pytest.MonkeyPatch.context() as mp:  # a fixture's monkeypatch would outlive one example
        _check(x, lengths, group, tiles, programs, _DEVICE, mp, block=data.draw(st.booleans()))


def test_one_program_loops_over_every_tile(triton_device, monkeypatch):
    """A single program per row (1 resident program x 4 SMs / 8 rows) reads all of its row's tiles in turn."""
    x = torch.randn(8, 9 * T)
    lengths = torch.tensor([9 * T, 1, 0, 5 * T, 5 * T + 1, 2 * T - 1, 9 * T - 1, 64], dtype=torch.int32)
    monkeypatch.setattr(maxima_triton, "PROGRAMS_PER_SM", 1)
    assert maxima_triton.programs_per_row(8, 9 * T, torch.device("cpu"), T) == 1
    _check(x, lengths, 8, 1, 1, triton_device, monkeypatch)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 31, 32, 33, 200])
def test_the_grid_is_one_wave_of_resident_programs(rows):
    """rows x P never exceeds the resident programs (SMs x PROGRAMS_PER_SM: 4 x 8 off CUDA) unless one program a
    row already does (no program waits for a second wave), and takes all of them that whole rows can."""
    places = sm_count(torch.device("cpu")) * maxima_triton.PROGRAMS_PER_SM
    p = maxima_triton.programs_per_row(rows, 1 << 20, torch.device("cpu"), T)
    assert p == max(1, places // rows) and (rows * p <= places or p == 1)
    assert maxima_triton.programs_per_row(rows, 3 * T, torch.device("cpu"), T) == min(3, p)  # at most one a tile


def test_lengths_past_the_row_are_clamped(triton_device, monkeypatch):
    """A length beyond C (validate=False callers) reads nothing outside the row: the row below is never mixed in."""
    x = torch.full((2, 2 * T), -5.0)
    x[1] = 100.0  # a read past row 0 would find these
    lengths = torch.tensor([10 * T, 2 * T], dtype=torch.int32)
    dev = torch.device(triton_device)
    monkeypatch.setattr(maxima_triton, "TILE_UNITS", 1)
    gmax = torch.full((2, 4), POISON, device=dev)
    maxima_triton.row_maxima_triton(x.to(dev), lengths.to(dev), gmax, 32)
    assert torch.equal(gmax.cpu(), torch.tensor([[-5.0] * 4, [100.0] * 4]))


def test_empty_and_nothing_to_write(triton_device):
    dev = torch.device(triton_device)
    out = torch.full((0, 4), POISON, device=dev)
    maxima_triton.row_maxima_triton(torch.zeros(0, 256, device=dev), torch.zeros(0, dtype=torch.int32, device=dev),
                                    out, 64)
    maxima_triton.row_maxima_triton(torch.zeros(2, 256, device=dev), torch.ones(2, dtype=torch.int32, device=dev))


@pytest.mark.parametrize("bad, match", [
    (dict(lengths=torch.zeros(3, dtype=torch.int64)), "lengths"),
    (dict(lengths=torch.zeros(2, dtype=torch.int32)), "lengths"),
    (dict(group=24), "group"),
    (dict(logits=torch.zeros(3, 256, dtype=torch.float16)), "logits"),
    (dict(group_max_out=torch.zeros(3, 2)), "group_max_out"),
    (dict(group_max_out=torch.zeros(3, 8, dtype=torch.float16)), "group_max_out"),
    # made on the device: moving a strided view there makes it contiguous
    (dict(block_max_out=lambda dev: torch.zeros(3, 16, device=dev)[:, ::2]), "block_max_out"),
])
def test_bad_arguments_name_themselves(bad, match, triton_device):
    dev = torch.device(triton_device)
    args = dict(logits=torch.zeros(3, 256), lengths=torch.full((3,), 256, dtype=torch.int32),
                group_max_out=torch.full((3, 8), POISON), group=32, block_max_out=None)
    args.update(bad)
    args = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v(dev) if callable(v) else v) for k, v in args.items()}
    with pytest.raises((ValueError, TypeError), match=match):
        maxima_triton.row_maxima_triton(**args)
    if "group_max_out" not in bad:
        assert bool((args["group_max_out"] == POISON).all())  # a rejected call writes nothing
