"""Every buffer the decode step writes, allocated once per (layers, max batch, max blocks) and reused.

plan() fills the per-layer plans of all layers at once (selection reads only a layer's own history from
earlier steps, so nothing in a step changes it before that layer runs); run(layer) reads that layer's
plan and writes the shared logits buffers and that layer's top-k. A smaller batch or table uses the
leading slices: shapes never change inside a captured step.
"""
from __future__ import annotations

import torch


class Workspace:
    """Buffers of a SpinIndexer (L layers, B <= max_batch requests, N rows each, W <= max_blocks).

    kept_blocks, compact_table: int32 [L, B, W]; num_kept: int32 [L, B]; compact_lens: int32 [L, B, N];
    num_blocks: int32 [B]; block_ids: int32 [W] (0 .. W - 1); guarded: bool [B]; update_rows: bool [B, N];
    logits: float32 [B*N, W*T]; block_max: float32 [B*N, W]; group_max: float32 [B*N, W*T / GROUP_MIN] (the
    top-k's group maxima when it prunes finer than a block; leading [:, :W*T / G] used); topk: int32 [L, B*N, K];
    deepgemm_schedule: int32 [L, S + 1, 2], every layer's SM schedule for DeepGEMM's logits (S = schedule_sms,
    the GPU's SMs where DeepGEMM serves; None when schedule_sms = 0); tau_hint: int32 [L, B*N], each layer and
    row's last top-k threshold key (ops.topk_positions(tau_hint=): a hint only, any value is correct);
    plan_stash: int32 [max(B, 1), 2], the fused plan's (step, first entered block) of each request, read by its
    select launches (in plan(), or in run() with the summary mix); layer_sparsity: float64 [L, 2], each layer's
    sparsity from profile_from on and below it (SpinConfig.layer_sparsity(l) and (l, short=True):
    layer_sparsity= at construction, zeros without), which the fused plan reads under a sparsity_profile.
    With summary (SpinConfig.summary > 0; None otherwise): summary_first: int32 [L, B], each layer's first block
    of a request not yet in the summary cache; full_blocks: int32 [B], its full blocks (row 0's length // T, at
    most W); summary_scores: float32 [B, W], the layer's summary scores; select_scratch: float32 [B, W], the
    per-layer select's scratch row.
    """

    GROUP_MIN = 8  # the finest group the step writes maxima for (topk_group of a wide table is 8-64)

    def __init__(self, num_layers: int, max_batch: int, max_blocks: int, next_n: int, tokens_per_block: int,
                 topk: int, device: torch.device, schedule_sms: int = 0, summary: bool = False,
                 layer_sparsity: list[tuple[float, float]] | None = None):
        L, B, W, N, T = num_layers, max_batch, max_blocks, next_n, tokens_per_block
        i32 = dict(dtype=torch.int32, device=device)
        self.layer_sparsity = torch.tensor(layer_sparsity if layer_sparsity is not None else [(0.0, 0.0)] * L,
                                           dtype=torch.float64, device=device)
        if self.layer_sparsity.shape != (L, 2):
            raise ValueError(f"layer_sparsity: expected {L} pairs (one a layer), got shape "
                             f"{tuple(self.layer_sparsity.shape)}")
        self.kept_blocks = torch.full((L, B, W), -1, **i32)
        self.compact_table = torch.zeros((L, B, W), **i32)
        self.num_kept = torch.zeros((L, B), **i32)
        self.compact_lens = torch.zeros((L, B, N), **i32)
        self.num_blocks = torch.zeros((B,), **i32)
        self.block_ids = torch.arange(W, **i32)  # the kept blocks of a shape-guarded step's plan
        self.guarded = torch.zeros((B,), dtype=torch.bool, device=device)
        self.update_rows = torch.zeros((B, N), dtype=torch.bool, device=device)
        self.logits = torch.empty((B * N, W * T), dtype=torch.float32, device=device)
        self.block_max = torch.empty((B * N, W), dtype=torch.float32, device=device)
        self.group_max = torch.empty((B * N, -(-W * T // self.GROUP_MIN)), dtype=torch.float32, device=device)
        self.topk = torch.empty((L, B * N, topk), **i32)
        self.deepgemm_schedule = torch.zeros((L, schedule_sms + 1, 2), **i32) if schedule_sms else None
        self.tau_hint = torch.zeros((L, B * N), **i32)
        self.plan_stash = torch.zeros((max(B, 1), 2), **i32)
        self.summary_first = torch.zeros((L, B), **i32) if summary else None
        self.full_blocks = torch.zeros((B,), **i32) if summary else None
        self.summary_scores = torch.empty((B, W), dtype=torch.float32, device=device) if summary else None
        self.select_scratch = torch.empty((B, W), dtype=torch.float32, device=device) if summary else None

    @staticmethod
    def bytes_needed(num_layers: int, max_batch: int, max_blocks: int, next_n: int, tokens_per_block: int,
                     topk: int, schedule_sms: int = 0, summary: bool = False) -> int:
        """Bytes the buffers take (what __init__ allocates)."""
        L, B, W, N, T = num_layers, max_batch, max_blocks, next_n, tokens_per_block
        group_max = B * N * -(-W * T // Workspace.GROUP_MIN)
        summary_words = L * B + B + 2 * B * W if summary else 0
        return 4 * (2 * L * B * W + L * B + L * B * N + B + W + B * N * W * T + B * N * W + group_max
                    + L * B * N * topk + (L * (schedule_sms + 1) * 2 if schedule_sms else 0) + L * B * N
                    + 2 * max(B, 1) + summary_words) + B + B * N + 16 * L

    def packed(self, name: str, rows: int, cols: int) -> torch.Tensor:
        """A contiguous [rows, cols] view over the first rows x cols elements of 2-D buffer `name` (logits,
        block_max, group_max, summary_scores): a step narrower than the buffer (W < max_blocks) gets rows as the
        ops' `out=` arguments want them (a [:rows, :cols] slice would keep the buffer's row stride)."""
        return getattr(self, name).view(-1)[:rows * cols].view(rows, cols)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))
