"""Experiment 10 (not in the paper): how DHP's speed-up over the best static baseline moves with the
share of long clips, a parameter no published statistic of the named datasets gives (openvid's and
internvid's tail shares are our choice). Everything else (mix body, preset, cluster, seed) fixed."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from dhp_jax.data.datasets import DATASETS, sample_mix
from dhp_jax.sim.cluster import Cluster
from dhp_jax.sim.simulate import simulate
from experiments.common import best_static, save_figure


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    rows = []
    for model in p["models"]:
        cluster = Cluster(nodes=p["nodes"], ranks_per_node=p["ranks_per_node"], model=model, hardware=p["hardware"])
        cost = cluster.cost_model()
        for name in p["datasets"]:
            base = DATASETS[name]
            for share in p["tail_shares"]:
                mix = dataclasses.replace(base, tail_share=float(share))
                batches = [sample_mix(mix, p["batch"], seed * 1_000_003 + i, vision=cluster.vision)   # make_batches
                           for i in range(p["steps"])]
                runs = {s: simulate(cluster, batches, s, cost=cost) for s in p["strategies"]}
                bs, bt = best_static(runs)
                dhp = runs["dhp"].mean_step_s
                rows.append({"model": model, "dataset": name, "tail_share": float(share),
                             "built_in": abs(float(share) - base.tail_share) < 1e-12, "dhp_step_s": dhp,
                             "best_static": bs, "best_static_step_s": bt, "speedup": bt / dhp,
                             "label": f"simulated ({p['hardware']} preset, {model}, {cluster.num_ranks} ranks)"})
                log(f"{model} {name} tail {share:.3f}: DHP {dhp:.3f} s, {bs} {bt:.3f} s, {bt / dhp:.2f}x")
    summary = [f"{m} {d}: DHP speed-up over best static " + ", ".join(
        f"{r['speedup']:.2f}x @ {r['tail_share']:.1%}{' (built-in)' if r['built_in'] else ''}"
        for r in rows if r["model"] == m and r["dataset"] == d) for m in p["models"] for d in p["datasets"]]
    return {"label": f"simulated ({p['hardware']} preset, long-clip share varied)", "rows": rows,
            "summary": summary}


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in result["config"]["models"]:
        for d in result["config"]["datasets"]:
            rs = [r for r in result["rows"] if r["model"] == m and r["dataset"] == d]
            ax.plot([100 * r["tail_share"] for r in rs], [r["speedup"] for r in rs], "o-", label=f"{m} {d}")
            ax.plot([100 * r["tail_share"] for r in rs if r["built_in"]],
                    [r["speedup"] for r in rs if r["built_in"]], "k*", ms=10)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("share of long clips (%), * = the built-in mix")
    ax.set_ylabel("DHP speed-up over best static")
    save_figure(fig, path, f"{result['name']}: {result['label']}", ax=ax, fontsize=8, legend=True)
