"""The `dhp` command: one subcommand per job, each living in the package that owns it.

Only the chosen subcommand's module is imported, so `dhp plan` never pays for importing jax.
Each subcommand module exposes `configure(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("dhp_jax.planner.cli", "plan one batch with a strategy and compare with the static baselines"),
    "simulate": ("dhp_jax.sim.cli", "simulate step times of strategies on a described cluster"),
    "train": ("dhp_jax.train.cli", "train the multimodal model with DHP plans (default: the CPU demo)"),
    "profile": ("dhp_jax.train.profile_cli", "time group executables and fit the cost model"),
    "bench": ("dhp_jax.bench", "benchmarks: planner solve time, executor overhead, manifest speed, compiled memory"),
    "analyze": ("dhp_jax.sim.analyze_cli", "what DHP would do for a dataset manifest"),
}


def _parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dhp", description="Dynamic Hybrid Parallelism for multimodal LLMs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).configure(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = _parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
