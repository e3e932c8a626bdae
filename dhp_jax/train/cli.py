"""`dhp train [CONFIG.yaml] [key=value ...]`: the main job (default: experiments/configs/demo.yaml).

jax is imported only inside `run`, after XLA_FLAGS has been set for the fake CPU devices the
config asks for (the flag only works before jax's first import).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                        help="a `kind: train` YAML (default: the embedded demo) and dotted overrides, "
                             "e.g. steps=10 optim.learning_rate=1e-3")
    parser.add_argument("--strategy", help="planner strategy (dhp, static-ring:best, static-ring:4, ...); "
                                           "same as planner.strategy=...")
    parser.add_argument("--plan-file", help="replay plans from a file (.json or a run's plans.jsonl)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--out", help="output directory (same as metrics.out_dir=...)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the config, devices, plan file and the first plan; run no step")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    config, overrides = None, []
    for a in items:
        if "=" in a:
            overrides.append(a)
        elif config is None:
            config = a
        else:
            raise SystemExit(f"dhp train: unexpected argument {a!r} (one config file, then key=value overrides)")
    return config, overrides


def force_cpu_devices(count: int) -> None:
    """Ask XLA for `count` fake host devices; effective only if jax has not been imported yet."""
    if "jax" in sys.modules:
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={count}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def run(args: argparse.Namespace) -> int:
    from dhp_jax.train.config import ConfigError, load_config

    config_path, overrides = _split_args(list(args.args))
    if args.strategy:
        overrides.append(f"planner.strategy={args.strategy}")
    if args.plan_file:
        overrides.append(f"planner.plan_file={args.plan_file}")
    if args.out:
        overrides.append(f"metrics.out_dir={args.out}")
    try:
        config = load_config(config_path, overrides)
    except ConfigError as e:
        print(f"dhp train: config error: {e}", file=sys.stderr)
        return 2
    if config.devices.platform == "cpu":
        force_cpu_devices(config.devices.count)

    from dhp_jax.train.checkpoint import CheckpointError
    from dhp_jax.train.metrics import MetricsError
    from dhp_jax.train.plans import PlanFileError
    from dhp_jax.train.trainer import TrainError, Trainer, dry_run

    try:
        if args.dry_run:
            report = dry_run(config)
            print(json.dumps(report, indent=2) if args.json else _format_dry_run(report))
            return 0
        trainer = Trainer(config)
        result = trainer.run(resume=args.resume)
    except (TrainError, PlanFileError, CheckpointError, ConfigError, MetricsError) as e:
        print(f"dhp train: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.summary, indent=2, default=str))
    else:
        print("\n".join(format_summary(result.summary)))
    return 0


def _format_dry_run(r: dict) -> str:
    return (f"config {r['name']!r} ok: {r['num_ranks']} ranks on {r['devices']}; first batch "
            f"{r['batch_samples']} samples / {r['batch_tokens']} tokens; plan ({r['strategy']}) degrees "
            f"{r['degrees']}")


def format_summary(s: dict[str, Any]) -> list[str]:
    from dhp_jax.train.compare import format_comparison

    lines = [f"run {s['name']!r}: {s['steps_run']} steps on {s['devices']} in {s['wall_time_s']:.1f} s "
             f"(measured wall time, compiles included)"]
    if s.get("loss_first") is not None:
        lines.append(f"loss {s['loss_first']:.4f} -> {s['loss_last']:.4f} "
                     f"(mean of first/last few steps: {s['loss_first_mean']:.4f} -> {s['loss_last_mean']:.4f})")
    if s.get("step_time_median_s") is not None:
        lines.append(f"median step {s['step_time_median_s'] * 1e3:.1f} ms; planning wait per step in steady state: "
                     f"median {s['plan_wait_median_s'] * 1e3:.2f} ms, max {s['plan_wait_max_steady_s'] * 1e3:.2f} ms "
                     f"(planning itself: median {s['plan_solve_median_s'] * 1e3:.2f} ms, in the planner thread); "
                     f"{s.get('num_compiles')} executables compiled")
    if s.get("compare"):
        lines.extend(format_comparison(s["compare"]))
    lines.append(f"metrics: {s['config']['metrics']['out_dir']}/metrics.jsonl, summary.json, plans.jsonl")
    return lines
