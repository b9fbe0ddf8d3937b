"""`spin-indexer`: the argparse root. Each subcommand lives in spin_indexer/cli/<name>.py with
`add_arguments(parser)` and `run(args) -> int`, and is imported only when it is the one chosen (so
`spin-indexer demo` never imports the model or plotting stacks).

Shared options, accepted before or after the subcommand: --device --seed --out --threads --quiet --debug.
A subcommand may define one of them itself (with its own default); the root adds the rest, or only those
named in the module's `SHARED_OPTIONS` tuple (so `report --help` lists no option it would ignore).
Failures print one line `spin-indexer <command>: error: ...` and exit non-zero; --debug shows the traceback.
Commands check their arguments (and that --out can be created) before loading any model.
There is no `bench` command: the GPU benchmarks run from benchmarks/run_all.py.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from pathlib import Path

PROG = "spin-indexer"

# name -> one-line help. The module is spin_indexer.cli.<name>; listed here even before it exists.
SUBCOMMANDS: dict[str, str] = {
    "demo": "real-model demo: SmolLM2 + a RULER needle at ~4K, all-keep vs SPIN 30/40%%, report + plot in "
            "./spin-demo; no arguments needed",
    "eval": "replay SPIN policies over traces; write fidelity tables and plots",
    "report": "merge evaluation runs into one summary page",
    "capture": "run the proxy model and record per-step indexer logits and top-k traces",
    "distill": "fit the proxy model's indexer head to its own attention",
    "calibrate": "a per-layer sparsity profile from traces (SpinConfig.sparsity_profile)",
    "quality": "task scores of the proxy model with the dense and the SPIN indexer",
}

# Shared options: (flags, keyword arguments).
SHARED = [
    (("--device",), dict(default=None, help="torch device (default: cuda when available, else cpu)")),
    (("--seed",), dict(type=int, default=0, help="random seed (default 0)")),
    (("--out",), dict(default=None, metavar="DIR", help="output directory (default: the command's own)")),
    (("--threads",), dict(type=int, default=1, help="CPU threads for torch (default 1: replay and the reference "
                          "ops run many small tensors, where intra-op threads cost more than they give)")),
    (("--quiet",), dict(action="store_true", help="no progress bars, only the final result")),
    (("--debug",), dict(action="store_true", help="show the full traceback on failure")),
]
_VALUE_OPTIONS = {"--device", "--seed", "--out", "--threads"}


class NotAvailable(Exception):
    """The chosen subcommand's module is not written yet, or a package it needs is missing."""


def load(name: str):
    """Import spin_indexer.cli.<name>, or raise NotAvailable with a one-line reason."""
    module = f"spin_indexer.cli.{name}"
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name == module:
            raise NotAvailable(f"'{name}' is not available yet (no module {module})") from err
        raise NotAvailable(f"'{name}' needs the package '{err.name}', which is not installed "
                           f"(see README: pip install -e \".[model,eval]\")") from err
    if not (callable(getattr(mod, "add_arguments", None)) and callable(getattr(mod, "run", None))):
        raise NotAvailable(f"'{name}' is not available yet ({module} lacks add_arguments/run)")
    return mod


def device_of(args) -> str:
    """The --device value, or cuda when available, else cpu."""
    if getattr(args, "device", None):
        return args.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def chosen_command(argv: list[str]) -> str | None:
    """The first positional argument (the subcommand), skipping root options and their values."""
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token.startswith("-"):
            skip = token in _VALUE_OPTIONS  # "--seed 3" (but not "--seed=3")
        else:
            return token
    return None


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default after its help, unless the help already states it or there is none to
    show (None, False, suppressed)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or action.default == []):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def check_out_dir(name: str, path) -> Path:
    """`path` is, or can be created as, a writable folder: checked before any work, so a bad --out fails
    in a second rather than after the model load. Raises ValueError naming the option."""
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        what = path if probe == path else f"{path} (its parent {probe})"
        raise ValueError(f"{name}: expected a folder that can be created, got {what}: not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: {path} is not writable (no write permission on {probe})")
    return path


def loading_line(where: str = "") -> str:
    """The progress line printed before the SmolLM2 load (silent for ~26-50 s on the first one); `where`
    (e.g. " on cpu") goes before the dots."""
    from ..model import loader

    gguf = loader.find_gguf()
    cache = loader.cache_dir(gguf) if gguf is not None else None
    cold = gguf is not None and (cache is None or not (cache / "model.safetensors").is_file())
    name = gguf.name if gguf is not None else loader.GGUF_NAME
    note = (" (first load converts the GGUF, ~50 s; later loads read the cache in ~1 s)" if cold
            and cache is not None else " (cache off: converting the GGUF, ~50 s)" if cold else "")
    return f"loading SmolLM2-135M-Instruct from {name}{where} ...{note}"


def _add_shared(parser: argparse.ArgumentParser, suppress: bool, only: tuple[str, ...] | None = None) -> None:
    """Shared options the parser does not define yet (only those in `only` when given); suppress=True leaves
    them unset unless given, so a value given before the subcommand survives."""
    for flags, kw in SHARED:
        if any(f in parser._option_string_actions for f in flags):
            continue
        if only is not None and not any(f in only for f in flags):
            continue
        kw = dict(kw, default=argparse.SUPPRESS) if suppress else kw
        parser.add_argument(*flags, **kw)


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, str | None]:
    """The root parser with every subcommand; only the chosen one is imported and given its arguments.

    returns (parser, chosen name); raises NotAvailable when the chosen module cannot be loaded.
    """
    root = argparse.ArgumentParser(prog=PROG, description="SPIN: shadow predictive indexer for DeepSeek-style "
                                   "sparse attention decoding.", formatter_class=HelpFormatter,
                                   epilog="GPU benchmarks: python benchmarks/run_all.py (see benchmarks/).")
    _add_shared(root, suppress=False)
    sub = root.add_subparsers(dest="command", metavar="COMMAND")
    chosen = chosen_command(argv)
    for name, text in SUBCOMMANDS.items():
        parser = sub.add_parser(name, help=text, description=text.replace("%%", "%"), formatter_class=HelpFormatter)
        only = None
        if name == chosen:
            mod = load(name)
            mod.add_arguments(parser)
            only = getattr(mod, "SHARED_OPTIONS", None)
        _add_shared(parser, suppress=True, only=only)
    return root, (chosen if chosen in SUBCOMMANDS else None)


def _fail(command: str | None, message: str, code: int) -> int:
    where = f"{PROG} {command}" if command else PROG
    print(f"{where}: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point. Returns the exit status (0 on success)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        parser, chosen = build_parser(argv)
    except NotAvailable as err:
        if debug:
            traceback.print_exc()
        return _fail(chosen_command(argv), str(err), 2)
    args = parser.parse_args(argv)  # exits 2 with argparse's own message on bad usage
    args.argv = argv  # the command line as typed, for commands that record how their output was made
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        import torch

        # Measured on a busy 2-core machine: the EMA update of 8 x 16K slots took 442 ms with 2 threads,
        # 13 ms with 1 (thread spin-waits under contention).
        torch.set_num_threads(max(1, args.threads))
        code = load(args.command).run(args)
    except KeyboardInterrupt:
        return _fail(args.command, "interrupted", 130)
    except Exception as err:  # one clear line; the traceback only on request
        if args.debug:
            traceback.print_exc()
        # Our validation errors already read "<argument>: expected ..."; anything else shows its type.
        text = str(err) if isinstance(err, (ValueError, TypeError)) and str(err) else f"{type(err).__name__}: {err}"
        return _fail(args.command, text, 1)
    return int(code or 0)


if __name__ == "__main__":  # python -m spin_indexer.cli.main
    sys.exit(main())
