"""Experiment 8: ablations of DHP: no packing, power-of-two degrees only, placement that ignores
nodes, a fixed micro-batch count, no refinement; each against full DHP on the same batches."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from dhp_jax.sim.cluster import Cluster
from dhp_jax.sim.simulate import make_batches, simulate
from experiments.common import save_figure


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    from dhp_jax.planner import PlanningError

    cluster = Cluster(nodes=p["nodes"], ranks_per_node=p["ranks_per_node"], model=p["model"], hardware=p["hardware"])
    cost = cluster.cost_model()
    if "full" not in p["variants"]:
        raise ValueError("ablations config: `variants` must contain 'full' (the reference)")
    rows = []
    for ds in p["datasets"]:
        batches = make_batches(ds, p["batch"], p["steps"], seed, cluster.vision)
        ref = None
        for name, opts in p["variants"].items():
            row: dict[str, Any] = {"dataset": ds, "variant": name, "options": opts,
                                   "label": f"simulated ({p['hardware']} preset, {p['model']}, "
                                            f"{cluster.nodes}x{cluster.ranks_per_node} ranks)"}
            try:
                r = simulate(cluster, batches, "dhp", cost=cost, plan_options=opts)
            except PlanningError as e:  # e.g. one micro-batch cannot hold the batch in memory
                row["infeasible"] = str(e)
                rows.append(row)
                log(f"{ds:>10} {name:<26} infeasible: {e}")
                continue
            row.update(step_s=r.mean_step_s, utilisation=float(r.utilisation.mean()),
                       micro_batches=float(r.num_micro_batches.mean()),
                       plan_wall_ms=float(np.median(r.plan_wall_ms)))
            if name == "full":
                ref = r.mean_step_s
            rows.append(row)
            log(f"{ds:>10} {name:<26} {r.mean_step_s:8.3f} s/step")
        for row in rows:
            if row["dataset"] == ds and "step_s" in row and ref:
                row["slowdown_vs_full"] = row["step_s"] / ref
    summary = [f"{r['dataset']} {r['variant']}: " + (f"{r['slowdown_vs_full']:.3f}x the full DHP step time"
                                                     if "slowdown_vs_full" in r else "infeasible")
               for r in rows if r["variant"] != "full"]
    return {"label": f"simulated ({p['hardware']} preset)", "rows": rows, "summary": summary}


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "slowdown_vs_full" in r]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / max(1, len(datasets))
    x = np.arange(len(variants))
    for i, ds in enumerate(datasets):
        vals = [next((r["slowdown_vs_full"] for r in rows if r["dataset"] == ds and r["variant"] == v), np.nan)
                for v in variants]
        ax.bar(x + i * w, vals, w, label=ds)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x + w * (len(datasets) - 1) / 2)
    ax.set_xticklabels(variants, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("step time / full DHP")
    save_figure(fig, path, f"{result['name']}: {result['label']}", ax=ax, fontsize=9, legend=True)
