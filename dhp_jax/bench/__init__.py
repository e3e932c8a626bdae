"""`dhp bench TARGET`: benchmarks live here, never in timed tests.

A target that measures one part lives in that part's package (the planner's solve time, the
executor's overhead, the data loaders, the compiled memory of a group program); the benchmarks of
the whole stack live in this room (`attention`: the ring kernel inside the demo's training steps;
`compiles`: plans of real batches and the programs they compile; `memory --step`: a whole training
step, optimizer update included). Each target module exposes `configure(parser)` / `run(args)`,
and only the chosen target's module is imported, so `dhp bench planner` never imports jax and a
target module imports what it measures at the top.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

TARGETS: dict[str, tuple[str, str]] = {
    "planner": ("dhp_jax.planner.bench", "solve time median/p99 over (ranks, batch) sizes"),
    "executor": ("dhp_jax.sharding.bench", "host overhead of a DHP step on the local devices"),
    "manifest": ("dhp_jax.data.manifest_bench", "manifest lines parsed per second"),
    "data": ("dhp_jax.data.loader_bench", "fine-tuning loader: samples/s and tokens/s of images and short videos"),
    "attention": ("dhp_jax.bench.attention",
                  "ring attention: temp memory, computed tiles, step time vs the earlier ring; --device-check"),
    "memory": ("dhp_jax.bench.step_memory",
               "compiled bytes of the group program (--step: of a whole step) vs the CostModel memory"),
    "ulysses": ("dhp_jax.sharding.ulysses_bench", "temp memory per device of Ulysses/hybrid vs ring group programs"),
    "compiles": ("dhp_jax.bench.compiles", "programs, executables per process and padding of DHP plans"),
    "load": ("dhp_jax.sharding.load_bench",
             "peak host memory of loading a synthetic >= 1B-param bf16 checkpoint into the sharded state"),
}


class _ChosenTarget(argparse._SubParsersAction):
    """Subcommands whose options the chosen target's module adds when it is chosen (argparse calls
    this action with the target's name and the arguments after it, `--help` included)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        name = values[0]
        if name in TARGETS and name not in self.configured:
            self.configured.add(name)
            importlib.import_module(TARGETS[name][0]).configure(self.choices[name])
        super().__call__(parser, namespace, values, option_string)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.register("action", "chosen_target", _ChosenTarget)
    sub = parser.add_subparsers(dest="target", metavar="TARGET", required=True, action="chosen_target")
    sub.configured = set()
    for name, (module, help_text) in TARGETS.items():
        sub.add_parser(name, help=help_text, description=help_text)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(TARGETS[args.target][0]).run(args) or 0)
