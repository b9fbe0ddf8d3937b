"""`spin-indexer calibrate`: a per-layer sparsity profile from traces (eval/calibrate.py).

    spin-indexer capture --prompts my_text.jsonl --context 8192 --steps 32 --out runs/traces/mine
    spin-indexer calibrate --traces runs/traces/mine --sparsity 0.3 0.4 0.5 --out runs/calibrate
    spin-indexer eval --traces runs/traces/other --sparsity-profile runs/calibrate/profile.json --sparsity 0.4
Writes OUT/profile.json: {"profiles": {"<sparsity>": [one entry a layer]}, "calibrations": {"<sparsity>": {menu,
miss (the replays behind it), chosen_miss}}, "policy", "traces", "command", "commit", "date"}. A profile is
calibrated for its sparsity: SpinConfig(sparsity=s, sparsity_profile=profiles[s]) (scaled to another sparsity it
was measured worse: benchmarks/NOTES.md, session 56), so eval and quality take the entry of their sparsity.
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path


def default_menu(sparsity: float) -> list[float]:
    """Sparsities a layer may take: sparsity - 0.3 ... sparsity + 0.3 in steps of 0.1, inside [0, 0.9]."""
    return [round(sparsity + d / 10, 10) for d in range(-3, 4) if 0 <= sparsity + d / 10 <= 0.9 + 1e-9]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", action="append", default=[], metavar="DIR", required=True,
                        help="directory of traces (searched recursively; repeat for more)")
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.4],
                        help="mean sparsities over the layers, one profile each (default 0.4)")
    parser.add_argument("--menu", type=float, nargs="+", default=None,
                        help="evenly spaced sparsities a layer may take (default: each target -0.3 ... +0.3 in "
                             "steps of 0.1, inside [0, 0.9])")
    parser.add_argument("--policy", default="spin-default", help="the policy whose miss is balanced (default "
                        "spin-default)")
    parser.add_argument("--batch", type=int, default=4, help="traces per replay batch")
    if "--out" not in parser._option_string_actions:  # main's shared parser may have added it
        parser.add_argument("--out", default=None, metavar="DIR",
                            help="output directory of profile.json (default runs/calibrate)")


def run(args) -> int:
    from ..checks import check_int
    from ..eval.calibrate import calibrate
    from ..predictor.policies import get_policy
    from .eval import _commit, load_trace_dir
    from .main import check_out_dir

    out = Path(args.out or "runs/calibrate")
    check_int("--batch", args.batch, low=1)
    check_out_dir("--out", str(out))
    configs = {s: get_policy(args.policy, s) for s in args.sparsity}  # an unknown policy or a bad sparsity: here
    traces = [trace for d in args.traces for trace in load_trace_dir(d)]
    profiles, calibrations, lines = {}, {}, []
    for s, config in configs.items():
        result = calibrate(traces, config, s, args.menu or default_menu(s), device=args.device or "cpu",
                           max_batch=args.batch)
        profiles[f"{s:g}"] = result.profile
        calibrations[f"{s:g}"] = {k: v for k, v in result.to_dict().items() if k not in ("profile", "sparsity")}
        layers = len(result.profile)
        line = f"{s:g}: predicted mean miss {sum(result.chosen_miss) / layers:.2%}"
        uniform = [i for i, m in enumerate(result.menu) if abs(m - s) < 1e-9]
        if uniform:
            line += f" (uniform {sum(result.miss[uniform[0]]) / layers:.2%})"
        lines.append(line)
    record = {"profiles": profiles, "calibrations": calibrations, "policy": args.policy,
              "traces": [t.name for t in traces], "command": "spin-indexer " + " ".join(getattr(args, "argv", [])),
              "commit": _commit(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"calibrate: {len(traces)} traces; {'; '.join(lines)}; wrote {out / 'profile.json'}")
    return 0
