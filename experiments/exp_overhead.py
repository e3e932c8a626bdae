"""Experiment 4: scheduler overhead measured on this machine: solver and whole-scheduling time vs
global batch size and ranks (the paper's table: 21/44/86 ms solver, 468/684/921 ms scheduling at
64 NPUs and GBS 128/256/512, on its host CPU).

"Solver" is the planner's own `solve_ms` (packing + degree allocation + placement). "Scheduling" is
everything a rank-0 scheduler does for one global batch here: read lengths and vision shares from the
samples' metadata, plan, validate the plan against the batch and the memory budget, and serialise it
to the JSON that would be broadcast. The step time beside it is simulated (cost-model preset).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from experiments.runner import describe_machine
from dhp_jax.sim.cluster import Cluster
from dhp_jax.sim.simulate import evaluate, make_batches
from experiments.common import save_figure


def _schedule(samples: list[Any], cluster: Cluster, cost: Any, strategy: str) -> tuple[float, float, Any, list[int], list[float]]:
    from dhp_jax.data import sample_etas, sample_lengths
    from dhp_jax.planner import plan_batch
    from dhp_jax.planner.cost.plan_check import check_plan

    t0 = time.perf_counter()
    lengths, etas = sample_lengths(samples), sample_etas(samples)
    plan = plan_batch(samples, cluster.num_ranks, cost, strategy, ranks_per_node=cluster.ranks_per_node)
    check_plan(plan, cost, lengths, num_samples=len(samples))
    payload = plan.to_json()
    wall = (time.perf_counter() - t0) * 1e3
    assert payload  # serialised: what a rank-0 scheduler broadcasts
    return float(plan.solver.get("solve_ms", np.nan)), wall, plan, lengths, etas


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    rows = []
    where = describe_machine()
    for ranks, batch in p["points"]:
        cluster = Cluster.with_ranks(int(ranks), p["ranks_per_node"], model=p["model"], hardware=p["hardware"])
        cost = cluster.cost_model()
        batches = make_batches(p["dataset"], int(batch), p["repeats"] + 1, seed, cluster.vision)
        _schedule(batches[0], cluster, cost, p["strategy"])  # warm-up: imports, caches
        solve, sched, step = [], [], []
        for samples in batches[1:]:
            s, w, plan, lengths, etas = _schedule(samples, cluster, cost, p["strategy"])
            solve.append(s)
            sched.append(w)
            step.append(evaluate(plan, lengths, cost, etas).step_s)
        row = {"ranks": int(ranks), "batch": int(batch), "repeats": len(solve),
               "solver_ms_median": float(np.median(solve)), "solver_ms_max": float(np.max(solve)),
               "scheduling_ms_median": float(np.median(sched)), "scheduling_ms_max": float(np.max(sched)),
               "sim_step_s_mean": float(np.mean(step)),
               "scheduling_share_of_step": float(np.median(sched) / 1e3 / np.mean(step)),
               "label": f"measured ({where}); step time simulated ({p['hardware']} preset)"}
        rows.append(row)
        log(f"{ranks:>5} ranks batch {batch:>6}: solver {row['solver_ms_median']:8.1f} ms, scheduling "
            f"{row['scheduling_ms_median']:8.1f} ms (median of {len(solve)}), simulated step {row['sim_step_s_mean']:.2f} s")
    summary = [f"{r['ranks']} ranks / GBS {r['batch']}: solver {r['solver_ms_median']:.1f} ms, scheduling "
               f"{r['scheduling_ms_median']:.1f} ms" for r in rows]
    return {"label": f"measured ({where})", "rows": rows, "summary": summary}


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["solver_ms_median"] for r in rows], 0.4, label="solver (median)")
    ax.bar(x + 0.2, [r["scheduling_ms_median"] for r in rows], 0.4, label="whole scheduling (median)")
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r['ranks']} r\nGBS {r['batch']}" for r in rows], fontsize=7)
    ax.set_ylabel("ms (measured)")
    save_figure(fig, path, f"{result['name']}: {result['label']}", ax=ax, fontsize=8, legend=True)
