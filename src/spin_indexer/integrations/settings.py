"""SpinVllmSettings: whether and how SPIN runs inside vLLM, from vLLM's additional_config or the environment.

Sources, highest precedence first:
  1. additional_config={"spin": {"enable": true, "sparsity": 0.4, "exploration": "random",
     "policy": "spin-default", "gamma": 0.05, "seed": 0}}  (vLLM's --additional-config JSON)
  2. environment variables SPIN_ENABLE, SPIN_SPARSITY, SPIN_EXPLORATION, SPIN_POLICY, SPIN_GAMMA, SPIN_SEED
  3. the defaults below: SPIN is OFF unless enabled.
The policy names are those of spin_indexer.predictor.policies (the paper's variants); top-k always comes from
the model (the layer's index_topk), and the MTP policy is forced to "row0" because vLLM's indexer metadata
carries no accepted-draft counts.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from ..checks import check_range

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_ENV = {"enable": "SPIN_ENABLE", "sparsity": "SPIN_SPARSITY", "exploration": "SPIN_EXPLORATION",
        "policy": "SPIN_POLICY", "gamma": "SPIN_GAMMA", "seed": "SPIN_SEED"}


@dataclasses.dataclass(frozen=True)
class SpinVllmSettings:
    """enable: run SPIN on decode rows; sparsity: target block sparsity in [0, 1); policy: a name from
    spin_indexer.predictor.policies; exploration/gamma: override the policy's (None keeps the policy's);
    seed: exploration randomness."""

    enable: bool = False
    sparsity: float = 0.3
    policy: str = "spin-default"
    exploration: str | None = None
    gamma: float | None = None
    seed: int = 0

    def __post_init__(self):
        check_range("SpinVllmSettings.sparsity", self.sparsity, low=0.0, high=1.0, high_open=True)
        if self.gamma is not None:
            check_range("SpinVllmSettings.gamma", self.gamma, low=0.0, high=1.0, high_open=True)

    def spin_config(self, topk: int, tokens_per_block: int = 64):
        """The SpinConfig for a layer with top-k `topk` (raises ValueError naming a bad policy)."""
        from ..predictor.policies import get_policy
        cfg = get_policy(self.policy, sparsity=float(self.sparsity), topk=topk, seed=self.seed)
        changes: dict[str, Any] = {"mtp": "row0", "tokens_per_block": tokens_per_block}
        if self.exploration is not None:
            changes["exploration"] = self.exploration
        if self.gamma is not None:
            changes["gamma"] = self.gamma
        return dataclasses.replace(cfg, **changes)


def load_settings(additional_config: Mapping[str, Any] | None = None,
                  environ: Mapping[str, str] | None = None) -> SpinVllmSettings:
    """Settings from additional_config["spin"] (first) and the environment (second).

    raises ValueError naming the key and the source when a value does not parse.
    """
    environ = os.environ if environ is None else environ
    spin = {}
    if additional_config:
        spin = additional_config.get("spin", {}) if isinstance(additional_config, Mapping) else {}
        if not isinstance(spin, Mapping):
            raise ValueError(f"additional_config['spin']: expected a mapping, got {type(spin).__name__}")
        unknown = sorted(set(spin) - set(_ENV))
        if unknown:
            raise ValueError(f"additional_config['spin']: expected keys among {', '.join(_ENV)}, got {unknown}")
    values: dict[str, Any] = {}
    for key, env in _ENV.items():
        if key in spin:
            values[key] = _parse(key, spin[key], f"additional_config['spin']['{key}']")
        elif env in environ:
            values[key] = _parse(key, environ[env], env)
    return SpinVllmSettings(**values)


def _parse(key: str, raw: Any, where: str):
    try:
        if key == "enable":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE or text in _FALSE:
                return text in _TRUE
            raise ValueError(raw)
        if key in ("sparsity", "gamma"):
            return float(raw)
        if key == "seed":
            return int(raw)
        return str(raw).strip()
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a valid {key}, got {raw!r}") from None
