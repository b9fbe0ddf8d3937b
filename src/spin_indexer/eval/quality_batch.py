"""Batched quality runs: B prompts of one length bin decoded together, one CUDA graph per configuration.

`BatchedQualityRunner.run_batch(prompts, configs, score)` gives, per prompt, the same result rows as
`QualityRunner.run` (eval/quality.py: config names, scoring, stopping rule, miss and sparsity fields),
for configurations with one row per step (dense, all-keep, spin-<s>[-noexp][-hybrid<w>]; MTP and adaptive
budgets stay with the per-prompt runner). What changes is how the tokens are made:

  * the prompts are prefilled in groups (`model.decode.prefill_batch`) into one B-request cache, once;
    every configuration decodes from it: its steps write only positions past each prompt (caches.lengths
    is reset between configurations), so no copy of the cache is needed;
  * every configuration decodes all B requests with the model's own `decode_one_step` (B rows a step);
    on CUDA the first step runs eagerly, the next is captured (`model.cuda_graph.capture_step`) and
    replayed for the rest: no host sync inside a step. The greedy tokens land in a device buffer;
  * the stopping rule is applied afterwards per request: a request's greedy tokens up to its stop do not
    depend on the tokens decoded after it (or on the other requests: per-row top-k, per-request SPIN
    state), so cutting each row where `QualityRunner._done` first holds gives the per-prompt runner's
    output. The batch checks every `check_every` steps whether every request has stopped, and ends early;
  * the SPIN miss is recorded on the device (`StepMissRecorder`: per step, layer and row, at a device step
    counter) and summarized per request over its own steps.

Differences from B = 1 that remain: floating-point sums of batched kernels may round differently (a greedy
token can flip where two logits tie to rounding), and SPIN's random exploration is drawn per state slot,
so each request's exploration differs from a B = 1 run's (same distribution).
"""
from __future__ import annotations

from typing import Callable

import torch

from .quality import (MissRecorder, Prompt, QualityConfig, QualityRunner, check_configs_for_mode, index_head_dim,
                      miss_summary)
from ..predictor.miss import miss_per_row

Score = Callable[[str, list[str]], float]


class StepMissRecorder(MissRecorder):
    """A MissRecorder whose bookkeeping captures in a CUDA graph: each step's per-row miss (NaN where the row's
    context is <= k) and per-request realized sparsity go to fixed buffers float32 [max_steps, L, B] at a
    device step counter, advanced by plan(). next_n = 1 (rows are requests)."""

    def __init__(self, inner, k: int, max_steps: int, num_layers: int, batch: int):
        super().__init__(inner, k)
        dev = inner.device
        self.miss = torch.full((max_steps, num_layers, batch), float("nan"), device=dev)
        self.block_sparsity = torch.full((max_steps, num_layers, batch), float("nan"), device=dev)
        self.counter = torch.full((1,), -1, dtype=torch.int64, device=dev)

    def plan(self, block_table, seq_lens, slot_ids, num_accepted=None, validate=True):
        self.counter.add_(1)
        super().plan(block_table, seq_lens, slot_ids, num_accepted=num_accepted, validate=validate)

    def _record(self, layer: int, dense_topk: torch.Tensor) -> None:
        plan = self.inner.block_plan
        eligible = self._lens.reshape(-1) > self.k
        miss = miss_per_row(plan.keep_mask, dense_topk, 1, plan.tokens_per_block)
        nan = torch.full_like(miss, float("nan"))
        self.miss.select(1, layer).index_copy_(0, self.counter, torch.where(eligible, miss, nan)[None])
        spars = torch.where(eligible, plan.sparsity().float(), nan)
        self.block_sparsity.select(1, layer).index_copy_(0, self.counter, spars[None])

    def summary_of(self, row: int, steps: int) -> dict:
        """miss_summary of request `row` over its first `steps` decode steps, plus miss_values [n] (CPU)."""
        miss = self.miss[:steps, :, row].reshape(-1).cpu()
        miss = miss[~miss.isnan()]
        spars = self.block_sparsity[:steps, :, row].reshape(-1).cpu()
        return dict(miss_summary(miss, spars[~spars.isnan()]), miss_values=miss)


class BatchedQualityRunner(QualityRunner):
    """QualityRunner (same arguments) plus graphs (None: on CUDA), check_every (steps between checks that
    every request stopped) and prefill_group (prompts prefilled together)."""

    def __init__(self, model, decode_text: Callable[[list[int]], str], mode: str = "oracle", indexer=None,
                 k: int = 256, eos_id: int | None = None, seed: int = 0, graphs: bool | None = None,
                 check_every: int = 8, prefill_group: int = 8):
        super().__init__(model, decode_text, mode, indexer, k, eos_id, seed)
        self.graphs = model.embed.weight.is_cuda if graphs is None else graphs
        self.check_every, self.prefill_group = max(1, check_every), max(1, prefill_group)

    def run_batch(self, prompts: list[Prompt], configs: list[QualityConfig], score: Score | list[Score],
                  on_config: Callable[[str], None] | None = None) -> list[list[dict]]:
        """Per prompt, one result dict per config (in `configs` order), as QualityRunner.run returns them.

        prompts: one length bin (any lengths; the cache is sized for the longest); configs: next_n = 1 and
        fixed budgets only (ValueError naming the config otherwise); score: score(text, answers) -> [0, 1],
        one for every prompt or a list with one per prompt (tasks score differently)."""
        from ..model.decode import Caches, prefill_batch

        for cfg in configs:
            if cfg.next_n > 1 or cfg.adaptive is not None:
                raise ValueError(f"configs: {cfg.name!r} is not run batched (MTP and adaptive budgets: use --batch 1)")
        check_configs_for_mode(configs, self.mode)
        if not prompts:
            return []
        scores = list(score) if isinstance(score, (list, tuple)) else [score] * len(prompts)
        steps = max(p.max_new for p in prompts) - 1  # decode steps at most: the prefill gives the first token
        idx = self.indexer if self.mode == "lightning" else None
        caches = Caches.allocate(self.model, len(prompts), max(p.ids.shape[0] for p in prompts) + steps + 1, idx)
        g = self.prefill_group
        first = torch.cat([prefill_batch(self.model, caches, r, [p.ids for p in prompts[r:r + g]], idx)
                           for r in range(0, len(prompts), g)])
        lengths0 = caches.lengths.clone()
        out: list[list[dict]] = [[] for _ in prompts]
        for cfg in configs:
            caches.lengths.copy_(lengths0)
            ids, stops, recorder = self._decode(cfg, caches, first, steps, prompts, scores)
            for b, prompt in enumerate(prompts):
                t = stops[b]  # tokens up to the stop, as QualityRunner._greedy keeps them
                row = self._row(cfg, self._trim(ids[b][:t], prompt), prompt, scores[b], t - 1, 1.0)
                if recorder is not None:
                    row.update(recorder.summary_of(b, t - 1))
                out[b].append(row)
            if on_config is not None:
                on_config(cfg.name)
        return out

    def _decode(self, cfg: QualityConfig, caches, first_logits: torch.Tensor, steps: int, prompts, scores):
        """Greedy decoding of every request: (token ids per request [steps + 1 at most], stop lengths,
        StepMissRecorder or None)."""
        from ..model.decode import decode_one_step

        batch = len(prompts)
        dev = first_logits.device
        mode = "dense" if cfg.kind == "dense" else self.mode
        recorder = None
        if cfg.kind == "spin":
            recorder = StepMissRecorder(self._spin(cfg, caches, batch), self.k, max(steps, 1),
                                        self.model.cfg.num_layers, batch)
        tokens = torch.zeros(steps + 1, batch, dtype=torch.int64, device=dev)  # row s: the s-th greedy token
        token = first_logits.argmax(-1).view(batch, 1)
        tokens[0] = token.view(-1)
        counter = torch.ones(1, dtype=torch.int64, device=dev)  # the tokens row the next step writes
        validate = not self.graphs  # plan() checks its data on the eager path (a host sync)

        def step():
            logits = decode_one_step(self.model, caches, token, mode, self.k, self.indexer, recorder,
                                     validate=validate)
            token.copy_(logits[:, -1].argmax(-1, keepdim=True))
            tokens.index_copy_(0, counter, token.view(1, -1))
            counter.add_(1)

        scan = [[1, None] for _ in prompts]  # per request: next length to test, stop length once found
        graph, done = None, 0
        while done < steps:
            if self.graphs and graph is None:
                from ..model.cuda_graph import capture_step

                graph = capture_step(step)  # runs one step, records the next
            elif graph is not None:
                graph.replay()
            else:
                step()
            done += 1
            if done % self.check_every == 0 and self._stopped(tokens[:done + 1].T.tolist(), prompts, scores, scan):
                break
        ids = tokens[:done + 1].T.tolist()
        self._stopped(ids, prompts, scores, scan)
        del graph
        return ids, [s[1] if s[1] is not None else len(ids[b]) for b, s in enumerate(scan)], recorder

    def _spin(self, cfg: QualityConfig, caches, batch: int):
        from ..indexer import SpinIndexer

        spin = SpinIndexer(cfg.spin_config(self.k, self.seed), num_layers=self.model.cfg.num_layers, max_batch=batch,
                           max_blocks=caches.block_table.shape[1], device=caches.block_table.device,
                           topk_sorted=True,  # all-keep's ops.topk order: the attention sums in the same order
                           head_dim=index_head_dim(caches))
        caches.slot_ids.copy_(torch.tensor([spin.state.allocate() for _ in range(batch)], dtype=torch.int32))
        return spin

    def _stopped(self, ids: list[list[int]], prompts, scores, scan) -> bool:
        """Advance every request's stop search over the tokens decoded so far (each prefix tested once);
        True when every request has stopped."""
        for row, prompt, score, state in zip(ids, prompts, scores, scan):
            while state[1] is None and state[0] <= len(row):
                if self._done(row[:state[0]], prompt, score):
                    state[1] = state[0]
                else:
                    state[0] += 1
        return all(state[1] is not None for state in scan)
