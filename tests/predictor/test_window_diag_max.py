"""plan_triton._window_diag_max (the fused plan's diagonal window, read in aligned chunks) alone, against a direct
max over each block's offsets: rows at every alignment of the 16-byte vectors (row starts 0..VEC), windows that are
and are not multiples of T, queries before, at and past the window, a raised lo, fp16 and fp32 state. The cells
around the row (the previous row's tail before it, the trash cell and the slack after it) hold a sentinel larger
than any value, so a read outside the block's offsets or the window shows in the result; the scratch row and the
output are poisoned first."""
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from spin_indexer.predictor import plan_triton  # noqa: E402

pytestmark = pytest.mark.interpreter
SENTINEL = 1000.0


@triton.jit
def _probe(out_ptr, scr_ptr, diag_ptr, row_start, q, lo, window, T: tl.constexpr, CR: tl.constexpr,
           VEC: tl.constexpr, SB: tl.constexpr):
    blk = tl.arange(0, SB)
    tl.store(out_ptr + blk, plan_triton._window_diag_max(scr_ptr, blk, diag_ptr, row_start, q, lo, window, T, CR, VEC))


def _expected(row: torch.Tensor, q: int, lo: int, window: int, t: int, sb: int) -> torch.Tensor:
    """float32 [sb]: for blk in [lo, q // t), the max of row[o] over the offsets o = q - i of the block's slots i
    with o < window (-inf where none, or the cells are -inf); -inf for every other blk."""
    out = torch.full((sb,), float("-inf"))
    for blk in range(max(lo, 0), q // t):
        offs = [q - i for i in range(blk * t, blk * t + t) if q - i < window]
        if offs:
            out[blk] = row[offs].float().max()
    return out


CASES = [  # T, window, q, lo (None: the window's first block, as plan() passes)
    (64, 200, 1000, None), (64, 200, 150, None), (64, 256, 4095, None), (64, 256, 4096, None), (64, 256, 255, None),
    (64, 90, 63, None), (64, 90, 64, None), (64, 8192, 3000, None), (64, 100, 1000, 14), (64, 1, 500, None),
    (16, 70, 333, None), (16, 64, 47, None), (8, 33, 129, None), (8, 33, 2, None), (64, 200, 0, None),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("t,window,q,lo", CASES)
def test_window_max_matches_the_offsets(t, window, q, lo, dtype, gen, triton_device):
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    if lo is None:
        lo = max(q - window + 1, 0) // t
    sb = triton.next_power_of_2(q // t + 1)
    for row_start in range(0, vec + 1):  # every alignment of the row, and one whole vector in
        vals = torch.randn(window, generator=gen) * 4
        row = torch.where(torch.rand(window, generator=gen) < 0.2, float("-inf"), vals).to(dtype)
        # the previous row's tail, this row, its trash cell and T cells of slack (SpinState's layout)
        flat = torch.full((row_start + window + 1 + t,), SENTINEL, dtype=dtype)
        flat[row_start:row_start + window] = row
        out = torch.full((sb,), float("nan"))
        scr = torch.full((sb,), float("nan"))
        flat_d, out_d, scr_d = (x.to(triton_device) for x in (flat, out, scr))
        _probe[(1,)](out_d, scr_d, flat_d, row_start, q, lo, window, T=t, CR=max(1, 16 * 32 * 4 // t), VEC=vec,
                     SB=sb, num_warps=4)
        want = _expected(row, q, lo, window, t, sb)
        torch.testing.assert_close(out_d.cpu(), want, rtol=0, atol=0,
                                   msg=lambda m: f"row_start {row_start}: {m}")


@pytest.mark.parametrize("t,cell_bytes,combine,reduce,reg,mixed,takes", [
    (64, 2, "max", "max", True, False, True), (64, 4, "diagonal", "max", True, False, True),
    (8, 2, "max", "max", True, False, True), (4, 4, "max", "max", True, False, True),
    (4, 2, "max", "max", True, False, False),  # a chunk of 4 fp16 cells: rows would start off the 16-byte grid
    (48, 2, "max", "max", True, False, False),  # T not a power of two
    (64, 2, "sum", "max", True, False, False), (64, 2, "vertical", "max", True, False, False),
    (64, 2, "max", "mean", True, False, False), (64, 2, "max", "max", False, False, False),
    (64, 2, "max", "max", True, True, False),
])
def test_the_launcher_takes_the_window_path_only_where_its_loads_stay_aligned(t, cell_bytes, combine, reduce, reg,
                                                                               mixed, takes):
    from spin_indexer.predictor import SpinConfig
    cfg = SpinConfig(sparsity=0.4, topk=64, tokens_per_block=t, combine=combine, reduce=reduce)
    rows = plan_triton._window_path_rows(cfg, 4, reg, mixed, cell_bytes)
    assert (rows > 0) == takes
    if takes:
        assert rows * t == 16 * 32 * 4 or (rows == 1 and t > 16 * 32 * 4)  # 16 cells a thread at 4 warps
