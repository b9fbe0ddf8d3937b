"""benchmarks/logits_clocks.py: the clock and power samples are taken from nvidia-smi's lines stamped inside a
provider's replay window only (the lines of the other providers' windows, and malformed lines, left out)."""
from __future__ import annotations

import math

from conftest import import_benchmark


def test_samples_outside_the_window_and_malformed_lines_are_left_out():
    clocks = import_benchmark("logits_clocks")
    lines = [(0.5, "1980, 300.1"), (1.2, "1605, 694.0"), (1.5, "[N/A], 690.0"), (1.7, "1560, 692.0"),
             (2.0, "1530, 693.0"), (3.5, "1335, 695.0")]
    mhz, watts = clocks.sample_clocks(1.0, 2.0, lines)
    assert mhz == 1560.0 and watts == 693.0
    mhz, watts = clocks.sample_clocks(5.0, 6.0, lines)
    assert math.isnan(mhz) and math.isnan(watts)
