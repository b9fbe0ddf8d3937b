"""benchmarks/ncu_source.py (the summary of Nsight Compute's source page) on a small hand-made page: its
shares, top instructions and excess-sector lines come from the rows it is given, and a file that is not a
source page is rejected by name."""
from __future__ import annotations

import gzip

import pytest

from conftest import import_benchmark

HEADER = ['"Address"', '"Source"', '"Warp Stall Sampling (All Samples)"', '"L2 Theoretical Sectors Global Excessive"',
          '"L2 Theoretical Sectors Global"', '"L1 Wavefronts Shared Excessive"', '"L1 Wavefronts Shared"',
          '"stall_long_sb"', '"stall_barrier"', '"stall_long_sb (Not Issued)"']


def _page(kernels) -> str:
    lines = []
    for name, rows in kernels:
        lines.append(f'"Kernel Name","{name}",')
        lines.append(",".join(HEADER))
        for row in rows:
            lines.append(",".join(f'"{v}"' for v in row))
    return "\n".join(lines) + "\n"


def test_summary_shares_and_excess_come_from_the_rows(tmp_path, capsys):
    ncu_source = import_benchmark("ncu_source")
    page = _page([
        ("_pass", [("0x10", "DEPBAR.LE SB0, 0x5", 30, 0, 0, 0, 0, 25, 5, 25),
                   ("0x20", "@P1 LDGSTS.E.BYPASS.128 [R52], desc[UR20][R28.64]", 10, 700, 1400, 0, 0, 10, 0, 10),
                   ("0x30", "LDS.128 R28, [R52]", 60, 0, 0, 190, 390, 0, 60, 0)]),
        ("_select", [("0x40", "SHFL.BFLY PT, R1, R2, 0x4, 0x1f", 5, 0, 0, 0, 0, 5, 0, 5)]),
    ])
    path = tmp_path / "source.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(page)
    assert ncu_source.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    first, second = out.split("== _select")
    assert "== _pass: 3 SASS instructions, 100 samples" in first
    assert "stall reasons: barrier 65.0%, long_sb 35.0%" in first  # the Not Issued column is not a reason
    assert "by opcode: LDS 60.0%, DEPBAR 30.0%, LDGSTS 10.0%" in first  # predicate and modifiers dropped
    top = [line for line in first.splitlines() if line.startswith("    0x")]
    assert [line.split()[0] for line in top] == ["0x30", "0x10"]  # --top 2, most samples first
    assert "700 of 1400" in first and "190 of 390" in first
    assert "5 samples" in second and "of 0" not in second  # no excess: no line


def test_a_file_without_kernels_is_rejected(tmp_path):
    ncu_source = import_benchmark("ncu_source")
    path = tmp_path / "details.txt"
    path.write_text("Section: GPU Speed Of Light Throughput\n")
    with pytest.raises(SystemExit, match="details.txt: no 'Kernel Name' rows"):
        ncu_source.main([str(path)])
