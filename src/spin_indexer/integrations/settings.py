"""SpinVllmSettings: whether and how SPIN runs inside vLLM, from vLLM's additional_config or the environment.

Sources, highest precedence first:
  1. additional_config={"spin": {"enable": true, "sparsity": 0.4, "exploration": "random",
     "policy": "spin-default", "gamma": 0.05, "seed": 0, "mtp": "row0", "shadow": false,
     "sparsity_profile": "profile.json", "profile_from": 0, "vertical_grain": "auto"}}
     (vLLM's --additional-config JSON)
  2. environment variables SPIN_ENABLE, SPIN_SPARSITY, SPIN_EXPLORATION, SPIN_POLICY, SPIN_GAMMA, SPIN_SEED,
     SPIN_MTP, SPIN_SHADOW, SPIN_SPARSITY_PROFILE, SPIN_PROFILE_FROM, SPIN_VERTICAL_GRAIN
  3. the defaults below: SPIN is OFF unless enabled.
The policy names are those of spin_indexer.predictor.policies (the paper's variants); top-k always comes from
the model (the layer's index_topk). MTP "row-local" takes the accepted-draft counts that the request tracker
infers on the device from consecutive steps' seq_lens (vLLM's metadata carries none).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from ..checks import check_bool, check_choice, check_float, check_int, describe
from ..predictor.config import Exploration, Grain
from ..predictor.policies import LAYERED, get_policy, policy_names

# The only spellings an environment variable may use for a bool (any case, surrounding blanks ignored);
# anything else, the empty string included, is an error naming the variable: never "truthy".
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_ENV = {"enable": "SPIN_ENABLE", "sparsity": "SPIN_SPARSITY", "exploration": "SPIN_EXPLORATION",
        "policy": "SPIN_POLICY", "gamma": "SPIN_GAMMA", "seed": "SPIN_SEED", "mtp": "SPIN_MTP",
        "shadow": "SPIN_SHADOW", "sparsity_profile": "SPIN_SPARSITY_PROFILE", "profile_from": "SPIN_PROFILE_FROM",
        "vertical_grain": "SPIN_VERTICAL_GRAIN"}


@dataclasses.dataclass(frozen=True)
class SpinVllmSettings:
    """enable: run SPIN on decode rows; sparsity: target block sparsity in [0, 1); policy: a name from
    spin_indexer.predictor.policies; exploration/gamma: override the policy's (None keeps the policy's);
    seed: exploration randomness; mtp: "row0" or "row-local" (num_accepted inferred on the device from
    consecutive steps' seq_lens); shadow: SPIN predicts and records its miss and realized sparsity against the
    dense indexer, which still decides (integrations/shadow.py); sparsity_profile: a `spin-indexer calibrate`
    output (profile.json) for the served model's layers: each layer's budget at `sparsity` moves by the profile
    calibrated at that sparsity (the same key bytes a step, more kept where the model's own traces showed SPIN
    misses most); profile_from: requests shorter than this many tokens keep the uniform budget;
    vertical_grain: SpinConfig.vertical_grain over the policy's ("auto", the default: one vertical value a block
    wherever the policy's rule reads no slot's own value, spin-default included: no SPIN pages in vLLM's KV
    cache and the cheaper update; "slot": the paper's value a token, history pages in the KV cache; "block")."""

    enable: bool = False
    sparsity: float = 0.3
    policy: str = "spin-default"
    exploration: str | None = None
    gamma: float | None = None
    seed: int = 0
    mtp: str = "row0"
    shadow: bool = False
    sparsity_profile: str | None = None
    profile_from: int = 0
    vertical_grain: str = "auto"

    def __post_init__(self):
        for key in _ENV:
            object.__setattr__(self, key, _check(key, getattr(self, key)))  # frozen: store the checked value
        try:  # the grain against the policy's rule ("block" where the rule reads a slot's own V is refused)
            dataclasses.replace(get_policy(self.policy, self.sparsity), vertical_grain=self.vertical_grain)
        except ValueError as e:
            raise ValueError(f"SpinVllmSettings.vertical_grain: {e}") from None
        object.__setattr__(self, "_profile", self._read_profile())  # not a field: derived from the file

    def _read_profile(self) -> tuple[float, ...]:
        """The file's profile at this sparsity, read once (a missing file or sparsity fails at start-up)."""
        if self.sparsity_profile is None:
            return ()
        from ..predictor.policies import load_profiles, profile_at

        name = "SpinVllmSettings.sparsity_profile"
        try:
            profile = profile_at(load_profiles(self.sparsity_profile), self.sparsity, self.sparsity_profile)
            # the entries checked here (numbers, sparsity x entry < 1), not when the first layer is built
            dataclasses.replace(get_policy(self.policy, self.sparsity), sparsity_profile=profile)
        except OSError as e:
            raise ValueError(f"{name}: expected a readable profile.json (spin-indexer calibrate's output), got "
                             f"{self.sparsity_profile!r} ({e.strerror})") from None
        except (TypeError, ValueError) as e:  # json's errors are ValueErrors too
            raise type(e)(f"{name}: {e}") from None
        return profile

    def spin_config(self, topk: int, tokens_per_block: int = 64):
        """The SpinConfig for a layer with top-k `topk` (the policy name was checked at construction)."""
        cfg = get_policy(self.policy, sparsity=float(self.sparsity), topk=topk, seed=self.seed)
        changes: dict[str, Any] = {"mtp": self.mtp, "tokens_per_block": tokens_per_block,
                                   "vertical_grain": self.vertical_grain}
        if self.exploration is not None:
            changes["exploration"] = self.exploration
        if self.gamma is not None:
            changes["gamma"] = self.gamma
        if self._profile:  # its length is checked against the model's layers where the indexer is built
            changes.update(sparsity_profile=self._profile, profile_from=self.profile_from)
        return dataclasses.replace(cfg, **changes)


def load_settings(additional_config: Mapping[str, Any] | None = None,
                  environ: Mapping[str, str] | None = None) -> SpinVllmSettings:
    """Settings from additional_config["spin"] (first) and the environment (second).

    additional_config values are JSON values of the field's own type (true, 0.4, "random", null for the
    optional ones): no strings for numbers or bools. Environment variables are text: SPIN_ENABLE takes
    1/0, true/false, yes/no, on/off (any case), the numbers take what int() / float() parse.
    raises TypeError (wrong JSON type) or ValueError (unparsable text, unknown key or name, out of range),
    naming the field and the key or variable it came from.
    """
    environ = os.environ if environ is None else environ
    spin = {}
    if additional_config:
        # vLLM's additional_config may also be a platform's own object: only a mapping can hold "spin".
        spin = additional_config.get("spin", {}) if isinstance(additional_config, Mapping) else {}
        if not isinstance(spin, Mapping):
            raise TypeError(f"additional_config['spin']: expected a mapping, got {describe(spin)}")
        unknown = sorted(set(spin) - set(_ENV))
        if unknown:
            raise ValueError(f"additional_config['spin']: expected keys among {', '.join(_ENV)}, got {unknown}")
    values: dict[str, Any] = {}
    for key, env in _ENV.items():
        if key in spin:
            where, value = f"additional_config['spin']['{key}']", spin[key]
        elif env in environ:
            where, value = env, _parse_env(env, key, environ[env])
        else:
            continue
        try:
            values[key] = _check(key, value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e} (from {where})") from None
    return SpinVllmSettings(**values)


def _check(key: str, value):
    """One field's value, checked for type and range; messages name SpinVllmSettings.<key>."""
    name = f"SpinVllmSettings.{key}"
    if key in ("enable", "shadow"):
        return check_bool(name, value)
    if key == "mtp":
        return check_choice(name, value, ["row0", "row-local"])
    if key == "sparsity":
        return check_float(name, value, low=0, high=1, high_open=True)
    if key == "gamma":
        return None if value is None else check_float(name, value, low=0, high=1, high_open=True)
    if key == "seed":
        return check_int(name, value, low=0, high=2**31 - 1)
    if key == "profile_from":
        return check_int(name, value, low=0)
    if key == "sparsity_profile":
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name}: expected a path (str) or None, got {describe(value)}")
        if value == "":
            raise ValueError(f"{name}: expected a path to a profile.json or None, got ''")
        return value
    if key == "policy":
        check_choice(name, value, policy_names(), what="a policy, one of")
        if value in LAYERED:  # budgets calibrated for the proxy model's 30 layers, not a served model's
            raise ValueError(f"{name}: {value!r} holds the proxy model's per-layer budgets (an evaluation policy); "
                             f"expected a policy without a sparsity_profile (SpinVllmSettings.sparsity_profile "
                             f"takes the served model's own calibrated budgets)")
        if get_policy(value, 0.0).summary > 0:  # its cache is not in vLLM's KV-cache manager; its cost unmeasured
            raise ValueError(f"{name}: {value!r} is an evaluation policy (the summary mix's cache is not allocated "
                             f"through vLLM's KV-cache manager yet); expected one without SpinConfig.summary")
        return value
    if key == "exploration":
        return None if value is None else check_choice(name, value, [m.value for m in Exploration])
    if key == "vertical_grain":
        return check_choice(name, value, [g.value for g in Grain])
    raise AssertionError(key)  # _ENV and this function list the same keys


def _parse_env(env: str, key: str, raw: str):
    """The text of environment variable `env` as the type of field `key` (ValueError naming `env`)."""
    text = raw.strip()
    if key in ("enable", "shadow"):
        if text.lower() in _TRUE or text.lower() in _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{env}: expected one of {', '.join(_TRUE + _FALSE)} (any case), got {raw!r}")
    number = {"sparsity": float, "gamma": float, "seed": int, "profile_from": int}.get(key)
    if number is None:
        return text
    try:
        return number(text)
    except ValueError:
        raise ValueError(f"{env}: expected {'an int' if number is int else 'a float'}, got {raw!r}") from None
