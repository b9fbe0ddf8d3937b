"""Public ops. Each dispatches on the tensor's device: CUDA (with Triton installed) goes to the Triton
twin, everything else to the torch reference, behind one signature. SPIN_INDEXER_FORCE_REF=1 forces the
reference everywhere (for debugging a kernel).
"""
from __future__ import annotations

import torch

from ..checks import check_tensor
from ..dispatch import LOGITS_BACKENDS, triton_twin
from .block_summary import (block_summary_scores_ref, paged_summary_scores_ref, update_and_score_summaries_ref,
                            write_block_summaries_ref)
from .history import HistoryUpdate, block_tokens, update_history_ref
from .indexer_logits import block_max_ref, check_paged_indexer_args, paged_indexer_logits_ref
from .kv_cache import (check_keys, check_quantize_and_write_args, dequantize_blocks, read_kv_cache, write_kv_cache)
from .kv_cache import quantize_and_write as quantize_and_write_ref
from .kv_cache import quantize_keys as quantize_keys_ref
from .topk import group_max_into, group_max_ref, topk_group, topk_positions_ref, topk_ref
from .topk_attention import check_topk_attention_args, topk_attention_ref


def _triton_twin(module: str, name: str, t):
    """The Triton twin `name` from `spin_indexer.ops.<module>`, or None (see spin_indexer.dispatch)."""
    return triton_twin(f"{__name__}.{module}", name, t)


def paged_indexer_logits(q_fp8, kv_cache, weights, seq_lens, block_table, validate: bool = True,
                         out=None, block_max_out=None, fill_tail: bool = True, history: HistoryUpdate | None = None,
                         group_max_out=None, group: int = 64, deepgemm_schedule=None,
                         active_width: int | None = None, backend: str | None = None):
    """Paged indexer logits float32 [B*next_n, W*T]; see `paged_indexer_logits_ref` for shapes.
    validate=False skips the data checks: a length past W*T then reads as W*T on the project's kernels (no id
    past a row is read, no logit past a row written) and out-of-range ids are clamped into the cache. DeepGEMM
    (the next_n = 2 backend) takes lengths and ids as they are: its callers pass checked ones.

    out: optional float32 [B*next_n, W*T] written in place; block_max_out: optional float32 [B*next_n, W]
    receiving the per-block max (fused into the kernel on CUDA: pass it on to `topk(..., block_max=)`).
    fill_tail: write -inf past each row's length (and into block_max_out past its used blocks); False
    leaves those entries unspecified, as the production kernel does, so the cost follows the lengths.
    history: a HistoryUpdate: also apply SPIN's EMA update from these logits (block_table is then the
    compact table of history.kept_blocks), folded into the kernel's epilogue where the kernel can.
    group_max_out: optional float32 [B*next_n, >= W*T / group] receiving the max of every `group` columns
    (group_max_ref; a power of two dividing T): the top-k's group maxima (topk_positions(group_max=)). The
    Triton kernel writes them in its epilogue, the CUDA kernel at 16 or 32 columns (`writes_group_max`), else
    the pass behind the kernel.
    deepgemm_schedule: optional int32 [num_sms + 1, 2], DeepGEMM's schedule for these seq_lens when it is the
    backend (deepgemm_schedule.schedule; SpinIndexer computes every layer's in plan()); ignored elsewhere.
    active_width: the block-table columns expected to hold blocks (SPIN's kept budget on a compact table):
    the project's kernels size their programs by it (paged_indexer_logits_triton, _cuda); None = all W.
    Backends (one place decides, `logits_backend`): DeepGEMM where it imports and covers the shape, the CUDA
    kernel (indexer_logits_cuda.py) at next_n 2-4 where it builds (both only with fill_tail=False: they do not
    clean the tail), else the Triton kernel on CUDA, else the reference. Behind DeepGEMM and the CUDA kernel,
    one pass over the logits applies the update and writes the maxima they do not (DeepGEMM: none; the CUDA
    kernel: the block maxima, and the group maxima where `writes_group_max`).
    backend: what `logits_backend` answered the caller for these inputs (SpinIndexer asks it for its step,
    then applies the update itself on a side stream: history=None here); None = decided here.
    """
    if backend is None:
        backend = logits_backend(q_fp8, kv_cache, block_table=block_table)
    elif backend not in LOGITS_BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, LOGITS_BACKENDS))} or None, "
                         f"got {backend!r}")
    if backend in ("deepgemm", "cuda") and fill_tail:  # they leave the tail as it is: the Triton kernel fills it
        backend = "triton"
    if backend in ("deepgemm", "cuda"):
        kernel_groups = writes_group_max(backend, group) and group_max_out is not None
        if backend == "deepgemm":
            from . import deepgemm
            logits = deepgemm.paged_indexer_logits_deepgemm(q_fp8, kv_cache, weights, seq_lens, block_table,
                                                            validate=validate, out=out, schedule=deepgemm_schedule)
        else:
            from .indexer_logits_cuda import paged_indexer_logits_cuda
            logits = paged_indexer_logits_cuda(q_fp8, kv_cache, weights, seq_lens, block_table, validate=validate,
                                               out=out, block_max_out=block_max_out,
                                               group_max_out=group_max_out if kernel_groups else None, group=group,
                                               active_width=active_width)
        kernel_block_max = backend == "cuda"
        if history is not None or (group_max_out is not None and not kernel_groups) or (
                block_max_out is not None and not kernel_block_max):
            # DeepGEMM writes logits only (the CUDA kernel their block maxima too, and the group maxima of
            # 16 or 32 columns): one pass over them gives the maxima it did not write and the update.
            bmax = None if kernel_block_max else block_max_out if block_max_out is not None else torch.empty(
                logits.shape[0], block_table.shape[1], dtype=torch.float32, device=logits.device)
            # an explicit last dim: view(B, N, -1) is ambiguous for an empty batch
            update_history(history, logits.view(q_fp8.shape[0], q_fp8.shape[1], logits.shape[1]), block_table,
                           seq_lens, block_max_out=bmax, group_max_out=None if kernel_groups else group_max_out,
                           group=group, block_max_in=block_max_out if kernel_block_max else None)
        return logits
    if backend == "triton":
        from .indexer_logits_triton import paged_indexer_logits_triton
        block_grain = history is not None and history.vertical is None
        if block_grain and block_max_out is None:  # the block-grain update reads the maxima the kernel writes
            block_max_out = torch.empty(q_fp8.shape[0] * q_fp8.shape[1], block_table.shape[1], dtype=torch.float32,
                                        device=q_fp8.device)
        logits = paged_indexer_logits_triton(q_fp8, kv_cache, weights, seq_lens, block_table, validate=validate,
                                             out=out, block_max_out=block_max_out, fill_tail=fill_tail,
                                             history=None if block_grain else history, active_width=active_width,
                                             group_max_out=group_max_out, group=group)
        if block_grain:
            update_history(history, logits.view(q_fp8.shape[0], q_fp8.shape[1], logits.shape[1]), block_table,
                           seq_lens, block_max_in=block_max_out)
        return logits
    logits = paged_indexer_logits_ref(q_fp8, kv_cache, weights, seq_lens, block_table, validate=validate)
    _check_outputs(logits, block_table.shape[1], q_fp8.device, out, block_max_out)  # as the twin checks them
    if out is not None:
        out.copy_(logits)
        logits = out
    if block_max_out is not None:
        block_max_out.copy_(block_max_ref(logits, kv_cache.shape[1]))
    if group_max_out is not None:
        group_max_into(group_max_out, logits, seq_lens, group)
    if history is not None:
        update_history_ref(history, logits.view(q_fp8.shape[0], q_fp8.shape[1], logits.shape[1]), block_table,
                           seq_lens)
    return logits


def logits_backend(q_fp8, kv_cache, deepgemm: bool = True, block_table=None) -> str:
    """"deepgemm", "cuda", "triton" or "reference": which kernel computes paged indexer logits for these inputs.

    DeepGEMM (deepgemm.py) where `deep_gemm` imports, on SM90, for its shapes, at next_n = 2 on block tables of
    >= 8M tokens (B x W x T; block_table None: as such a table), or smaller ones where the CUDA kernel cannot run
    (deepgemm.spin_step_uses; the dense step and SPIN's alike); else the project's CUDA kernel
    (indexer_logits_cuda.py: SM90, nvcc to build it) at next_n 2-4 (indexer_logits_cuda.step_uses: H200, run 118,
    96 x 128K, paired rounds: 520 us at next_n = 2 against the Triton kernel's 683; 739 / 920 at 3 / 4 against
    1014 / 1183; below 8M tokens at next_n = 2 its fused maxima beat DeepGEMM + the maxima pass, run 154); else
    the Triton kernel (at next_n = 1 everywhere: its fused maxima win). SPIN_INDEXER_LOGITS=triton / deepgemm /
    cuda forces one. The Triton twin on other CUDA inputs; the reference elsewhere (and everywhere under
    SPIN_INDEXER_FORCE_REF=1). deepgemm=False: the project's own kernel that runs where DeepGEMM does not serve
    (benchmarks time it beside DeepGEMM's). block_table: int32 [B, W], the table the logits are computed over
    (its size decides at next_n = 2; SPIN's compact table has the dense table's W)."""
    if _triton_twin("indexer_logits_triton", "paged_indexer_logits_triton", q_fp8) is None:
        return "reference"
    from . import deepgemm as dg, indexer_logits_cuda
    tokens = None if block_table is None else block_table.shape[0] * block_table.shape[1] * kv_cache.shape[1]
    if deepgemm and dg.supports(q_fp8, kv_cache, tokens):
        return "deepgemm"
    if indexer_logits_cuda.step_uses(q_fp8.shape[1]) and indexer_logits_cuda.supports(q_fp8, kv_cache):
        return "cuda"
    return "triton"


def writes_group_max(backend: str, group: int) -> bool:
    """Whether the logits kernel of `backend` writes the top-k's `group`-column maxima itself (group_max_out=
    of paged_indexer_logits), so that no pass over the logits runs behind it for them: the Triton kernel in its
    epilogue, the CUDA kernel at indexer_logits_cuda.FUSED_GROUPS from its block maxima's partials; DeepGEMM and
    the reference never (the pass, or the reference's own, computes them)."""
    if backend == "triton":
        return True
    if backend == "cuda":
        from .indexer_logits_cuda import FUSED_GROUPS
        return group in FUSED_GROUPS
    return False


def update_history(history: HistoryUpdate | None, logits, compact_table, compact_lens, block_max_out=None,
                   group_max_out=None, group: int = 64, block_max_in=None) -> None:
    """SPIN's EMA update of one layer from compact logits float32 [B, N, X] (see ops/history.py; None: no
    update); block_max_out: optional float32 [B*N, W] receiving each compact block's max; group_max_out:
    optional float32 [B*N, >= X / group], the same per `group` columns (one pass for all three).
    block_max_in: float32 [B*N, >= X / T], those block maxima already written (by the logits kernel, or a pass
    before): a block-grain history (history.vertical None) reads them instead of the logits; None: the update
    computes them first (into block_max_out where given)."""
    if history is not None and history.vertical is None:
        return _update_block_history(history, logits, compact_table, compact_lens, block_max_out, group_max_out,
                                     group, block_max_in)
    twin = _triton_twin("history_triton", "update_history_triton", logits)
    if twin is not None:
        return twin(history, logits, compact_table, compact_lens, block_max_out=block_max_out,
                    group_max_out=group_max_out, group=group)
    if group_max_out is not None:
        group_max_into(group_max_out, logits.reshape(-1, logits.shape[-1]), compact_lens, group)
    if block_max_out is not None:
        flat = logits.reshape(-1, logits.shape[-1])
        cols = torch.arange(flat.shape[1], device=flat.device)
        masked = torch.where(cols[None, :] < compact_lens.reshape(-1, 1).long(), flat, float("-inf"))
        bm = block_max_ref(masked, block_tokens(history))
        block_max_out[:, :bm.shape[1]].copy_(bm)
    if history is not None:
        update_history_ref(history, logits, compact_table, compact_lens)


def _update_block_history(history: HistoryUpdate, logits, compact_table, compact_lens, block_max_out, group_max_out,
                          group: int, block_max_in) -> None:
    """update_history for a block-grain history: the maxima (unless given), then the O(blocks) update."""
    twin = _triton_twin("history_block_triton", "update_block_history_triton", logits)
    if twin is None:
        update_history(None, logits, compact_table, compact_lens, block_max_out, group_max_out, group)
        update_history_ref(history, logits, compact_table, compact_lens)
        return
    if block_max_in is None:
        batch, next_n, cols = logits.shape
        block_max_in = block_max_out if block_max_out is not None else torch.empty(
            batch * next_n, cols // block_tokens(history), dtype=torch.float32, device=logits.device)
        update_history(None, logits, compact_table, compact_lens, block_max_in, group_max_out, group)
    elif block_max_out is not None or group_max_out is not None:
        update_history(None, logits, compact_table, compact_lens, block_max_out, group_max_out, group)
    twin(history, logits, block_max_in, compact_table, compact_lens)


def topk(logits, lengths, k: int, validate: bool = True, block_max=None):
    """Top-k positions int32 [R, k], -1 padded; see `topk_ref`. block_max: optional float32 [R, ceil(C/64)]
    exact per-block max of the valid logits (as `paged_indexer_logits(..., block_max_out=)` writes it):
    lets the Triton top-k read only the blocks that can hold a winner; the reference ignores it.
    validate=False: a length past C reads as C (no column of another row is read)."""
    twin = _triton_twin("topk_triton", "topk_triton", logits)
    if twin is not None:
        return twin(logits, lengths, k, validate=validate, block_max=block_max)
    out = topk_ref(logits, lengths, k, validate=validate)
    if block_max is not None:  # unused here, but rejected exactly as the twin rejects it
        check_tensor("block_max", block_max, dtype=torch.float32, shape=(logits.shape[0], -(-logits.shape[1] // 64)),
                     shape_names="[R, ceil(C / 64)]", device=logits.device, device_of="logits")
    return out


def topk_positions(logits, lengths, k: int, block_max=None, kept_blocks=None, next_n: int = 1,
                   tokens_per_block: int = 64, out=None, validate: bool = True, group_max=None, tau_hint=None,
                   history: HistoryUpdate | None = None, compact_table=None, sorted: bool = True,
                   group: int | None = None):
    """Top-k positions int32 [R, k], best first (sorted=False: the same set in no particular order, one
    launch fewer on CUDA), -1 padded, through SPIN's compact-to-logical map; see
    `topk_positions_ref`. On CUDA the Triton top-k (block_max / group_max let it read only the groups that
    can hold a winner) writes the mapped positions in its final pass. tau_hint: optional int32 [R], the
    Triton top-k's threshold hint, read and written (topk_triton); the reference has no threshold and leaves
    it as it is. Any value gives the same result.
    history, compact_table: also apply SPIN's EMA update of `history` from these compact logits (viewed
    [R // next_n, next_n, C], lengths their compact lengths; compact_table int32 [R // next_n, M]), as
    update_history(history, ...) would: on CUDA the update pass's programs run in the top-k's first launch
    (topk_triton's `update`; a block-grain history there reads block_max, and without it updates after the
    top-k), elsewhere after the top-k. group: the top-k's group size (topk_positions_ref;
    None: topk_group(C, k)), the one group_max was written at."""
    if (history is None) != (compact_table is None):
        raise ValueError("history, compact_table: expected both or neither")
    if history is not None:
        if not isinstance(history, HistoryUpdate):
            raise TypeError(f"history: expected a HistoryUpdate, got {type(history).__name__}")
        rows, cols = logits.shape if logits.dim() == 2 else (0, 0)
        check_tensor("compact_table", compact_table, dtype=torch.int32, ndim=2, device=logits.device,
                     device_of="logits")
        t = block_tokens(history)
        if rows % next_n or compact_table.shape[0] != rows // next_n or compact_table.shape[1] < cols // t:
            raise ValueError(f"compact_table: expected shape [R // next_n, >= C / T] = [{rows // next_n}, >= "
                             f"{cols // t}] for logits [{rows}, {cols}], next_n = {next_n}, T = {t}, got "
                             f"{list(compact_table.shape)}")
    twin = _triton_twin("topk_triton", "topk_triton", logits)
    if history is not None and history.vertical is None and (twin is None or block_max is None
                                                             or tokens_per_block != 64):
        # block grain without the maxima (or off the Triton top-k): the top-k, then its O(blocks) update
        out = topk_positions(logits, lengths, k, block_max, kept_blocks, next_n, tokens_per_block, out, validate,
                             group_max, tau_hint, sorted=sorted, group=group)
        update_history(history, logits.view(logits.shape[0] // next_n, next_n, logits.shape[1]), compact_table,
                       lengths.view(-1, next_n), block_max_in=block_max)
        return out
    if twin is None or tokens_per_block != 64:
        if tau_hint is not None:  # unused here, but rejected exactly as the twin rejects it
            check_tensor("tau_hint", tau_hint, dtype=torch.int32, shape=(logits.shape[0],), shape_names="[R]",
                         device=logits.device, device_of="logits", contiguous=True)
        out = topk_positions_ref(logits, lengths, k, block_max=block_max, kept_blocks=kept_blocks, next_n=next_n,
                                 tokens_per_block=tokens_per_block, out=out, validate=validate, group_max=group_max,
                                 sorted=sorted, group=group)
        if history is not None:
            update_history(history, logits.view(logits.shape[0] // next_n, next_n, logits.shape[1]), compact_table,
                           lengths.view(-1, next_n))
        return out
    from .topk import check_topk_positions_args
    check_topk_positions_args(logits, lengths, k, block_max, kept_blocks, next_n, tokens_per_block, out, validate,
                              group_max, sorted, group)
    return twin(logits, lengths, k, validate=False, block_max=block_max, kept_blocks=kept_blocks, next_n=next_n,
                out=out, group_max=group_max, tau_hint=tau_hint,
                update=None if history is None else (history, compact_table), sorted=sorted, group=group)


def _check_outputs(logits, width, dev, out, block_max_out) -> None:
    rows, cols = logits.shape
    if out is not None:
        check_tensor("out", out, dtype=torch.float32, shape=(rows, cols), shape_names="[B*next_n, W*T]",
                     device=dev, device_of="q_fp8", contiguous=True)
    if block_max_out is not None:
        check_tensor("block_max_out", block_max_out, dtype=torch.float32, shape=(rows, width),
                     shape_names="[B*next_n, W]", device=dev, device_of="q_fp8", contiguous=True)


def quantize_keys(keys):
    """Per-token FP8 keys with a power-of-two scale: (float8_e4m3fn [N, D], float32 [N]) from keys [N, D] float;
    see kv_cache.quantize_keys (the reference: the same bits)."""
    check_keys(keys)
    twin = _triton_twin("kv_cache_triton", "quantize_keys_triton", keys)
    return (twin or quantize_keys_ref)(keys)


def quantize_and_write(kv_cache, keys, slot_mapping, validate: bool = True) -> None:
    """quantize_keys(keys) into the paged cache's slots slot_mapping [N] (-1: padding); see
    kv_cache.quantize_and_write. validate: also check the data (finite keys, slots inside the cache: a host sync);
    without it the Triton twin writes nothing for a slot past the cache."""
    twin = _triton_twin("kv_cache_triton", "quantize_and_write_triton", keys)
    if twin is None:
        return quantize_and_write_ref(kv_cache, keys, slot_mapping, validate)
    check_quantize_and_write_args(kv_cache, keys, slot_mapping, validate)
    from .kv_cache_triton import writes_directly  # importable: the twin is
    if writes_directly(kv_cache):
        twin(kv_cache, keys, slot_mapping)
    else:  # scales not 4-byte aligned (odd T x D): the reference, its data already checked above
        quantize_and_write_ref(kv_cache, keys, slot_mapping, validate=False)


def topk_attention(q, keys, vals, topk, validate: bool = True):
    """Decode attention of each query row over its selected tokens only: [B, N, Hq, d] in q's dtype; see
    `topk_attention_ref` (q [B, N, Hq, d], keys / vals [B, P, Hkv, d], topk int32 [B, N, K], -1 padded).
    validate: also refuse positions outside [-1, P) (a host sync: False inside a captured graph, where such a
    position reads nothing and counts as padding)."""
    check_topk_attention_args(q, keys, vals, topk, validate)
    twin = _triton_twin("topk_attention_triton", "topk_attention_triton", q)
    if twin is None:
        return topk_attention_ref(q, keys, vals, topk)
    return twin(q, keys, vals, topk)


def block_max(logits, tokens_per_block: int = 64):
    """Per-block max float32 [R, ceil(C / T)]; see `block_max_ref`."""
    return block_max_ref(logits, tokens_per_block)


def write_block_summaries(kv_cache, summaries, block_table, first, stop, validate: bool = True) -> None:
    """Write the summary cache's rows of logical blocks [first[b], stop[b]) of each request (full blocks only;
    write_block_summaries_ref has the shapes): the Triton twin on CUDA, else the reference."""
    twin = _triton_twin("block_summary_triton", "write_block_summaries_triton", kv_cache)
    return (twin or write_block_summaries_ref)(kv_cache, summaries, block_table, first, stop, validate)


def paged_summary_scores(q_fp8, summaries, weights, block_table, num_summarized, validate: bool = True, out=None):
    """float32 [B, W]: this step's query against the summary cache, max over rows and sub-blocks; -inf past
    num_summarized (paged_summary_scores_ref has the shapes; out: optional float32 [B, W] written and returned):
    the Triton twin on CUDA, else the reference."""
    twin = _triton_twin("block_summary_triton", "paged_summary_scores_triton", q_fp8)
    return (twin or paged_summary_scores_ref)(q_fp8, summaries, weights, block_table, num_summarized, validate, out)


def update_and_score_summaries(q_fp8, kv_cache, summaries, weights, block_table, first, stop, validate: bool = True,
                               out=None):
    """float32 [B, W]: write the summaries of blocks [first[b], stop[b]) of each request, then score every block
    below stop[b] with this step's query (update_and_score_summaries_ref has the shapes): one Triton launch on CUDA,
    else the reference."""
    twin = _triton_twin("block_summary_triton", "update_and_score_summaries_triton", q_fp8)
    return (twin or update_and_score_summaries_ref)(q_fp8, kv_cache, summaries, weights, block_table, first, stop,
                                                    validate, out)


def block_summary_scores(q_fp8, kv_cache, weights, seq_lens, block_table, parts: int = 4, validate: bool = True):
    """float32 [B, W]: each block's sub-block mean keys scored with this step's query (block_summary_scores_ref
    for the math and shapes). The torch reference on every device: no kernel yet (docs/current_step_selection.md)."""
    return block_summary_scores_ref(q_fp8, kv_cache, weights, seq_lens, block_table, parts, validate)


__all__ = [
    "block_summary_scores", "block_summary_scores_ref", "write_block_summaries", "write_block_summaries_ref",
    "paged_summary_scores", "paged_summary_scores_ref", "update_and_score_summaries",
    "update_and_score_summaries_ref",
    "HistoryUpdate", "update_history", "logits_backend", "writes_group_max",
    "paged_indexer_logits", "paged_indexer_logits_ref", "check_paged_indexer_args", "topk", "topk_ref",
    "topk_positions", "topk_positions_ref", "topk_group", "group_max_ref",
    "block_max", "block_max_ref", "quantize_keys", "quantize_keys_ref", "write_kv_cache", "quantize_and_write",
    "quantize_and_write_ref", "read_kv_cache",
    "dequantize_blocks", "topk_attention", "topk_attention_ref",
]
