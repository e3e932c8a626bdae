"""Experiment 13: tensor parallelism inside a rank. For each model, device count and tensor-parallel
size t (a rank = t devices of a node; the planner sees devices / t ranks), DHP and the best static
strategies are planned on the same batches and timed with the cost model (simulated); the gain is
DHP at its best t over the best static strategy at its best t. Then one long sample (the
`long_tokens` question): which (t, degree) the planner picks for it and whether the memory model
says that group fits one device."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from dhp_jax.planner.compare import compare_strategies
from dhp_jax.planner.contract.plan import PlanningError
from dhp_jax.planner.cost.memory import group_program_bytes, rank_state_bytes
from dhp_jax.sim.cluster import Cluster
from dhp_jax.sim.simulate import make_batches
from experiments.common import LABELS, STATIC, save_figure


def _cluster(p: dict[str, Any], model: str, devices: int, t: int) -> Cluster:
    # the state is sharded over every device of the run, whatever t
    return Cluster.with_devices(devices, p["devices_per_node"], t, model=model, hardware=p["hardware"],
                                state_shards=devices, sequence_parallel=bool(p["sequence_parallel"]) and t > 1)


def _cost(cluster: Cluster) -> tuple[Any, str | None]:
    try:
        return cluster.cost_model(), None
    except ValueError as e:   # a head layout t cannot split, or a model that does not fit a device
        return None, str(e)


def _grid(p: dict[str, Any], model: str, devices: int, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    batch = p["batch_per_device"] * devices
    vision = Cluster(nodes=1, model=model).vision
    batches = make_batches(p["dataset"], batch, p["steps"], seed, vision)
    per_t: dict[str, Any] = {}
    for t in p["tensor_parallel"]:
        cluster = _cluster(p, model, devices, t)
        cost, why = _cost(cluster)
        if cost is None:
            per_t[str(t)] = {"error": why}
            log(f"{model:>15} {devices:>4} devices t={t}: {why}")
            continue
        comp = compare_strategies(batches, cluster.num_ranks, cost, p["strategies"],
                                  ranks_per_node=cluster.ranks_per_node)
        cell: dict[str, Any] = {"ranks": cluster.num_ranks, "step_s": {}, "errors": {}}
        for s, r in comp.runs.items():
            if r.ok:
                cell["step_s"][s] = r.mean_step_time_s
                if s in STATIC:
                    cell.setdefault("static_degree", {})[s] = sorted({d for pl in r.plans for d in pl.degrees[0]})
            else:
                cell["errors"][s] = r.error
        per_t[str(t)] = cell
        log(f"{model:>15} {devices:>4} devices t={t}: " + ", ".join(f"{s} {v:.2f} s" for s, v in cell["step_s"].items())
            + "".join(f", {s} infeasible" for s in cell["errors"]))
    row: dict[str, Any] = {"model": model, "devices": devices, "batch": batch, "per_t": per_t}
    dhp = [(v["step_s"]["dhp"], int(t)) for t, v in per_t.items() if "dhp" in v.get("step_s", {})]
    static = [(v["step_s"][s], int(t), s) for t, v in per_t.items() for s in STATIC if s in v.get("step_s", {})]
    if dhp:
        row["dhp_s"], row["dhp_t"] = min(dhp)
    if static:
        row["static_s"], row["static_t"], row["static"] = min(static)
    if dhp and static:
        row["gain"] = row["static_s"] / row["dhp_s"]
        # and with t fixed at the best static strategy's t (TP chosen once for both)
        same = per_t[str(row["static_t"])]["step_s"]
        row["gain_same_t"] = row["static_s"] / same["dhp"] if "dhp" in same else None
    return row


def _long_sample(p: dict[str, Any], model: str, log: Callable[[str], None]) -> dict[str, Any]:
    """One sample of `long_tokens` tokens (vision share `long_vision`) on `long_devices` devices: the
    DHP plan at each t, the degree of its group and the memory model's bytes against the device."""
    L, vis, devices = p["long_tokens"], p["long_vision"], p["long_devices"]
    lengths, etas = np.array([L]), np.array([vis * vis])
    out: dict[str, Any] = {"model": model, "tokens": L, "devices": devices, "per_t": {}}
    for t in p["tensor_parallel"]:
        cluster = _cluster(p, model, devices, t)
        cost, why = _cost(cluster)
        if cost is None:
            out["per_t"][str(t)] = {"error": why}
            continue
        try:
            comp = compare_strategies([(lengths, etas)], cluster.num_ranks, cost, ["dhp"], errors="raise",
                                      ranks_per_node=cluster.ranks_per_node)
        except PlanningError as e:
            out["per_t"][str(t)] = {"error": str(e)}
            continue
        plan = comp.runs["dhp"].plans[0]
        g = next(g for mb in plan.micro_batches for g in mb.groups if g.samples)
        program = group_program_bytes(cost, [L], g.degree)
        total = program + rank_state_bytes(cost)
        out["per_t"][str(t)] = {"step_s": comp.mean("dhp"), "degree": g.degree, "attention": g.attention,
                                "device_bytes": total, "usable_bytes": cost.usable_bytes,
                                "fits": bool(total <= cost.usable_bytes)}
    ok = [(v["step_s"], int(t)) for t, v in out["per_t"].items() if "step_s" in v]
    if ok:
        out["best_t"] = min(ok)[1]
        best = out["per_t"][str(out["best_t"])]
        out["best_degree"], out["fits"] = best["degree"], best["fits"]
    log(f"{model:>15} one {L}-token sample on {devices} devices: "
        + (f"t={out['best_t']} degree {out['best_degree']} ({'fits' if out['fits'] else 'does NOT fit'})"
           if ok else "no t plans it"))
    return out


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    rows = [_grid(p, model, devices, seed, log) for model in p["models"] for devices in p["devices"]]
    long_rows = [_long_sample(p, model, log) for model in p["long_models"]]
    summary = []
    for r in rows:
        if "gain" in r:
            summary.append(f"{r['model']}, {r['devices']} devices: DHP at t={r['dhp_t']} {r['dhp_s']:.2f} s vs "
                           f"{LABELS.get(r['static'], r['static'])} at t={r['static_t']} {r['static_s']:.2f} s: "
                           f"{r['gain']:.2f}x")
        else:
            summary.append(f"{r['model']}, {r['devices']} devices: no t runs it "
                           f"({'; '.join(sorted({v.get('error', '') for v in r['per_t'].values()}))})")
    for r in long_rows:
        if "best_t" in r:
            summary.append(f"{r['model']}, one {r['tokens'] // 1024}k-token sample, {r['devices']} devices: the planner "
                           f"picks t={r['best_t']}, degree {r['best_degree']}; the memory model says it "
                           f"{'fits' if r['fits'] else 'does NOT fit'}")
    return {"label": f"simulated ({p['hardware']} preset, tensor parallelism priced by the cost model)", "rows": rows,
            "long_rows": long_rows, "summary": summary}


def plot(result: dict[str, Any], path: Any) -> None:
    plot_per_t(result, path, lambda r: f"{r['model']}\n{r['devices']} devices", 8)


def plot_per_t(result: dict[str, Any], path: Any, title: Any, fontsize: int) -> None:
    """Step time against t, DHP and the static strategies, one panel a row (`title(row)` its title)."""
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ts = result["config"]["tensor_parallel"]
    fig, axes = plt.subplots(1, len(rows), figsize=(2.6 * len(rows), 3.4), squeeze=False)
    for ax, r in zip(axes[0], rows):
        for s in ["dhp"] + list(STATIC):
            ys = [r["per_t"][str(t)].get("step_s", {}).get(s, np.nan) for t in ts]
            ax.plot(ts, ys, marker="o", label=LABELS.get(s, s))
        ax.set_xscale("log", base=2)
        ax.set_xticks(ts)
        ax.set_xticklabels([str(t) for t in ts])
        ax.set_title(title(r), fontsize=fontsize)
        ax.set_xlabel("tensor parallel t")
    axes[0][0].set_ylabel("step (s)")
    axes[0][-1].legend(fontsize=6)
    save_figure(fig, path, f"{result['name']}: {result['label']}", fontsize=8)
