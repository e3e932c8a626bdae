"""`plan_batch`: one entry point for DHP and every baseline, returning a validated `Plan`.

"dhp" = micro-batch count search -> memory-aware packing -> exact degree allocation -> refinement
-> node-aware placement. Deterministic: no wall-clock limits (only "milp"/"flexsp" have one, and
record whether they proved optimality).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from dhp_jax.data.sample import Sample, sample_etas, sample_lengths
from dhp_jax.planner import baselines, microbatch
from dhp_jax.planner.allocate import allocate, allowed_degrees
from dhp_jax.planner.build import build_plan
from dhp_jax.planner.cost import CostModel
from dhp_jax.planner.packing import pack
from dhp_jax.planner.placement import place
from dhp_jax.planner.plan import Plan, PlanningError
from dhp_jax.planner.refine import refine as refine_groups

STRATEGIES = ("dhp", "static-ring:<d>", "static-ring:best", "static-ulysses:<d>", "static-ulysses:best",
              "flexsp", "milp")

_MB_PATIENCE = 2  # stop the micro-batch count search after this many counts without improvement
_MB_MAX_TRIES = 12


class Problem:
    """A batch prepared for the solvers: lengths, etas, per-sample cost terms, limits."""

    def __init__(self, lengths: np.ndarray, etas: np.ndarray, num_ranks: int, cost: CostModel):
        self.lengths, self.etas, self.num_ranks, self.cost = lengths, etas, num_ranks, cost
        self.attn, self.lin, self.tok = cost.terms(lengths, etas)
        self.work = self.attn + self.lin
        self.dmin = cost.min_degree(lengths)
        self.cap = cost.max_tokens_per_rank


def prepare(samples_or_lengths: Any, num_ranks: int, cost: CostModel, etas: Any = None,
            ranks_per_node: int | None = None) -> Problem:
    """Check the input (errors name the sample and the limit) and precompute cost terms."""
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise PlanningError(f"num_ranks must be a positive integer, got {num_ranks!r}")
    num_ranks = int(num_ranks)
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a CostModel, got {type(cost).__name__}")
    if ranks_per_node is not None:
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, (int, np.integer)) or ranks_per_node < 1:
            raise PlanningError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if int(ranks_per_node) != cost.ranks_per_node:
            cost = cost.replace(ranks_per_node=int(ranks_per_node))
    items = list(samples_or_lengths)
    if not items:
        raise PlanningError("empty batch: there are no samples to plan")
    lengths = sample_lengths(items)
    if etas is None:
        etas_arr = sample_etas(items) if any(isinstance(x, Sample) for x in items) else np.zeros(len(items))
    else:
        etas_arr = np.asarray(etas, dtype=np.float64).reshape(-1)
        if etas_arr.size != lengths.size:
            raise PlanningError(f"etas has {etas_arr.size} entries for a batch of {lengths.size} samples")
        bad = np.flatnonzero(~np.isfinite(etas_arr) | (etas_arr < 0) | (etas_arr > 1))
        if bad.size:
            raise PlanningError(f"sample {int(bad[0])}: eta must be in [0, 1], got {etas_arr[bad[0]]}")
    prob = Problem(lengths, etas_arr, num_ranks, cost)
    over = np.flatnonzero(prob.dmin > num_ranks)
    if over.size:
        k = int(over[np.argmax(lengths[over])])
        raise PlanningError(
            f"sample {k} has {int(lengths[k])} tokens but all {num_ranks} ranks hold at most "
            f"{int(num_ranks * prob.cap)} tokens ({prob.cap:.0f} per rank at "
            f"{cost.mem_per_token / 1024:.0f} KiB/token, budget {cost.memory_budget / 2**30:.2f} GiB)")
    return prob


# ---------------------------------------------------------------------------------------------- dhp
def solve_microbatch(prob: Problem, idx: np.ndarray, allowed: np.ndarray, packing: bool = True,
                     do_refine: bool = True) -> tuple[list[list[int]], np.ndarray, float] | None:
    """Groups (global sample ids), degrees and makespan of one micro-batch; None if it cannot fit."""
    N, cost = prob.num_ranks, prob.cost
    if packing:
        local = pack(prob.work[idx], prob.tok[idx], prob.dmin[idx], N, prob.cap)
        bins = [[int(idx[k]) for k in b] for b in local]
    else:
        bins = [[int(k)] for k in idx[np.lexsort((idx, -prob.work[idx]))]]
    if len(bins) > N:
        return None
    best = None
    for _ in range(2 if do_refine else 1):
        A = [prob.attn[b].sum() for b in bins]
        B = [prob.lin[b].sum() for b in bins]
        S = [prob.tok[b].sum() for b in bins]
        dmin = cost.min_degree(S)
        res = allocate(A, B, S, dmin, N, cost, allowed)
        if res is None:
            break
        deg, mk = res
        if best is None or mk < best[2]:
            best = (bins, deg, mk)
        if not do_refine:
            break
        new = refine_groups(bins, deg, prob.attn, prob.lin, prob.tok, cost)
        new = [g for g in new if g]
        if new == bins:
            break
        bins = new
    return best


def solve_dhp(prob: Problem, num_micro_batches: int | None = None, packing: bool = True, degrees: Any = "any",
              node_aware: bool = True, refine: bool = True) -> tuple[list, dict[str, Any]]:
    N, cost = prob.num_ranks, prob.cost
    allowed = allowed_degrees(N, degrees)
    if allowed.size == 0:
        raise PlanningError(f"no allowed degree fits {N} ranks (degrees={degrees!r})")
    K = len(prob.lengths)
    dmin_ok = np.searchsorted(allowed, prob.dmin) < allowed.size
    if not np.all(dmin_ok):
        k = int(np.flatnonzero(~dmin_ok)[0])
        raise PlanningError(f"sample {k} ({int(prob.lengths[k])} tokens) needs {int(prob.dmin[k])} ranks; "
                            f"no allowed degree of {degrees!r} on {N} ranks is that large")
    lo = microbatch.min_micro_batches(prob.tok, N, prob.cap)
    if not packing:
        lo = max(lo, -(-K // N))
    if num_micro_batches is not None:
        if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, (int, np.integer)) \
                or not 1 <= num_micro_batches <= K:
            raise PlanningError(f"num_micro_batches must be an integer in 1..{K} (batch size), got {num_micro_batches!r}")
        counts = [int(num_micro_batches)]
    else:
        counts = range(lo, K + 1)
    best = None
    stale = tries = 0
    for M in counts:
        parts = microbatch.split(prob.work, M)
        sols = []
        for idx in parts:
            s = solve_microbatch(prob, idx, allowed, packing, refine)
            if s is None:
                break
            sols.append(s)
        if len(sols) < len(parts):
            if best is not None:
                stale += 1
                if stale >= _MB_PATIENCE:
                    break
            continue
        tries += 1
        total = sum(s[2] for s in sols)
        if best is None or total < best[0] * (1 - 1e-12):
            best, stale = (total, M, sols), 0
        else:
            stale += 1
        if stale >= _MB_PATIENCE or tries >= _MB_MAX_TRIES:
            break
    if best is None:
        raise PlanningError(f"no micro-batch split fits {N} ranks"
                            + (f" with num_micro_batches={num_micro_batches}" if num_micro_batches else ""))
    mbs = []
    for groups, deg, _ in best[2]:
        ranks = place([int(d) for d in deg], N, cost.ranks_per_node, node_aware)
        mbs.append(list(zip(ranks, groups)))
    return mbs, {"num_micro_batches": best[1], "est_makespan_sum_s": best[0]}


# ---------------------------------------------------------------------------------------------- API
def plan_batch(samples_or_lengths: Sequence[Sample] | Sequence[int] | np.ndarray, num_ranks: int, cost: CostModel,
               strategy: str = "dhp", *, ranks_per_node: int | None = None, etas: Sequence[float] | None = None,
               num_micro_batches: int | None = None, packing: bool = True, degrees: str | Sequence[int] = "any",
               node_aware: bool = True, refine: bool = True, time_limit_s: float | None = None) -> Plan:
    """Plan one global batch on `num_ranks` ranks with `strategy` (see STRATEGIES).

    Options (ablations of "dhp"): `num_micro_batches` fixes the count instead of searching it;
    `packing=False` makes every sequence its own atomic group; `degrees="pow2"` (or a list)
    restricts group degrees; `node_aware=False` places groups on consecutive ranks; `refine=False`
    skips the re-balancing. `time_limit_s` bounds the MILP of "milp"/"flexsp" only.
    """
    if not isinstance(strategy, str):
        raise PlanningError(f"strategy must be a string, got {strategy!r}")
    prob = prepare(samples_or_lengths, num_ranks, cost, etas, ranks_per_node)
    cost, N = prob.cost, prob.num_ranks
    t0 = time.perf_counter()
    attention = "ring"
    extra: dict[str, Any] = {}
    if strategy == "dhp":
        mbs, extra = solve_dhp(prob, num_micro_batches, packing, degrees, node_aware, refine)
    elif strategy.startswith("static-ring:") or strategy.startswith("static-ulysses:"):
        kind, _, arg = strategy.partition(":")
        attention = "ring" if kind == "static-ring" else "ulysses"
        mbs, extra = _static(prob, attention, arg, strategy)
    elif strategy == "milp":
        from dhp_jax.planner.milp import solve_milp
        mbs, extra = solve_milp(prob, num_micro_batches, degrees, node_aware, time_limit_s)
    elif strategy == "flexsp":
        from dhp_jax.planner.milp import solve_flexsp
        mbs, extra = solve_flexsp(prob, num_micro_batches, time_limit_s)
        attention = "auto"
    else:
        raise PlanningError(f"unknown strategy {strategy!r}; known strategies: {', '.join(STRATEGIES)}")
    solve_ms = (time.perf_counter() - t0) * 1e3
    solver = {"strategy": strategy, "solve_ms": round(solve_ms, 3), **extra}
    plan = build_plan(mbs, prob.lengths, prob.etas, cost, N, solver, attention)
    plan.validate(num_samples=len(prob.lengths), cost=cost, lengths=prob.lengths)
    return plan


def _static(prob: Problem, attention: str, arg: str, strategy: str) -> tuple[list, dict[str, Any]]:
    from dhp_jax.sim.step import step_time

    N, cost = prob.num_ranks, prob.cost
    if arg == "best":
        cands = baselines.static_degrees(N, cost, attention)
        best = None
        errors = []
        for d in cands:
            try:
                mbs = baselines.static_groups(prob.lengths, N, cost, d, attention)
            except PlanningError as e:
                errors.append(str(e))
                continue
            t = step_time(build_plan(mbs, prob.lengths, prob.etas, cost, N, {"attention": attention}, attention),
                          prob.lengths, cost, prob.etas)
            if best is None or t < best[0]:
                best = (t, d, mbs)
        if best is None:
            raise PlanningError(f"{strategy}: no degree among {cands} fits this batch ({errors[-1] if errors else ''})")
        return best[2], {"degree": best[1], "tried": cands}
    try:
        d = int(arg)
    except ValueError:
        raise PlanningError(f"unknown strategy {strategy!r}: the degree must be an integer or 'best'") from None
    return baselines.static_groups(prob.lengths, N, cost, d, attention), {"degree": d}
