"""Run experiment configs: `python -m experiments.run CONFIG.yaml [--tiny] [--out DIR] [--report] [key=value ...]`.

`python -m experiments.run --all` regenerates every result under experiments/results/; `--report`
then rewrites the tables of experiments/REPORT.md from them (`python -m experiments.report`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from experiments.runner import ConfigError, config_files, load_config, parse_override, run_experiment


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.run", description=__doc__)
    p.add_argument("configs", nargs="*", help="config YAMLs, then optional key=value overrides")
    p.add_argument("--all", action="store_true", help="every kind: experiment config in experiments/configs/")
    p.add_argument("--tiny", action="store_true", help="apply each config's tiny: block (seconds)")
    p.add_argument("--out", default=None, help="output folder (default experiments/results/)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--report", action="store_true",
                   help="then rewrite the REPORT.md tables from the results (python -m experiments.report)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_intermixed_args(argv)
    paths = [a for a in args.configs if "=" not in a]
    try:
        overrides = dict(parse_override(a) for a in args.configs if "=" in a)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.all:
        paths = [str(x) for x in config_files()] + paths
    if not paths:
        p.error("give config files or --all")
    for path in paths:
        try:
            exp = load_config(path, tiny=args.tiny, overrides=overrides)
        except (ConfigError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        print(f"== {exp.name} ({exp.kind}) from {path}", flush=True)
        res = run_experiment(exp, args.out, plot=not args.no_plot, log=lambda s: print("   " + s, flush=True))
        out = Path(args.out) if args.out else Path("experiments/results")
        print(f"   wrote {out / (exp.name + '.json')} in {time.perf_counter() - t0:.1f} s", flush=True)
        for line in res.get("summary", []):
            print("   " + line)
    if args.report:
        from experiments.report import update

        print(f"   updated the REPORT.md tables {', '.join(update())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
