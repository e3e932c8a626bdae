"""Experiment 3: per-rank throughput and scaling efficiency from 8 to 4096 ranks (batch grows with ranks)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from experiments.common import LABELS, run_strategies, save_figure
from dhp_jax.sim.cluster import Cluster


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    rows = []
    for n in p["ranks"]:
        cluster = Cluster.with_ranks(n, p["ranks_per_node"], model=p["model"], hardware=p["hardware"])
        runs = run_strategies(cluster, p["dataset"], p["strategies"], batch=n * p["batch_per_rank"],
                              steps=p["steps"], seed=seed, log=log)
        for s, r in runs.items():
            rows.append({"ranks": n, "nodes": cluster.nodes, "batch": r.batch, "strategy": s,
                         "step_s": r.mean_step_s, "tokens_per_s_per_rank": r.tokens_per_s_per_rank,
                         "utilisation": float(r.utilisation.mean()),
                         "plan_wall_ms": float(np.median(r.plan_wall_ms)),
                         "label": f"simulated ({p['hardware']} preset, {p['model']})"})
    base = {}
    for row in rows:
        base.setdefault(row["strategy"], row["tokens_per_s_per_rank"])
        row["scaling_efficiency"] = row["tokens_per_s_per_rank"] / base[row["strategy"]]
        dhp = next(r for r in rows if r["ranks"] == row["ranks"] and r["strategy"] == "dhp") \
            if any(r["strategy"] == "dhp" for r in rows) else None
        if dhp is not None:
            row["dhp_speedup"] = row["step_s"] / dhp["step_s"]
    summary = []
    for s in p["strategies"]:
        rs = [r for r in rows if r["strategy"] == s]
        if rs:
            summary.append(f"{s}: scaling efficiency {rs[0]['ranks']} -> {rs[-1]['ranks']} ranks = "
                           f"{rs[-1]['scaling_efficiency']:.1%}")
    return {"label": f"simulated ({p['hardware']} preset)", "rows": rows, "summary": summary}


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for s in result["config"]["strategies"]:
        rs = [r for r in result["rows"] if r["strategy"] == s]
        a1.plot([r["ranks"] for r in rs], [r["tokens_per_s_per_rank"] for r in rs], "o-", label=LABELS.get(s, s))
        a2.plot([r["ranks"] for r in rs], [r["scaling_efficiency"] for r in rs], "o-", label=LABELS.get(s, s))
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xlabel("ranks")
        a.legend(fontsize=7)
    a1.set_ylabel("tokens / s / rank")
    a2.set_ylabel("scaling efficiency (vs smallest)")
    a2.axhline(0.9, color="grey", ls=":", lw=0.8)
    save_figure(fig, path, f"{result['name']}: {result['label']}", fontsize=9)
