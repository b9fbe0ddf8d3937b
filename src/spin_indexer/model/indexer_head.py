"""The lightning indexer retrofitted to the proxy model: one small DSA indexer per layer.

For a query token t and a cached token s of one layer (DeepSeek Sparse Attention, REFERENCE.md sec. 1):

    I[t, s] = sum_h  w[t, h] * ReLU( q[t, h] . k[s] )

- q[t, h]: H_I heads x D_I dims from the layer's normed input through a rank-`q_rank` bottleneck (as
  DeepSeek's indexer reads the query latent); k[s]: one shared D_I-dim key per token (MQA style) through
  a LayerNorm. Both get RoPE on their first `rope_dim` dims; the rest carry content only.
- w[t, h]: per-head weights projected from the same normed input, times H_I^-0.5 * D_I^-0.5.
- At inference keys are FP8 e4m3 with a power-of-two per-token scale in the engines' paged cache
  (`ops.quantize_and_write`), queries FP8 with a per-(token, head) scale folded into w, and the scores come
  from `ops.paged_indexer_logits`; training (distill.py) uses the float path `scores_float`.

Defaults: H_I = 4 heads x D_I = 64 dims, q_rank = 128, rope_dim = 32: 146K parameters per layer.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_tensor
from ..ops import quantize_and_write, quantize_keys
from .llama import Rope, RotaryTables, fused_kernels, merged_weight


@dataclass(frozen=True)
class IndexerConfig:
    dim: int = 576  # model hidden size (input of every projection)
    num_layers: int = 30
    num_heads: int = 4  # H_I
    head_dim: int = 64  # D_I (the paged cache row is D_I + 4 bytes)
    q_rank: int = 128
    rope_dim: int = 32
    rope_theta: float = 100000.0
    max_position: int = 8192
    # True: the rotary table takes the model's YaRN factor (heads trained before 2026-11-29 evening);
    # False: plain RoPE at every length, so a head distilled at one length sees the same rotation at all
    rope_yarn: bool = True

    def __post_init__(self):
        for name in ("dim", "num_layers", "num_heads", "head_dim", "q_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"IndexerConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.rope_dim % 2 or not 0 <= self.rope_dim <= self.head_dim:
            raise ValueError(f"IndexerConfig.rope_dim: expected an even number in [0, head_dim], got {self.rope_dim}")


class IndexerLayer(nn.Module):
    """The indexer of one model layer: projections only (scores are computed by the caller)."""

    def __init__(self, cfg: IndexerConfig):
        super().__init__()
        self.cfg = cfg
        self.wq_a = nn.Linear(cfg.dim, cfg.q_rank, bias=False)
        self.wq_b = nn.Linear(cfg.q_rank, cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.head_dim)
        self.w_proj = nn.Linear(cfg.dim, cfg.num_heads, bias=False)

    def queries(self, h: torch.Tensor, positions: torch.Tensor | None,
                rope: Rope | RotaryTables) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, S, dim] normed layer input, positions [B, S] or [S], rope: the indexer's Rope, or its tables
        at these positions (Rope.at: a decode step gathers them once for every layer; positions then unused) ->
        (q float32 [B, S, H_I, D_I] with RoPE, w float32 [B, S, H_I] with H_I^-0.5 * D_I^-0.5 folded in)."""
        c = self.cfg
        b, s, _ = h.shape
        h = h.to(self.wq_a.weight.dtype)
        q = self.wq_b(self.wq_a(h)).view(b, s, c.num_heads, c.head_dim).float()
        q = _rope_part(q, _tables(rope, positions), c.rope_dim)
        w = self.w_proj(h).float() * (c.num_heads ** -0.5 * c.head_dim ** -0.5)
        return q, w

    def keys(self, h: torch.Tensor, positions: torch.Tensor | None, rope: Rope | RotaryTables) -> torch.Tensor:
        """h [B, S, dim] -> k float32 [B, S, D_I]: projection, LayerNorm, RoPE on the first rope_dim dims
        (rope as in `queries`)."""
        k = self.k_norm(self.wk(h.to(self.wk.weight.dtype))).float()
        return _rope_part(k.unsqueeze(-2), _tables(rope, positions), self.cfg.rope_dim).squeeze(-2)

    def decode_inputs(self, h: torch.Tensor, rope: RotaryTables, kv_cache: torch.Tensor,
                      slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's indexer work before the scores: the keys of h's tokens into the paged cache, FP8 queries.

        h [B, N, dim] normed layer input; rope: the indexer's tables at the rows' positions; kv_cache uint8
        [num_blocks, T, 1, D_I + 4]; slots int64 [B * N] (each token's cache slot). returns (q_fp8 float8_e4m3fn
        [B, N, H_I, D_I], weights float32 [B * N, H_I]) as quantize_queries(*queries(...)). Where
        fused_kernels(h): one GEMM for the three projections of h and one Triton launch each for the keys
        (LayerNorm, RoPE, FP8, cache) and the queries (RoPE, FP8, weights); else the torch forms (~15 launches).
        """
        c = self.cfg
        h = h.to(self.wk.weight.dtype)
        keys_done = False
        if fused_kernels(h):
            from .decode_triton import index_keys_into_cache, index_queries
            b, n, _ = h.shape
            proj = F.linear(h, merged_weight(self, ("wk", "wq_a", "w_proj"))).view(b * n, -1)
            cos, sin = (t.reshape(b * n, -1)[:, :c.rope_dim] for t in rope.float32)
            keys_done = index_keys_into_cache(proj[:, :c.head_dim], self.k_norm.weight, self.k_norm.bias,
                                              self.k_norm.eps, cos, sin, kv_cache, slots)
            q = self.wq_b(proj[:, c.head_dim:c.head_dim + c.q_rank]).view(b * n, c.num_heads, c.head_dim)
            fused = index_queries(q, proj[:, c.head_dim + c.q_rank:], cos, sin,
                                  c.num_heads ** -0.5 * c.head_dim ** -0.5)
            if keys_done and fused is not None:
                return fused[0].view(b, n, c.num_heads, c.head_dim), fused[1]
        if not keys_done:
            self.write_keys(h, rope, kv_cache, slots)
        return quantize_queries(*self.queries(h, None, rope))

    def write_keys(self, h: torch.Tensor, rope: RotaryTables, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """The keys of h's tokens [B', S, dim] as FP8 + scale into the paged cache at slots [B' * S] (rope: the
        tables at the tokens' positions); the torch forms (prefill, and decode where the fused kernel declines)."""
        keys = self.keys(h, None, rope)
        quantize_and_write(kv_cache, keys.reshape(-1, keys.shape[-1]), slots, validate=False)


def _tables(rope: Rope | RotaryTables, positions: torch.Tensor | None) -> RotaryTables:
    return rope if isinstance(rope, RotaryTables) else rope.at(positions)


def _rope_part(x: torch.Tensor, rope: RotaryTables, rope_dim: int) -> torch.Tensor:
    return x if rope_dim == 0 else rope.rotate(x, rope_dim)


class Indexer(nn.Module):
    """All layers' indexers plus their rotary table (rope_dim wide; YaRN-scaled like the model's when
    cfg.rope_yarn, else plain)."""

    def __init__(self, cfg: IndexerConfig, max_len: int = 8192, yarn_factor: float = 1.0):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(IndexerLayer(cfg) for _ in range(cfg.num_layers))
        self.set_rope(max_len, yarn_factor)

    def set_rope(self, max_len: int, yarn_factor: float = 1.0) -> None:
        """(Re)build the rotary table for sequences up to max_len (yarn_factor: the model's; ignored unless
        cfg.rope_yarn)."""
        dev = next(self.parameters()).device
        if not self.cfg.rope_yarn:
            yarn_factor = 1.0
        self.rope = Rope(max(self.cfg.rope_dim, 2), self.cfg.rope_theta, max_len, yarn_factor,
                         self.cfg.max_position).to(dev)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """float16 safetensors with the config (and `extra`, e.g. the training command) in its metadata."""
        from safetensors.torch import save_file

        tensors = {name: p.detach().to(torch.float16).contiguous().cpu() for name, p in self.state_dict().items()}
        meta = {"indexer_config": json.dumps(dataclasses.asdict(self.cfg))}
        meta.update({key: json.dumps(val) for key, val in (extra or {}).items()})
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, max_len: int = 8192, yarn_factor: float = 1.0,
             device: str | torch.device = "cpu") -> "Indexer":
        """An Indexer in float32 from `save()`'s file."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if "indexer_config" not in meta:
                raise ValueError(f"{path}: not an indexer weights file (no 'indexer_config' metadata)")
            tensors = {name: f.get_tensor(name).float() for name in f.keys()}
        indexer = cls(IndexerConfig(**json.loads(meta["indexer_config"])), max_len, yarn_factor)
        indexer.load_state_dict(tensors, strict=True)
        return indexer.to(device).eval().requires_grad_(False)


def scores_float(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Float indexer scores, the reference of the FP8 cache path.

    q: float [R, H, D]; w: float [R, H]; k: float [P, D]. returns float32 [R, P] = sum_h w relu(q_h . k).
    """
    check_tensor("q", q, ndim=3)
    check_tensor("w", w, shape=(q.shape[0], q.shape[1]), shape_names="[R, H]")
    check_tensor("k", k, shape=(None, q.shape[2]), shape_names="[P, D]")
    return torch.einsum("rhp,rh->rp", torch.relu(torch.einsum("rhd,pd->rhp", q.float(), k.float())), w.float())


def quantize_queries(q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 queries with the per-(row, head) power-of-two scale folded into the head weights.

    q: float [B, N, H, D]; w: float [B, N, H]. returns (q_fp8 float8_e4m3fn [B, N, H, D],
    weights float32 [B*N, H]) such that weights * relu(q_fp8 . k) == w * relu(q . k) up to FP8 rounding
    (the scale is positive, so it moves through the ReLU).
    """
    check_tensor("q", q, ndim=4)
    b, n, h, d = q.shape
    check_tensor("w", w, shape=(b, n, h), shape_names="[B, N, H]")
    q_fp8, q_scale = quantize_keys(q.reshape(b * n * h, d))
    return q_fp8.view(b, n, h, d), (w.reshape(b * n, h).float() * q_scale.view(b * n, h)).contiguous()
