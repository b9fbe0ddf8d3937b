"""Padded cache pages (DeepSeek-V4 in vLLM: 8448-byte pages 8640 or 8704 bytes apart) in the paged indexer
logits, reference and Triton twin: logits equal those of the same cache unpadded, the padding (poisoned with
0xFF, NaN as fp8 and as fp32) is never read, and layouts the ops cannot read are rejected naming kv_cache.

The Triton cases run under TRITON_INTERPRET=1 on CPU (conftest); on a CUDA box the compiled kernel runs.
"""
from __future__ import annotations

import pytest
import torch

from conftest import (ODD_IDS, ODD_SHAPES, T, assert_logits_close, logits_f64, make_case_inputs, make_paged_inputs,
                      padded, random_cache, random_fp8, row_lengths)
from spin_indexer.layout import cache_views, page_stride_bytes
from spin_indexer.ops import paged_indexer_logits, paged_indexer_logits_ref

# 192 and 256: V4's 8640 / 8704 strides for D = 128 (8640 is no whole number of 128-byte rows: the Triton
# kernel's 3D descriptor; 8704 is 68 rows: its 2D one); 16: the smallest legal pad, 3D for every D >= 32.
PADS = [16, 192, 256]


def _args(inputs, kv_cache, device):
    q, _, w, lens, table = inputs.args()
    return [t.to(device) for t in (q, kv_cache, w, lens, table)]


@pytest.mark.parametrize("pad", PADS)
def test_views_skip_the_padding(pad, gen):
    cache = make_paged_inputs((130,), 1, 8, 32, gen).kv_cache
    view = padded(cache, pad)
    assert page_stride_bytes(view) == cache.shape[1] * cache.shape[3] + pad
    for got, want in zip(cache_views(view), cache_views(cache)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("case", ODD_SHAPES, ids=ODD_IDS)
def test_reference_on_padded_pages_equals_unpadded(case, pad, gen):
    inputs = make_case_inputs(case, gen)
    want = paged_indexer_logits_ref(*inputs.args())
    got = paged_indexer_logits_ref(*_args(inputs, padded(inputs.kv_cache, pad), "cpu"))
    assert torch.equal(got, want)


@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("case", ODD_SHAPES, ids=ODD_IDS)
def test_triton_on_padded_pages_matches_float64_and_unpadded(case, pad, gen, triton_device):
    from spin_indexer.ops.indexer_logits_triton import paged_indexer_logits_triton
    inputs = make_case_inputs(case, gen)
    rows = case.batch * case.next_n
    width = inputs.block_table.shape[1]
    outs = []
    padded_kv = padded(inputs.kv_cache, pad, device=triton_device)
    assert page_stride_bytes(padded_kv) == inputs.kv_cache.stride(0) + pad  # on the device, still padded
    for kv in (inputs.kv_cache, padded_kv):
        out = torch.full((rows, width * T), float("nan"), device=triton_device)
        bmax = torch.full((rows, width), float("nan"), device=triton_device)
        paged_indexer_logits_triton(*_args(inputs, kv, triton_device), out=out, block_max_out=bmax)
        outs.append((out, bmax))
    expected, magnitude = logits_f64(*inputs.args())
    assert_logits_close(outs[1][0], expected, magnitude)
    assert torch.equal(outs[1][0], outs[0][0]) and torch.equal(outs[1][1], outs[0][1])


@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("pad", [192, 256])
def test_v4_page_strides_with_next_n(next_n, pad, gen, triton_device):
    """V4's shape (H = 64, D = 128, 8640 / 8704-byte pages), a partial last block, garbage table entries, the
    dispatching op and the twin with a fused block max; the pages sit 16 bytes into their allocation."""
    from spin_indexer.ops.indexer_logits_triton import paged_indexer_logits_triton
    inputs = make_paged_inputs((5 * T + 17, 2 * T, 3), next_n, 64, 128, gen, extra_width=2, spare_blocks=3)
    kv = padded(inputs.kv_cache, pad, lead=16)
    assert kv.stride(0) in (8640, 8704)
    expected, magnitude = logits_f64(*inputs.args())
    assert_logits_close(paged_indexer_logits(*_args(inputs, kv, "cpu")), expected, magnitude)
    kv_dev = padded(inputs.kv_cache, pad, lead=16, device=triton_device)
    assert kv_dev.stride(0) == kv.stride(0)
    got = paged_indexer_logits_triton(*_args(inputs, kv_dev, triton_device), chunk=2)
    assert_logits_close(got, expected, magnitude)


def _bad_layouts(cache):
    num_blocks, tokens, _, row = cache.shape
    page = tokens * row
    store = torch.zeros(num_blocks * 2 * page, dtype=torch.uint8)
    return [
        (torch.as_strided(store, cache.shape, (page + 8, row, row, 1)), "multiple of 16"),  # not 16-aligned
        (torch.as_strided(store, cache.shape, (page - 16, row, row, 1)), "multiple of 16"),  # pages overlap
        (torch.as_strided(store, cache.shape, (page + 512, row + 4, row, 1)), "contiguous"),  # gaps between tokens
        (torch.as_strided(store, cache.shape, (page + 512, row, row, 2)), "contiguous"),  # gaps between bytes
    ]


@pytest.mark.parametrize("which", range(4), ids=["stride-not-16", "stride-below-page", "token-gaps", "byte-gaps"])
@pytest.mark.parametrize("fn", ["ref", "dispatch", "triton", "views"])
def test_unreadable_strides_are_rejected_naming_kv_cache(fn, which, gen):
    inputs = make_paged_inputs((100, 30), 2, 8, 32, gen)
    kv, fragment = _bad_layouts(inputs.kv_cache)[which]
    with pytest.raises(ValueError) as info:
        if fn == "views":
            cache_views(kv)
        elif fn == "triton":
            pytest.importorskip("triton")
            from spin_indexer.ops.indexer_logits_triton import paged_indexer_logits_triton
            paged_indexer_logits_triton(*_args(inputs, kv, "cpu"))
        else:
            (paged_indexer_logits_ref if fn == "ref" else paged_indexer_logits)(*_args(inputs, kv, "cpu"))
    msg = str(info.value)
    assert msg.startswith("kv_cache: expected") and fragment in msg, msg


def test_triton_rejects_a_misaligned_base(gen):
    """A legal page stride, but the first page 4 bytes into its allocation: TMA cannot take that base."""
    pytest.importorskip("triton")
    from spin_indexer.ops.indexer_logits_triton import paged_indexer_logits_triton
    inputs = make_paged_inputs((100, 30), 1, 8, 32, gen)
    kv = padded(inputs.kv_cache, 16, lead=4)
    assert torch.equal(paged_indexer_logits_ref(*_args(inputs, kv, "cpu")), paged_indexer_logits_ref(*inputs.args()))
    with pytest.raises(ValueError, match="^kv_cache: expected a page stride and data pointer"):
        paged_indexer_logits_triton(*_args(inputs, kv, "cpu"))


def test_one_block_cache_ignores_its_stride(gen):
    """With one block stride(0) means nothing (torch gives it any value): the page size is used."""
    inputs = make_paged_inputs((40,), 1, 8, 32, gen, spare_blocks=0)
    kv = inputs.kv_cache
    odd = torch.as_strided(kv, kv.shape, (7, *kv.stride()[1:]))
    assert page_stride_bytes(odd) == kv.shape[1] * kv.shape[3]
    assert torch.equal(paged_indexer_logits_ref(*_args(inputs, odd, "cpu")), paged_indexer_logits_ref(*inputs.args()))


@pytest.mark.parametrize("pad", [0, 64])
def test_pages_of_a_fractional_number_of_key_rows(pad, gen, triton_device):
    """T = 16, D = 128: a contiguous page is 2112 B = 16.5 rows of 128 B, which takes the kernel's 3D
    descriptor (before the page stride, the launcher's 2D view of 16 rows per page raised a RuntimeError);
    padded by 64 it is 17 rows, the 2D one."""
    from spin_indexer.ops.indexer_logits_triton import paged_indexer_logits_triton
    tokens, dim = 16, 128
    cache = random_cache(9, dim, gen, tokens=tokens)
    kv = padded(cache, pad) if pad else cache
    table = torch.tensor([[3, 0, 7, 1, 5, 8], [2, 6, 0, 0, 0, 0]], dtype=torch.int32)
    args = (random_fp8((2, 1, 8, dim), gen), kv, torch.randn(2, 8, generator=gen),
            row_lengths((5 * tokens + 3, 2 * tokens), 1), table)
    expected, magnitude = logits_f64(*args)
    dev_args = [t.to(triton_device) for t in args]
    if pad:  # built on the device: .to() would copy the pages contiguously
        dev_args[1] = padded(cache, pad, device=triton_device)
        assert dev_args[1].stride(0) == kv.stride(0)
    assert_logits_close(paged_indexer_logits_triton(*dev_args), expected, magnitude)
