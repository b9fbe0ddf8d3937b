"""Record what replaying SPIN needs while the proxy model decodes a prompt: a trace (traces/schema.py).

Per decode step s, layer l and query row j: the dense indexer score of every cached logical position
(float16, -inf at and after the row's length), the row lengths, and the dense top-k the live indexer
picked from its float32 scores. The model decodes greedily with all-keep top-k sparse attention (each
layer attends to its indexer's top-k), so the trace shows exactly the scores an online SPIN would
have predicted.

Speculative decoding (next_n = N > 1, as with MTP): each step verifies N rows; row 0 is the last
emitted token, rows 1..N-1 are draft tokens. The draft is the model's own greedy continuation (the
same all-keep decode with next_n = 1, run first) unless one is given. Drafts are accepted while they
equal the verifier's greedy token of the row before; the step emits the accepted drafts plus the
verifier's next (bonus) token, and the cache rolls back past the rejected rows. Every row is recorded,
rejected ones included (an engine computes them too), with seq_lens[s, j] = L_s + j + 1 and
accepted[s] in [0, N - 1] = the accepted drafts, which is what replay passes to plan(num_accepted=...)
(rows 0..accepted[s] are valid). The emitted tokens equal plain greedy decoding.

Size: scores dominate, S x L x N x C x 2 bytes (C = the longest row, about context + S x N at full
acceptance): 256 steps x 30 layers at 32K is 256 x 30 x 1 x (32768 + 256) x 2 = 507 MB at next_n = 1 and
256 x 30 x 3 x (32768 + 768) x 2 = 1545 MB at next_n = 3; 4K x 64 steps = 16 MB at next_n = 1. top-k adds
S x L x N x K x 4 bytes (7.9 MB at K = 256, next_n = 1). Block summaries (P sub-block counts in
summary_parts) add S x L x P x C / 64 x 4 bytes: P / 32 of the scores' bytes at next_n = 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int, check_range, check_tensor
from ..layout import TOKENS_PER_BLOCK
from ..model.decode import Caches, check_mode, prefill, verify_step
from ..ops.block_summary import block_summary_scores_many_ref
from .schema import Trace, TraceMeta

FP16_MAX = 65504.0


@torch.no_grad()
def capture_trace(model, prompt: torch.Tensor, steps: int, mode: str, k: int, indexer=None, *, prompt_id: str,
                  task: str = "", model_name: str = "SmolLM2-135M-Instruct", eos_id: int | None = None,
                  progress: bool = False, layers: list[int] | None = None, extra: dict | None = None,
                  next_n: int = 1, draft: torch.Tensor | None = None, draft_noise: float = 0.0,
                  noise_seed: int = 0, summary_parts: tuple[int, ...] = ()) -> tuple[Trace, torch.Tensor]:
    """Decode `steps` greedy steps after `prompt` and record the trace.

    prompt: int64 [S0] token ids; mode: "oracle" or "lightning" (the indexer whose scores are recorded);
    k: top-k of the sparse attention and of the recorded dense top-k; eos_id: stop after the step that
    consumes it (the trace then has fewer steps); layers: record only these model layers (ascending; the
    trace's layer axis then holds them in order and meta.extra["layers"] names them), default all.
    next_n: query rows per step (1 + drafts); draft: int64 [T] proposed continuation, draft[i] for
    generated token i (draft[0] is unused: the prompt's logits give token 0; positions past T propose
    token 0); default the model's own greedy continuation. draft_noise: probability that a draft token is
    replaced by another (seeded by noise_seed): the model's own continuation is accepted almost always,
    while an MTP head accepts less; noise makes rejections, and so the row-local policy, show up in the
    trace. summary_parts: sub-block counts (divisors of the block's tokens) at which to record each block's
    summary score too (ops.block_summary_scores; lightning only), so a replay can run SpinConfig.summary.
    returns (trace, generated int64 [G]): the
    tokens the valid rows consumed, G = steps at next_n = 1, sum(accepted + 1) otherwise.
    """
    check_tensor("prompt", prompt, dtype=torch.int64, ndim=1)
    check_int("steps", steps, low=1)
    check_int("k", k, low=1)
    check_int("next_n", next_n, low=1)
    check_range("draft_noise", draft_noise, low=0.0, high=1.0)
    if check_mode(mode) == "dense":
        raise ValueError("mode: expected 'oracle' or 'lightning' (dense attention has no indexer), got 'dense'")
    summary_parts = list(summary_parts)
    for parts in summary_parts:
        check_int("summary_parts", parts, low=1, high=TOKENS_PER_BLOCK)
        if TOKENS_PER_BLOCK % parts:
            raise ValueError(f"summary_parts: expected divisors of the {TOKENS_PER_BLOCK} tokens a block, got {parts}")
    if summary_parts and mode != "lightning":
        raise ValueError("summary_parts: block summaries score the lightning indexer's keys: expected mode "
                         f"'lightning', got {mode!r}")
    if draft is not None:
        check_tensor("draft", draft, dtype=torch.int64, ndim=1, device=prompt.device, device_of="prompt")
    context = prompt.shape[0]
    max_len = context + steps * next_n  # the longest row at full acceptance
    dev = prompt.device
    layers = list(range(model.cfg.num_layers)) if layers is None else sorted(set(layers))
    if not layers or layers[0] < 0 or layers[-1] >= model.cfg.num_layers:
        raise ValueError(f"layers: expected indices in [0, {model.cfg.num_layers - 1}], got {layers}")
    slot_of = {layer: i for i, layer in enumerate(layers)}
    caches = Caches.allocate(model, 1, max_len, indexer if mode == "lightning" else None)
    first_logits = prefill(model, caches, 0, prompt, indexer, progress=progress)
    draft_source = "given"
    if next_n > 1 and draft is None:
        # the reference greedy continuation, then back to the prompt: entries past caches.lengths are
        # overwritten before they are read, exactly as after a rejected draft
        draft = _decode(model, caches, first_logits, steps * next_n - 1, 1, None, mode, k, indexer,
                        progress_desc=f"draft {prompt_id}" if progress else None).tokens
        caches.lengths.fill_(context)
        draft_source = f"greedy all-keep continuation ({mode}, k={k}, next_n=1)"
    if next_n > 1 and draft_noise > 0:
        draft = corrupt_draft(draft, draft_noise, model.cfg.vocab_size, noise_seed)
        draft_source += f", each token replaced with probability {draft_noise:g} (seed {noise_seed})"
    scores = torch.full((steps, len(layers), next_n, max_len), float("-inf"), dtype=torch.float16, device=dev)
    topk = torch.full((steps, len(layers), next_n, k), -1, dtype=torch.int32, device=dev)
    width = -(-max_len // TOKENS_PER_BLOCK)
    summary = torch.full((steps, len(layers), len(summary_parts), width), float("-inf"), device=dev)
    step = [0]

    def observe(layer: int, layer_scores: torch.Tensor, layer_topk: torch.Tensor, inputs) -> None:
        if layer not in slot_of:
            return
        layer = slot_of[layer]
        if summary_parts:  # every sub-block count from one dequantization of the keys
            summary[step[0], layer] = block_summary_scores_many_ref(*inputs, tuple(summary_parts),
                                                                    validate=False)[:, 0, :width]
        # fp16 keeps ~3 significant digits; clamp so large finite scores never turn into +-inf
        finite = layer_scores[:, :max_len].clamp(-FP16_MAX, FP16_MAX)
        finite = torch.where(torch.isneginf(layer_scores[:, :max_len]), float("-inf"), finite)
        scores[step[0], layer] = finite.to(torch.float16)
        topk[step[0], layer] = layer_topk

    run = _decode(model, caches, first_logits, steps, next_n, draft, mode, k, indexer, observe, step, eos_id,
                  f"capture {prompt_id}" if progress else None)
    done = run.num_steps
    seq_lens = run.seq_lens[:done].cpu()
    meta = TraceMeta(model=model_name, indexer=mode, prompt_id=prompt_id, task=task, context_len=context, k=k,
                     next_n=next_n, extra=dict(extra or {}))
    if len(layers) < model.cfg.num_layers:
        meta.extra["layers"] = layers
    accepted = None
    if next_n > 1:
        accepted = run.accepted[:done].cpu()
        meta.extra.update({"draft": draft_source,
                           "acceptance_rate": float(accepted.double().mean()) / (next_n - 1),
                           "tokens_per_step": float(accepted.double().mean()) + 1})
    cols = int(seq_lens.max())  # the longest row: drop the columns no row reached
    kept = None
    if summary_parts:
        meta.extra["summary_parts"] = summary_parts
        kept = summary[:done, ..., :-(-cols // TOKENS_PER_BLOCK)].cpu()
    trace = Trace(scores[:done, ..., :cols].cpu(), seq_lens, meta, topk[:done].cpu(), accepted, kept)
    return trace, run.generated(eos_id)


def corrupt_draft(draft: torch.Tensor, p: float, vocab: int, seed: int) -> torch.Tensor:
    """draft with each token replaced, with probability p, by a different random token id."""
    gen = torch.Generator().manual_seed(seed)
    hit = torch.rand(draft.shape, generator=gen) < p
    shift = torch.randint(1, vocab, draft.shape, generator=gen)  # never 0: the token always changes
    return torch.where(hit.to(draft.device), (draft + shift.to(draft.device)) % vocab, draft)


@dataclass
class _Run:
    """What _decode leaves behind, on the device: tokens int64 [>= fed] emitted (the first `fed` were
    consumed by valid rows), seq_lens int32 [steps, N] and accepted int32 [steps] per step."""
    tokens: torch.Tensor
    fed: torch.Tensor
    seq_lens: torch.Tensor
    accepted: torch.Tensor
    num_steps: int

    def generated(self, eos_id: int | None) -> torch.Tensor:
        """The tokens the valid rows consumed, cut after the first eos_id."""
        out = self.tokens[:int(self.fed)]
        if eos_id is not None and bool((out == eos_id).any()):
            out = out[:int((out == eos_id).int().argmax()) + 1]
        return out


def _decode(model, caches, first_logits, steps, next_n, draft, mode, k, indexer, observer=None, step=None,
            eos_id=None, progress_desc=None) -> _Run:
    """Greedy speculative decoding of request 0 for `steps` steps of next_n rows (next_n = 1: plain greedy).

    The bookkeeping stays on the device (no host sync per step unless eos_id is set): `emitted` counts the
    tokens emitted so far, tokens[emitted - 1] is the next row 0 and proposals[emitted:] the next drafts.
    """
    dev = first_logits.device
    num_drafts = next_n - 1
    tokens = torch.zeros(1 + steps * next_n, dtype=torch.int64, device=dev)  # emitted tokens
    tokens[0] = first_logits.argmax(-1)
    proposals = torch.zeros_like(tokens)  # the draft, zero-padded to every position a step can read
    if num_drafts:
        proposals[:draft.numel()] = draft[:proposals.numel()]
    emitted = torch.ones(1, dtype=torch.int64, device=dev)  # [1], not a 0-dim index: no host sync
    rows = torch.arange(next_n, device=dev)
    seq_lens = torch.zeros(steps, next_n, dtype=torch.int32, device=dev)
    accepted = torch.zeros(steps, dtype=torch.int32, device=dev)
    it = range(steps)
    if progress_desc:
        from tqdm import tqdm
        it = tqdm(it, desc=progress_desc, unit="step", leave=False)
    done = 0
    for s in it:
        if step is not None:
            step[0] = s
        row_tokens = torch.cat([tokens[emitted - 1], proposals[emitted + rows[:num_drafts]]]).view(1, next_n)
        seq_lens[s] = (caches.lengths[0] + 1 + rows).to(torch.int32)
        greedy, num_accepted = verify_step(model, caches, row_tokens, mode, k, indexer, observer=observer)
        tokens[emitted + rows] = greedy  # only emitted .. emitted + num_accepted stay: later steps overwrite the rest
        accepted[s] = num_accepted
        emitted = emitted + num_accepted + 1
        done = s + 1
        if eos_id is not None and bool((row_tokens[0, :1 + int(num_accepted)] == eos_id).any()):
            break
    return _Run(tokens, emitted - 1, seq_lens, accepted, done)


def trace_bytes(steps: int, num_layers: int, context: int, k: int, next_n: int = 1) -> int:
    """On-disk tensor bytes of a trace at full acceptance (fp16 scores + int32 top-k + int32 lengths),
    headers excluded."""
    cols = context + steps * next_n
    return steps * num_layers * next_n * (cols * 2 + k * 4) + steps * next_n * 4
