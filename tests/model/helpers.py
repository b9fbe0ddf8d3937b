"""Tiny random models for the model tests: same code paths as SmolLM2, shapes small enough for 2 CPU cores."""
from __future__ import annotations

import torch

from spin_indexer.model.indexer_head import Indexer, IndexerConfig
from spin_indexer.model.llama import Llama, LlamaConfig

TINY = LlamaConfig(vocab_size=97, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=96,
                   rope_theta=10000.0, max_position=256)


def tiny_model(max_len: int = 512, yarn_factor: float = 1.0, seed: int = 0) -> Llama:
    gen = torch.Generator().manual_seed(seed)
    cfg = LlamaConfig(**{**TINY.__dict__, "yarn_factor": yarn_factor})
    model = Llama(cfg, max_len=max_len)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1))
        model.embed.weight.mul_(8.0)  # sharper attention than a plain init, so top-k choices matter
    return model.eval().requires_grad_(False)


def tiny_indexer(max_len: int = 512, seed: int = 1, head_dim: int = 16) -> Indexer:
    torch.manual_seed(seed)
    cfg = IndexerConfig(dim=TINY.dim, num_layers=TINY.num_layers, num_heads=2, head_dim=head_dim, q_rank=16,
                        rope_dim=8, rope_theta=TINY.rope_theta, max_position=TINY.max_position)
    return Indexer(cfg, max_len=max_len).eval().requires_grad_(False)
