"""Indexer-score traces: tensor names, shapes, dtypes, the format version, save and load.

One trace = one prompt decoded for S steps through a model with L indexer layers. On disk it is two
files side by side:

    <name>.safetensors
        scores    float16 [S, L, N, C]  indexer score of every logical position at every step, layer and
                                        query row; C = max_len (the longest row); -inf at and after each
                                        row's length (row (s, j) sees positions < seq_lens[s, j]).
        seq_lens  int32   [S, N]        row lengths; row j of step s has L_s - N + j + 1 tokens.
        topk      int32   [S, L, N, K]  optional: the dense top-k positions (best first, -1 padded), as the
                                        live indexer picked them from its fp32 logits. When absent it is
                                        recomputed from `scores` (fp16 ties may then differ).
        summary   float32 [S, L, P, W]  optional: each logical block's summary score (ops.block_summary_scores:
                                        this step's query against the block's sub-block mean keys, max over
                                        rows and sub-blocks), for each sub-block count in
                                        extra["summary_parts"] (P values); W = ceil(C / tokens_per_block);
                                        -inf past the step's longest row. Replay of SpinConfig.summary needs
                                        it: the mix reads keys, which a trace does not keep.
    <name>.json
        {"format_version": 1, "model": ..., "indexer": "oracle"|"lightning"|..., "prompt_id": ...,
         "task": ..., "context_len": prompt tokens (cache length before decode step 0), "k": top-k,
         "tokens_per_block": 64, "next_n": N, "accepted": [per-step accepted draft rows] or null,
         "extra": {free-form}}

Large traces (32K x 256 steps x 30 layers is ~0.5 GB in fp16) stay one `scores` tensor: safetensors
slices lazily, so `load_trace(path, layers=..., steps=...)` reads only the requested part.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..checks import check_int, check_tensor
from ..layout import TOKENS_PER_BLOCK

FORMAT_VERSION = 1
TENSOR_NAMES = ("scores", "seq_lens", "topk", "summary")
META_REQUIRED = ("format_version", "model", "indexer", "prompt_id", "task", "context_len", "k",
                 "tokens_per_block", "next_n")


class TraceFormatError(ValueError):
    """A trace file is missing, unreadable or inconsistent; the message names the file and the field."""


@dataclass
class TraceMeta:
    """What the trace came from. `k` is the top-k used to score fidelity (2048 on V3.2-style models)."""
    model: str
    indexer: str
    prompt_id: str
    task: str
    context_len: int
    k: int
    next_n: int = 1
    tokens_per_block: int = TOKENS_PER_BLOCK
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)


@dataclass
class Trace:
    """One prompt's per-step, per-layer indexer scores (shapes in the module docstring).

    scores: float16 (or float32) [S, L, N, C]; seq_lens: int32 [S, N]; topk: int32 [S, L, N, K] or None;
    accepted: int32 [S] (accepted draft rows per step, for MTP prefix-valid updates) or None;
    summary: float32 [S, L, P, W] block summary scores for the P sub-block counts of
    meta.extra["summary_parts"], or None.
    """
    scores: torch.Tensor
    seq_lens: torch.Tensor
    meta: TraceMeta
    topk: torch.Tensor | None = None
    accepted: torch.Tensor | None = None
    summary: torch.Tensor | None = None

    def __post_init__(self) -> None:
        validate_trace(self, read_data=False)

    @property
    def num_steps(self) -> int:
        return self.scores.shape[0]

    @property
    def num_layers(self) -> int:
        return self.scores.shape[1]

    @property
    def next_n(self) -> int:
        return self.scores.shape[2]

    @property
    def max_len(self) -> int:
        return self.scores.shape[3]

    @property
    def name(self) -> str:
        return self.meta.prompt_id

    def has_summary(self, parts: int) -> bool:
        """True when the trace recorded block summaries at `parts` sub-blocks a block."""
        return self.summary is not None and parts in self.meta.extra.get("summary_parts", [])

    def summary_of(self, parts: int) -> torch.Tensor:
        """float32 [S, L, W]: the block summary scores at `parts` sub-blocks a block. raises ValueError naming
        the trace and the sub-block counts it has when it has none at `parts`."""
        have = list(self.meta.extra.get("summary_parts", [])) if self.summary is not None else []
        if not self.has_summary(parts):
            raise ValueError(f"trace {self.name}: expected block summaries at summary_parts = {parts} (SpinConfig."
                             f"summary replays from them), the trace has {have or 'none'}: capture with "
                             f"--summary-parts {parts}")
        return self.summary[:, :, have.index(parts)]

    def save(self, directory: str | Path, name: str | None = None) -> Path:
        """Write `<name>.safetensors` and `<name>.json` into `directory`; returns the .safetensors path."""
        return save_trace(self, directory, name)


def validate_trace(trace: Trace, read_data: bool = True, source: str = "trace") -> None:
    """Shape/dtype/metadata consistency; with read_data, also that scores are -inf exactly past each row's
    length and top-k entries are valid positions. Raises TraceFormatError naming `source` and the field."""
    try:
        _validate(trace, read_data)
    except (TypeError, ValueError) as err:
        if isinstance(err, TraceFormatError):
            raise
        raise TraceFormatError(f"{source}: {err}") from None


def _validate(trace: Trace, read_data: bool) -> None:
    meta = trace.meta
    if not isinstance(meta, TraceMeta):
        raise TypeError(f"meta: expected a TraceMeta, got {type(meta).__name__}")
    if meta.format_version != FORMAT_VERSION:
        raise ValueError(f"format_version: expected {FORMAT_VERSION}, got {meta.format_version}")
    check_int("k", meta.k, low=1)
    check_int("next_n", meta.next_n, low=1)
    check_int("tokens_per_block", meta.tokens_per_block, low=1)
    check_int("context_len", meta.context_len, low=0)
    scores = check_tensor("scores", trace.scores, dtype=(torch.float16, torch.float32), ndim=4)
    steps, layers, next_n, max_len = scores.shape
    if next_n != meta.next_n:
        raise ValueError(f"scores: expected next_n = {meta.next_n} rows (dim 2, from the metadata), got {next_n}")
    check_tensor("seq_lens", trace.seq_lens, dtype=torch.int32, shape=(steps, next_n), shape_names="[S, N]",
                 device=scores.device, device_of="scores")
    if trace.topk is not None:
        check_tensor("topk", trace.topk, dtype=torch.int32, shape=(steps, layers, next_n, meta.k),
                     shape_names="[S, L, N, K]", device=scores.device, device_of="scores")
    if trace.accepted is not None:
        check_tensor("accepted", trace.accepted, dtype=torch.int32, shape=(steps,), shape_names="[S]")
    parts = meta.extra.get("summary_parts")
    if trace.summary is not None:
        if not (isinstance(parts, list) and parts and all(type(p) is int and p >= 1 for p in parts)):
            raise ValueError(f"extra.summary_parts: expected a non-empty list of sub-block counts beside the "
                             f"summary tensor, got {parts!r}")
        width = -(-max_len // meta.tokens_per_block)
        check_tensor("summary", trace.summary, dtype=torch.float32, shape=(steps, layers, len(parts), width),
                     shape_names="[S, L, P, W] (P = len(extra.summary_parts), W = ceil(max_len / T))",
                     device=scores.device, device_of="scores")
    elif parts is not None:
        raise ValueError(f"summary: expected the tensor that extra.summary_parts = {parts!r} describes, got none")
    if not read_data or steps == 0:
        return
    lens = trace.seq_lens.long()
    lo, hi = int(lens.min()), int(lens.max())
    if lo < 1 or hi > max_len:
        raise ValueError(f"seq_lens: expected lengths in [1, max_len = {max_len}], got min {lo}, max {hi}")
    cols = torch.arange(max_len, device=scores.device)
    past = cols[None, None, :] >= lens[:, :, None]  # [S, N, C]
    is_inf = torch.isneginf(scores)
    if not bool(is_inf.masked_select(past[:, None].expand_as(scores)).all()):
        raise ValueError("scores: expected -inf at and after each row's length (seq_lens)")
    if bool(torch.isnan(scores).any()) or bool(torch.isposinf(scores).any()):
        raise ValueError("scores: expected finite values before each row's length, found NaN or +inf")
    if trace.topk is not None:
        tk = trace.topk.long()
        bad = (tk < -1) | (tk >= lens[:, None, :, None])
        if bool(bad.any()):
            raise ValueError("topk: expected positions in [0, seq_len) or -1 padding")
    if trace.accepted is not None:
        acc = trace.accepted
        if bool((acc < 0).any()) or bool((acc >= next_n).any()):
            raise ValueError(f"accepted: expected values in [0, next_n - 1 = {next_n - 1}]")
    if trace.summary is not None:
        t = meta.tokens_per_block
        blocks = -(-lens.amax(dim=1) // t)  # [S]: the blocks the step's longest row reaches
        past = torch.arange(trace.summary.shape[-1], device=scores.device)[None, :] >= blocks[:, None]  # [S, W]
        summary = trace.summary
        if not bool(torch.isneginf(summary).masked_select(past[:, None, None].expand_as(summary)).all()):
            raise ValueError("summary: expected -inf past the blocks each step's longest row reaches")
        if bool(torch.isnan(summary).any()) or bool(torch.isposinf(summary).any()):
            raise ValueError("summary: expected finite values (or -inf) before, found NaN or +inf")


def _paths(path: str | Path) -> tuple[Path, Path]:
    p = Path(path)
    base = p.with_suffix("") if p.suffix in (".safetensors", ".json") else p
    return base.with_name(base.name + ".safetensors"), base.with_name(base.name + ".json")


def save_trace(trace: Trace, directory: str | Path, name: str | None = None) -> Path:
    """Write a trace as `<directory>/<name>.safetensors` + `.json` (name defaults to meta.prompt_id)."""
    from safetensors.torch import save_file

    validate_trace(trace, read_data=True)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors_path, meta_path = _paths(directory / (name or trace.meta.prompt_id))
    tensors = {"scores": trace.scores.contiguous().cpu(), "seq_lens": trace.seq_lens.contiguous().cpu()}
    if trace.topk is not None:
        tensors["topk"] = trace.topk.contiguous().cpu()
    if trace.summary is not None:
        tensors["summary"] = trace.summary.contiguous().cpu()
    save_file(tensors, str(tensors_path))
    meta = asdict(trace.meta)
    meta["accepted"] = None if trace.accepted is None else [int(a) for a in trace.accepted.cpu()]
    meta_path.write_text(json.dumps(meta, indent=1))
    return tensors_path


def load_meta(path: str | Path) -> tuple[TraceMeta, torch.Tensor | None]:
    """Metadata and `accepted` of a trace, without reading its tensors."""
    _, meta_path = _paths(path)
    if not meta_path.is_file():
        raise TraceFormatError(f"{meta_path}: metadata file not found (expected beside the .safetensors)")
    try:
        raw = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TraceFormatError(f"{meta_path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise TraceFormatError(f"{meta_path}: expected a JSON object, got {type(raw).__name__}")
    missing = [key for key in META_REQUIRED if key not in raw]
    if missing:
        raise TraceFormatError(f"{meta_path}: missing metadata field(s) {', '.join(missing)}")
    if raw["format_version"] != FORMAT_VERSION:
        raise TraceFormatError(f"{meta_path}: format_version: expected {FORMAT_VERSION}, got {raw['format_version']}")
    known = set(TraceMeta.__dataclass_fields__)
    extra = dict(raw.get("extra") or {})
    extra.update({key: val for key, val in raw.items() if key not in known and key != "accepted"})
    meta = TraceMeta(**{key: raw[key] for key in known if key in raw and key != "extra"}, extra=extra)
    accepted = raw.get("accepted")
    acc = None if accepted is None else torch.tensor(accepted, dtype=torch.int32)
    return meta, acc


def load_trace(path: str | Path, layers: list[int] | range | None = None, steps: range | None = None,
               validate: bool = True, dtype: torch.dtype | None = None) -> Trace:
    """Load `<name>.safetensors` + `<name>.json` (path may name either file or the common stem).

    layers: layer indices to keep, in the order given (default all); each must lie in [0, L) of the file,
    else ValueError naming `layers`. steps: a range with step 1 (default all): replay needs consecutive
    decode steps (SPIN's history carries from one step to the next), so a strided range such as
    range(0, 4, 2) is rejected (ValueError naming `steps`), never silently read as range(0, 4); the start
    must lie in [0, S) and a stop past S is clipped to S (so `range(0, n)` means "at most n steps").
    dtype: cast scores (e.g. torch.float32) after loading. Validates shapes always, and data when `validate`.
    raises TraceFormatError naming the file and the problem (a ValueError too).
    """
    from safetensors import SafetensorError, safe_open

    _check_steps_type(steps)
    if layers is not None:
        layers = _check_layers_type(layers)
    tensors_path, _ = _paths(path)
    meta, accepted = load_meta(path)
    if not tensors_path.is_file():
        raise TraceFormatError(f"{tensors_path}: tensor file not found")
    try:
        with safe_open(str(tensors_path), framework="pt") as f:
            names = set(f.keys())
            for need in ("scores", "seq_lens"):
                if need not in names:
                    raise TraceFormatError(f"{tensors_path}: missing tensor '{need}' (has {sorted(names)})")
            shape = f.get_slice("scores").get_shape()
            if len(shape) == 4:  # other ranks fail the shape validation below, naming the tensor
                _check_bounds(tensors_path, shape, layers, steps)
            tensors = {name: _read(f, name, layers, steps) for name in TENSOR_NAMES if name in names}
    except SafetensorError as err:
        raise TraceFormatError(f"{tensors_path}: unreadable safetensors file ({err})") from None
    if steps is not None and accepted is not None:
        accepted = accepted[steps.start:steps.stop]
    scores = tensors["scores"] if dtype is None else tensors["scores"].to(dtype)
    try:
        trace = Trace(scores, tensors["seq_lens"], meta, tensors.get("topk"), accepted, tensors.get("summary"))
    except TraceFormatError as err:
        raise TraceFormatError(f"{tensors_path}: {str(err).removeprefix('trace: ')}") from None
    if validate:
        validate_trace(trace, read_data=True, source=str(tensors_path))
    return trace


def _check_steps_type(steps) -> None:
    if steps is None:
        return
    if not isinstance(steps, range):
        raise TypeError(f"steps: expected a range (or None for all), got {type(steps).__name__}")
    if steps.step != 1:
        raise ValueError(f"steps: expected a range with step 1 (replay needs consecutive decode steps), got {steps}")


def _check_layers_type(layers) -> list[int]:
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"layers: expected a list or range of layer indices, got {type(layers).__name__}")
    layers = list(layers)
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int)]
    if bad:
        raise TypeError(f"layers: expected int layer indices, got {bad[0]!r}")
    return layers


def _check_bounds(tensors_path: Path, shape, layers: list[int] | None, steps: range | None) -> None:
    """Layers in [0, L), steps starting in [0, S) and not ending before they start (shape = [S, L, N, C])."""
    num_steps, num_layers = shape[0], shape[1]
    if layers is not None:
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad:
            raise TraceFormatError(f"{tensors_path}: layers: expected indices in [0, {num_layers}) (the trace has "
                                   f"{num_layers} layers), got {bad[:5]}")
    if steps is not None and not (0 <= steps.start < num_steps and steps.stop > steps.start):
        raise TraceFormatError(f"{tensors_path}: steps: expected a non-empty range starting in [0, {num_steps}) "
                               f"(the trace has {num_steps} steps), got {steps}")


def _read(f, name: str, layers, steps) -> torch.Tensor:
    sl = f.get_slice(name)
    rank = len(sl.get_shape())
    s = slice(None) if steps is None else slice(steps.start, steps.stop)
    if name == "seq_lens" or rank < 2:
        return sl[s] if rank >= 1 else f.get_tensor(name)
    if layers is None:
        return sl[s]
    layers = list(layers)
    if layers and layers == list(range(layers[0], layers[-1] + 1)):
        return sl[s, layers[0]:layers[-1] + 1]  # contiguous: one lazy slice
    return torch.stack([sl[s, i] for i in layers], dim=1) if layers else sl[s, 0:0]


def trace_shape(path: str | Path) -> tuple[int, ...]:
    """Shape [S, L, N, C] of a trace's scores, read from the safetensors header only."""
    from safetensors import SafetensorError, safe_open

    tensors_path, _ = _paths(path)
    try:
        with safe_open(str(tensors_path), framework="pt") as f:
            return tuple(f.get_slice("scores").get_shape())
    except (SafetensorError, OSError) as err:
        raise TraceFormatError(f"{tensors_path}: cannot read the scores header ({err})") from None


def list_traces(directory: str | Path) -> list[Path]:
    """The .safetensors trace files of a directory (recursively), sorted, each with its .json beside it."""
    root = Path(directory)
    if not root.is_dir():
        raise TraceFormatError(f"{root}: not a directory")
    return sorted(p for p in root.rglob("*.safetensors") if p.with_suffix(".json").is_file())


def context_bin(context_len: int) -> str:
    """Label of the nearest power-of-two context bin ('4K', '8K', '16K', '32K', ...; nearest in log scale, so
    a 4K capture budget whose prompt came out at 3,900 or 4,150 tokens lands in '4K' either way)."""
    if context_len <= 0:
        return "0"
    kib = 2 ** max(0, round(math.log2(context_len / 1024)))
    return f"{kib}K"
