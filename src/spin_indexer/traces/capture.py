"""Record what replaying SPIN needs while the proxy model decodes a prompt: a trace (traces/schema.py).

Per decode step s, layer l and query row j: the dense indexer score of every cached logical position
(float16, -inf at and after the row's length), the row lengths, and the dense top-k the live indexer
picked from its float32 scores. The model decodes greedily with all-keep top-k sparse attention (each
layer attends to its indexer's top-k), so the trace shows exactly the scores an online SPIN would
have predicted.

Size: scores dominate, S x L x N x C x 2 bytes: 256 steps x 30 layers x 1 row x (32768 + 256) positions
= 507 MB at 32K; 4K x 64 steps = 16 MB. top-k adds S x L x N x K x 4 bytes (7.9 MB at K = 256).
"""
from __future__ import annotations

import torch

from ..checks import check_int, check_tensor
from ..model.decode import Caches, check_mode, decode_one_step, prefill
from .schema import Trace, TraceMeta

FP16_MAX = 65504.0


@torch.no_grad()
def capture_trace(model, prompt: torch.Tensor, steps: int, mode: str, k: int, indexer=None, *, prompt_id: str,
                  task: str = "", model_name: str = "SmolLM2-135M-Instruct", eos_id: int | None = None,
                  progress: bool = False, layers: list[int] | None = None,
                  extra: dict | None = None) -> tuple[Trace, torch.Tensor]:
    """Decode `steps` greedy tokens after `prompt` and record the trace.

    prompt: int64 [S0] token ids; mode: "oracle" or "lightning" (the indexer whose scores are recorded);
    k: top-k of the sparse attention and of the recorded dense top-k; eos_id: stop early (the trace then
    has fewer steps); layers: record only these model layers (ascending; the trace's layer axis then holds
    them in order and meta.extra["layers"] names them), default all. returns (trace with next_n = 1,
    generated int64 [steps]).
    """
    check_tensor("prompt", prompt, dtype=torch.int64, ndim=1)
    check_int("steps", steps, low=1)
    check_int("k", k, low=1)
    if check_mode(mode) == "dense":
        raise ValueError("mode: expected 'oracle' or 'lightning' (dense attention has no indexer), got 'dense'")
    context = prompt.shape[0]
    max_len = context + steps
    dev = prompt.device
    layers = list(range(model.cfg.num_layers)) if layers is None else sorted(set(layers))
    if not layers or layers[0] < 0 or layers[-1] >= model.cfg.num_layers:
        raise ValueError(f"layers: expected indices in [0, {model.cfg.num_layers - 1}], got {layers}")
    slot_of = {layer: i for i, layer in enumerate(layers)}
    num_layers = len(layers)
    caches = Caches.allocate(model, 1, max_len, indexer if mode == "lightning" else None)
    scores = torch.full((steps, num_layers, 1, max_len), float("-inf"), dtype=torch.float16, device=dev)
    topk = torch.full((steps, num_layers, 1, k), -1, dtype=torch.int32, device=dev)
    step = [0]

    def observe(layer: int, layer_scores: torch.Tensor, layer_topk: torch.Tensor) -> None:
        if layer not in slot_of:
            return
        layer = slot_of[layer]
        # fp16 keeps ~3 significant digits; clamp so large finite scores never turn into +-inf
        finite = layer_scores[:, :max_len].clamp(-FP16_MAX, FP16_MAX)
        finite = torch.where(torch.isneginf(layer_scores[:, :max_len]), float("-inf"), finite)
        scores[step[0], layer] = finite.to(torch.float16)
        topk[step[0], layer] = layer_topk

    logits = prefill(model, caches, 0, prompt, indexer, progress=progress)
    generated = []
    it = range(steps)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc=f"capture {prompt_id}", unit="step", leave=False)
    for s in it:
        token = logits.argmax(-1).view(1, 1)
        generated.append(token.view(1))
        step[0] = s
        logits = decode_one_step(model, caches, token, mode, k, indexer, observer=observe)[0, -1]
        if eos_id is not None and int(token) == eos_id:
            break
    done = len(generated)
    seq_lens = (context + 1 + torch.arange(done, dtype=torch.int32)).view(done, 1)
    meta = TraceMeta(model=model_name, indexer=mode, prompt_id=prompt_id, task=task, context_len=context, k=k,
                     next_n=1, extra=dict(extra or {}))
    if len(layers) < model.cfg.num_layers:
        meta.extra["layers"] = layers
    trace = Trace(scores[:done].cpu(), seq_lens, meta, topk[:done].cpu())
    return trace, torch.cat(generated)


def trace_bytes(steps: int, num_layers: int, context: int, k: int, next_n: int = 1) -> int:
    """On-disk tensor bytes of a trace (fp16 scores + int32 top-k + int32 lengths), headers excluded."""
    cols = context + steps
    return steps * num_layers * next_n * (cols * 2 + k * 4) + steps * next_n * 4
