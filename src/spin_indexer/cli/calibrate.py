"""`spin-indexer calibrate`: a per-layer sparsity profile from traces (eval/calibrate.py).

    spin-indexer capture --prompts my_text.jsonl --context 8192 --steps 32 --out runs/traces/mine
    spin-indexer calibrate --traces runs/traces/mine --sparsity 0.4 --out runs/calibrate
    spin-indexer eval --traces runs/traces/other --sparsity-profile runs/calibrate/profile.json --sparsity 0.4
Writes OUT/profile.json: {"sparsity_profile": [...], "sparsity", "menu", "policy", "miss" (the replays behind
it), "chosen_miss", "traces", "command", "commit", "date"}; SpinConfig(sparsity_profile=...) takes the list.
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

MENU = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", action="append", default=[], metavar="DIR", required=True,
                        help="directory of traces (searched recursively; repeat for more)")
    parser.add_argument("--sparsity", type=float, default=0.4, help="the mean sparsity over the layers (default 0.4)")
    parser.add_argument("--menu", type=float, nargs="+", default=list(MENU),
                        help="evenly spaced sparsities a layer may take (default 0.1 ... 0.7)")
    parser.add_argument("--policy", default="spin-default", help="the policy whose miss is balanced (default "
                        "spin-default)")
    parser.add_argument("--batch", type=int, default=4, help="traces per replay batch")
    if not any(f in parser._option_string_actions for f in ("--out",)):
        parser.add_argument("--out", default=None, metavar="DIR",
                            help="output directory of profile.json (default runs/calibrate)")


def run(args) -> int:
    from ..checks import check_int
    from ..eval.calibrate import calibrate
    from ..predictor.policies import get_policy
    from ..traces import list_traces, load_trace
    from .eval import _commit
    from .main import check_out_dir

    out = Path(args.out or "runs/calibrate")
    check_int("--batch", args.batch, low=1)
    check_out_dir("--out", str(out))
    config = get_policy(args.policy, args.sparsity)  # an unknown policy or a sparsity out of range: refused here
    traces = []
    for d in args.traces:
        if not Path(d).is_dir():
            raise FileNotFoundError(f"--traces {d}: not a directory")
        files = list_traces(d)
        if not files:
            raise FileNotFoundError(f"--traces {d}: no <name>.safetensors with a <name>.json beside it")
        traces += [load_trace(f, validate=True) for f in files]
    result = calibrate(traces, config, args.sparsity, args.menu, device=args.device or "cpu", max_batch=args.batch)
    record = {"sparsity_profile": result.profile, **result.to_dict(), "policy": args.policy,
              "traces": [t.name for t in traces], "command": "spin-indexer " + " ".join(getattr(args, "argv", [])),
              "commit": _commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    record.pop("profile")
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(record, indent=1) + "\n")
    layers = len(result.profile)
    uniform = [m for m in result.menu if abs(m - result.sparsity) < 1e-9]
    line = f"calibrate: {layers} layers, mean sparsity {result.sparsity:g}; predicted mean miss " \
           f"{sum(result.chosen_miss) / layers:.2%}"
    if uniform:
        row = result.miss[result.menu.index(uniform[0])]
        line += f" (uniform {sum(row) / layers:.2%})"
    print(f"{line}; wrote {out / 'profile.json'}")
    return 0


def load_profile(path: str) -> tuple[float, ...]:
    """The sparsity_profile of a calibrate output (or a JSON list of floats) at `path`."""
    data = json.loads(Path(path).read_text())
    profile = data.get("sparsity_profile") if isinstance(data, dict) else data
    if not isinstance(profile, list) or not profile:
        raise ValueError(f"--sparsity-profile {path}: expected a calibrate output (a 'sparsity_profile' list) or a "
                         f"JSON list of floats")
    return tuple(profile)
