"""Profile the cost model on the current devices: time one-group executables, fit, check held out.

A profile point is one CP group: `lengths` (the sequences it holds) on `degree` devices (ranks
0..degree-1) running one attention kind (ring, Ulysses or a Ulysses x ring hybrid), so the fit
covers every kind the planner may choose. Each point is timed through the public `PlanExecutor` (forward + backward of a
one-group plan, compile excluded, minimum over repeats and passes). The planner's `fit_cost_model` fits the
coefficients on a training subset of the points; the rest are held out and the relative error of
the fitted cost model's `pricing.group_time` on them is the estimator error reported (the paper reports 4-8 %).

The timing function is a parameter, so the fitting path is tested with synthetic timings drawn
from a cost model with known coefficients.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from dhp_jax.data.sample import Sample, Segment
from dhp_jax.planner.contract.kinds import KINDS, RING_KIND, attention_kinds, resolve
from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan
from dhp_jax.planner.cost.fit import fit_cost_model
from dhp_jax.planner.cost.pricing import group_time

# measure(lengths, etas, degree, attention) -> seconds for one group holding these sequences.
MeasureFn = Callable[[Sequence[int], Sequence[float], int, str], float]


@dataclasses.dataclass(frozen=True)
class ProfilePoint:
    lengths: tuple[int, ...]
    etas: tuple[float, ...]
    degree: int
    attention: str = "ring"

    def to_dict(self) -> dict:
        return {"lengths": list(self.lengths), "etas": list(self.etas), "degree": self.degree,
                "attention": self.attention}


def default_points(degrees: Sequence[int], lengths: Sequence[int], eta: float = 0.5,
                   packs: Sequence[int] = (1, 2), kinds: Sequence[str] = ("ring",),
                   num_heads: int | None = None) -> list[ProfilePoint]:
    """A grid: every degree x total length, as `p` equal sequences for each p in `packs`, on the ring;
    with `kinds` also "ulysses" and/or "hybrid" (every Ulysses x ring split the `num_heads` allow,
    `dhp_jax.planner.contract.kinds.attention_kinds`) at every degree x length, one sequence each.

    Packing several sequences into one group separates the quadratic (per sequence) from the
    linear (per token) terms; mixing etas separates bidirectional from causal attention work; the
    other kinds' points add all-to-all traffic, which the ring never has.
    """
    unknown = set(kinds) - {k.name for k in KINDS}
    if unknown or RING_KIND.name not in kinds:
        raise ValueError(f"profile kinds must include 'ring' and be among ring, ulysses, hybrid; got {list(kinds)}")
    points = []
    for d in degrees:
        others = [k for k in attention_kinds(d, num_heads)[1:] if resolve(k, d).kind.name in kinds] if num_heads else []
        for n in lengths:
            for i, p in enumerate(packs):
                if n // p < 1:
                    continue
                e = eta if (i + d) % 2 == 0 else 0.0
                points.append(ProfilePoint(tuple([n // p] * p), tuple([e] * p), int(d)))
            for j, k in enumerate(others):
                e = eta if (j + d) % 2 else 0.0
                points.append(ProfilePoint((n,), (e,), int(d), k))
    return points


def split_points(points: Sequence[ProfilePoint], holdout_every: int = 4, seed: int = 0) -> tuple[list[int], list[int]]:
    """Deterministic split: a seeded random 1/`holdout_every` of the points is held out.

    Random rather than strided, so the held-out set mixes degrees, lengths and packings instead
    of repeating one position of the grid.
    """
    if holdout_every < 2:
        raise ValueError(f"holdout_every must be >= 2, got {holdout_every}")
    n = len(points)
    held = sorted(int(i) for i in np.random.default_rng(seed).permutation(n)[: n // holdout_every])
    train = [i for i in range(n) if i not in set(held)]
    return train, held


def relative_errors(cost: Any, measurements: Sequence[dict]) -> list[float]:
    out = []
    for m in measurements:
        est = float(group_time(cost, list(m["lengths"]), int(m["degree"]), etas=m.get("etas"),
                              attention=m.get("attention", "ring")))
        out.append(abs(est - m["seconds"]) / m["seconds"])
    return out


def measure_points(points: Sequence[ProfilePoint], measure: MeasureFn,
                   progress: Callable[[int, ProfilePoint, float], None] | None = None,
                   passes: int = 1) -> list[dict]:
    """Time every point `passes` times (whole grid per pass) and keep each point's minimum.

    Several passes over the grid, rather than more repeats in a row, spread each point's timings
    over the run, so a burst of load from other processes cannot spoil one point's every sample;
    the minimum is the estimate of the undisturbed time.
    """
    best = [float("inf")] * len(points)
    for _ in range(max(1, passes)):
        for i, p in enumerate(points):
            seconds = float(measure(list(p.lengths), list(p.etas), p.degree, p.attention))
            if not seconds > 0:
                raise ValueError(f"profile point {i} (degree {p.degree}, {p.attention}, lengths {list(p.lengths)}) measured "
                                 f"{seconds} s; a timing must be > 0")
            best[i] = min(best[i], seconds)
            if progress is not None:
                progress(i, p, seconds)
    return [{**p.to_dict(), "seconds": t} for p, t in zip(points, best)]


def fit_profile(measurements: Sequence[dict], base: Any, holdout_every: int = 4, seed: int = 0) -> tuple[Any, dict]:
    """Fit on the training split, report the error on the held-out split. Returns (cost, report)."""
    points = [ProfilePoint(tuple(m["lengths"]), tuple(m.get("etas") or [0.0] * len(m["lengths"])), m["degree"],
                           m.get("attention", "ring")) for m in measurements]
    train_idx, held_idx = split_points(points, holdout_every, seed)
    train = [measurements[i] for i in train_idx]
    held = [measurements[i] for i in held_idx]
    cost, fit_report = fit_cost_model(train, base)
    train_err = relative_errors(cost, train)
    held_err = relative_errors(cost, held)
    report = {
        "num_points": len(measurements), "num_train": len(train), "num_held_out": len(held),
        "train_mean_rel_error": float(np.mean(train_err)) if train_err else None,
        "held_out_mean_rel_error": float(np.mean(held_err)) if held_err else None,
        "held_out_max_rel_error": float(np.max(held_err)) if held_err else None,
        "held_out": [{**m, "estimate_s": float(group_time(cost, list(m["lengths"]), int(m["degree"]), etas=m.get("etas"),
                                                        attention=m.get("attention", "ring"))),
                      "rel_error": e} for m, e in zip(held, held_err)],
        "fit": fit_report,
    }
    return cost, report


# ------------------------------------------------------------------------------ real devices
class ExecutorTimer:
    """Times one-group plans through a `PlanExecutor`: fwd + bwd, compile and a warm-up run excluded,
    min of repeats.

    The minimum, not the median: on a machine shared with other work, slow samples are other
    processes' time, not the group's.
    """

    def __init__(self, executor: Any, params: Any, model_config: Any, repeats: int = 5, seed: int = 0):
        self.executor, self.params, self.model_config = executor, params, model_config
        self.repeats, self.seed = int(repeats), int(seed)
        self.num_devices = len(executor.mesh.devices.flat)
        self._warm: set = set()

    def samples(self, lengths: Sequence[int], etas: Sequence[float]) -> list:
        """Real payload samples: a vision span of share sqrt(eta) then text (eta = (v/L)^2)."""
        rng = np.random.default_rng(self.seed)
        out = []
        for i, (n, eta) in enumerate(zip(lengths, etas)):
            v = int(round(n * float(np.sqrt(max(0.0, min(1.0, eta))))))
            v = min(v, n - 1) if n > 1 else 0
            segs = []
            if v:
                segs.append(Segment("image", v, pixels=rng.normal(size=(v, self.model_config.patch_dim)).astype(np.float32)))
            t = n - v
            segs.append(Segment("text", t, token_ids=rng.integers(1, self.model_config.vocab_size, t).astype(np.int32)))
            out.append(Sample(tuple(segs), sample_id=i))
        return out

    def __call__(self, lengths: Sequence[int], etas: Sequence[float], degree: int, attention: str = "ring") -> float:
        import jax


        if degree > self.num_devices:
            raise ValueError(f"profile degree {degree} exceeds the {self.num_devices} devices available")
        samples = self.samples(lengths, etas)
        plan = Plan(num_ranks=self.num_devices, micro_batches=(MicroBatch((
            Group(tuple(range(degree)), degree, tuple(range(len(samples))), attention=attention),)),),
            solver={"strategy": "profile"})

        def once() -> float:
            t0 = time.perf_counter()
            jax.block_until_ready(self.executor.loss_and_grads(self.params, samples, plan))
            return time.perf_counter() - t0

        if (degree, tuple(lengths), attention) not in self._warm:
            once()  # compile, once per point
            self._warm.add((degree, tuple(lengths), attention))
        # one untimed run first on every call: passes interleave the points, so the previous call
        # ran another program and left other buffers and code in the caches
        once()
        return min(once() for _ in range(self.repeats))


def host_cores() -> int:
    """Cores this process may run on: the parallelism fake CPU devices really get."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_average() -> list[float] | None:
    """The host's 1/5/15-minute load averages (None where the OS has none): context for timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_label() -> str:
    import jax

    d = jax.devices()
    return f"{len(d)} x {d[0].platform} ({d[0].device_kind}) on {platform.node() or 'host'}, {platform.processor() or platform.machine()}"


def write_profile(path: str | Path, cost: Any, report: dict, measurements: Sequence[dict],
                  extra: dict | None = None) -> tuple[Path, Path]:
    """The fitted model at `path` (loadable by `CostModel.from_profile`) and the report beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cost.save(path)
    report_path = path.with_name(path.stem + ".report.json")
    report_path.write_text(json.dumps({**(extra or {}), **report, "measurements": list(measurements)},
                                      indent=2, default=float) + "\n")
    return path, report_path
