"""Experiment 9 (not in the paper): how DHP's speed-up over the best static baseline depends on the
inter-node bandwidth of the described cluster, everything else (preset, data, batches) fixed."""

from __future__ import annotations

from typing import Any, Callable


from experiments.common import best_static, run_strategies, save_figure
from dhp_jax.sim.cluster import Cluster


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    rows = []
    for model in p["models"]:
        for bw in p["inter_node_gbps"]:
            cluster = Cluster(nodes=p["nodes"], ranks_per_node=p["ranks_per_node"], model=model,
                              hardware=p["hardware"], inter_node_gbps=float(bw))
            runs = run_strategies(cluster, p["dataset"], p["strategies"], batch=p["batch"], steps=p["steps"],
                                  seed=seed, log=log)
            bs, bt = best_static(runs)
            rows.append({"model": model, "inter_node_gbps": float(bw), "dhp_step_s": runs["dhp"].mean_step_s,
                         "best_static": bs, "best_static_step_s": bt, "speedup": bt / runs["dhp"].mean_step_s,
                         "label": f"simulated ({p['hardware']} preset, inter-node {bw} GB/s per rank)"})
    summary = []
    for model in p["models"]:
        rs = [r for r in rows if r["model"] == model]
        summary.append(f"{model}: DHP speed-up over best static " +
                       ", ".join(f"{r['speedup']:.2f}x @ {r['inter_node_gbps']:g} GB/s" for r in rs))
    return {"label": f"simulated ({p['hardware']} preset, inter-node bandwidth varied)", "rows": rows,
            "summary": summary}


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for model in result["config"]["models"]:
        rs = [r for r in result["rows"] if r["model"] == model]
        ax.plot([r["inter_node_gbps"] for r in rs], [r["speedup"] for r in rs], "o-", label=model)
    ax.set_xscale("log", base=2)
    ax.axvline(12.5, color="grey", ls=":", lw=0.8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("inter-node GB/s per rank (preset: 12.5)")
    ax.set_ylabel("DHP speed-up over best static")
    save_figure(fig, path, f"{result['name']}: {result['label']}", ax=ax, fontsize=8, legend=True)
