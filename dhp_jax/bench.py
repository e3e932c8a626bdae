"""`dhp bench TARGET`: benchmarks live here, never in timed tests.

Each target lives in the package it measures and exposes `configure(parser)` / `run(args)`.
"""

from __future__ import annotations

import argparse
import importlib

TARGETS: dict[str, tuple[str, str]] = {
    "planner": ("dhp_jax.planner.bench", "solve time median/p99 over (ranks, batch) sizes"),
    "executor": ("dhp_jax.sharding.bench", "host overhead of a DHP step on the local devices"),
    "manifest": ("dhp_jax.data.manifest_bench", "manifest lines parsed per second"),
    "data": ("dhp_jax.data.loader_bench", "fine-tuning loader: samples/s and tokens/s of images and short videos"),
    "attention": ("dhp_jax.train.attention_bench",
                  "ring attention: temp memory, computed tiles, step time vs the earlier ring; --device-check"),
    "memory": ("dhp_jax.train.step_memory",
               "compiled bytes of the group program (--step: of a whole step) vs the CostModel memory"),
    "ulysses": ("dhp_jax.sharding.ulysses_bench", "temp memory per device of Ulysses/hybrid vs ring group programs"),
    "compiles": ("dhp_jax.train.compiles_bench", "programs, executables per process and padding of DHP plans"),
    "load": ("dhp_jax.sharding.load_bench",
             "peak host memory of loading a synthetic >= 1B-param bf16 checkpoint into the sharded state"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    for name, (module, help_text) in TARGETS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            importlib.import_module(module).configure(p)
        except ImportError:  # a target whose module is not built yet stays listed but unusable
            pass


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(TARGETS[args.target][0]).run(args) or 0)
