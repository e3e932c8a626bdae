"""The end-of-run comparison: DHP vs static plans, measured here and simulated on a preset.

Measured: the same batches, the same params, each strategy's plan run through the same executor
(compile excluded, strategies interleaved per repeat so drift hits all alike, median per batch);
the best static plan is the fastest *measured* static candidate. On fake CPU devices that share a
few cores this is a correctness and overhead figure, not a speed-up. Simulated: batches of the run's
mix at full token counts (`compare.sim_batch_size` samples each, or the run's own batches),
planned for the chosen cost-model preset on `compare.sim_ranks` ranks and timed with
`dhp_jax.planner.compare.compare_strategies`
(step times of `dhp_jax.sim.step_time`). Each figure carries a label saying which it is.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from dhp_jax.planner import CostModel, PlanningError
from dhp_jax.planner.compare import Comparison, compare_strategies
from dhp_jax.planner.cost.pricing import allreduce_time
from dhp_jax.train.metrics import phase_bar
from dhp_jax.train.plans import PlanSource


def _time_plan(executor: Any, params: Any, samples: list, plan: Any) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(executor.loss_and_grad_shards(params, samples, plan))
    return time.perf_counter() - t0


def measured_comparison(trainer: Any, params: Any, batches: list, strategies: list[str], repeats: int,
                        progress: bool = False) -> dict:
    n, p = trainer.config.num_ranks, trainer.config.planner
    out: dict[str, Any] = {}
    plans = {}
    for s in strategies:
        source = PlanSource(n, cost=trainer.cost, strategy=s, num_micro_batches=p.num_micro_batches,
                            full_size=p.full_size)
        try:
            plans[s] = [source(b.step, b) for b in batches]
        except PlanningError as e:
            out[s] = {"infeasible": str(e)}
    ok = list(plans)
    with phase_bar(len(ok) * len(batches) * (1 + repeats), f"compare: {len(ok)} plans x {len(batches)} batches "
                   f"(compile, then {repeats} timed repeats)", progress) as bar:
        for s in ok:  # compile + warm every executable before any timing
            for b, plan in zip(batches, plans[s]):
                _time_plan(trainer.executor, params, b.samples, plan)
                bar.update(1)
        times: dict[str, list[list[float]]] = {s: [[] for _ in batches] for s in ok}
        for _ in range(repeats):
            for i, b in enumerate(batches):
                for s in ok:
                    times[s][i].append(_time_plan(trainer.executor, params, b.samples, plans[s][i]))
                    bar.update(1)
    for s in ok:
        med = [statistics.median(t) for t in times[s]]
        low = [min(t) for t in times[s]]
        out[s] = {"step_time_s": sum(med) / len(med), "per_batch_median_s": med,
                  "step_time_min_s": sum(low) / len(low), "degrees": [p.degrees for p in plans[s]]}
    return {s: out[s] for s in strategies}


def simulated_comparison(batches: list[list], strategies: list[str], cost: Any, num_ranks: int,
                         progress: bool = False) -> tuple[dict, Any]:
    """Mean simulated step time per strategy over `batches` (lists of unscaled samples); also the
    first batch's DHP plan (for a picture). Strategy by strategy, each a tick of a progress bar."""
    runs = {}
    with phase_bar(len(strategies), f"compare: simulating {len(strategies)} strategies on {num_ranks} ranks "
                   f"({cost.model} on {cost.hardware})", progress) as bar:
        for s in strategies:
            bar.set_description_str(f"compare: simulating {s} on {num_ranks} ranks ({cost.model} on {cost.hardware})")
            runs.update(compare_strategies(batches, num_ranks, cost, [s]).runs)
            bar.update(1)
    out = {s: {"step_time_s": r.mean_step_time_s, "degrees": r.degrees} if r.ok else {"infeasible": r.error}
           for s, r in runs.items()}
    dhp = runs.get("dhp")
    return out, (dhp.plans[0] if dhp is not None and dhp.ok and dhp.plans else None)


def _comparison(results: dict) -> Comparison:
    return Comparison.of_means({s: r.get("step_time_s") for s, r in results.items()})


def compare_plans(trainer: Any, params: Any, first_step: int, progress: bool = False) -> dict:
    """DHP vs the best static plan on `compare.batches` fresh batches (steps after the run's last)."""
    cfg = trainer.config
    c = cfg.compare
    batches = [trainer.pipeline.batch(first_step + i) for i in range(c.batches)]
    statics = [s.strip() for s in c.static_strategy.split(",") if s.strip()]
    devices = trainer.devices
    result: dict[str, Any] = {"batches": [b.step for b in batches]}
    if c.measured:
        measured = measured_comparison(trainer, params, batches, ["dhp", *statics], c.repeats, progress)
        best = _comparison(measured).best_static(statics)
        cpu = devices[0].platform == "cpu"
        result["measured"] = {
            "label": f"measured on {len(devices)} {devices[0].platform} ({devices[0].device_kind}) devices of this "
                     f"machine, tiny model, scaled batches, median of {c.repeats} repeats"
                     + (": a correctness and overhead run (the fake devices share the host's cores)" if cpu else ""),
            "strategies": measured, "best_static": best,
            "speedup_vs_best_static": _comparison(measured).speedup("dhp", best) if best else None,
        }
    sim_ranks = c.sim_ranks or cfg.num_ranks
    rpn = min(c.sim_ranks_per_node, sim_ranks)
    t = cfg.parallel.tensor   # the simulated ranks are the run's: t devices each
    cost = CostModel.preset(c.sim_model, c.sim_hardware, ranks_per_node=rpn, state_shards=sim_ranks * t,
                            **({"tensor_parallel": t} if t > 1 else {}))
    if c.sim_batch_size:  # the run's mix at the simulated scale, one batch per compared batch
        sim_batches = [trainer.pipeline.source_batch(first_step + i, c.sim_batch_size) for i in range(c.batches)]
    else:
        sim_batches = [b.source_samples for b in batches]
    # the simulation also knows Ulysses (all-to-all) baselines, which the JAX executor does not run
    sim_statics = list(dict.fromkeys([*statics, "static-ring:best", "static-ulysses:best"]))
    simulated, plan = simulated_comparison(sim_batches, ["dhp", *sim_statics], cost, sim_ranks, progress)
    scomp = _comparison(simulated)
    sbest = scomp.best_static(sim_statics)
    result["simulated"] = {
        "label": f"simulated: preset {c.sim_model} on {c.sim_hardware}, {sim_ranks} ranks ({rpn} per node), "
                 f"global batch {len(sim_batches[0])} of the run's mix ({cfg.data.dataset}) at full token counts, "
                 f"mean of {len(sim_batches)} batches",
        "ranks": sim_ranks, "batch_size": len(sim_batches[0]), "model": c.sim_model, "hardware": c.sim_hardware,
        "strategies": simulated, "best_static": sbest,
        "speedup_vs_best_static": scomp.speedup("dhp", sbest) if sbest else None,
        "allreduce_s": float(allreduce_time(cost, sim_ranks)), "_plan": plan,
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
                lines.append(f"  {s:<22} infeasible ({r.get('infeasible', '?')[:120]})")
        sp = part.get("speedup_vs_best_static")
        if sp is not None:
            lines.append(f"  DHP vs best static ({part['best_static']}): {sp:.2f}x"
                         + (" (simulated)" if key == "simulated" else " (measured)"))
    return lines
