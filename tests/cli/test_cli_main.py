"""The argparse root: subcommand discovery, lazy imports, shared options before/after the command, one-line
errors and exit codes."""
from __future__ import annotations

import sys

import pytest

from spin_indexer.cli import main as cli


@pytest.mark.parametrize("argv, chosen", [
    (["demo"], "demo"), (["--seed", "3", "quality", "--samples", "2"], "quality"), (["--seed=3", "eval"], "eval"),
    (["--device", "cpu", "--threads", "2", "report"], "report"), (["--quiet"], None), ([], None),
    (["--out", "demo", "quality"], "quality")])  # an option's value is never the command
def test_chosen_command(argv, chosen):
    assert cli.chosen_command(argv) == chosen


def test_parser_lazy_and_shared_options():
    for name in ("eval.quality", "cli.quality"):
        sys.modules.pop(f"spin_indexer.{name}", None)
    parser, chosen = cli.build_parser(["--seed", "5", "demo", "--quiet"])
    assert chosen == "demo" and "spin_indexer.cli.quality" not in sys.modules  # only the chosen one is imported
    args = parser.parse_args(["--seed", "5", "demo", "--quiet"])
    assert (args.command, args.seed, args.quiet, args.device) == ("demo", 5, True, None)
    assert args.out == "spin-demo" and args.sparsity == [0.3, 0.4] and args.context == 4096  # demo's own defaults
    parser, _ = cli.build_parser(["quality", "--seed", "7", "--tasks", "vt", "--configs", "dense", "spin-0.3"])
    args = parser.parse_args(["quality", "--seed", "7", "--tasks", "vt", "--configs", "dense", "spin-0.3"])
    # --out is resolved in run(): results/quality for a run, runs/quality-report for --report-only
    assert (args.seed, args.tasks, args.configs, args.out, args.contexts) == (7, ["vt"], ["dense", "spin-0.3"],
                                                                              None, [4096])


def test_every_listed_subcommand_builds():
    for name in ("demo", "quality"):
        parser, chosen = cli.build_parser([name])
        assert chosen == name
        assert parser.parse_args([name]).command == name


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_unknown_option_exits_2(capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(["quality", "--no-such-option"])
    assert err.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_bad_value_is_one_line(capsys, tmp_path):
    code = cli.main(["quality", "--configs", "spin-1.5", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("spin-indexer quality: error: config")
    assert "Traceback" not in "".join(err)


def test_debug_shows_traceback(capsys, tmp_path):
    assert cli.main(["quality", "--configs", "nope", "--out", str(tmp_path), "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err
