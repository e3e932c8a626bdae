"""Experiments 1 and 2: end-to-end step time of DHP vs the best static baselines (and FlexSP-style),
for the six models x three video mixes (experiment 2: the same with the vision encoder frozen)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from experiments.common import LABELS, STATIC, best_static, run_strategies, save_figure, simulated_label
from dhp_jax.sim.bounds import lower_bound
from dhp_jax.sim.cluster import Cluster
from dhp_jax.sim.simulate import make_batches


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    rows = []
    for model in p["models"]:
        cluster = Cluster(nodes=p["nodes"], ranks_per_node=p["ranks_per_node"], model=model,
                          hardware=p["hardware"], freeze_vision=p["freeze_vision"])
        for ds in p["datasets"]:
            runs = run_strategies(cluster, ds, p["strategies"], batch=p["batch"], steps=p["steps"], seed=seed,
                                  log=log)
            row: dict[str, Any] = {"model": model, "dataset": ds, "label": simulated_label(cluster),
                                   "step_s": {s: r.mean_step_s for s, r in runs.items()},
                                   "utilisation": {s: float(r.utilisation.mean()) for s, r in runs.items()},
                                   "plan_wall_ms": {s: float(np.median(r.plan_wall_ms)) for s, r in runs.items()}}
            if any(s in runs for s in STATIC) and "dhp" in runs:
                bs, bt = best_static(runs)
                row["best_static"] = bs
                row["best_static_degrees"] = sorted({d for st in runs[bs].degrees for mb in st for d in mb})
                row["speedup_vs_best_static"] = bt / runs["dhp"].mean_step_s
            # What no plan can beat under this cost model: the best attainable speed-up over static.
            from dhp_jax.data import sample_etas, sample_lengths
            lbs = [lower_bound(sample_lengths(b), cluster.num_ranks, cluster.cost_model(), sample_etas(b)).step_s
                   for b in make_batches(ds, p["batch"], p["steps"], seed, cluster.vision)]
            row["lower_bound_s"] = float(np.mean(lbs))
            if "best_static" in row:
                row["max_attainable_speedup"] = bt / row["lower_bound_s"]
            if "flexsp" in runs and "dhp" in runs:
                row["speedup_vs_flexsp"] = runs["flexsp"].mean_step_s / runs["dhp"].mean_step_s
            rows.append(row)
    sp = [r["speedup_vs_best_static"] for r in rows if "speedup_vs_best_static" in r]
    frozen = " (vision encoder frozen)" if p["freeze_vision"] else ""
    summary = [f"DHP over best static{frozen}: {min(sp):.2f}x - {max(sp):.2f}x over {len(sp)} settings "
               f"(median {np.median(sp):.2f}x)"] if sp else []
    return {"label": f"simulated ({p['hardware']} preset)", "rows": rows, "summary": summary}


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    strategies = [s for s in result["config"]["strategies"] if s != "dhp"]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows) + 2), 4))
    x = np.arange(len(rows))
    w = 0.8 / max(1, len(strategies))
    for i, s in enumerate(strategies):
        vals = [r["step_s"][s] / r["step_s"]["dhp"] for r in rows]
        ax.bar(x + i * w, vals, w, label=f"{LABELS.get(s, s)} / DHP")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x + w * (len(strategies) - 1) / 2)
    ax.set_xticklabels([f"{r['model']}\n{r['dataset']}" for r in rows], rotation=90, fontsize=7)
    ax.set_ylabel("step time relative to DHP (higher = DHP faster)")
    save_figure(fig, path, f"{result['name']}: {result['label']}", ax=ax, fontsize=9, legend=True)
