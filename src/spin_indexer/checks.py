"""The single source of input-validation error messages.

TypeError for a wrong Python type or dtype; ValueError for rank, shape, device or range. Messages read
`<name>: expected <what>, got <what>`. Shape/dtype/device checks are free; the data checks
(`check_values_in_range`) read the tensor and so synchronise with the device: they run only where the
caller asked for validation (see `SpinIndexer.plan(..., validate=True)`).
"""
from __future__ import annotations

import enum
import math
from typing import Sequence

import torch


def check_tensor(name: str, t, *, dtype: torch.dtype | Sequence[torch.dtype] | None = None,
                 ndim: int | None = None, shape: Sequence[int | None] | None = None,
                 shape_names: str | None = None, device: torch.device | None = None,
                 device_of: str | None = None, contiguous: bool = False) -> torch.Tensor:
    """Validate one tensor argument and return it.

    shape: expected sizes, None for "any"; shape_names: the glossary letters for the message,
    e.g. "[B, next_n]"; device_of: name of the argument whose device `device` came from.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if shape is not None and ndim is None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions{_named(shape, shape_names)}, got shape {list(t.shape)}")
    if shape is not None:
        for want, got in zip(shape, t.shape):
            if want is not None and want != got:
                raise ValueError(f"{name}: expected shape{_named(shape, shape_names)}, got {list(t.shape)}")
    if device is not None and not same_device(t.device, device):
        src = f" (same as {device_of})" if device_of else ""
        raise ValueError(f"{name}: expected device {device}{src}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    return t


def same_device(actual: torch.device, expected) -> bool:
    """True when `actual` is `expected`; an index-less expected device ("cuda") matches any index."""
    expected = torch.device(expected)
    return actual.type == expected.type and (expected.index is None or actual.index == expected.index)


def _named(shape, names) -> str:
    if shape is None:
        return ""
    sizes = ", ".join("*" if s is None else str(s) for s in shape)
    return f" {names} = [{sizes}]" if names else f" [{sizes}]"


def check_int(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """A Python int with low <= value <= high (either bound optional); bool and float are refused, never
    truncated: `SpinConfig.seed: expected an int, got float 1.7`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {describe(value)}")
    check_range(name, value, low=low, high=high)
    return int(value)


def check_float(name: str, value, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False) -> float:
    """A real number (int or float, never bool or str) with low <= value <= high (< or > when open),
    returned as a float. NaN fails every bound; with no bounds, inf and NaN are refused too."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {describe(value)}")
    value = float(value)
    if low is None and high is None and not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite float, got {value}")
    check_range(name, value, low=low, high=high, low_open=low_open, high_open=high_open)
    return value


def check_bool(name: str, value) -> bool:
    """True or False exactly: no truthy strings ('false' is a str), no 0/1 ints."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {describe(value)}")
    return value


def check_choice(name: str, value, choices: Sequence[str], what: str = "one of") -> str:
    """A str among `choices`: TypeError for a non-str, ValueError listing the known ones."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, {what} {', '.join(choices)}, got {describe(value)}")
    if value not in choices:
        raise ValueError(f"{name}: expected {what} {', '.join(choices)}, got {value!r}")
    return value


def check_enum(name: str, value, cls: type[enum.Enum]):
    """A member of the str enum `cls`, or its value as a string ("a1-max" -> Pooling.A1_MAX)."""
    if isinstance(value, cls):
        return value
    known = ", ".join(m.value for m in cls)
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a {cls.__name__} or one of {known}, got {describe(value)}")
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{name}: expected one of {known}, got {value!r}") from None


def check_sequence(name: str, value, check_item) -> tuple:
    """A tuple or list (never a str), each item passed through check_item(f"{name}[i]", item); returns a
    tuple, so a frozen config holding it stays hashable."""
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{name}: expected a tuple or list, got {describe(value)}")
    return tuple(check_item(f"{name}[{i}]", item) for i, item in enumerate(value))


def describe(value) -> str:
    """`float 1.7`, `str '0.3'`, `None`: the type and a short repr, for the `got ...` half of a message."""
    if value is None:
        return "None"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def check_range(name: str, value, *, low=None, high=None, low_open: bool = False, high_open: bool = False) -> None:
    """low <= value <= high (or low < value when low_open, value < high when high_open)."""
    ok = (low is None or (value > low if low_open else value >= low)) and \
         (high is None or (value < high if high_open else value <= high))
    if not ok:
        lo = "" if low is None else (f"{low} < " if low_open else f"{low} <= ")
        hi = "" if high is None else (f" < {high}" if high_open else f" <= {high}")
        raise ValueError(f"{name}: expected {lo}{name.split('.')[-1]}{hi}, got {value}")


def check_values_in_range(name: str, t: torch.Tensor, low: int, high: int, what: str = "values") -> None:
    """Every element in [low, high]. Reads the data (a host sync): call only when validating."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or hi > high:
        raise ValueError(f"{name}: expected {what} in [{low}, {high}], got min {lo}, max {hi}")


def check_device(name: str, device) -> torch.device:
    """A torch.device this build can use: a CUDA device needs CUDA (not an AssertionError from deep inside
    torch on a CPU build), with its index below the device count."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name}: expected a device such as 'cpu' or 'cuda:0', got {describe(device)}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: expected an available device, got {dev} (this torch build or machine has "
                             "no CUDA: torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}: expected a CUDA index below {torch.cuda.device_count()}, got {dev}")
    return dev


def allocation_error(what: str, nbytes: int, device, sizes: str) -> MemoryError:
    """The MemoryError raised when a sized structure does not fit (instead of a bare allocator error)."""
    return MemoryError(f"{what}: {nbytes / 2**30:.2f} GiB for {sizes} does not fit on {device}; lower those sizes")
