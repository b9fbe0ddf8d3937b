"""Where a kernel's warps stall, by SASS instruction: a summary of Nsight Compute's source page.

`ncu --import REPORT.ncu-rep --page source --csv --print-source sass` writes, per profiled kernel, one row per
SASS instruction with its warp-state samples (stall_* columns) and memory counters. This prints, per kernel:
the stall reasons' shares of all samples, the instructions with the most samples (and their two main stall
reasons), the global loads / stores whose L2 sectors exceed the ideal most (an access that touches more
sectors than its bytes need), the shared accesses with the most excess wavefronts (bank conflicts), and the
samples by opcode. The report needs `--section SourceCounters --section WarpStateStats` (h200_step.sh ncu
with NCU_SOURCE=1 exports it and runs this).

    python benchmarks/ncu_source.py benchmarks/results/run93_ncu_pass_plan/source.csv.gz

With --sass, the samples are also summed by source line: each FILE is `nvdisasm --print-line-info -c` of a cubin
the run compiled (Triton's cache on the device: ~/.triton/cache/*/KERNEL.cubin; nvdisasm ships with triton), and
each kernel takes the listing whose instructions match its own at the same offsets (from the kernel's first).
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import os
import re


SAMPLES = "Warp Stall Sampling (All Samples)"
EXCESS = (("global accesses with the most excess L2 sectors", "L2 Theoretical Sectors Global Excessive",
           "L2 Theoretical Sectors Global"),
          ("shared accesses with the most excess wavefronts", "L1 Wavefronts Shared Excessive", "L1 Wavefronts Shared"))


def kernels(text: str) -> list[dict]:
    """[{name, header, rows}] of the CSV: a "Kernel Name" line opens each kernel, an "Address" line its header."""
    out = []
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            out.append(dict(name=row[1], header=None, rows=[]))
        elif row[0] == "Address" and out:
            out[-1]["header"] = row
        elif out and out[-1]["header"] is not None:
            out[-1]["rows"].append(row)
    # a kernel the page holds twice in a row, row for row (run 182's report: each of four launches twice), once
    return [k for i, k in enumerate(out) if i == 0 or k != out[i - 1]]


def opcode(source: str) -> str:
    """The SASS opcode without its predicate and modifiers ("@!P1 LDG.E.U16 R3, ..." -> "LDG")."""
    return re.sub(r"^@!?U?P\w+\s+", "", source.strip()).split(" ")[0].split(".")[0]


def summarize(kernel: dict, top: int = 15) -> list[str]:
    col = {name: i for i, name in enumerate(kernel["header"])}

    def num(row, name):
        try:
            return float(row[col[name]])
        except (KeyError, ValueError):
            return 0.0

    rows = kernel["rows"]
    stalls = [c for c in kernel["header"] if c.startswith("stall_") and "Not Issued" not in c]
    samples = sum(num(r, SAMPLES) for r in rows) or 1.0
    by_reason = collections.Counter({c[6:]: sum(num(r, c) for r in rows) for c in stalls})
    by_op = collections.Counter()
    for r in rows:
        by_op[opcode(r[col["Source"]])] += num(r, SAMPLES)
    lines = [f"== {kernel['name']}: {len(rows)} SASS instructions, {samples:.0f} samples",
             "  stall reasons: " + ", ".join(f"{k} {100 * v / samples:.1f}%" for k, v in by_reason.most_common(9)),
             "  by opcode: " + ", ".join(f"{k} {100 * v / samples:.1f}%" for k, v in by_op.most_common(12)),
             "  top instructions (share of samples, two main reasons):"]
    for r in sorted(rows, key=lambda r: -num(r, SAMPLES))[:top]:
        (n1, reason1), (n2, reason2) = sorted(((num(r, c), c[6:]) for c in stalls), reverse=True)[:2]
        lines.append(f"    {r[col['Address']][-5:]} {100 * num(r, SAMPLES) / samples:5.1f}%  "
                     f"{r[col['Source']].strip()[:64]:64s} {reason1} {n1:.0f}, {reason2} {n2:.0f}")
    for title, excess, total in EXCESS:
        lines.append(f"  {title} (excess of all):")
        for r in sorted(rows, key=lambda r: -num(r, excess))[:6]:
            if num(r, excess) > 0:
                lines.append(f"    {r[col['Source']].strip()[:72]:72s} {num(r, excess):.0f} of {num(r, total):.0f}")
    return lines


def parse_sass(text: str) -> tuple[dict, dict]:
    """({offset: "file.py:line"}, {offset: instruction}) of an nvdisasm --print-line-info listing."""
    lines, code, where = {}, {}, None
    for line in text.splitlines():
        m = re.search(r'File ".*?([^/"]+)", line (\d+)', line)
        if m:
            where = f"{m.group(1)}:{m.group(2)}"
            continue
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if m:
            lines[int(m.group(1), 16)] = where
            code[int(m.group(1), 16)] = m.group(2)
    return lines, code


def by_source_line(kernel: dict, listings: list[tuple[str, dict, dict]], top: int = 25) -> list[str]:
    """The kernel's samples summed by source line, from the listing (name, lines, code) whose opcodes agree with
    the kernel's rows at the most offsets (counted from the kernel's first instruction)."""
    col = {name: i for i, name in enumerate(kernel["header"])}
    base = int(kernel["rows"][0][col["Address"]], 16)
    rows = [(int(r[col["Address"]], 16) - base, r[col["Source"]], float(r[col[SAMPLES]] or 0)) for r in kernel["rows"]]
    name, lines, _ = max(listings, key=lambda x: sum(opcode(x[2].get(off, "?")) == opcode(src) for off, src, _ in rows))
    total = sum(s for *_, s in rows) or 1.0
    agg = collections.Counter()
    for off, _, samples in rows:
        agg[lines.get(off) or "?"] += samples
    out = [f"  by source line ({name}):"]
    out += [f"    {where:32s} {100 * samples / total:5.1f}%" for where, samples in agg.most_common(top)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="the source page as CSV (.gz allowed)")
    ap.add_argument("--top", type=int, default=15, help="instructions listed per kernel (default 15)")
    ap.add_argument("--sass", nargs="+", default=[], metavar="FILE",
                    help="nvdisasm --print-line-info listings of the run's cubins: samples by source line too")
    args = ap.parse_args(argv)
    listings = []
    for path in args.sass:
        with open(path) as f:
            lines, code = parse_sass(f.read())
        if not code:
            raise SystemExit(f"--sass: {path} has no SASS instructions: expected nvdisasm --print-line-info -c output")
        listings.append((os.path.basename(path), lines, code))
    opener = gzip.open if args.csv.endswith(".gz") else open
    with opener(args.csv, "rt") as f:
        found = kernels(f.read())
    if not found:
        raise SystemExit(f"{args.csv}: no 'Kernel Name' rows: expected ncu --page source --csv output")
    for kernel in found:
        print("\n".join(summarize(kernel, args.top)))
        if listings:
            print("\n".join(by_source_line(kernel, listings)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
