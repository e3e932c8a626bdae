"""Experiment 14: mixture-of-experts models (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B) under DHP. For each
model, data mix, device count and tensor-parallel size t (a rank = t devices of a node, its experts
split over them; the planner sees devices / t ranks), DHP and the best static strategies are
planned on the same batches and timed with the cost model (simulated: compute on the active
parameters, memory on all of them, the sparse layers' row exchange inside a rank); the gain is
DHP at its best t over the best static strategy at its best t (experiment 13's grid). Then one
long sample: the (t, degree) DHP's plans give it at each t, and the one the memory model picks
(`dhp_jax.planner.cost.tensor_parallel.choose`)."""

from __future__ import annotations

from typing import Any, Callable

from dhp_jax.planner.cost.tensor_parallel import choose
from experiments.common import LABELS
from experiments.exp_tensor_parallel import _grid, _long_sample, plot_per_t

# what the table keeps of `tensor_parallel.choose`'s answer
CHOICE = ("t", "degree", "step_s", "device_bytes", "usable_bytes", "fits")


def _choice(p: dict[str, Any], model: str) -> dict[str, Any]:
    """The memory model's pick for the long sample (`tensor_parallel.choose`), or why none fits."""
    try:
        r = choose(model, p["hardware"], p["long_tokens"], p["long_devices"], devices_per_node=p["devices_per_node"],
                   vision_share=p["long_vision"], sequence_parallel=p["sequence_parallel"])
    except ValueError as e:
        return {"error": str(e)}
    return {k: r[k] for k in CHOICE}


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    # the parameters experiment 13's grid and long sample read
    base = {k: p[k] for k in ("devices_per_node", "tensor_parallel", "sequence_parallel", "batch_per_device", "steps",
                              "hardware", "strategies", "long_tokens", "long_vision", "long_devices")}
    rows = []
    for model in p["models"]:
        for dataset in p["datasets"]:
            for devices in p["devices"]:
                row = _grid({**base, "dataset": dataset}, model, devices, seed, log)
                rows.append({**row, "dataset": dataset})
    long_rows = [{**_long_sample(base, model, log), "choose": _choice(p, model)} for model in p["long_models"]]
    summary = []
    for r in rows:
        if "gain" in r:
            summary.append(f"{r['model']}, {r['dataset']}, {r['devices']} devices: DHP at t={r['dhp_t']} "
                           f"{r['dhp_s']:.2f} s vs {LABELS.get(r['static'], r['static'])} at t={r['static_t']} "
                           f"{r['static_s']:.2f} s: {r['gain']:.2f}x (simulated)")
        else:
            why = sorted({v.get("error", "") for v in r["per_t"].values()})
            summary.append(f"{r['model']}, {r['dataset']}, {r['devices']} devices: no t runs it "
                           f"({'does not fit a device' if all('does not fit' in w for w in why) else '; '.join(why)})")
    for r in long_rows:
        c = r["choose"]
        summary.append(f"{r['model']}, one {r['tokens'] // 1024}k-token sample, {r['devices']} devices: "
                       + (f"the planner picks t={r['best_t']}, degree {r['best_degree']}" if "best_t" in r
                          else "no t plans it")
                       + (f"; the memory model's pick: t={c['t']}, degree {c['degree']} ({c['device_bytes'] / 1e9:.1f} "
                          f"of {c['usable_bytes'] / 1e9:.1f} GB)" if "t" in c else "; nothing fits by the memory model"))
    return {"label": f"simulated ({p['hardware']} preset, MoE priced by the cost model: active compute, all weights)",
            "rows": rows, "long_rows": long_rows, "summary": summary}


def plot(result: dict[str, Any], path: Any) -> None:
    plot_per_t(result, path, lambda r: f"{r['model']}\n{r['dataset']}, {r['devices']} devices", 7)
