"""`spin-indexer report RESULTS_DIR`: merge every eval run under a directory into one page.

Writes summary.csv, table1.csv, REPORT.md and plots/*.png from all rows.json files below RESULTS_DIR (a
later run of the same (trace set, indexer, context, target, policy) replaces the earlier row), into
RESULTS_DIR itself or into --out. Every rows.json is checked first: a corrupt or wrongly shaped one fails
with one line naming the file, before anything is written.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the root adds no shared option the report would ignore (it has no device, seed, progress bar or threads)
SHARED_OPTIONS = ("--debug",)
_NUMERIC = ("sparsity_target", "mean_miss", "p99_miss", "realized_sparsity", "rows", "pearson", "topk_recall")
_TEXT = ("trace_set", "indexer", "policy", "predictor", "context")  # sort keys: one type each


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results_dir", help="directory holding eval runs (rows.json files, searched recursively)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="folder for summary.csv, table1.csv, REPORT.md and plots/ (default: RESULTS_DIR)")
    parser.add_argument("--no-plots", action="store_true", help="write the tables only, no plots/*.png")
    if "--debug" not in parser._option_string_actions:
        parser.add_argument("--debug", action="store_true", help="show tracebacks")


def check_rows_files(root: Path) -> list[Path]:
    """Every rows.json under root parses and has the shape `spin-indexer eval` writes; raises ValueError
    naming the file and what is wrong (FileNotFoundError when there is none)."""
    from ..eval.ablations import SUMMARY_COLUMNS, TABLE1_COLUMNS

    files = sorted(root.rglob("rows.json"))
    if not files:
        raise FileNotFoundError(f"{root}: no rows.json found (run `spin-indexer eval --out ...` first)")
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{f}: not valid JSON ({err})") from None
        except OSError as err:
            raise ValueError(f"{f}: unreadable ({err.strerror or err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{f}: expected a JSON object with 'summary', 'table1' and 'run' (as spin-indexer eval "
                             f"writes), got a {type(data).__name__}; rename a file that is not an eval run")
        if "summary" not in data:
            raise ValueError(f"{f}: missing 'summary' (not a rows.json written by spin-indexer eval)")
        if not isinstance(data.get("run", {}), dict):
            raise ValueError(f"{f}: run: expected an object, got {type(data['run']).__name__}")
        for key, columns in (("summary", SUMMARY_COLUMNS), ("table1", TABLE1_COLUMNS)):
            rows = data.get(key, [])
            if not isinstance(rows, list):
                raise ValueError(f"{f}: {key}: expected a list of rows, got {type(rows).__name__}")
            for i, row in enumerate(rows):
                if not isinstance(row, dict):
                    raise ValueError(f"{f}: {key}[{i}]: expected an object, got {type(row).__name__}")
                missing = [c for c in columns if c not in row]
                if missing:
                    raise ValueError(f"{f}: {key}[{i}]: missing field(s) {', '.join(missing)}")
                for c in columns:
                    v = row[c]
                    number = isinstance(v, (int, float)) and not isinstance(v, bool)
                    if c in _NUMERIC and not number and (v is not None or c == "sparsity_target"):
                        raise ValueError(f"{f}: {key}[{i}].{c}: expected a number, got {v!r}")
                    if c in _TEXT and not isinstance(v, str):
                        raise ValueError(f"{f}: {key}[{i}].{c}: expected a string, got {v!r}")
    return files


def run(args) -> int:
    from ..eval.ablations import SUMMARY_COLUMNS, TABLE1_COLUMNS
    from ..predictor.policies import POLICIES
    from ..eval.report import load_runs, markdown, table1_csv_rows, write_csv
    from .main import check_out_dir

    try:
        root = Path(args.results_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: not a directory")
        dest = check_out_dir("--out", args.out) if args.out else root
        check_rows_files(root)
        summary, t1, runs = load_runs(root)
        known = list(POLICIES)
        order = lambda r: (r["trace_set"], r["indexer"],  # noqa: E731  policies in registry order
                           known.index(r["policy"]) if r["policy"] in known else len(known), r["policy"],
                           r["context"], r["sparsity_target"])
        summary.sort(key=order)
        dest.mkdir(parents=True, exist_ok=True)
        write_csv(dest / "summary.csv", summary, SUMMARY_COLUMNS)
        write_csv(dest / "table1.csv", table1_csv_rows(t1), TABLE1_COLUMNS)
        (dest / "REPORT.md").write_text(markdown(summary, t1, runs))
        plots = []
        if not args.no_plots:
            from ..eval.plots import all_figures

            plots = all_figures(summary, dest / "plots")
        print(f"report: {len(summary)} rows from {len(runs)} runs -> {dest / 'summary.csv'}, "
              f"{dest / 'table1.csv'}, {dest / 'REPORT.md'}, {len(plots)} plots")
        return 0
    except (ValueError, TypeError, FileNotFoundError, KeyError) as err:
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
