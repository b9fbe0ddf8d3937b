"""SPIN as a vLLM general plugin.

    pip install "spin-indexer[vllm]"          # vllm==0.33.0, the version this plugin is verified with
    SPIN_ENABLE=1 SPIN_SPARSITY=0.4 vllm serve deepseek-ai/DeepSeek-V3.2 ...
    # or: --additional-config '{"spin": {"enable": true, "sparsity": 0.4}}'

vLLM calls register() (entry point `vllm.general_plugins` -> spin_indexer) once per process, in the API
process and in every engine and worker process. register() is idempotent. It checks the vLLM version and
the symbols the plugin uses (a clear error names an unsupported version), registers the op spin_indexer::sparse_attn_indexer, makes vLLM split its compiled
graphs at that op as at vllm::sparse_attn_indexer, and installs SpinSparseAttnIndexer with
SparseAttnIndexer.register_oot so that every model that builds the indexer layer (DeepSeek-V3.2, GLM-5,
DeepSeek-V4) builds ours; that layer stays inert (vLLM's own forward) unless SPIN is enabled. What is verified and what is not: docs/vllm.md.
"""
from __future__ import annotations

import importlib
import logging
import os
import tempfile

logger = logging.getLogger("spin_indexer.vllm")

SUPPORTED_VLLM = ("0.33.0",)
# module -> names the plugin relies on; checked before anything is installed
REQUIRED = {
    "vllm.model_executor.layers.sparse_attn_indexer": ("SparseAttnIndexer", "sparse_attn_indexer"),
    "vllm.model_executor.custom_op": ("op_registry_oot",),
    "vllm.v1.attention.backends.mla.indexer": ("DeepseekV32IndexerMetadata", "DeepSeekV32IndexerDecodeMetadata"),
    "vllm.forward_context": ("get_forward_context",),
    "vllm.config": ("get_current_vllm_config", "CompilationConfig"),
}
_registered = False


class UnsupportedVllmError(ImportError):
    """The installed vLLM lacks what the SPIN plugin needs."""


def vllm_version() -> str:
    try:
        from importlib.metadata import version
        return version("vllm")
    except Exception:  # noqa: BLE001 - not installed, or broken metadata
        return "not installed"


def check_vllm() -> None:
    """Raise UnsupportedVllmError naming the installed version and the first missing symbol."""
    found = vllm_version()
    for module, names in REQUIRED.items():
        try:
            mod = importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - any import failure means "unsupported here"
            raise UnsupportedVllmError(
                f"spin-indexer's vLLM plugin supports vllm=={'/'.join(SUPPORTED_VLLM)}; found vllm {found}, "
                f"where `import {module}` fails: {err}") from err
        missing = [n for n in names if not hasattr(mod, n)]
        if missing:
            raise UnsupportedVllmError(
                f"spin-indexer's vLLM plugin supports vllm=={'/'.join(SUPPORTED_VLLM)}; found vllm {found}, "
                f"whose {module} lacks {', '.join(missing)}")
    if found not in SUPPORTED_VLLM:
        logger.warning("spin-indexer: vLLM %s is untested (verified: %s); the symbols it needs are present",
                       found, ", ".join(SUPPORTED_VLLM))


def register() -> bool:
    """The vLLM plugin entry point. Returns True if SPIN's layer class is installed in this process.

    The layer is inert (vLLM's own forward, one attribute check per call) until SPIN is enabled through
    SPIN_ENABLE=1 or additional_config, which it reads when vLLM builds it. On an unsupported vLLM this
    raises UnsupportedVllmError if SPIN_ENABLE asks for SPIN, and only logs a warning otherwise.
    """
    global _registered
    if _registered:
        return True
    try:
        check_vllm()
    except UnsupportedVllmError as err:
        if _enabled_in_env():
            raise
        logger.warning("spin-indexer: vLLM plugin inactive: %s", err)
        return False
    from vllm.config import CompilationConfig
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    from .vllm_layer import OP_NAME, SpinSparseAttnIndexer, _register_op

    _register_op()
    # Attention ops split vLLM's piecewise graphs and run eagerly with fresh metadata each step; ours must
    # too. Appended to the class-level list before any VllmConfig is built (plugins load first).
    ops = CompilationConfig._attention_ops
    if OP_NAME not in ops:
        ops.append(OP_NAME)
    current = op_registry_oot.get("SparseAttnIndexer")
    if current is None:
        SparseAttnIndexer.register_oot(SpinSparseAttnIndexer)
    elif current is not SpinSparseAttnIndexer:
        raise RuntimeError(f"spin-indexer: another plugin already replaced SparseAttnIndexer with {current!r}")
    # Shadow-mode counters go from the workers to the API process's stat logger through files in one directory:
    # the first process (the API server) names it, the engine and workers it starts inherit the name.
    from .shadow_export import ENV_DIR
    os.environ.setdefault(ENV_DIR, os.path.join(tempfile.gettempdir(), f"spin-indexer-stats-{os.getpid()}"))
    _registered = True
    logger.info("spin-indexer: SPIN indexer layer registered for vLLM %s", vllm_version())
    return True


def _enabled_in_env() -> bool:
    from .settings import _TRUE
    return os.environ.get("SPIN_ENABLE", "").strip().lower() in _TRUE
