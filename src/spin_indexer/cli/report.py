"""`spin-indexer report RESULTS_DIR`: merge every eval run under a directory into one page.

Writes RESULTS_DIR/summary.csv, table1.csv, REPORT.md and plots/*.png from all rows.json files below it
(a later run of the same (trace set, indexer, context, target, policy) replaces the earlier row).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results_dir", help="directory holding eval runs (rows.json files, searched recursively)")
    parser.add_argument("--no-plots", action="store_true")
    if "--quiet" not in parser._option_string_actions:
        parser.add_argument("--quiet", action="store_true")
    if "--debug" not in parser._option_string_actions:
        parser.add_argument("--debug", action="store_true", help="show tracebacks")


def run(args) -> int:
    from ..eval.ablations import SUMMARY_COLUMNS, TABLE1_COLUMNS
    from ..predictor.policies import POLICIES
    from ..eval.report import load_runs, markdown, table1_csv_rows, write_csv

    try:
        root = Path(args.results_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: not a directory")
        summary, t1, runs = load_runs(root)
        known = list(POLICIES)
        order = lambda r: (r["trace_set"], r["indexer"],  # noqa: E731  policies in registry order
                           known.index(r["policy"]) if r["policy"] in known else len(known), r["policy"],
                           r["context"], r["sparsity_target"])
        summary.sort(key=order)
        write_csv(root / "summary.csv", summary, SUMMARY_COLUMNS)
        write_csv(root / "table1.csv", table1_csv_rows(t1), TABLE1_COLUMNS)
        (root / "REPORT.md").write_text(markdown(summary, t1, runs))
        plots = []
        if not args.no_plots:
            from ..eval.plots import all_figures

            plots = all_figures(summary, root / "plots")
        print(f"report: {len(summary)} rows from {len(runs)} runs -> {root / 'summary.csv'}, "
              f"{root / 'table1.csv'}, {root / 'REPORT.md'}, {len(plots)} plots")
        return 0
    except (ValueError, FileNotFoundError, KeyError) as err:
        if getattr(args, "debug", False):
            raise
        print(f"spin-indexer report: error: {err}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="spin-indexer report", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
