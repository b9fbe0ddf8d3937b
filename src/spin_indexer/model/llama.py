"""A small Llama forward (SmolLM2-135M), written out so that sparse attention over top-k is explicit.

The weights come from transformers (see loader.py); everything that runs is here: RMSNorm, rotary
embeddings (with YaRN scaling for contexts past the trained 8K), grouped-query attention, the SwiGLU MLP.
decode.py drives it (prefill, decode steps with dense or top-k attention); distill.py reads the
attention of each layer from it.

Shapes: B requests, S new tokens, P cached positions, Hq = 9 query heads, Hkv = 3 KV heads, d = 64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 49152
    dim: int = 576
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    ffn_dim: int = 1536
    norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position: int = 8192  # trained context
    yarn_factor: float = 1.0  # > 1 enables YaRN (contexts up to yarn_factor * max_position)

    @classmethod
    def from_hf(cls, hf_config, yarn_factor: float = 1.0) -> "LlamaConfig":
        rope = getattr(hf_config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return cls(vocab_size=hf_config.vocab_size, dim=hf_config.hidden_size,
                   num_layers=hf_config.num_hidden_layers, num_heads=hf_config.num_attention_heads,
                   num_kv_heads=hf_config.num_key_value_heads,
                   head_dim=getattr(hf_config, "head_dim", hf_config.hidden_size // hf_config.num_attention_heads),
                   ffn_dim=hf_config.intermediate_size, norm_eps=hf_config.rms_norm_eps, rope_theta=float(theta),
                   max_position=hf_config.max_position_embeddings, yarn_factor=float(yarn_factor))


def rope_inv_freq(dim: int, theta: float, yarn_factor: float = 1.0, original_max: int = 8192,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies float32 [dim/2] and the attention factor (1.0 without YaRN).

    YaRN (Peng et al. 2023): dimensions that turn fewer than beta_slow times over the trained context
    are interpolated (divided by the factor), those turning more than beta_fast times are kept, a
    linear ramp blends the band between; cos/sin are scaled by 0.1 ln(factor) + 1.
    """
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv_freq = 1.0 / pos_freqs
    if yarn_factor <= 1.0:
        return inv_freq.float(), 1.0

    def correction_dim(num_rotations: float) -> float:  # the dim index that turns num_rotations times
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    inv_freq = inv_freq / yarn_factor * (1 - keep) + inv_freq * keep
    return inv_freq.float(), 0.1 * math.log(yarn_factor) + 1.0


class Rope(nn.Module):
    """cos/sin tables [max_len, dim] for the rotate-half convention (HF Llama)."""

    def __init__(self, dim: int, theta: float, max_len: int, yarn_factor: float = 1.0, original_max: int = 8192):
        super().__init__()
        inv_freq, attn_factor = rope_inv_freq(dim, theta, yarn_factor, original_max)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [max_len, dim/2]
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos() * attn_factor, persistent=False)
        self.register_buffer("sin", angles.sin() * attn_factor, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., S, heads, dim], positions int [..., S] -> rotated x (same dtype)."""
        return self.at(positions)(x)

    def at(self, positions: torch.Tensor) -> "RotaryTables":
        """The cos / sin rows of `positions` (int [..., S]), gathered once: a decode step rotates every layer's
        queries and keys at the same positions, so it gathers here once instead of twice per layer."""
        return RotaryTables(self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2))


class RotaryTables:
    """cos / sin float32 [..., S, 1, dim] of some positions (Rope.at); calling it on x [..., S, heads, dim]
    rotates x exactly as Rope.forward at those positions (the tables cast to x's dtype, once per dtype).
    On CUDA one Triton launch computes the torch form's values bit for bit (rope_triton.py); elsewhere, for
    inputs that kernel does not take, and where autograd records (distillation: the kernel has no backward),
    the torch form runs."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self._tables = {cos.dtype: (cos, sin)}
        self._float32 = (cos, sin)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.rotate(x, x.shape[-1])

    @property
    def float32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) float32 [..., S, 1, dim]: the tables the fused decode kernels read (decode_triton.py)."""
        return self._float32

    def rotate(self, x: torch.Tensor, dims: int) -> torch.Tensor:
        """x [..., S, heads, D] with its first `dims` dims rotated (dims: the tables' width) and the rest as
        they are (the indexer rotates part of its dims)."""
        if x.is_cuda and not (x.requires_grad and torch.is_grad_enabled()):  # the kernel has no backward
            from .rope_triton import rotate_triton
            y = rotate_triton(x, *self._float32, dims)
            if y is not None:
                return y
        if x.dtype not in self._tables:
            cos, sin = self._float32
            self._tables[x.dtype] = (cos.to(x.dtype), sin.to(x.dtype))
        cos, sin = self._tables[x.dtype]
        if dims == x.shape[-1]:
            return _rotate_half(x, cos, sin)
        return torch.cat([_rotate_half(x[..., :dims], cos, sin), x[..., dims:]], dim=-1)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch form of the rotation (HF Llama's rotate-half): x * cos + (-x2, x1) * sin, in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def fused_kernels(x: torch.Tensor) -> bool:
    """Whether the decode step runs decode_triton.py's fused kernels on x's device: CUDA (tests patch this to
    run them under Triton's interpreter on the CPU)."""
    return x.is_cuda


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding delta (None: nothing) and its RMSNorm: (x + delta, rms_norm(x + delta)).
    One Triton launch where fused_kernels(x) (the torch form: eight)."""
    if fused_kernels(x):
        from .decode_triton import add_rms_norm as fused
        out = fused(x, delta, weight, eps)
        if out is not None:
            return out
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps)


def merged_weight(module: nn.Module, names: tuple[str, ...]) -> torch.Tensor:
    """The weights of module's Linears `names` stacked along the output dim, so that projections of one input
    run as one GEMM; cached on the module until any of them changes (storage or in-place update)."""
    weights = [getattr(module, name).weight for name in names]
    key = tuple((w.data_ptr(), w._version) for w in weights)
    cache = module.__dict__.setdefault("_merged_weights", {})
    if names not in cache or cache[names][0] != key:
        cache[names] = (key, torch.cat([w.detach() for w in weights]))
    return cache[names][1]


class Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.attn_norm = nn.Parameter(torch.ones(cfg.dim))
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(cfg.dim))
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def qkv(self, h: torch.Tensor, rope: "RotaryTables"):
        """h [B, S, dim] (already normed), rope: the rotary tables of the S positions (Rope.at) -> q [B, S, Hq, d],
        k and v [B, S, Hkv, d], RoPE applied."""
        b, s, _ = h.shape
        c = self.cfg
        q = self.wq(h).view(b, s, c.num_heads, c.head_dim)
        k = self.wk(h).view(b, s, c.num_kv_heads, c.head_dim)
        v = self.wv(h).view(b, s, c.num_kv_heads, c.head_dim)
        return rope(q), rope(k), v

    def qkv_into_cache(self, h: torch.Tensor, rope: "RotaryTables", k_cache: torch.Tensor, v_cache: torch.Tensor,
                         pos: torch.Tensor) -> torch.Tensor:
        """A decode step's attention inputs: h [B, N, dim] normed, rope: the tables at pos, k_cache / v_cache
        [B, P, Hkv, d], pos int64 [B, N] cache positions. Stores k (RoPE'd) and v at [b, pos[b, n]] and returns q
        [B, N, Hq, d] with RoPE. Where fused_kernels(h): one GEMM and one Triton launch (else three GEMMs, two
        rotations and two scatters)."""
        if fused_kernels(h):
            from .decode_triton import rope_qkv_into_cache
            qkv = F.linear(h, merged_weight(self, ("wq", "wk", "wv")))
            q = rope_qkv_into_cache(qkv, *rope.float32, k_cache, v_cache, pos, self.cfg.num_heads)
            if q is not None:
                return q
        q, k, v = self.qkv(h, rope)
        rows = torch.arange(h.shape[0], device=h.device)[:, None]
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
        return q

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp_normed(rms_norm(x, self.ffn_norm, self.cfg.norm_eps))

    def mlp_normed(self, h: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP of h, the residual stream already normed; where fused_kernels(h) gate and up are one GEMM
        and silu(gate) * up one Triton launch."""
        if fused_kernels(h):
            from .decode_triton import silu_mul
            act = silu_mul(F.linear(h, merged_weight(self, ("w_gate", "w_up"))))
            if act is not None:
                return self.w_down(act)
        return self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Llama(nn.Module):
    """Embedding, layers, final norm; the LM head is tied to the embedding."""

    def __init__(self, cfg: LlamaConfig, max_len: int = 8192):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.dim))
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, max_len, cfg.yarn_factor, cfg.max_position)

    @property
    def max_len(self) -> int:
        return self.rope.cos.shape[0]

    def logits(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., dim] residual stream (plus delta, the last layer's output not yet added, if given) -> float32
        logits [..., vocab]."""
        return F.linear(add_rms_norm(x, delta, self.norm, self.cfg.norm_eps)[1], self.embed.weight).float()

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in transformers' LlamaForCausalLM."""
        own = {"embed.weight": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"]}
        names = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
                 "wq.weight": "self_attn.q_proj.weight", "wk.weight": "self_attn.k_proj.weight",
                 "wv.weight": "self_attn.v_proj.weight", "wo.weight": "self_attn.o_proj.weight",
                 "w_gate.weight": "mlp.gate_proj.weight", "w_up.weight": "mlp.up_proj.weight",
                 "w_down.weight": "mlp.down_proj.weight"}
        for i in range(self.cfg.num_layers):
            for mine, theirs in names.items():
                own[f"layers.{i}.{mine}"] = sd[f"model.layers.{i}.{theirs}"]
        self.load_state_dict(own, strict=True)

    @torch.no_grad()
    def forward_dense(self, tokens: torch.Tensor, return_attn_inputs: bool = False):
        """Plain causal forward of whole sequences (no cache), for perplexity and distillation.

        tokens: int64 [B, S]. returns float32 logits [B, S, vocab]; with return_attn_inputs also the list of
        (h [B, S, dim] normed layer input, q [B, S, Hq, d], k [B, S, Hkv, d]) per layer.
        """
        saved = [] if return_attn_inputs else None
        logits = self.logits(self._layers(tokens, saved))
        return (logits, saved) if return_attn_inputs else logits

    @torch.no_grad()
    def attention_inputs(self, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """forward_dense's per-layer (h, q, k) without the LM head: distillation at 32K would otherwise
        materialise float32 logits [B, S, vocab] (6.4 GB per sequence) it never reads."""
        saved: list = []
        self._layers(tokens, saved, last_layer=len(self.layers) - 1)
        return saved

    def _layers(self, tokens: torch.Tensor, saved: list | None, last_layer: int | None = None) -> torch.Tensor:
        """Residual stream [B, S, dim] after the layers (up to last_layer's attention inputs, when given)."""
        rope = self.rope.at(torch.arange(tokens.shape[1], device=tokens.device))
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, self.cfg.norm_eps)
            q, k, v = layer.qkv(h, rope)
            if saved is not None:
                saved.append((h, q, k))
            if i == last_layer:
                break
            out = causal_attention(q, k, v)
            x = x + layer.wo(out.flatten(2))
            x = x + layer.mlp(x)
        return x


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, S, Hq, d], k/v [B, S, Hkv, d] -> [B, S, Hq, d], causal, GQA by repeating KV heads."""
    groups = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(groups, dim=1), vt.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)
