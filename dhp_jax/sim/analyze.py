"""What DHP would do for a dataset: its token profile and simulated step times per strategy.

`analyze(source, model, ranks, batch)` streams a JSONL manifest (or draws a built-in mix) into a
`TokenProfile` (`dhp_jax.data.token_profile`), then draws `num_batches` global batches by seed and
prices the plans of "dhp" and the best static baselines. Pure NumPy: no jax.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dhp_jax.checks import positive_int
from dhp_jax.data.token_profile import TokenProfile, histogram, load_profile, summary
from dhp_jax.data.vision import rules_for_model, vision_rules
from dhp_jax.planner.cli_args import cost_model, is_profile
from dhp_jax.planner.compare import compare_strategies

DEFAULT_STRATEGIES = ("dhp", "static-ring:best", "static-ulysses:best")


def simulate(profile: TokenProfile, model: str, hardware: str, ranks: int, batch: int, num_batches: int,
             seed: int, strategies: Sequence[str] = DEFAULT_STRATEGIES, ranks_per_node: int = 8,
             cost: str | None = None) -> dict[str, Any]:
    """Step time of each strategy on `num_batches` batches drawn by `seed` (simulated, not measured).

    Batches are drawn without replacement inside a batch when the data has enough samples. A
    strategy that cannot plan a batch (a sample longer than all ranks hold) is reported as failed.
    ":best" baselines pick their best degree per batch, which favours them over one fixed degree.
    `cost` (a profile path or MODEL/HARDWARE) replaces the preset of `model` on `hardware`.
    """
    # a preset's fp32 state is sharded over the `ranks` (a fitted profile keeps its own figures)
    shards = {} if cost and is_profile(cost) else {"state_shards": ranks}
    source, cost = cost, cost_model(cost or model, hardware, ranks_per_node=ranks_per_node, **shards)
    rng = np.random.default_rng(seed)
    total, eta = profile.total, profile.eta
    K = total.size
    draws = [rng.choice(K, size=batch, replace=batch > K) for _ in range(num_batches)]
    comp = compare_strategies([(total[idx], eta[idx]) for idx in draws], ranks, cost, strategies)
    kind = f"simulated with cost model {source}" if source else f"simulated with CostModel.preset({model!r}, {hardware!r})"
    out: dict[str, Any] = {"model": model, "hardware": hardware, "ranks": ranks, "ranks_per_node": ranks_per_node,
                           "batch": batch, "num_batches": num_batches, "seed": seed,
                           "kind": kind, "strategies": {}}
    for s, r in comp.runs.items():
        ok = r.ok
        out["strategies"][s] = {
            "mean_step_time_s": r.mean_step_time_s,
            "step_time_s": r.step_time_s if ok else [],
            "median_solve_ms": float(np.median([p.solver.get("solve_ms", 0.0) for p in r.plans])) if ok else None,
            "choices": [{k: v for k, v in p.solver.items() if k in ("degree", "num_micro_batches")}
                        for p in r.plans] if ok else [],
            "error": r.error,
        }
    best = comp.best_static([s for s in comp.runs if s != "dhp"])
    if best and comp.mean("dhp"):
        out["best_baseline"] = best
        out["speedup_vs_best_baseline"] = comp.speedup("dhp", best)
    return out


def analyze(source: str, model: str = "qwen3-vl-8b", ranks: int = 64, batch: int = 512, *,
            hardware: str = "ascend-910b", vision: str | None = None, num_batches: int = 3, seed: int = 0,
            skip_bad: bool = False, image_root: str | None = None, tokenizer: str | None = None,
            strategies: Sequence[str] = DEFAULT_STRATEGIES, ranks_per_node: int = 8,
            mix_samples: int = 8192, cost: str | None = None, video_sampling: Any = "auto") -> dict[str, Any]:
    """The full report as a JSON-ready dict: data profile, histogram, simulated step times."""
    for name, v in (("ranks", ranks), ("batch", batch), ("num_batches", num_batches)):
        positive_int(v, name)
    rules = vision_rules(vision, video_sampling) if vision else rules_for_model(model, video_sampling)
    prof, info = load_profile(source, rules, skip_bad=skip_bad, image_root=image_root, tokenizer=tokenizer,
                              mix_samples=mix_samples, seed=seed)
    return {"data": {**info, "vision": rules.name, **summary(prof)}, "histogram": histogram(prof),
            "simulation": simulate(prof, model, hardware, ranks, batch, num_batches, seed, strategies,
                                   ranks_per_node, cost)}
