"""`dhp bench planner`: solve-time median and p99 of "dhp" over (ranks, batch) sizes, per model preset
and built-in data mix (default: internvl3-8b on openvid; `--models all --datasets all` runs every one).

Each repeat plans a fresh batch of the mix (seed = repeat index) given as lengths + etas, the metadata a
loader hands the planner. "solve" is the solver alone for the whole global batch (the Plan's
`solve_ms`: micro-batch count search and split, packing, allocation, refinement, placement of every
micro-batch); "total" adds input checks, building the `Plan` and its validation. The targets
(`TARGETS_MS`) are medians of that per-batch solve time in thread CPU (`solve_cpu_ms`: what other load
on the machine does not inflate), with the slowest batch within `MAX_OVER_MEDIAN` times the median. The per-micro-batch figure (each plan's
solve time divided by its micro-batch count) is reported beside it for comparison with per-step
figures, never as the target. CPU-measured on this machine; the load average is recorded because a
shared machine slows every wall-clock figure (the thread CPU time is reported beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import numpy as np

from dhp_jax.data import make_dataset, sample_etas, sample_lengths
from dhp_jax.planner.api import plan_batch
from dhp_jax.planner.contract.plan import PlanningError
from dhp_jax.planner.cli_args import add_cost_args, cost_model

SIZES = ((8, 128), (64, 512), (256, 2048), (1024, 4096), (4096, 16384))
TARGETS_MS = {(64, 512): 5.0, (1024, 4096): 20.0}  # median solve thread-CPU time of one global batch
MAX_OVER_MEDIAN = 2.0  # the slowest batch of a size within this factor of its median
PAPER_MS = {(64, 128): 21.0, (64, 256): 44.0, (64, 512): 86.0}  # DHP paper's solver times at 64 NPUs


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=10, help="batches per size (default 10)")
    parser.add_argument("--sizes", default=None, help="override sizes as 'ranks:batch,...' (default 8:128,64:512,256:2048,1024:4096,4096:16384)")
    add_cost_args(parser, ranks_per_node=None)
    parser.add_argument("--strategy", default="dhp")
    parser.add_argument("--models", default=None, metavar="NAMES",
                        help="model presets, comma-separated, or 'all' (every preset); replaces --model")
    parser.add_argument("--datasets", default="openvid", metavar="NAMES",
                        help="built-in data mixes, comma-separated, or 'all' (default openvid)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def bench(sizes: tuple[tuple[int, int], ...] = SIZES, repeats: int = 10, model: str = "internvl3-8b",
          hardware: str = "ascend-910b", strategy: str = "dhp", cost: str | None = None,
          progress: bool = False, dataset: str = "openvid") -> dict[str, Any]:
    # lazy: `dhp bench --help` imports only the argument parsers
    cost = cost_model(cost or model, hardware)
    rows = []
    for ranks, batch in sizes:
        if progress:  # stderr: what is being timed, so a long size never looks like a hang
            print(f"dhp bench planner: {model} on {dataset}, {ranks} ranks, batch {batch}, {repeats} repeats ...",
                  file=sys.stderr, flush=True)
        solve, solve_cpu, total, cpu, mbs = [], [], [], [], []
        unplannable = 0
        for r in range(repeats):
            samples = make_dataset(dataset, batch, r)
            lengths, etas = sample_lengths(samples), sample_etas(samples)
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                plan = plan_batch(lengths, ranks, cost, strategy, etas=etas)
            except PlanningError:  # a sample longer than all ranks hold (long-tailed mixes on few ranks)
                unplannable += 1
                continue
            total.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.thread_time() - c0) * 1e3)
            solve.append(float(plan.solver["solve_ms"]))
            solve_cpu.append(float(plan.solver["solve_cpu_ms"]))
            mbs.append(len(plan.micro_batches))
        if not solve:
            rows.append({"ranks": ranks, "batch": batch, "repeats": repeats, "unplannable": unplannable})
            continue
        row = {"ranks": ranks, "batch": batch, "repeats": repeats, "unplannable": unplannable,
               "solve_ms_median": _pct(solve, 50), "solve_ms_p99": _pct(solve, 99),
               "solve_cpu_ms_median": _pct(solve_cpu, 50), "solve_cpu_ms_p99": _pct(solve_cpu, 99),
               "solve_cpu_ms_max": max(solve_cpu),
               "total_ms_median": _pct(total, 50), "total_ms_p99": _pct(total, 99),
               "total_cpu_ms_median": _pct(cpu, 50), "total_cpu_ms_p99": _pct(cpu, 99),
               "micro_batches_median": _pct(mbs, 50),
               "solve_ms_per_micro_batch_median": _pct([t / m for t, m in zip(solve, mbs)], 50),
               "solve_cpu_ms_per_micro_batch_median": _pct([t / m for t, m in zip(solve_cpu, mbs)], 50)}
        if (ranks, batch) in TARGETS_MS:
            row["target_ms"] = TARGETS_MS[(ranks, batch)]
        if (ranks, batch) in PAPER_MS:
            row["paper_solver_ms"] = PAPER_MS[(ranks, batch)]
        rows.append(row)
    return {"strategy": strategy, "model": model, "hardware": hardware, "dataset": dataset,
            "target": "median solve thread-CPU time (solve_cpu_ms) of one global batch: the whole solve, micro-batch "
                      f"split included; the slowest batch within {MAX_OVER_MEDIAN:g}x the median",
            "measured_on": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.processor() or platform.machine()})",
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "python": platform.python_version(), "results": rows}


def _names(arg: str | None, every: Any, default: str) -> list[str]:
    """A comma-separated list of names, or 'all' (every key of `every`); checked against `every`."""
    if not arg:
        return [default]
    names = list(every) if arg == "all" else [x.strip() for x in arg.split(",") if x.strip()]
    bad = [n for n in names if n not in every]
    if bad:
        raise ValueError(f"unknown name {bad[0]!r}; known: {', '.join(every)} (or 'all')")
    return names


def target_met(row: dict[str, Any]) -> bool:
    """Whether a row with a target meets it: median solve thread-CPU time <= the target, and the
    slowest batch within MAX_OVER_MEDIAN times the median."""
    return (row["solve_cpu_ms_median"] <= row["target_ms"]
            and row["solve_cpu_ms_max"] <= MAX_OVER_MEDIAN * row["solve_cpu_ms_median"])


def run(args: argparse.Namespace) -> int:
    from dhp_jax.data.datasets import DATASETS
    from dhp_jax.planner.cost.presets import MODELS

    sizes = SIZES
    if args.sizes:
        sizes = tuple(tuple(int(x) for x in s.split(":")) for s in args.sizes.split(","))  # type: ignore[misc]
    if args.repeats < 1:
        print("dhp bench planner: --repeats must be >= 1", file=sys.stderr)
        return 2
    try:
        models = _names(args.models, MODELS, args.model)
        datasets = _names(args.datasets, DATASETS, "openvid")
    except ValueError as e:
        print(f"dhp bench planner: {e}", file=sys.stderr)
        return 2
    outs, skipped = [], []
    for m in models:
        try:
            cost_model(args.cost or m, args.hardware)
        except ValueError as e:  # 'all' names presets too large for the hardware's memory
            if args.models != "all":
                print(f"dhp bench planner: {e}", file=sys.stderr)
                return 2
            skipped.append(f"{m} ({e})")
            continue
        outs += [bench(sizes, args.repeats, m, args.hardware, args.strategy, args.cost, progress=True, dataset=ds)
                 for ds in datasets]
    if args.json:
        print(json.dumps(outs[0] if len(outs) == 1 else outs, indent=2))
        return 0
    out = outs[0]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    load_text = (f"load average {', '.join(f'{x:.2f}' for x in load)} (1, 5, 15 min; {os.cpu_count()} CPUs)"
                 if load else "load average unknown")
    print(f"planner bench ({out['strategy']} on {out['hardware']}), CPU-measured on {out['measured_on']}, {load_text}")
    print("solve = solver wall time for the whole global batch (micro-batch split included); solve cpu = its "
          "thread CPU time (what other load does not inflate); total = plan_batch wall time (checks, Plan build, "
          "validation); per mb = median of solve / micro-batches (wall / cpu), for comparison only")
    print(f"target: {out['target']}")
    for line in skipped:
        print(f"skipped: {line}")
    missed = []
    for o in outs:
        print(f"{o['model']} on {o['dataset']}:")
        print(f"{'ranks':>6} {'batch':>6} {'solve med':>10} {'solve p99':>10} {'cpu med':>10} {'cpu max':>10} "
              f"{'total med':>10} {'total p99':>10} {'mbs':>4} {'per mb':>15}  target (solve cpu median, per batch)")
        for r in o["results"]:
            if "solve_ms_median" not in r:
                print(f"{r['ranks']:>6} {r['batch']:>6}  no batch fits these ranks ({r['unplannable']} of {r['repeats']})")
                continue
            tgt = ""
            if "target_ms" in r:
                met = target_met(r)
                tgt = f"<= {r['target_ms']:.0f} ms, max <= {MAX_OVER_MEDIAN:g}x: " + (
                    "met" if met else f"NOT met ({r['solve_cpu_ms_median']:.2f} ms, max {r['solve_cpu_ms_max']:.2f} ms)")
                if not met:
                    missed.append(f"{r['ranks']} ranks ({o['model']}, {o['dataset']})")
            per_mb = f"{r['solve_ms_per_micro_batch_median']:.2f}/{r['solve_cpu_ms_per_micro_batch_median']:.2f}ms"
            print(f"{r['ranks']:>6} {r['batch']:>6} {r['solve_ms_median']:>8.2f}ms {r['solve_ms_p99']:>8.2f}ms "
                  f"{r['solve_cpu_ms_median']:>8.2f}ms {r['solve_cpu_ms_max']:>8.2f}ms "
                  f"{r['total_ms_median']:>8.2f}ms {r['total_ms_p99']:>8.2f}ms {r['micro_batches_median']:>4.0f} "
                  f"{per_mb:>15}  {tgt}" + (f" ({r['unplannable']} batches fit no plan)" if r["unplannable"] else ""))
    if missed:
        print(f"target not met at {', '.join(missed)} (thread CPU time: the solver's own, though a machine whose "
              f"cores are shared slows it too)")
    return 0
