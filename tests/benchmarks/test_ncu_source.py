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


def test_a_kernel_repeated_row_for_row_is_summarized_once(tmp_path, capsys):
    # run 182's page held each launch twice in a row; two launches of one kernel that differ stay two
    ncu_source = import_benchmark("ncu_source")
    a = ("_k", [("0x10", "FFMA R1, R2, R3, R4", 30, 0, 0, 0, 0, 0, 30, 0)])
    b = ("_k", [("0x10", "FFMA R1, R2, R3, R4", 40, 0, 0, 0, 0, 0, 40, 0)])
    path = tmp_path / "source.csv"
    path.write_text(_page([a, a, b, a]))
    assert ncu_source.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert [line.split(", ")[1] for line in out.splitlines() if line.startswith("== ")] == \
        ["30 samples", "40 samples", "30 samples"]


def test_a_file_without_kernels_is_rejected(tmp_path):
    ncu_source = import_benchmark("ncu_source")
    path = tmp_path / "details.txt"
    path.write_text("Section: GPU Speed Of Light Throughput\n")
    with pytest.raises(SystemExit, match="details.txt: no 'Kernel Name' rows"):
        ncu_source.main([str(path)])


SASS = """\
        //## File "/src/k.py", line 7
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        //## File "/triton/language/standard.py", line 293
        /*0010*/                   SHFL.BFLY PT, R1, R2, 0x4, 0x1f ;
        /*0020*/                   IMAD.IADD R3, R1, 0x1, R3 ;
        //## File "/src/k.py", line 9
        /*0030*/                   LDG.E.U16 R4, desc[UR4][R2.64] ;
"""


def test_samples_by_source_line_come_from_the_matching_listing(tmp_path, capsys):
    ncu_source = import_benchmark("ncu_source")
    rows = [("0x7f00", "LDC R1, c[0x0][0x28]", 1, 0, 0, 0, 0, 0, 0, 0),
            ("0x7f10", "SHFL.BFLY PT, R1, R2, 0x4, 0x1f", 30, 0, 0, 0, 0, 0, 30, 0),
            ("0x7f20", "IMAD.IADD R3, R1, 0x1, R3", 9, 0, 0, 0, 0, 0, 9, 0),
            ("0x7f30", "LDG.E.U16 R4, desc[UR4][R2.64]", 60, 0, 0, 0, 0, 60, 0, 60)]
    page = tmp_path / "source.csv"
    page.write_text(_page([("_k", rows)]))
    good, other = tmp_path / "good.sass", tmp_path / "other.sass"
    good.write_text(SASS)
    other.write_text(SASS.replace("SHFL.BFLY", "FADD").replace("IMAD.IADD", "FMUL").replace("LDG.E.U16", "STS"))
    assert ncu_source.main([str(page), "--sass", str(other), str(good)]) == 0
    out = capsys.readouterr().out
    assert "by source line (good.sass):" in out  # the listing whose opcodes agree at the kernel's offsets
    shares = [line.split() for line in out.split("by source line")[1].splitlines()[1:]]
    assert shares == [["k.py:9", "60.0%"], ["standard.py:293", "39.0%"], ["k.py:7", "1.0%"]]
    empty = tmp_path / "empty.sass"
    empty.write_text("no code here\n")
    with pytest.raises(SystemExit, match="empty.sass has no SASS instructions"):
        ncu_source.main([str(page), "--sass", str(empty)])
