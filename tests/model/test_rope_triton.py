"""model/rope_triton.py: the one-launch rotation equals the torch form bit for bit (float32, bf16, fp16; the
decode step's per-request tables, a prefill chunk's table broadcast over requests, the indexer's partial
rotation), and declines the inputs it does not take."""
from __future__ import annotations

import pytest
import torch

from spin_indexer.model.llama import Rope, RotaryTables, _rotate_half


def _torch_form(x, cos, sin, dims):
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if dims == x.shape[-1]:
        return _rotate_half(x, cos, sin)
    return torch.cat([_rotate_half(x[..., :dims], cos, sin), x[..., dims:]], dim=-1)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,positions,dims", [
    ((3, 2, 9, 64), torch.tensor([[5, 6], [700, 701], [0, 1]]), 64),  # decode: [B, N] tables, 9 heads
    ((2, 7, 3, 64), torch.arange(100, 107), 64),  # prefill chunk: one [C] table for 2 requests
    ((3, 2, 4, 64), torch.tensor([[5, 6], [700, 701], [0, 1]]), 32),  # indexer queries: 32 of 64 dims rotated
    ((2, 7, 1, 64), torch.arange(100, 107), 32),  # indexer keys (one head)
])
def test_rotation_is_the_torch_form_bit_for_bit(dtype, shape, positions, dims, triton_device):
    from spin_indexer.model.rope_triton import rotate_triton
    if dtype == torch.bfloat16 and triton_device == "cpu":
        pytest.skip("Triton's interpreter rounds float32 -> bf16 toward zero and mis-negates bf16 (numpy has no "
                    "bf16): the bf16 case runs on CUDA only")
    rope = Rope(dims, 10000.0, 1024, yarn_factor=4.0, original_max=256)  # YaRN: an attention factor != 1
    tables = rope.at(positions)
    cos, sin = tables._float32
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    want = _torch_form(x, cos, sin, dims)
    dev = torch.device(triton_device)
    got = rotate_triton(x.to(dev), cos.to(dev), sin.to(dev), dims)
    assert got is not None and got.dtype == dtype
    assert torch.equal(got.cpu(), want)
    if dims == shape[-1]:  # RotaryTables (CPU: the torch form) says the same
        assert torch.equal(tables(x), want)
    else:
        assert torch.equal(tables.rotate(x, dims), want)


@pytest.mark.interpreter
def test_declines_what_it_does_not_take():
    from spin_indexer.model.rope_triton import rotate_triton
    rope = Rope(16, 10000.0, 64)
    cos, sin = rope.at(torch.arange(4))._float32  # [4, 1, 16]
    assert rotate_triton(torch.randn(2, 5, 3, 16), cos, sin, 16) is None  # table rows not a suffix of x's
    assert rotate_triton(torch.randn(2, 4, 3, 16).double(), cos, sin, 16) is None  # float64
    assert rotate_triton(torch.randn(2, 4, 3, 16), cos, sin, 8) is None  # table width != rope_dim
    assert rotate_triton(torch.randn(2, 4, 3, 8), cos, sin, 16) is None  # rope_dim > D


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel path runs on CUDA only")
def test_rotation_keeps_autograd_on_cuda():
    """Distillation rotates the indexer's keys with grad enabled: the kernel (no backward) must step aside there,
    so the gradient reaches x and equals the torch form's (session 45: distill32k on the H200 failed without it)."""
    tables = Rope(32, 10000.0, 1024).at(torch.arange(100, 107))
    cos, sin = (t.cuda() for t in tables._float32)
    x = torch.randn(2, 7, 1, 64, device="cuda", requires_grad=True)
    y = RotaryTables(cos, sin).rotate(x, 32)
    assert y.requires_grad
    (y * torch.arange(64, device="cuda")).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    (_torch_form(x2, cos, sin, 32) * torch.arange(64, device="cuda")).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    with torch.no_grad():  # the kernel's path (no autograd): the same values
        assert torch.equal(RotaryTables(cos, sin).rotate(x, 32), y.detach())
