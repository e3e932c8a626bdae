"""Experiment 6: the group configurations DHP chooses for one openvid and one msrvtt batch at 32
ranks, against the best static configuration, in the paper's table form (degree x group count)."""

from __future__ import annotations

from typing import Any, Callable

from experiments.common import STATIC, best_static, degree_multiset, run_strategies, save_figure, simulated_label
from dhp_jax.sim.cluster import Cluster


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    cluster = Cluster(nodes=p["nodes"], ranks_per_node=p["ranks_per_node"], model=p["model"], hardware=p["hardware"])
    rows = []
    for ds in p["datasets"]:
        runs = run_strategies(cluster, ds, p["strategies"], batch=p["batch"], steps=1, seed=seed, log=log)
        dhp = runs["dhp"]
        bs, bt = best_static(runs)
        static_mbs = runs[bs].degrees[0]
        rows.append({
            "dataset": ds, "label": simulated_label(cluster),
            "baseline": bs, "baseline_config": f"<{static_mbs[0][0]}>x{len(static_mbs[0])}",
            "baseline_micro_batches": len(static_mbs), "baseline_step_s": bt,
            "dhp_micro_batches": [degree_multiset(mb) for mb in dhp.degrees[0]],
            "dhp_step_s": dhp.mean_step_s, "speedup": bt / dhp.mean_step_s,
            "step_s": {s: r.mean_step_s for s, r in runs.items() if s in STATIC or s == "dhp"},
        })
    summary = [f"{r['dataset']}: baseline {r['baseline_config']} ({r['baseline_micro_batches']} micro-batches); DHP "
               f"{' | '.join(r['dhp_micro_batches'][:3])}{' ...' if len(r['dhp_micro_batches']) > 3 else ''}"
               f" ({len(r['dhp_micro_batches'])} micro-batches) -> {r['speedup']:.2f}x" for r in rows]
    return {"label": simulated_label(cluster), "rows": rows, "summary": summary}


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, r in zip(axes[0], rows):
        # Histogram of the degrees DHP used across the batch's micro-batches.
        degs: dict[int, int] = {}
        for mb in r["dhp_micro_batches"]:
            for part in mb.split(", "):
                d, c = part.split("x")
                degs[int(d)] = degs.get(int(d), 0) + int(c)
        ks = sorted(degs)
        ax.bar([str(k) for k in ks], [degs[k] for k in ks])
        ax.set_xlabel("CP degree")
        ax.set_ylabel("groups in the batch")
        ax.set_title(f"{r['dataset']}: DHP {r['speedup']:.2f}x over {r['baseline_config']}", fontsize=9)
    save_figure(fig, path, f"{result['name']}: {result['label']}", fontsize=8)
