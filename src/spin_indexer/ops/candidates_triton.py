"""The top-k's candidate keys, shared by its gather launch (topk_triton) and by the EMA update pass that gathers
them while it streams the logits (history_triton, `GATHER`).

Key: the fp32 value mapped to an order-preserving uint32 (`ukey`: -0.0 folded into +0.0, every NaN into +NaN, as
topk_ref) in the upper half of an int64, 0xFFFFFFFF - column in the lower half (`sort_key`): descending keys put
larger values first and, among equal values, lower columns first.
"""
from __future__ import annotations

try:  # the package imports this module only for CUDA tensors
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    @triton.jit
    def ukey(x):
        """fp32 -> uint32 with the same order (-0.0 folded into +0.0, every NaN into +NaN, as topk_ref)."""
        x = tl.where(x == 0.0, 0.0, x)
        bits = tl.where(x != x, 0x7FC00000, x.to(tl.uint32, bitcast=True)).to(tl.uint32)
        flip = tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
        return bits ^ flip

    @triton.jit
    def sort_key(u, pos):
        """int64 key: ukey in the upper half (shifted to signed), 0xFFFFFFFF - pos in the lower half."""
        hi = u.to(tl.int64) - 2147483648
        return (hi << 32) | (4294967295 - pos.to(tl.int64))

    @triton.jit
    def append_candidates(x, cols, ok, tau, count_ptr, cand_ptr, CAP: tl.constexpr):
        """Appends the keys of the cells of x (float32 [R, C], columns cols int [R, C]) where ok and ukey >= tau
        (uint32) to a row's candidate buffer cand_ptr[:CAP] (int64), its count at count_ptr: one atomic per call
        reserves the slots, cells past CAP are dropped (the count still says how many there were: > CAP sends
        the row to the top-k's overflow merge)."""
        u = ukey(x)
        sel = (ok & (u >= tau)).to(tl.int32)
        per_row = tl.sum(sel, axis=1)  # [R]
        n_sel = tl.sum(per_row, axis=0)
        if n_sel > 0:
            start = tl.atomic_add(count_ptr, n_sel)  # one slot range per call
            row_start = start + tl.cumsum(per_row, axis=0) - per_row
            slot = row_start[:, None] + tl.cumsum(sel, axis=1) - sel  # [R, C]
            tl.store(cand_ptr + slot, sort_key(u, cols), mask=(sel != 0) & (slot < CAP))
