"""The `dhp` command: one subcommand per job, each living in the package that owns it.

Only the chosen subcommand's module is imported, so `dhp plan` never pays for importing jax.
Each subcommand module exposes `configure(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from typing import Iterator, Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("dhp_jax.planner.plan_cli", "plan one batch with a strategy and compare with the static baselines"),
    "simulate": ("dhp_jax.sim.simulate_cli", "simulate step times of strategies on a described cluster"),
    "train": ("dhp_jax.train.train_cli", "train the multimodal model with DHP plans (default: the CPU demo)"),
    "profile": ("dhp_jax.train.profile_cli", "time group executables and fit the cost model"),
    "bench": ("dhp_jax.bench", "benchmarks: planner solve time, executor overhead, manifest speed, compiled memory"),
    "analyze": ("dhp_jax.sim.analyze_cli", "what DHP would do for a dataset manifest"),
    "example": ("dhp_jax.train.example", "write a tiny random checkpoint of a family and example data (offline)"),
    "export": ("dhp_jax.train.export", "a run's checkpoint as a Hugging Face checkpoint (safetensors)"),
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
    try:
        with _json_stdout(bool(getattr(args, "json", False))):
            return int(module.run(args) or 0)
    except BrokenPipeError:
        # the reader went away (`dhp plan --json | head`): end quietly, as a Unix filter does
        _silence_stdout()
        return 0


@contextlib.contextmanager
def _json_stdout(active: bool) -> Iterator[None]:
    """With --json, stdout carries only what Python prints: file descriptor 1 points at stderr
    meanwhile, so a native library's chatter (a solver's banner) can never corrupt the JSON."""
    if not active:
        yield
        return
    try:
        sys.stdout.flush()
        real_fd = sys.stdout.fileno() == 1
    except (OSError, ValueError, AttributeError):  # stdout is not a file (captured by a test)
        real_fd = False
    if not real_fd:
        yield
        return
    saved = os.dup(1)
    os.dup2(2, 1)
    real = sys.stdout
    sys.stdout = os.fdopen(os.dup(saved), "w", buffering=1)
    try:
        yield
    finally:
        out, sys.stdout = sys.stdout, real
        os.dup2(saved, 1)
        os.close(saved)
        try:
            out.flush()  # a closed pipe raises here, and main() ends quietly
        finally:
            with contextlib.suppress(OSError):
                out.close()


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
