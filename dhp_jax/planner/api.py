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
from dhp_jax.planner.build import build_plan, padded_tokens
from dhp_jax.planner.cost import CostModel
from dhp_jax.planner.packing import bin_sums, bins_of, pack
from dhp_jax.planner.placement import place, spans_nodes
from dhp_jax.planner.plan import Plan, PlanningError, PlanValidationError
from dhp_jax.planner.programs import ProgramCache, reuse_ranks
from dhp_jax.planner.refine import refine as refine_groups

STRATEGIES = ("dhp", "static-ring:<d>", "static-ring:best", "static-ulysses:<d>", "static-ulysses:best",
              "flexsp", "milp")

_MB_PATIENCE = 1  # stop the micro-batch count search after this many counts without improvement
_MB_MAX_TRIES = 3  # feasible counts tried at most (4 was at most 0.13 % better on 30 mixed batches)
_MB_MIN_GAIN = 5e-3  # one more micro-batch must win by this fraction to keep the search going
_FINALISTS = 1  # best micro-batch counts (plus the fewest) finished and compared by placed makespans
_NEAR_BOUND = 1e-3  # a packing this close to the work bound ends the granularity search
_COARSEN_PATIENCE = 2  # packing granularities tried past the best before skipping to the coarsest


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
    items = samples_or_lengths if isinstance(samples_or_lengths, np.ndarray) else list(samples_or_lengths)
    if len(items) == 0:
        raise PlanningError("empty batch: there are no samples to plan")
    has_samples = not isinstance(items, np.ndarray) and any(isinstance(x, Sample) for x in items)
    lengths = sample_lengths(items) if has_samples else _plain_lengths(items)
    if etas is None:
        etas_arr = sample_etas(items) if has_samples else np.zeros(len(items))
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


def _plain_lengths(items: Any) -> np.ndarray:
    """Vectorised check of integer lengths (the per-item path names the first bad sample)."""
    try:
        arr = np.asarray(items)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu":
        return sample_lengths(items)  # slow path: floats, objects, mixed -> per-item errors
    bad = np.flatnonzero(arr < 0)
    if bad.size:
        raise ValueError(f"sample {int(bad[0])}: length must be >= 0, got {int(arr[bad[0]])}")
    return arr.astype(np.int64)


# ---------------------------------------------------------------------------------------------- dhp
def coarsen_factors(num_ranks: int) -> list[float]:
    """Packing granularities tried, finest first: 1, 2, 4, ... ranks' work per bin, then all ranks."""
    fs, f = [], 1
    while f < num_ranks:
        fs.append(float(f))
        f *= 2
    return fs + [float(num_ranks)]


def solve_microbatch(prob: Problem, idx: np.ndarray, allowed: np.ndarray, packing: bool = True,
                     do_refine: bool = True, factors: Sequence[float] | None = None
                     ) -> tuple[list[list[int]], np.ndarray, float, float] | None:
    """Groups (global sample ids), degrees and makespan of one micro-batch; None if it cannot fit.

    Packs at the granularities `factors` (default `coarsen_factors`; stopping once the makespan
    gets worse), allocates degrees exactly for each packing, keeps the best, then refines it and
    re-allocates. The fourth entry is the granularity that won.
    """
    N, cost = prob.num_ranks, prob.cost
    attn, lin, tok = prob.attn[idx], prob.lin[idx], prob.tok[idx]
    w, dm = prob.work[idx], prob.dmin[idx]
    order = np.lexsort((np.arange(len(idx)), -w))
    if packing:
        fs = list(coarsen_factors(N) if factors is None else factors)
        makers = [lambda f=f: pack(w, tok, dm, N, prob.cap, f, order) for f in fs]
    else:
        fs = [1.0]
        makers = [lambda: np.argsort(order, kind="stable")]  # every sequence its own bin
    # no packing beats the micro-batch's work spread evenly: makespan >= work / N + b1
    bound = float(w.sum()) / N + cost.b1
    best = None
    stale = 0
    for c, make in enumerate(makers):
        near = best is not None and best[2] <= bound * (1 + _NEAR_BOUND)
        if (near or stale >= _COARSEN_PATIENCE) and c < len(makers) - 1:
            # within a hair of the bound, or past the best granularity: only the coarsest (one
            # group on all ranks, a cheap allocation) is still tried
            continue
        assign = make()
        n = int(assign.max()) + 1
        if n > N:
            continue
        A, B, S = (np.bincount(assign, v, minlength=n) for v in (attn, lin, tok))
        dmin_bins = np.maximum(1, np.ceil(S / prob.cap - 1e-12)).astype(np.int64)  # = cost.min_degree(S)
        res = allocate_scored(A, B, S, dmin_bins, N, cost, allowed)
        if res is None:
            continue
        if best is None or res[1] < best[2]:
            best, stale = (assign, res[0], res[1], fs[c]), 0
        else:
            stale += 1
    if best is None:
        return None
    best = (bins_of(best[0], idx), best[1], best[2], best[3])
    return refine_microbatch(prob, best, allowed) if do_refine else best


def refine_microbatch(prob: Problem, sol: tuple, allowed: np.ndarray) -> tuple:
    """Re-balance a solved micro-batch (refine.py), re-allocate its degrees; keep it if better."""
    bins, deg, mk, f = sol
    new = [g for g in refine_groups(bins, deg, prob.attn, prob.lin, prob.tok, prob.cost) if g]
    if new != bins:
        res = _allocate_bins(prob, new, allowed)
        if res is not None and res[1] < mk:
            return (new, res[0], res[1], f)
        # the refined groups at their old degrees are never worse than before
        A, B, S = bin_sums(new, prob.attn, prob.lin, prob.tok)
        t_new = score(prob.cost, A, B, S, deg)
        if t_new < mk:
            return (new, deg, t_new, f)
    return sol


def _allocate_bins(prob: Problem, bins: list[list[int]], allowed: np.ndarray) -> tuple[np.ndarray, float] | None:
    A, B, S = bin_sums(bins, prob.attn, prob.lin, prob.tok)
    return allocate_scored(A, B, S, prob.cost.min_degree(S), prob.num_ranks, prob.cost, allowed)


def score(cost: CostModel, A: Any, B: Any, S: Any, deg: Any) -> float:
    """Makespan of one micro-batch's groups at degrees `deg` (lanes-aware: `CostModel.makespan`)."""
    return cost.makespan(cost.group_times(A, B, S, deg), deg)


def allocate_scored(A: Any, B: Any, S: Any, dmin: np.ndarray, num_ranks: int, cost: CostModel,
                    allowed: np.ndarray | None) -> tuple[np.ndarray, float] | None:
    """`allocate`, judged by the micro-batch makespan that the plan's estimates use.

    Without `compute_lanes` this is `allocate` itself (exact for max_g T_g). On shared cores the
    lanes cap (sum_g T_g min(d_g, p) / p) can make spare ranks a loss: extra degree only adds ring
    work on the same p cores. So the allocations on N/2, N/4, ... ranks and the one giving every
    bin its least allowed degree are scored too, and the lowest lanes-aware makespan is kept (ties:
    the full allocation). Exactness of `allocate` holds for the per-group model only.
    """
    res = allocate(A, B, S, dmin, num_ranks, cost, allowed)
    if res is None or cost.compute_lanes is None:
        return res
    ds = np.arange(1, num_ranks + 1) if allowed is None else np.asarray(allowed, dtype=np.int64)
    least = ds[np.searchsorted(ds, np.asarray(dmin, dtype=np.int64), side="left")]
    cands = [res[0]]
    n = num_ranks // 2
    while n >= int(least.sum()):
        r = allocate(A, B, S, dmin, n, cost, ds[ds <= n])
        if r is not None:
            cands.append(r[0])
        n //= 2
    cands.append(least)
    best = None
    for deg in cands:
        mk = score(cost, A, B, S, deg)
        if best is None or mk < best[1]:
            best = (np.asarray(deg, dtype=np.int64), mk)
    return best


def solve_dhp(prob: Problem, num_micro_batches: int | None = None, packing: bool = True, degrees: Any = "any",
              node_aware: bool = True, refine: bool = True, programs: ProgramCache | None = None
              ) -> tuple[list, dict[str, Any]]:
    """The "dhp" strategy: per micro-batch count (from the memory minimum upward, while one more
    micro-batch wins by at least _MB_MIN_GAIN and the work bound allows it) split the batch, pack
    and allocate every micro-batch; finish the best count and the fewest (refine, place, repair)
    and keep the one with the least placed step time."""
    N, cost = prob.num_ranks, prob.cost
    if isinstance(degrees, str) and degrees == "any" and cost.bucket_menu and cost.bucket_min:
        degrees = [d for d, _ in cost.bucket_menu]  # a menu of programs bounds the degrees too
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
    feasible: list[tuple[float, int, list]] = []
    stale = tries = 0
    all_f = coarsen_factors(N)
    factors = None  # the first count tries every granularity; later ones its winners' neighbours
    total_work = float(prob.work.sum())
    for M in counts:
        # M micro-batches take at least total work / N + M b1; stop once that cannot win enough
        if best is not None and total_work / N + M * cost.b1 >= best[0] * (1 - _MB_MIN_GAIN):
            break
        parts = microbatch.split(prob.work, M)
        sols = []
        for idx in parts:
            s = solve_microbatch(prob, idx, allowed, packing, False, factors)
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
        won = sorted({all_f.index(s[3]) for s in sols if s[3] in all_f})
        near = sorted({j for i in won for j in (i - 1, i, i + 1) if 0 <= j < len(all_f) - 1})
        factors = [all_f[j] for j in near] + [all_f[-1]]
        feasible.append((total, M, sols))
        if best is None or total < best[0] * (1 - _MB_MIN_GAIN):
            best, stale = (total, M, sols), 0
        else:
            stale += 1
        if stale >= _MB_PATIENCE or tries >= _MB_MAX_TRIES:
            break
    if best is None:
        raise PlanningError(f"no micro-batch split fits {N} ranks"
                            + (f" with num_micro_batches={num_micro_batches}" if num_micro_batches else ""))
    # the best few counts by allocation makespan are finished (refined, placed on nodes, repaired)
    # and judged by their placed makespans: placement can cost what the allocation did not see
    fewest = min(feasible, key=lambda x: x[1])  # refinement helps the fewest micro-batches most
    feasible.sort(key=lambda x: (x[0], x[1]))
    finalists = feasible[:_FINALISTS] + ([fewest] if fewest not in feasible[:_FINALISTS] else [])
    chosen = None
    for total, M, sols in finalists:
        done = [finish_microbatch(prob, s, allowed, refine, node_aware) for s in sols]
        actual = sum(d[2] for d in done) + _compile_price(prob, done, programs)
        if chosen is None or actual < chosen[0] * (1 - 1e-12):
            chosen = (actual, M, done, total)
    _, M, done, total = chosen
    mbs = [list(zip(ranks, groups)) for groups, ranks, _ in done]
    info: dict[str, Any] = {"num_micro_batches": M, "est_makespan_sum_s": chosen[0]}
    if cost.compute_lanes is not None and num_micro_batches is None and packing:
        mbs, info = _shared_lanes_fallback(prob, allowed, mbs, info)
    return mbs, info


def _shared_lanes_fallback(prob: Problem, allowed: np.ndarray, mbs: list, info: dict[str, Any]
                           ) -> tuple[list, dict[str, Any]]:
    """On shared cores also score the uniform ring plans of every allowed degree; keep the best.

    The packing balances unpadded work and the allocation is exact for max_g T_g only; with
    `compute_lanes` the padded buckets and the lanes cap can make a plain uniform packing better.
    Each candidate is judged by the same lanes-aware makespan sum (`CostModel.makespans`); the
    planner's own plan wins ties. Used only when `cost.compute_lanes` is set.
    """
    cost, N = prob.cost, prob.num_ranks

    def total(cand: list) -> float:
        plan = build_plan(cand, prob.lengths, prob.etas, cost, N, {})
        return sum(mb.est_makespan_s for mb in plan.micro_batches)

    best = (total(mbs), mbs, None)
    for d in baselines.static_degrees(N, cost, "ring"):
        if d not in allowed:
            continue
        try:
            cand = baselines.static_groups(prob.lengths, N, cost, d, "ring")
            t = total(cand)
        except (PlanningError, PlanValidationError):
            continue  # this degree does not fit the batch
        if t < best[0] * (1 - 1e-12):
            best = (t, cand, d)
    if best[2] is None:
        return mbs, {**info, "est_makespan_sum_s": best[0]}
    return best[1], {"num_micro_batches": len(best[1]), "est_makespan_sum_s": best[0],
                     "shared_lanes_uniform_degree": best[2]}


def _compile_price(prob: Problem, done: list, programs: ProgramCache | None) -> float:
    """Seconds a candidate pays for the programs it needs that no earlier plan needed."""
    if programs is None or not programs.compile_s:
        return 0.0
    keys = [(len(r), int(p), ()) for groups, ranks, _ in done for g, r in zip(groups, ranks)
            for p in padded_tokens(prob.tok[np.asarray(g, dtype=np.int64)].sum(), len(r), prob.cost).reshape(1)]
    return programs.compile_s * len(programs.new_programs(keys))


def finish_microbatch(prob: Problem, sol: tuple, allowed: np.ndarray, refine: bool, node_aware: bool
                      ) -> tuple[list[list[int]], list[tuple[int, ...]], float]:
    """Refine, place on ranks, shrink node-spanning groups where that is faster; placed makespan."""
    N, cost = prob.num_ranks, prob.cost
    if refine:
        sol = refine_microbatch(prob, sol, allowed)
    groups, deg = sol[0], [int(d) for d in sol[1]]
    ranks = place(deg, N, cost.ranks_per_node, node_aware)
    A, B, S = bin_sums(groups, prob.attn, prob.lin, prob.tok)
    rpn = cost.ranks_per_node
    inter = np.array([spans_nodes(r, rpn) for r in ranks], dtype=bool)
    times = cost.group_times(A, B, S, np.asarray(deg), inter)
    if node_aware:
        for i in np.flatnonzero(inter & (np.asarray(deg) <= rpn)).tolist():
            # a small group cut by a node boundary: its largest piece alone may be faster
            pieces: dict[int, list[int]] = {}
            for r in ranks[i]:
                pieces.setdefault(r // rpn, []).append(r)
            piece = max(pieces.values(), key=lambda p: (len(p), -p[0]))
            d = len(piece)
            if S[i] * cost.mem_per_token / d > cost.memory_budget:
                continue
            t = float(cost.group_times(A[i], B[i], S[i], d, False))
            if t < times[i]:
                ranks[i], times[i] = tuple(piece), t
    return groups, ranks, cost.makespan(times, [len(r) for r in ranks])


# ---------------------------------------------------------------------------------------------- API
def plan_batch(samples_or_lengths: Sequence[Sample] | Sequence[int] | np.ndarray, num_ranks: int, cost: CostModel,
               strategy: str = "dhp", *, ranks_per_node: int | None = None, etas: Sequence[float] | None = None,
               num_micro_batches: int | None = None, packing: bool = True, degrees: str | Sequence[int] = "any",
               node_aware: bool = True, refine: bool = True, time_limit_s: float | None = None,
               every_rank: bool = False, programs: ProgramCache | None = None) -> Plan:
    """Plan one global batch on `num_ranks` ranks with `strategy` (see STRATEGIES).

    Options (ablations of "dhp"): `num_micro_batches` fixes the count instead of searching it;
    `packing=False` makes every sequence its own atomic group; `degrees="pow2"` (or a list)
    restricts group degrees; `node_aware=False` places groups on consecutive ranks; `refine=False`
    skips the re-balancing. `time_limit_s` bounds the MILP of "milp"/"flexsp" only.
    `every_rank=True` is for executors in which every rank must run some group (the torch backend):
    a rank the plan would leave idle in every micro-batch (shared CPU lanes, node repairs, fewer
    samples than ranks) joins the slowest group instead.
    `programs` (a `ProgramCache` of the plans issued so far; the plan is recorded in it) makes the
    placement reuse compiled executables and prices new programs at `programs.compile_s` (see
    `dhp_jax.planner.programs`).
    """
    if not isinstance(strategy, str):
        raise PlanningError(f"strategy must be a string, got {strategy!r}")
    prob = prepare(samples_or_lengths, num_ranks, cost, etas, ranks_per_node)
    cost, N = prob.cost, prob.num_ranks
    t0, c0 = time.perf_counter(), time.thread_time()
    attention = "ring"
    extra: dict[str, Any] = {}
    if strategy == "dhp":
        mbs, extra = solve_dhp(prob, num_micro_batches, packing, degrees, node_aware, refine, programs)
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
    cpu_ms = (time.thread_time() - c0) * 1e3  # this thread's CPU: what a loaded machine does not inflate
    solver = {"strategy": strategy, "solve_ms": round(solve_ms, 3), "solve_cpu_ms": round(cpu_ms, 3), **extra}
    plan = build_plan(mbs, prob.lengths, prob.etas, cost, N, solver, attention)  # checks memory, vectorised
    if every_rank:
        plan = _use_every_rank(plan, prob, solver, attention)
    if programs is not None:
        plan = reuse_placement(plan, prob.lengths, prob.etas, cost, programs, attention)
    plan.validate(num_samples=len(prob.lengths))
    return plan


def reuse_placement(plan: Plan, lengths: Any, etas: Any, cost: CostModel, programs: ProgramCache,
                    attention: str = "ring") -> Plan:
    """The plan with equally fast rank tuples swapped so that groups land where their program is
    already compiled (`dhp_jax.planner.programs.reuse_ranks`; group times unchanged); the result
    is recorded in `programs`."""
    rpn = plan.ranks_per_node or plan.num_ranks
    mbs = []
    for mb in plan.micro_batches:
        ranks = reuse_ranks([(g.degree, g.padded_tokens, g.ranks) for g in mb.groups], rpn, programs)
        mbs.append([(r, list(g.samples)) for r, g in zip(ranks, mb.groups)])
    out = build_plan(mbs, np.asarray(lengths), np.zeros(len(lengths)) if etas is None else np.asarray(etas, float),
                     cost, plan.num_ranks, dict(plan.solver), attention)
    programs.add(out)
    return out


def _use_every_rank(plan: Plan, prob: Problem, solver: dict[str, Any], attention: str) -> Plan:
    """Give each rank that no group of any micro-batch uses to the group that is slowest at that
    moment (ring order kept, the new rank last); a larger degree never needs more memory per rank,
    so the plan stays within its budget. Estimates are rebuilt after every addition."""
    used = {r for g in plan.groups for r in g.ranks}
    idle = [r for r in range(plan.num_ranks) if r not in used]
    if not idle:
        return plan
    solver = {**solver, "every_rank_added": idle}
    for r in idle:
        m, i = max(((m, i) for m, mb in enumerate(plan.micro_batches) for i in range(len(mb.groups))),
                   key=lambda mi: (plan.micro_batches[mi[0]].groups[mi[1]].est_time_s, -mi[0], -mi[1]))
        mbs = [[(list(g.ranks) + ([r] if (k, j) == (m, i) else []), list(g.samples))
                for j, g in enumerate(mb.groups)] for k, mb in enumerate(plan.micro_batches)]
        plan = build_plan(mbs, prob.lengths, prob.etas, prob.cost, plan.num_ranks, solver, attention)
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
