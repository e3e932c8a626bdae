"""`dhp train [CONFIG.yaml] [key=value ...]`: the main job (default: the packaged demo, dhp_jax/train/configs/demo.yaml).

jax is imported only inside `run`, after XLA_FLAGS has been set for the fake CPU devices the
config asks for (the flag only works before jax's first import).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

from dhp_jax.train.train_config import ConfigError, checkpoint_path, compilation_cache_path, load_config


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                        help="a `kind: train` YAML (default: the embedded demo) and dotted overrides, "
                             "e.g. steps=10 optim.learning_rate=1e-3")
    parser.add_argument("--strategy", help="planner strategy (dhp, static-ring:best, static-ring:4, ...); "
                                           "same as planner.strategy=...")
    parser.add_argument("--plan-file", help="replay plans from a file (.json or a run's plans.jsonl)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in an output directory that holds an earlier run's checkpoints "
                             "(they are deleted); without it such a run is refused")
    parser.add_argument("--out", help="output directory (same as metrics.out_dir=...)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the config, devices, plan file and the first plan; run no step")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (only JSON on stdout)")
    dist = parser.add_argument_group("multi-process (jax.distributed; default: from DHP_*, JAX_* or SLURM env)")
    dist.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordinator")
    dist.add_argument("--num-processes", type=int, help="processes in the run (one per host, usually)")
    dist.add_argument("--process-id", type=int, help="this process's index, 0..num_processes-1")
    dist.add_argument("--step-timeout", type=float, default=300.0, metavar="S",
                      help="seconds a process waits for its peers (joining, each step's plan agreement and "
                           "device work) before it fails naming the step and the missing process, and for a "
                           "step's group programs before it ends naming them")


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


def run(args: argparse.Namespace) -> int:
    config_path, overrides = _split_args(list(args.args))
    if args.strategy:
        overrides.append(f"planner.strategy={args.strategy}")
    if args.plan_file:
        overrides.append(f"planner.plan_file={args.plan_file}")
    if args.out:
        overrides.append(f"metrics.out_dir={args.out}")
    try:
        config = load_config(config_path, overrides, check_paths=True)   # input paths first, before jax
    except ConfigError as e:
        print(f"dhp train: config error: {e}", file=sys.stderr)
        return 2
    from dhp_jax.train.distributed import DistributedError, PlanMismatchError, describe, initialize, resolve
    from dhp_jax.train.rundir import RunDir, RunLockedError, checkpoint_lock

    try:
        dist = resolve(args.coordinator, args.num_processes, args.process_id)
        if dist is not None and config.devices.platform == "cpu" and config.devices.count % dist.num_processes:
            raise DistributedError(f"devices.count={config.devices.count} does not split evenly over "
                                   f"{dist.num_processes} processes")
    except DistributedError as e:
        print(f"dhp train: {e}", file=sys.stderr)
        return 2
    # One run at a time in a run directory, refused here, before jax is imported: each process
    # locks what it writes (process 0 the directory, process k its process-k/), held to the end.
    # A checkpoint.dir outside the run directory is locked too (process 0), and released with it.
    process = dist.process_id if dist else 0
    run_dir = RunDir(config.metrics.out_dir, process)
    try:
        if args.dry_run:
            run_dir.check_free()
            checkpoint_lock(config.metrics.out_dir, checkpoint_path(config), process, dry_run=True)
        else:
            cache = compilation_cache_path(config.compilation_cache, config.metrics.out_dir)
            run_dir.track(config.metrics.out_dir, checkpoint_path(config), *([cache] if cache else []))
            run_dir.acquire()
            run_dir.attach(checkpoint_lock(config.metrics.out_dir, checkpoint_path(config), process))
    except RunLockedError as e:
        run_dir.release()
        print(f"dhp train: {e}", file=sys.stderr)
        return 2
    try:
        return _run_locked(args, config, dist, run_dir)
    except KeyboardInterrupt:    # Ctrl-C while jax is imported or the processes join: nothing ran
        _say_interrupted(None, args)
        sys.stdout.flush()
        sys.stderr.flush()
        run_dir.release()
        os._exit(130)            # no interpreter teardown: a half-imported jaxlib can crash in it
    finally:
        run_dir.release()


def _run_locked(args: argparse.Namespace, config: Any, dist: Any, run_dir: Any) -> int:
    """`run` once the run directory is this process's: join the other processes, train, report."""
    from dhp_jax.train.distributed import DistributedError, PlanMismatchError, describe, initialize

    if config.metrics.progress or args.dry_run:
        # said at once: importing jax and planning the first batch take seconds before the run's own line
        # (one write, newline included: a Ctrl-C cannot land between the line and its end)
        print(f"dhp train: {'checking' if args.dry_run else 'starting'} {config.name!r} "
              f"({config.num_ranks} ranks on {config.devices.count} {config.devices.platform} devices): importing jax, "
              f"planning the first batch ...\n", end="", file=sys.stderr, flush=True)
    from dhp_jax.train.interrupt import held_sigint

    with held_sigint():   # a Ctrl-C while jax is imported stops the run once the import is whole
        if config.devices.platform == "cpu":
            # devices.count is the run's total; each process creates its share of fake CPU devices
            from dhp_jax.devices import force_cpu_devices

            force_cpu_devices(config.devices.count // (dist.num_processes if dist else 1))
        import jax  # noqa: F401
    if dist is not None:
        # Said before joining: if a process never comes, jax's runtime ends this one after the
        # timeout with its own message (DEADLINE_EXCEEDED on RegisterTask), and this line says why.
        print(f"dhp train: {describe(dist)}: joining, waiting up to {int(args.step_timeout)} s for all "
              f"{dist.num_processes} processes", file=sys.stderr, flush=True)
        try:
            initialize(dist, timeout_s=int(args.step_timeout))
        except DistributedError as e:
            print(f"dhp train: {e}", file=sys.stderr)
            return 2

    with held_sigint():
        from dhp_jax.train.checkpoint import CheckpointError
        from dhp_jax.train.interrupt import RunInterrupted
        from dhp_jax.train.metrics import MetricsError
        from dhp_jax.train.plans import PlanFileError
        from dhp_jax.train.step_sync import WATCHDOG_EXIT_CODE
        from dhp_jax.train.trainer import StepStalled, TrainError, Trainer, check_resumable, dry_run

    try:
        if args.dry_run:
            report = dry_run(config)
            print(json.dumps(report, indent=2) if args.json else _format_dry_run(report))
            return 0
        if args.resume and args.overwrite:
            raise TrainError("--resume continues a run and --overwrite replaces it: give one of them")
        if args.resume:
            check_resumable(config)   # before the Trainer creates its compilation cache directory
        trainer = Trainer(config, step_timeout_s=args.step_timeout)
        result = trainer.run(resume=args.resume, overwrite=args.overwrite)
    except (RunInterrupted, KeyboardInterrupt) as e:
        _say_interrupted(e if isinstance(e, RunInterrupted) else None, args)
        sys.stdout.flush()
        sys.stderr.flush()
        run_dir.release()   # os._exit skips the caller's finally: no empty folder of this run left behind
        # a compile may still run on a worker thread (XLA cannot cancel one): do not wait for it
        os._exit(130)
    except PlanMismatchError as e:
        # every process is alive and raised the same error: a normal exit, through jax.distributed's
        # shutdown barrier, so process 0 (the coordinator) does not vanish under the others
        print(f"dhp train: {e}", file=sys.stderr)
        return 2
    except DistributedError as e:
        print(f"dhp train: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        run_dir.release()
        # A peer is gone: jax.distributed's shutdown barrier would wait for it; end now instead.
        os._exit(3)
    except StepStalled as e:
        print(f"dhp train: {e}; ending the process (its device work cannot be cancelled)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        run_dir.release()
        os._exit(WATCHDOG_EXIT_CODE)
    except (TrainError, PlanFileError, CheckpointError, ConfigError, MetricsError) as e:
        print(f"dhp train: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.summary, indent=2, default=str))
    elif result.summary:
        try:
            print("\n".join(format_summary(result.summary)))
        except KeyError:  # a finished run's summary.json from an older version: said so on stderr already
            pass
    return 0


def _say_interrupted(e: Any, args: argparse.Namespace) -> None:
    """One line: where the run stopped and the command that continues it."""
    again = ["dhp", "train", *args.args] + [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                                            ("strategy", "plan_file", "out") if getattr(args, k)]
    if e is not None and e.checkpoint:
        print(f"dhp train: interrupted after step {e.step} of {e.total}, checkpoint {e.checkpoint}"
              + (f" ({e.detail})" if e.detail else "") + f"; resume with: {shlex.join(again + ['--resume'])}",
              file=sys.stderr)
    else:
        flag = ["--resume"] if args.resume else ["--overwrite"] if args.overwrite else []
        print("dhp train: interrupted before a step finished, nothing new saved; run again with: "
              + shlex.join(again + flag), file=sys.stderr)


def _format_dry_run(r: dict) -> str:
    return (f"config {r['name']!r} ok: {r['num_ranks']} ranks on {r['devices']}; first batch "
            f"{r['batch_samples']} samples / {r['batch_tokens']} tokens; plan ({r['strategy']}) degrees "
            f"{r['degrees']}; cost model: {r['cost_model']}")


def _seconds(x: float) -> str:
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.1f} s"


def _executables(s: dict[str, Any]) -> str:
    """'15 group programs', or with some loaded from another device set's compile:
    '15 group executables: 8 compiled, 7 loaded onto other devices'."""
    n, loaded = s.get("num_compiles"), int(s.get("num_rebound") or 0)
    if not loaded:
        return f"{n} group programs"
    return f"{n} group executables: {n - loaded} compiled, {loaded} loaded onto other devices"


def format_summary(s: dict[str, Any]) -> list[str]:
    from dhp_jax.train.compare import format_comparison

    label = s.get("labels", {}).get("step_time", "")
    lines = [f"run {s['name']!r}: {s['steps_run']} steps on {s['devices']}"
             + (f" ({label.split('; ', 1)[1]})" if "; " in label else "")]
    if s.get("planning"):
        lines.append(f"plans ({s['planning']})")
    groups = {int(d): n for d, n in s.get("groups_by_degree", {}).items()}
    if groups:
        odd = [d for d in groups if d & (d - 1)]
        lines.append("groups run: " + ", ".join(f"{n} of degree {d}" for d, n in sorted(groups.items()))
                     + (f" ({', '.join(map(str, odd))}: not powers of two)" if odd else ""))
    lines.append(f"loss {s['loss_first']:.4f} -> {s['loss_last']:.4f} "
                 f"(mean of first/last few steps: {s['loss_first_mean']:.4f} -> {s['loss_last_mean']:.4f})")
    # time: step work apart from compiles and the end comparison
    t = s["time_s"]
    first = f", the first {_seconds(t['first_step'])} with its one-off jit of the update" if t.get("first_step") else ""
    parts = [f"{s['steps_run']} steps {_seconds(t['steps'])} (median step {_seconds(s['step_time_median_s'])}{first})",
             f"compiles {_seconds(t['compiles'])} ({_executables(s)})"]
    if t.get("comparison") is not None:
        parts.append(f"comparison {_seconds(t['comparison'])}")
    lines.append("time: " + ", ".join(parts) + f"; wall {_seconds(t['wall'])}")
    lines.append(f"planning: {_seconds(s['plan_solve_median_s'])} median per batch in the planner thread; "
                 f"wait per step in steady state median {s['plan_wait_median_s'] * 1e3:.2f} ms, "
                 f"max {s['plan_wait_max_steady_s'] * 1e3:.2f} ms")
    if s.get("data"):   # fine-tuning: the records, the skipped ones, the measured wait for decoded batches
        d = s["data"]
        lines.append(f"data: {d['samples']} records, {d['epochs']:.2f} epochs; {d['skipped']} skipped"
                     + (f" ({', '.join(f'{n} {k}' for k, n in sorted(d['skipped_by_kind'].items()))}; listed in "
                        f"{d['issues_file']})" if d["skipped"] else "")
                     + f"; wait for decoded data per step median {d['data_wait_median_s'] * 1e3:.2f} ms, "
                       f"max {d['data_wait_max_s'] * 1e3:.1f} ms")
    if s.get("steps_waiting_for_compile_after_warmup") is not None:
        wait = s.get("compile_wait_after_warmup_s") or {}
        lines.append(f"steps after the first {s['warmup_steps']} that waited for a compile: "
                     f"{s['steps_waiting_for_compile_after_warmup']}"
                     + (f" (median wait {_seconds(wait['median'])}, max {_seconds(wait['max'])})"
                        if s['steps_waiting_for_compile_after_warmup'] and wait else "")
                     + "; measured: each plan's programs compile in the background once it is planned, and "
                     f"{s.get('steps_on_compiled_substitutes', 0)} steps ran another plan than the planner's")
    if s.get("compare"):
        lines.extend(format_comparison(s["compare"]))
    if s.get("plan_png"):
        lines.append(f"plan of one simulated step (ranks x time): {s['plan_png']}")
    lines.append(f"metrics: {s['config']['metrics']['out_dir']}/metrics.jsonl, summary.json, plans.jsonl")
    return lines
