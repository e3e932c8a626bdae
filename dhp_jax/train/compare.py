"""The end-of-run comparison: DHP vs static plans, measured here and simulated on a preset.

Measured: the same batches, the same params, each strategy's plan run through the same executor
(compile excluded, strategies interleaved per repeat so drift hits all alike, median per batch);
the best static plan is the fastest *measured* static candidate. Simulated: the same batches at
their full (unscaled) token counts, planned for the chosen cost-model preset and timed with
`dhp_jax.planner.compare.compare_strategies` (step times of `dhp_jax.sim.step_time`). Each figure carries a label saying which it is.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from dhp_jax.planner.compare import Comparison
from dhp_jax.train.plans import PlanSource


def _time_plan(executor: Any, params: Any, samples: list, plan: Any) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(executor.loss_and_grad_shards(params, samples, plan))
    return time.perf_counter() - t0


def measured_comparison(trainer: Any, params: Any, batches: list, strategies: list[str], repeats: int) -> dict:
    n = trainer.config.num_ranks
    sources = {s: PlanSource(n, cost=trainer.cost, strategy=s) for s in strategies}
    plans = {s: [sources[s](b.step, b) for b in batches] for s in strategies}
    for s in strategies:  # compile + warm every executable before any timing
        for b, p in zip(batches, plans[s]):
            _time_plan(trainer.executor, params, b.samples, p)
    times: dict[str, list[list[float]]] = {s: [[] for _ in batches] for s in strategies}
    for _ in range(repeats):
        for i, b in enumerate(batches):
            for s in strategies:
                times[s][i].append(_time_plan(trainer.executor, params, b.samples, plans[s][i]))
    out = {}
    for s in strategies:
        med = [statistics.median(t) for t in times[s]]
        low = [min(t) for t in times[s]]
        out[s] = {"step_time_s": sum(med) / len(med), "per_batch_median_s": med,
                  "step_time_min_s": sum(low) / len(low), "degrees": [p.degrees for p in plans[s]]}
    return out


def simulated_comparison(batches: list, strategies: list[str], model: str, hardware: str, num_ranks: int) -> dict:
    from dhp_jax.planner import CostModel
    from dhp_jax.planner.compare import compare_strategies

    cost = CostModel.preset(model, hardware, ranks_per_node=min(8, num_ranks))
    comp = compare_strategies([b.source_samples for b in batches], num_ranks, cost, strategies)
    return {s: {"step_time_s": r.mean_step_time_s, "degrees": r.degrees} if r.ok else {"infeasible": r.error}
            for s, r in comp.runs.items()}


def _comparison(results: dict) -> Comparison:
    return Comparison.of_means({s: r.get("step_time_s") for s, r in results.items()})


def compare_plans(trainer: Any, params: Any, first_step: int) -> dict:
    """DHP vs the best static plan on `compare.batches` fresh batches (steps after the run's last)."""
    cfg = trainer.config
    c = cfg.compare
    batches = [trainer.pipeline.batch(first_step + i) for i in range(c.batches)]
    statics = [s.strip() for s in c.static_strategy.split(",") if s.strip()]
    dhp = "dhp"
    measured = measured_comparison(trainer, params, batches, [dhp, *statics], c.repeats)
    mcomp = _comparison(measured)
    best = mcomp.best_static(statics)
    devices = trainer.devices
    result: dict[str, Any] = {
        "batches": [b.step for b in batches],
        "measured": {
            "label": f"CPU-measured: {len(devices)} x {devices[0].platform} ({devices[0].device_kind}) devices of "
                     f"this machine, tiny model, scaled batches; median of {c.repeats} repeats per batch",
            "strategies": measured, "best_static": best,
            "speedup_vs_best_static": mcomp.speedup(dhp, best) if best else None,
        },
    }
    sim_ranks = c.sim_ranks or cfg.num_ranks
    # the simulation also knows Ulysses (all-to-all) baselines, which the JAX executor does not run
    sim_statics = list(dict.fromkeys([*statics, "static-ring:best", "static-ulysses:best"]))
    simulated = simulated_comparison(batches, [dhp, *sim_statics], c.sim_model, c.sim_hardware, sim_ranks)
    scomp = _comparison(simulated)
    sbest = scomp.best_static(sim_statics)
    result["simulated"] = {
        "label": f"simulated: cost-model preset {c.sim_model} on {c.sim_hardware}, {sim_ranks} ranks, "
                 f"the same batches at full token counts",
        "strategies": simulated, "best_static": sbest,
        "speedup_vs_best_static": scomp.speedup(dhp, sbest) if sbest else None,
    }
    return result


def format_comparison(comp: dict) -> list[str]:
    lines = []
    for key in ("measured", "simulated"):
        part = comp.get(key)
        if not part:
            continue
        lines.append(f"[{part['label']}]")
        for s, r in part["strategies"].items():
            if "step_time_s" in r:
                lines.append(f"  {s:<22} {r['step_time_s'] * 1e3:10.1f} ms/step")
            else:
                lines.append(f"  {s:<22} infeasible ({r.get('infeasible', '?')[:60]})")
        sp = part.get("speedup_vs_best_static")
        if sp is not None:
            lines.append(f"  DHP vs best static ({part['best_static']}): {sp:.2f}x")
    return lines
