"""The SPIN predictor: configuration, per-request history state, block scoring, selection and update."""
from .config import PRESETS, Combine, Exploration, MtpPolicy, Pooling, Reduce, SpinConfig
from .state import SpinState

__all__ = ["SpinConfig", "SpinState", "PRESETS", "Pooling", "Reduce", "Combine", "Exploration", "MtpPolicy"]
