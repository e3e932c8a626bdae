"""Experiment 10: what DHP gains by choosing each group's attention kind (ring, Ulysses, or Ulysses
inside a node x ring across) over DHP with every group on the ring, at experiment 1's settings
(six models x three video mixes, 64 ranks, the same batches for both). `variants` re-run it with
cost-model overrides, e.g. hardware whose ring traffic does not overlap the attention."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import numpy as np

from dhp_jax.data import sample_etas, sample_lengths
from dhp_jax.planner import plan_batch
from dhp_jax.planner.cost.pricing import step_time
from dhp_jax.sim.cluster import Cluster
from dhp_jax.sim.simulate import make_batches
from experiments.common import save_figure


def _family(kind: str) -> str:
    return "hybrid" if kind.startswith("hybrid:") else kind


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    rows = []
    for variant, overrides in p["variants"].items():
        for model in p["models"]:
            cluster = Cluster(nodes=p["nodes"], ranks_per_node=p["ranks_per_node"], model=model,
                              hardware=p["hardware"], freeze_vision=p["freeze_vision"])
            cost = cluster.cost_model().replace(**overrides)
            for ds in p["datasets"]:
                rows.append(_row(p, seed, cluster, cost, ds, variant, overrides))
                r = rows[-1]
                log(f"{variant:>28} {model:>15} {ds:>10}  dhp {r['step_s']['dhp']:8.3f} s  ring-only "
                    f"{r['step_s']['dhp ring-only']:8.3f} s  x{r['speedup']:.3f}  kinds {r['multi_rank_groups']}")
    summary = []
    for variant in p["variants"]:
        sp = [r["speedup"] for r in rows if r["variant"] == variant]
        summary.append(f"{variant}: DHP with per-group attention over DHP ring-only: {min(sp):.3f}x - "
                       f"{max(sp):.3f}x over {len(sp)} settings (median {np.median(sp):.3f}x)")
    return {"label": f"simulated ({p['hardware']} preset)", "rows": rows, "summary": summary}


def _row(p: dict[str, Any], seed: int, cluster: Cluster, cost: Any, ds: str, variant: str,
         overrides: dict[str, Any]) -> dict[str, Any]:
    best, ring, kinds = [], [], Counter()
    for batch in make_batches(ds, p["batch"], p["steps"], seed, cluster.vision):
        lengths, etas = sample_lengths(batch), sample_etas(batch)
        chosen = plan_batch(batch, cluster.num_ranks, cost)                     # per-group choice
        ring_only = plan_batch(batch, cluster.num_ranks, cost, attention="ring")
        best.append(step_time(chosen, lengths, cost, etas))
        ring.append(step_time(ring_only, lengths, cost, etas))
        kinds.update(_family(g.attention) for g in chosen.groups if g.degree > 1)
    return {"variant": variant, "cost_overrides": dict(overrides), "model": cluster.model, "dataset": ds,
            "label": f"simulated ({p['hardware']} preset, {cluster.nodes}x{cluster.ranks_per_node} ranks)",
            "step_s": {"dhp": float(np.mean(best)), "dhp ring-only": float(np.mean(ring))},
            "speedup": float(np.mean(ring) / np.mean(best)), "multi_rank_groups": dict(sorted(kinds.items()))}


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    multi = len({r["variant"] for r in rows}) > 1
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows) + 2), 3.5))
    ax.bar(np.arange(len(rows)), [r["speedup"] for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(rows)))
    ax.set_xticklabels([f"{r['model']}\n{r['dataset']}" + (f"\n{r['variant']}" if multi else "") for r in rows],
                       rotation=90, fontsize=6)
    ax.set_ylabel("ring-only step / per-group-choice step")
    save_figure(fig, path, f"{result['name']}: {result['label']}", ax=ax, fontsize=9)
