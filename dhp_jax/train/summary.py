"""What a finished run reports: `summary.json` (losses, where the time went, plan waits, compiles),
the summary a finished run left behind, and the Gantt of one simulated DHP step beside it."""

from __future__ import annotations

import collections
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from dhp_jax.train.plans import describe_cost

WARMUP_STEPS = 5  # steps allowed to compile in place (the summary counts later steps that waited)


def stored_summary(metrics_dir: Path) -> dict:
    """The `summary.json` an earlier run wrote in `metrics_dir` ({} when there is none)."""
    try:
        return json.loads((metrics_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def plot_simulated_step(comp: dict, metrics_dir: Path, process_index: int = 0) -> Path | None:
    """The Gantt of one simulated DHP step (ranks x time) beside the metrics, from the end comparison
    `comp` (its `_plan` is taken out on every process: the summary is JSON); drawn by process 0 only;
    None otherwise, without a plan, or without matplotlib."""
    plan = comp.get("simulated", {}).pop("_plan", None)
    if plan is None or process_index:
        return None
    try:
        from dhp_jax.planner.plot import plot_plan  # lazy: matplotlib is optional

        path = metrics_dir / "plan_simulated_step.png"
        sim = comp["simulated"]
        title = (f"DHP plan of one simulated step: {sim['model']} on {sim['hardware']}, {sim['ranks']} ranks, "
                 f"global batch {sim['batch_size']}")
        plot_plan(plan, path, title=title, allreduce_s=sim.get("allreduce_s", 0.0))
        return path
    except ImportError:
        return None


def run_summary(trainer: Any, records: list[dict], loop_s: float, start: int) -> dict:
    """The summary of `trainer`'s run over `records` (steps after `start`; the loop took `loop_s`
    seconds); {} without records (never a summary without real figures). `Trainer.run` adds the
    end comparison and the wall time."""
    cfg, devices = trainer.config, trainer.devices
    waits = [r["plan_wait_s"] for r in records]
    steady = waits[2:] if len(waits) > 3 else waits[1:]  # first steps: thread start + compiles
    losses = [r["loss"] for r in records]
    k = max(1, min(3, len(losses) // 4))
    groups = collections.Counter(d for r in records for mb in r["degrees"] for d in mb)
    after = [r.get("compile_wait_s", 0.0) for r in records if r["step"] > start + WARMUP_STEPS]
    waited = [w for w in after if w > 0]
    return {
        "name": cfg.name, "config": cfg.to_dict(), "model_config": trainer.model_config.to_dict(),
        "devices": f"{len(devices)} x {devices[0].platform} ({devices[0].device_kind})",
        "start_step": start, "steps_run": len(records),
        # where the time went: step work, compiles, the end comparison (filled in by run), the rest
        "time_s": {"steps": sum(r["step_time_s"] for r in records),
                   "compiles": sum(r.get("compile_s", 0.0) for r in records), "loop": loop_s,
                   "first_step": records[0]["step_time_s"] if start == 0 else None},
        "loss_first": losses[0], "loss_last": losses[-1],
        "loss_first_mean": float(np.mean(losses[:k])), "loss_last_mean": float(np.mean(losses[-k:])),
        "step_time_median_s": statistics.median(r["step_time_s"] for r in records),
        "plan_wait_median_s": statistics.median(steady) if steady else 0.0,
        "plan_wait_max_steady_s": max(steady) if steady else 0.0,
        "plan_solve_median_s": statistics.median(r["plan_solve_s"] for r in records),
        "num_compiles": trainer.executor.num_compiles,
        # of those executables, how many were a compiled program loaded onto other devices, not
        # compiled (`dhp_jax.sharding.rebind`; an executor without the count: none)
        "num_rebound": len(getattr(trainer.executor, "rebound_keys", ())),
        # measured: a step waited when a program it runs was not compiled yet when it started
        "steps_waiting_for_compile_after_warmup": len(waited),
        # (median and max over the steps that waited; median over every step after warm-up)
        "compile_wait_after_warmup_s": {"median": statistics.median(waited) if waited else 0.0,
                                        "max": max(waited, default=0.0),
                                        "median_all_steps": statistics.median(after) if after else 0.0},
        "warmup_steps": WARMUP_STEPS,
        # steps that ran another plan than the planner returned (plan digests compared): 0
        "steps_on_compiled_substitutes": sum(1 for r in records if r.get("ran_on_compiled_substitute")),
        "groups_by_degree": {str(d): n for d, n in sorted(groups.items())},
        "planning": f"{trainer.plan_source.label}: " + describe_cost(trainer.cost, cfg.planner.cost_profile,
                                                                  cfg.planner.full_size),
        "labels": {"step_time": f"measured on {len(devices)} {devices[0].platform} devices of this "
                                f"machine" + ("; they share the host's cores: a correctness and overhead run, "
                                              "not a speed-up" if devices[0].platform == "cpu" else "")},
    } if records else {}
