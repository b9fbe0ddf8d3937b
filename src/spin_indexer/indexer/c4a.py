"""DeepSeek-V4 C4A mode: SPIN over *compressed* indexer entries, with skipped and reusing layers.

In V4's C4A layers the indexer scores compressed entries, one per `ratio` = 4 raw tokens (only complete
groups exist), a KV block holds 64 compressed entries (256 raw tokens), top-k is 512, and core attention
always sees the newest `window` = 128 raw tokens besides the selected entries. Some layers have no
indexer of their own: with IndexCache-style reuse they take the top-k of an earlier indexer layer;
without it they are not sparse and SPIN skips them.

C4AIndexer maps that onto one SpinIndexer whose state layers are the model's indexer layers only:
    raw lengths --(// ratio)--> compressed lengths --SpinIndexer--> top-k entries per indexer layer
and a reusing layer returns its source layer's top-k of this step without scoring anything.
Entries inside the raw window are attended anyway, so `window_entries` marks them for the miss metric.
"""
from __future__ import annotations

import dataclasses

import torch

from ..checks import check_int, check_sequence, check_tensor, describe
from ..predictor.config import SpinConfig
from .spin import SpinIndexer


@dataclasses.dataclass(frozen=True)
class C4AConfig:
    """num_layers: model layers; indexer_layers: the ones with an indexer; reuse: {layer: source indexer
    layer} for IndexCache-style skip layers; ratio: raw tokens per entry; window: raw tokens always kept."""

    num_layers: int
    indexer_layers: tuple[int, ...]
    reuse: tuple[tuple[int, int], ...] = ()
    ratio: int = 4
    window: int = 128

    def __post_init__(self):
        # Types first (TypeError naming the field: layer ids are ints, never 0.5 or True), then the ranges;
        # the sequences are stored as tuples so role() and the frozen config's hash work on any input.
        def pair(name, value):
            value = check_sequence(name, value, check_int)
            if len(value) != 2:
                raise ValueError(f"{name}: expected a (layer, source) pair, got {value}")
            return value

        def put(name, value):
            object.__setattr__(self, name, value)  # frozen: the checked value replaces the given one

        put("num_layers", check_int("C4AConfig.num_layers", self.num_layers, low=1))
        put("indexer_layers", check_sequence("C4AConfig.indexer_layers", self.indexer_layers, check_int))
        put("reuse", check_sequence("C4AConfig.reuse", self.reuse, pair))
        put("ratio", check_int("C4AConfig.ratio", self.ratio, low=1))
        put("window", check_int("C4AConfig.window", self.window, low=0))
        layers = list(self.indexer_layers)
        if not layers or layers != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= self.num_layers:
            raise ValueError(f"C4AConfig.indexer_layers: expected ascending distinct layers in [0, {self.num_layers}), "
                             f"got {self.indexer_layers}")
        seen = set()
        for layer, source in self.reuse:
            if layer in layers or layer >= self.num_layers or source not in layers or source >= layer or layer in seen:
                raise ValueError(f"C4AConfig.reuse: expected distinct (layer without indexer < {self.num_layers}, "
                                 f"earlier indexer layer), got ({layer}, {source})")
            seen.add(layer)

    def role(self, layer: int) -> str:
        """'indexer', 'reuse' or 'dense' (no indexer, no reuse: SPIN does nothing there)."""
        if layer in self.indexer_layers:
            return "indexer"
        return "reuse" if layer in dict(self.reuse) else "dense"


def compressed_lengths(raw_seq_lens: torch.Tensor, ratio: int) -> torch.Tensor:
    """int32 [B, N]: complete compressed entries per row (raw // ratio)."""
    return torch.div(raw_seq_lens, ratio, rounding_mode="floor").to(torch.int32)


def window_entries(raw_seq_lens: torch.Tensor, width_entries: int, ratio: int, window: int) -> torch.Tensor:
    """bool [B*N, width_entries]: compressed entries whose raw tokens all lie in the sliding window."""
    start = torch.arange(width_entries, device=raw_seq_lens.device)[None, :] * ratio
    return start >= (raw_seq_lens.reshape(-1, 1).long() - window)


class C4AIndexer:
    """SPIN for V4 C4A layers. spin: SpinConfig (topk 512 for V4); c4a: C4AConfig; other arguments as
    SpinIndexer's, in compressed units (max_blocks = blocks of 64 compressed entries)."""

    def __init__(self, spin: SpinConfig, c4a: C4AConfig, max_batch: int, max_blocks: int, next_n: int = 1,
                 device: torch.device | str = "cpu", max_requests: int | None = None):
        if not isinstance(spin, SpinConfig):
            raise TypeError(f"spin: expected a SpinConfig, got {describe(spin)}")
        if not isinstance(c4a, C4AConfig):
            raise TypeError(f"c4a: expected a C4AConfig, got {describe(c4a)}")
        self.c4a = c4a
        self.spin = SpinIndexer(spin, len(c4a.indexer_layers), max_batch, max_blocks, next_n, device, max_requests)
        self._slot = {layer: i for i, layer in enumerate(c4a.indexer_layers)}
        self._topk: dict[int, torch.Tensor] = {}

    @property
    def state(self):
        return self.spin.state

    def plan(self, block_table: torch.Tensor, raw_seq_lens: torch.Tensor, slot_ids: torch.Tensor,
             num_accepted: torch.Tensor | None = None, validate: bool = True) -> None:
        """block_table: int32 [B, W] of the compressed cache; raw_seq_lens: int32 [B, next_n] raw tokens."""
        check_tensor("raw_seq_lens", raw_seq_lens, dtype=torch.int32, ndim=2)
        self.raw_seq_lens = raw_seq_lens
        self._topk.clear()
        self.spin.plan(block_table, compressed_lengths(raw_seq_lens, self.c4a.ratio), slot_ids, num_accepted, validate)

    def run(self, layer: int, q_fp8=None, kv_cache=None, weights=None, scores: torch.Tensor | None = None):
        """Top-k compressed entries int32 [B*next_n, K] for model `layer`, or None for a dense layer.

        Indexer layers need (q_fp8, kv_cache, weights) or, in replay, `scores` [B*next_n, W*64] over
        compressed entries; reusing layers need nothing (run their source layer first).
        """
        check_int("layer", layer, low=0, high=self.c4a.num_layers - 1)
        role = self.c4a.role(layer)
        if role == "dense":
            return None
        if role == "reuse":
            source = dict(self.c4a.reuse)[layer]
            if source not in self._topk:
                raise RuntimeError(f"C4AIndexer.run: layer {layer} reuses layer {source}, which has not run this step")
            return self._topk[source]
        state_layer = self._slot[layer]
        if scores is not None:
            out = self.spin.run_from_scores(state_layer, scores)
        else:
            out = self.spin.run(state_layer, q_fp8, kv_cache, weights)
        self._topk[layer] = out
        return out

    @property
    def block_plan(self):
        return self.spin.block_plan
