"""The SM schedule DeepGEMM's paged logits kernel takes, for every layer of a step in one launch.

`deep_gemm.fp8_paged_mqa_logits(..., schedule_meta, ...)` takes an int32 [num_sms + 1, 2] table that
`deep_gemm.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)` computes from the lengths: one
launch per call. SPIN's compact lengths differ per layer, so that was one more launch on every layer's path
(3.9 us per layer at 96 x 128K, run 14). The lengths of every layer are known once plan() has run, so this
module writes every layer's table at once: one launch per step instead of one per layer.

What the table says (read from DeepGEMM's SM90 scheduler, `sched::sm90_paged_mqa_logits_metadata`, for its
meaning; none of its code is here). Work comes in segments of SPLIT_KV = 256 tokens: request q owns
n_q = ceil(len_q / 256) segments (len_q = the length of its last row, context_lens[q, next_n - 1]), once per
row atom (A = 1 atom at next_n = 1, ceil(next_n / 2) atoms of two rows from next_n = 2 on). With the
prefix sums P_q = n_0 + ... + n_q and total = P_{B-1} * A segments split over S SMs as evenly as possible
(the first S - r SMs take u = total // S, the last r = total % S one more), SM s starts at segment
g_s = s * u + max(0, s - (S - r)), in request q_s = #{q : P_q * A <= g_s} (the first request whose
segments reach past g_s); with o_s = g_s - P_{q_s - 1} * A its offset there and m = n_{q_s}, its row atom is
o_s // m and its segment o_s % m (both 0 when m = 0). Entry s is (q_s * A + o_s // m, o_s % m); entry S is
(B * A, 0). The H200 test compares this table with DeepGEMM's own for random lengths, bit for bit
(tests/ops/test_deepgemm_schedule.py), so a DeepGEMM whose scheduler changes fails there, not silently.
"""
from __future__ import annotations

import torch

from ..checks import check_int, check_tensor
from ..dispatch import triton_twin

try:  # the package imports this module only for CUDA tensors; without triton the reference is used
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

SPLIT_KV = 256  # tokens per work segment (DeepGEMM's SM90 paged logits)
LENS_CHUNK = 32  # requests per pass of the kernel's loops (its compare tiles are [next_pow2(S + 1), LENS_CHUNK])


def row_atoms(next_n: int) -> int:
    """Row atoms per request: 1 at next_n = 1, else ceil(next_n / 2) (two rows per atom)."""
    return 1 if next_n == 1 else -(-next_n // 2)


def check_schedule_args(context_lens: torch.Tensor, num_sms: int) -> None:
    check_tensor("context_lens", context_lens, dtype=torch.int32, ndim=3, shape_names="[L, B, next_n]")
    check_int("num_sms", num_sms, low=1)


def schedule_ref(context_lens: torch.Tensor, num_sms: int) -> torch.Tensor:
    """int32 [L, num_sms + 1, 2]: DeepGEMM's SM schedule for each layer's lengths (see the module docstring).

    context_lens: int32 [L, B, next_n], each >= 0 (the lengths the logits call of layer l receives).
    """
    check_schedule_args(context_lens, num_sms)
    layers, batch, next_n = context_lens.shape
    atoms = row_atoms(next_n)
    dev = context_lens.device
    out = torch.zeros(layers, num_sms + 1, 2, dtype=torch.int32, device=dev)
    out[:, num_sms, 0] = batch * atoms
    if batch == 0:
        return out
    segs = (context_lens[:, :, -1].long() + SPLIT_KV - 1) // SPLIT_KV  # [L, B]
    prefix = torch.cumsum(segs, dim=1)  # [L, B]
    total = prefix[:, -1:] * atoms  # [L, 1]
    per_sm, extra = total // num_sms, total % num_sms
    s = torch.arange(num_sms, device=dev, dtype=torch.int64)[None, :]
    start = s * per_sm + torch.clamp(s - (num_sms - extra), min=0)  # [L, S]
    q = torch.searchsorted(prefix * atoms, start, right=True)  # #{q : P_q * A <= start}, [L, S]
    before = torch.where(q > 0, torch.gather(prefix, 1, (q - 1).clamp(min=0)), 0)  # P_{q-1}
    own = torch.where(q < batch, torch.gather(prefix, 1, q.clamp(max=batch - 1)), before) - before  # n_q
    offset = start - before * atoms
    safe = own.clamp(min=1)
    atom = torch.where(own > 0, offset // safe, 0)
    split = torch.where(own > 0, offset % safe, 0)
    out[:, :num_sms, 0] = (q * atoms + atom).to(torch.int32)
    out[:, :num_sms, 1] = split.to(torch.int32)
    return out


def schedule(context_lens: torch.Tensor, num_sms: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """schedule_ref's table for every layer: one Triton launch on CUDA (grid = L), the reference elsewhere.

    out: optional int32 [L, num_sms + 1, 2] (contiguous) to write into; returned.
    """
    _check_out(context_lens, num_sms, out)
    twin = triton_twin(__name__, "schedule_triton", context_lens)
    if twin is not None:
        return twin(context_lens, num_sms, out)
    ref = schedule_ref(context_lens, num_sms)
    return ref if out is None else out.copy_(ref)


def _check_out(context_lens: torch.Tensor, num_sms: int, out: torch.Tensor | None) -> None:
    check_schedule_args(context_lens, num_sms)
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, shape=(context_lens.shape[0], num_sms + 1, 2),
                     shape_names="[L, num_sms + 1, 2]", device=context_lens.device, device_of="context_lens",
                     contiguous=True)


def schedule_triton(context_lens: torch.Tensor, num_sms: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton twin of schedule_ref (CUDA, or the CPU under TRITON_INTERPRET=1); same arguments."""
    _check_out(context_lens, num_sms, out)
    if context_lens.stride(2) != 1:
        context_lens = context_lens.contiguous()
    layers, batch, next_n = context_lens.shape
    if out is None:
        out = torch.empty(layers, num_sms + 1, 2, dtype=torch.int32, device=context_lens.device)
    if layers == 0:
        return out
    _schedule_kernel[(layers,)](context_lens, out, batch, context_lens.stride(0), context_lens.stride(1),
                                next_n - 1, num_sms, ATOMS=row_atoms(next_n), SPLIT=SPLIT_KV,
                                SP=triton.next_power_of_2(num_sms + 1), BC=LENS_CHUNK, num_warps=4)
    return out


if triton is not None:
    @triton.jit
    def _schedule_kernel(lens_ptr, out_ptr, batch, stride_l, stride_b, last_row, num_sms,
                         ATOMS: tl.constexpr, SPLIT: tl.constexpr, SP: tl.constexpr, BC: tl.constexpr):
        """Program l: layer l's table. Two passes over the requests in chunks of BC: the total, then per SM
        lane the count of prefix sums <= its start and the prefix sums on either side of it ([SP, BC]
        int32 compares per chunk, 64 values a thread at SP = 256; no prefix array is stored). int32 holds
        any real table: segments <= B x max_len / 256 x ATOMS (2^31 would take 96 requests of 2.8G tokens)."""
        l = tl.program_id(0)
        base = lens_ptr + l.to(tl.int64) * stride_l + last_row
        total = tl.zeros([], tl.int32)
        for b0 in range(0, batch, BC):
            b = b0 + tl.arange(0, BC)
            n = tl.load(base + b.to(tl.int64) * stride_b, mask=b < batch, other=0)
            total += tl.sum((n + SPLIT - 1) // SPLIT, axis=0)
        total = total * ATOMS
        per_sm = total // num_sms
        extra = total % num_sms
        s = tl.arange(0, SP)
        start = s * per_sm + tl.maximum(s - (num_sms - extra), 0)  # [SP]
        q = tl.zeros([SP], tl.int32)  # requests whose P_q * A <= start
        before = tl.zeros([SP], tl.int32)  # the largest such P_q (0 when none)
        after = tl.full([SP], -1, tl.int32)  # the smallest P_q with P_q * A > start (-1: none yet)
        carry = tl.zeros([], tl.int32)
        NONE: tl.constexpr = 2147483647
        for b0 in range(0, batch, BC):
            b = b0 + tl.arange(0, BC)
            live = b < batch
            n = tl.load(base + b.to(tl.int64) * stride_b, mask=live, other=0)
            prefix = carry + tl.cumsum((n + SPLIT - 1) // SPLIT, axis=0)  # [BC]
            carry = tl.max(tl.where(live, prefix, 0), axis=0)
            le = live[None, :] & (prefix[None, :] * ATOMS <= start[:, None])  # [SP, BC]
            q += tl.sum(le.to(tl.int32), axis=1)
            before = tl.maximum(before, tl.max(tl.where(le, prefix[None, :], 0), axis=1))
            first_gt = tl.min(tl.where(live[None, :] & ~le, prefix[None, :], NONE), axis=1)
            after = tl.where((after < 0) & (first_gt < NONE), first_gt, after)
        own = tl.where(after >= 0, after - before, 0)  # n_q of the SM's request (0 past the last one)
        offset = start - before * ATOMS
        safe = tl.maximum(own, 1)
        atom = tl.where(own > 0, offset // safe, 0)
        split = tl.where(own > 0, offset % safe, 0)
        row = out_ptr + l.to(tl.int64) * (num_sms + 1) * 2
        on = s < num_sms
        tl.store(row + s * 2, q * ATOMS + atom, mask=on)
        tl.store(row + s * 2 + 1, split, mask=on)
        last = s == num_sms
        tl.store(row + s * 2, tl.where(last, batch * ATOMS, 0), mask=last)
        tl.store(row + s * 2 + 1, tl.zeros([SP], tl.int32), mask=last)
