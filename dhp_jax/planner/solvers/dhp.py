"""The "dhp" strategy: micro-batch count search (candidate splits per count, `microbatch.py`, ranked
by a step-time bound; then the best split with one micro-batch dissolved into the others, and local
moves of sequences between micro-batches) -> memory-aware packing
-> exact degree allocation -> refinement -> node-aware placement; then the static plans the options
allow as candidates (`static_candidates.py`; on shared CPU lanes they are also what a plain uniform
packing offers) and FlexSP-style packings (`flexsp_candidate.py`); last, the plan that won and the
search's own plan repacked at their own groups' ranks (`repack_plan`). Deterministic: no wall-clock limits.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Sequence

import numpy as np

from dhp_jax.planner.contract.plan import PlanningError, spans_nodes
from dhp_jax.planner.cost.memory import max_tokens_per_rank, min_degree
from dhp_jax.planner.cost.model import CostModel
from dhp_jax.planner.cost.pricing import (attention_for, best_kind_times, best_kinds, best_times, bin_sums, group_times, makespan,
                                         makespans, price_groups)
from dhp_jax.planner.programs.cache import ProgramCache
from dhp_jax.planner.solvers import microbatch
from dhp_jax.planner.solvers.allocate import allocate, allowed_degrees, scalar_time
from dhp_jax.planner.solvers.build import padded_tokens
from dhp_jax.planner.solvers.flexsp_candidate import best_flexsp
from dhp_jax.planner.solvers.packing import Packer, bins_of
from dhp_jax.planner.solvers.placement import place
from dhp_jax.planner.solvers.problem import Problem
from dhp_jax.planner.solvers.refine import refine as refine_groups
from dhp_jax.planner.solvers.static_candidates import best_static

_MB_PATIENCE = 1  # stop the micro-batch count search after this many counts without improvement
_MB_MAX_TRIES = 3  # feasible micro-batch counts tried at most
# One more micro-batch must win by this fraction of the summed makespans to keep the count search
# going (and to be tried at all, by its bound). Smaller gains are mostly erased by finishing the
# fewest count (moves, refinement), so a lower threshold costs solve time, not plan time.
_MB_MIN_GAIN = 2e-2
_FINALISTS = 1  # best micro-batch counts (plus the fewest) finished and compared by placed makespans
_NEAR_BOUND = 1e-3  # a packing this close to the work bound ends the granularity search
_COARSEN_PATIENCE = 2  # packing granularities tried past the best before skipping to the coarsest
_MOVES = 2  # local moves tried between micro-batches once the split is chosen
_ALONE_TOP = 32  # sequences whose time alone enters the split bound (the rest: their work / N + b1)
_SPLIT_MARGIN = 0.1  # another candidate split is solved only if its bound could win by this fraction
_DISSOLVE_SLACK = 0.02  # fill above the even share a dissolved micro-batch's sequences may first use
_MERGES = 2  # times the best split may lose a micro-batch by dissolving one into the others
_MOVE_NEAR = 0.05  # a move between micro-batches this close to their work bounds keeps their granularities

# Repacking a finished micro-batch at its own degrees (`repack_groups`): skipped where its ranks idle
# less than this fraction of its makespan (the groups already finish together); _REPACK False turns it off
_REPACK = True
_REPACK_IDLE = 2e-3
_REPACK_WAYS = (False, True)
_REPACK_SCALE_STEP = 0.05  # groups whose plan time / search price agree within this (log) share a class

_FINEST_MIN_RANKS = 32  # from this many ranks up the packings start at two ranks' work per bin


def coarsen_factors(num_ranks: int) -> list[float]:
    """Packing granularities tried, finest first: 1, 2, 4, ... ranks' work per bin, then all ranks.

    From _FINEST_MIN_RANKS ranks up the finest (one rank's work per bin) is left out: it rarely wins
    there, and its allocations (tens of groups each) are the costliest of the search."""
    fs, f = [], (2 if num_ranks >= _FINEST_MIN_RANKS else 1)
    while f < num_ranks:
        fs.append(float(f))
        f *= 2
    return fs + [float(num_ranks)]

def near_factors(sols: Sequence[tuple], all_f: Sequence[float]) -> list[float]:
    """The packing granularities worth trying on micro-batches like those of `sols`: the ones that
    won there and their neighbours in `all_f` (`coarsen_factors`), and always the coarsest."""
    won = sorted({all_f.index(s[3]) for s in sols if s[3] in all_f})
    near = sorted({j for i in won for j in (i - 1, i, i + 1) if 0 <= j < len(all_f) - 1})
    return [all_f[j] for j in near] + [all_f[-1]]


def solve_microbatch(prob: Problem, idx: np.ndarray, allowed: np.ndarray, packing: bool = True,
                     do_refine: bool = True, factors: Sequence[float] | None = None, limit: float = np.inf
                     ) -> tuple[list[list[int]], np.ndarray, float, float] | None:
    """Groups (global sample ids), degrees and makespan of one micro-batch; None if it cannot fit.

    Packs at the granularities `factors` (default `coarsen_factors`; stopping once the makespan
    gets worse), allocates degrees exactly for each packing, keeps the best, then refines it and
    re-allocates. The fourth entry is the granularity that won (0.0: every sequence alone, tried
    first whenever the micro-batch has no more sequences than ranks).

    `limit`: what the caller needs the makespan to come in under (a split or a move that cannot
    win otherwise). Each allocation is bounded by it and by the best so far, so a packing that
    cannot come in under either costs a few steps (`allocate`'s limit). A packing cut off by
    `limit` alone might still have beaten the best so far, so the granularity search goes on as if
    it had: every packing tried without the limit is still tried, and the result is the same
    whenever it comes in under `limit` (or, having tried more, better). None when nothing does.
    """
    N, cost = prob.num_ranks, prob.cost
    attn, lin, tok = prob.attn[idx], prob.lin[idx], prob.tok[idx]
    w, dm = prob.work[idx], prob.dmin[idx]
    order = np.lexsort((np.arange(len(idx)), -w))
    if packing:
        fs = [f for f in (coarsen_factors(N) if factors is None else factors) if f > 0]
        makers = [lambda f=f: _packing(prob, idx, order, f) for f in fs]
        if 1 < len(idx) <= N:
            # few sequences: each in its own group is a packing too (granularity 0), one the work
            # balance never makes when a light sequence fits beside a heavy one
            fs = [0.0] + fs
            makers = [lambda: np.argsort(order, kind="stable")] + makers
    else:
        fs = [1.0]
        makers = [lambda: np.argsort(order, kind="stable")]  # every sequence its own bin
    # no packing beats the micro-batch's work spread evenly: makespan >= work / N + b1
    bound = float(w.sum()) / N + cost.b1
    best = None
    stale = 0
    seen: dict[bytes, bool] = {}  # packings already allocated (granularities often agree): usable or not
    for c, make in enumerate(makers):
        near = best is not None and best[2] <= bound * (1 + _NEAR_BOUND)
        if (near or stale >= _COARSEN_PATIENCE) and c < len(makers) - 1:
            # within a hair of the bound, or past the best granularity: only the coarsest (one
            # group on all ranks, a cheap allocation) is still tried
            continue
        assign = make()
        key = assign.tobytes()
        if key in seen:  # the same packing again: its allocation cannot beat the best one
            stale += seen[key]
            continue
        seen[key] = False
        n = int(assign.max()) + 1
        if n > N:
            continue
        A, B, S = (np.bincount(assign, v, minlength=n) for v in (attn, lin, tok))
        dmin_bins = np.maximum(1, np.ceil(S / prob.cap - 1e-12)).astype(np.int64)  # = cost.min_degree(S)
        # bounded by the best so far: a packing that cannot beat it costs only a few raises
        res = allocate_scored(A, B, S, dmin_bins, N, cost, allowed, limit if best is None else min(best[2], limit),
                              prob.kind)
        if res is None:
            continue
        if res[1] == np.inf:  # cannot come in under the best so far, or under the limit
            seen[key] = True
            stale = 0 if best is None or best[2] > limit else stale + 1
            continue
        seen[key] = True
        if best is None or res[1] < best[2]:
            best, stale = (assign, res[0], res[1], fs[c]), 0
        else:
            stale += 1
    if best is None:
        return None
    best = (bins_of(best[0], idx), best[1], best[2], best[3])
    return refine_microbatch(prob, best, allowed) if do_refine else best

def _packing(prob: Problem, idx: np.ndarray, order: np.ndarray, f: float) -> np.ndarray:
    """`Packer` of the micro-batch `idx` (positions heaviest first: `order`) at granularity f, each
    (micro-batch, granularity) packed once per problem: the packing depends on neither the kind the
    search prices at nor the limits, so every search and move that meets it again reuses it."""
    key = (idx.tobytes(), f)
    got = prob.pack_cache.get(key)
    if got is None:
        packer = prob.packers.get(key[0])  # the set-up shared by the granularities
        if packer is None:
            packer = prob.packers[key[0]] = Packer(prob.work[idx], prob.tok[idx], prob.dmin[idx],
                                                              prob.num_ranks, prob.cap, order)
        got = prob.pack_cache[key] = packer(f)
    return got


def refine_microbatch(prob: Problem, sol: tuple, allowed: np.ndarray) -> tuple:
    """Re-balance a solved micro-batch (refine.py), re-allocate its degrees; keep it if better."""
    bins, deg, mk, f = sol
    new = [g for g in refine_groups(bins, deg, prob.attn, prob.lin, prob.tok, prob.cost, prob.kind) if g]
    if new != bins:
        res = _allocate_bins(prob, new, allowed, mk)
        if res is not None and res[1] < mk:
            return (new, res[0], res[1], f)
        # the refined groups at their old degrees are never worse than before
        A, B, S = bin_sums(new, prob.attn, prob.lin, prob.tok)
        t_new = score(prob.cost, A, B, S, deg, prob.kind)
        if t_new < mk:
            return (new, deg, t_new, f)
    return sol

def _allocate_bins(prob: Problem, bins: list[list[int]], allowed: np.ndarray, limit: float = np.inf
                   ) -> tuple[np.ndarray, float] | None:
    A, B, S = bin_sums(bins, prob.attn, prob.lin, prob.tok)
    return allocate_scored(A, B, S, min_degree(prob.cost, S), prob.num_ranks, prob.cost, allowed, limit, prob.kind)

def score(cost: CostModel, A: Any, B: Any, S: Any, deg: Any, kind: str = "ring") -> float:
    """Makespan of one micro-batch's groups at degrees `deg` (lanes-aware: `pricing.makespan`), each
    group on the ring or (`kind` "best") at its fastest kind (`pricing.best_times`)."""
    t = best_times(cost, A, B, S, deg) if kind == "best" else group_times(cost, A, B, S, deg)
    return makespan(cost, t, deg)

def allocate_scored(A: Any, B: Any, S: Any, dmin: np.ndarray, num_ranks: int, cost: CostModel,
                    allowed: np.ndarray | None, limit: float = np.inf, kind: str = "ring"
                    ) -> tuple[np.ndarray, float] | None:
    """`allocate`, judged by the micro-batch makespan that the plan's estimates use.

    Without `compute_lanes` this is `allocate` itself (exact for max_g T_g). On shared cores the
    lanes cap (sum_g T_g min(d_g, p) / p) can make spare ranks a loss: extra degree only adds ring
    work on the same p cores. So the allocations on N/2, N/4, ... ranks and the one giving every
    bin its least allowed degree are scored too, and the lowest lanes-aware makespan is kept (ties:
    the full allocation). Exactness of `allocate` holds for the per-group model only.
    `limit`: a result that cannot come in under it has makespan inf (`allocate`'s `limit`; on
    shared lanes the candidates are scored in full first). `kind`: how groups are priced ("ring", or
    "best": each at its fastest kind).
    """
    if cost.compute_lanes is None:
        return allocate(A, B, S, dmin, num_ranks, cost, allowed, kind, limit=limit)
    res = allocate(A, B, S, dmin, num_ranks, cost, allowed, kind)
    if res is None:
        return res
    ds = np.arange(1, num_ranks + 1) if allowed is None else np.asarray(allowed, dtype=np.int64)
    least = ds[np.searchsorted(ds, np.asarray(dmin, dtype=np.int64), side="left")]
    cands = [res[0]]
    n = num_ranks // 2
    while n >= int(least.sum()):
        r = allocate(A, B, S, dmin, n, cost, ds[ds <= n], kind)
        if r is not None:
            cands.append(r[0])
        n //= 2
    cands.append(least)
    best = None
    for deg in cands:
        mk = score(cost, A, B, S, deg, kind)
        if best is None or mk < best[1]:
            best = (np.asarray(deg, dtype=np.int64), mk)
    return best if best[1] < limit else (best[0], np.inf)

def solve_dhp(prob: Problem, num_micro_batches: int | None = None, packing: bool = True, degrees: Any = "any",
              node_aware: bool = True, refine: bool = True, programs: ProgramCache | None = None,
              attention: str = "ring") -> tuple[list, dict[str, Any], str]:
    """The "dhp" strategy: per micro-batch count (from the memory minimum upward, while one more
    micro-batch wins by at least _MB_MIN_GAIN and the work bound allows it) split the batch, pack
    and allocate every micro-batch; then dissolve one micro-batch of the lowest split into the
    others while that lowers it (at most _MERGES times, never below the memory minimum); finish the
    best count and the fewest (local moves, refine, place, repair) and keep the one with the least
    placed step time; then the static plans of the allowed degrees (`static_candidates.best_static`)
    and the FlexSP-style packings (`flexsp_candidate.best_flexsp`) replace it where one is faster by
    the same price, so that DHP is never slower than the best static plan or such a packing.
    `attention` ("ring" or "best", plan_batch's mode) names the kinds whose programs `programs`
    prices. Returns the micro-batches, the solver info ("chosen": "dhp" or the static
    plan that won, e.g. "static-best:8" or "flexsp-packing") and the attention mode to build the
    plan with (the given one, "ulysses" when "static-ulysses:<d>" won, "auto" for a packing on
    FlexSP's own kinds)."""
    N, cost = prob.num_ranks, prob.cost
    # the search prices each group on the kind the plan will give it: its fastest in "best" mode
    # (where a menu of programs fixes the kinds, the ring; the finished plans are priced on theirs)
    prob.kind = "best" if attention == "best" and not cost.geometry.menu_kinds else "ring"
    if isinstance(degrees, str) and degrees == "any" and cost.geometry.bucket_menu and cost.geometry.bucket_min:
        degrees = [d for d, _ in cost.geometry.bucket_menu]  # a menu of programs bounds the degrees too
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
    # the search prices each group on the kind the plan will give it, its fastest in "best" mode;
    # there the ring-priced search is run too, and the faster finished plan by the plan's own price
    # is kept (the first on ties): a search on the right prices can still take a path its packing
    # and count heuristics finish worse
    kinds = [prob.kind] + (["ring"] if prob.kind == "best" else [])
    runs = []
    for kind in kinds:
        prob.kind = kind
        runs.append(_search(prob, counts, lo, allowed, packing, refine, node_aware, programs, attention,
                            num_micro_batches))
    prob.kind = kinds[0]
    if len(runs) > 1:
        priced = []
        for (got, exact_run) in runs:
            if not exact_run:  # its plan's own price: every group on the kind the plan gives it
                kinds_run, spans = _kind_makespans(prob, got[2], attention)
                got = (sum(spans) + _compile_price(prob, got[2], programs, attention, kinds_run),) + got[1:]
            priced.append(got)
        chosen = min(priced, key=lambda c: c[0])  # the first of the least
        exact = True
    else:
        chosen, exact = runs[0]
    _, M, done, total = chosen
    mbs = [list(zip(ranks, groups)) for groups, ranks, _ in done]
    info: dict[str, Any] = {"num_micro_batches": M, "est_makespan_sum_s": chosen[0], "chosen": "dhp"}

    def price(cand: list | None, mode: str | None) -> float:
        # a plan as `build_plan` prices it (kinds of `mode`) plus its new programs; None: DHP's own
        got = done if cand is None else [([s for _, s in mb], [r for r, _ in mb], 0.0) for mb in cand]
        kinds, spans = _kind_makespans(prob, got, attention if mode is None else mode)
        return sum(spans) + _compile_price(prob, got, programs, attention, kinds)

    # the static plans of the allowed degrees are DHP plans too: one that is faster replaces the
    # search's (chosen[0] is the plan's price, but in "best" mode a lone finalist's is its ring price)
    static = best_static(prob, allowed, attention, num_micro_batches, packing, chosen[0], exact, price,
                         programs is None or not programs.compile_s)
    if static is not None:
        t, name, cand, mode, own = static
    else:
        t, name, cand, mode, own = chosen[0] if exact else None, "dhp", mbs, attention, None
    # FlexSP-style plans are DHP plans too: one that is faster replaces the best so far
    if attention == "best" and node_aware:
        if own is None:
            own = chosen[0] if exact else price(None, None)
        if t is None:
            t = own
        flex = best_flexsp(prob, allowed, attention, num_micro_batches, packing, node_aware, t, price)
        if flex is not None:
            t, name, cand, mode = flex
    # the plan that won and DHP's own plan, each repacked at its own groups' ranks where its ranks
    # idle (`repack_plan`): the fastest of these and the winner by the same price is kept
    repacked = False
    if _REPACK:
        if t is None:
            t = price(cand, mode)
        tries = [(name, cand, mode)] + ([("dhp", mbs, attention)] if name != "dhp" else [])
        for origin, plan, how in tries:
            for rp in repack_plan(prob, plan, how, np.inf if origin == name else t):
                t_new = price(rp, how)
                if t_new < t * (1 - 1e-12):
                    t, name, cand, mode, repacked = t_new, origin, rp, how, True
        if repacked and name == "dhp":
            mbs = cand
            info.update(est_makespan_sum_s=t, repacked=True)
    if name == "dhp":
        return mbs, info, attention
    return cand, {"num_micro_batches": len(cand), "est_makespan_sum_s": t, "chosen": name,
                  "dhp_search_makespan_sum_s": own, **({"repacked": True} if repacked else {})}, mode


def _search(prob: Problem, counts: Sequence[int], lo: int, allowed: np.ndarray, packing: bool, refine: bool,
            node_aware: bool, programs: ProgramCache | None, attention: str, num_micro_batches: int | None
            ) -> tuple[tuple, bool]:
    """DHP's own search with its groups priced on `prob.kind` (`solve_dhp`'s docstring: the count
    search, the dissolve step, the finalists finished and judged). Returns (placed price, count,
    finished micro-batches, search makespan sum) and whether that price is the plan's own (False: a
    lone finalist in "best" mode, priced as the search priced it)."""
    N, cost = prob.num_ranks, prob.cost
    best = None
    feasible: list[tuple[float, int, list]] = []
    stale = tries = 0
    all_f = coarsen_factors(N)
    factors = None  # the first count tries every granularity; later ones its winners' neighbours
    total_work = float(prob.work.sum())
    alone = alone_times(prob, allowed)
    for M in counts:
        # M micro-batches take at least total work / N + M b1; stop once that cannot win enough
        if best is not None and total_work / N + M * cost.b1 >= best[0] * (1 - _MB_MIN_GAIN):
            break
        got = _solve_split(prob, M, allowed, packing, factors, alone,
                           np.inf if best is None else best[0] * (1 - _MB_MIN_GAIN),
                           np.inf if best is None else best[0])
        if got is None:
            if best is not None:
                stale += 1
                if stale >= _MB_PATIENCE:
                    break
            continue
        tries += 1
        total, sols = got
        factors = near_factors(sols, all_f)
        feasible.append((total, M, sols))
        if best is None or total < best[0] * (1 - _MB_MIN_GAIN):
            best, stale = (total, M, sols), 0
        else:
            stale += 1
        if stale >= _MB_PATIENCE or tries >= _MB_MAX_TRIES:
            break
    if best is None:
        if num_micro_batches is not None and num_micro_batches < lo:
            raise PlanningError(
                f"num_micro_batches={num_micro_batches} is too few for this batch: its {len(prob.lengths)} samples "
                f"need activation memory for {float(prob.tok.sum()):.0f} tokens, {N} ranks hold at most "
                f"{N * prob.cap:.0f} at once ({prob.cap:.0f} per rank), so it needs at least {lo} micro-batches; "
                f"leave num_micro_batches unset (the planner picks the count) or set it to {lo} or more")
        raise PlanningError(f"no micro-batch split fits {N} ranks"
                            + (f" with num_micro_batches={num_micro_batches}" if num_micro_batches else ""))
    low = min(feasible, key=lambda x: (x[0], x[1]))
    for _ in range(_MERGES if num_micro_batches is None else 0):
        # one micro-batch fewer: the lowest split with one micro-batch dissolved into the others
        if low[1] <= lo:
            break
        got = dissolve_micro_batch(prob, low[2], allowed, packing, near_factors(low[2], all_f), low[0], alone)
        if got is None:
            break
        low = (got[0], low[1] - 1, got[1])
        feasible.append(low)
    # the best few counts by allocation makespan are finished (refined, placed on nodes, repaired)
    # and judged by their placed makespans: placement can cost what the allocation did not see
    fewest = min(feasible, key=lambda x: x[1])  # refinement helps the fewest micro-batches most
    feasible.sort(key=lambda x: (x[0], x[1]))
    finalists = feasible[:_FINALISTS] + ([fewest] if fewest not in feasible[:_FINALISTS] else [])
    chosen = None
    for total, M, sols in finalists:
        if num_micro_batches is None:
            sols = move_sequences(prob, sols, allowed, packing, None)
        done = [finish_microbatch(prob, s, allowed, refine, node_aware) for s in sols]
        # judged as the plan will be priced: with each group's fastest attention kind in "best" mode
        # (a count that loses on the ring can win once its wide groups use all-to-all); a lone
        # finalist needs no judging
        kinds, spans = (_kind_makespans(prob, done, attention) if attention == "best" and len(finalists) > 1
                        else (None, [d[2] for d in done]))
        actual = sum(spans) + _compile_price(prob, done, programs, attention, kinds)
        if chosen is None or actual < chosen[0] * (1 - 1e-12):
            chosen = (actual, M, done, total)
    return chosen, attention == "ring" or len(finalists) > 1

def alone_times(prob: Problem, allowed: np.ndarray) -> np.ndarray:
    """A lower bound on each sequence's time in any group (float64[K], vectorised): its least time
    alone on any allowed degree it fits for the _ALONE_TOP heaviest, work / N + b1 for the rest (no
    group is faster than its work spread over all N ranks, and only heavy sequences make the bound).
    Kept per kind on the problem: the "best" search prices the ring's times on the way, which are
    the ring search's."""
    key = (prob.kind, allowed.tobytes())
    got = prob.alone_cache.get(key)
    if got is not None:
        return got.copy()
    ds = allowed.astype(np.float64)
    out = prob.work / prob.num_ranks + prob.cost.b1
    ring = out.copy()
    top = np.argsort(-prob.work, kind="stable")[:_ALONE_TOP]
    # = pricing.group_times (or best_times) on the search's kind (`_ScalarTime.times`: the same floats)
    out[top], ring_top = scalar_time(prob.cost, prob.kind).least(prob.attn[top, None], prob.lin[top, None],
                                                                  prob.tok[top, None], allowed[None, :],
                                                                  ds[None, :] >= prob.dmin[top, None])
    prob.alone_cache[key] = out.copy()
    if ring_top is not None:
        ring[top] = ring_top
        prob.alone_cache[("ring", key[1])] = ring
    return out


def part_bounds(prob: Problem, parts: Sequence[np.ndarray], alone: np.ndarray) -> np.ndarray:
    """A lower bound on each micro-batch's makespan: its work spread over all N ranks plus b1, and
    at least its slowest sequence alone."""
    N, b1 = prob.num_ranks, prob.cost.b1
    return np.asarray([max(float(prob.work[p].sum()) / N + b1, float(alone[p].max())) for p in parts])


def solve_parts(prob: Problem, parts: Sequence[np.ndarray], allowed: np.ndarray, packing: bool,
                factors: Sequence[float] | None, bounds: np.ndarray, limit: float = np.inf) -> tuple[float, list] | None:
    """Every micro-batch of `parts` solved (packed, allocated; not refined) and the summed makespans;
    None when one does not fit, or as soon as the makespans so far plus the `bounds` (lower bounds
    per part) of the rest reach `limit` (the split cannot come in under it)."""
    rest = float(np.sum(bounds))
    done, sols = 0.0, []
    for idx, b in zip(parts, bounds.tolist()):
        if done + rest >= limit:
            return None
        # this micro-batch must come in under what the others' makespans and bounds leave
        s = solve_microbatch(prob, idx, allowed, packing, False, factors, limit - done - (rest - b))
        if s is None:
            return None
        sols.append(s)
        done += s[2]
        rest -= b
    return (done, sols) if done < limit else None


def _solve_split(prob: Problem, M: int, allowed: np.ndarray, packing: bool, factors: Sequence[float] | None,
                 alone: np.ndarray, cutoff: float = np.inf, limit: float = np.inf) -> tuple[float, list] | None:
    """The best candidate split for M micro-batches (`microbatch.candidates`), each micro-batch solved
    (packed, allocated; not yet refined); candidates are solved in order of their bound (the sum of `part_bounds`) until the
    next bound cannot win by more than _SPLIT_MARGIN, and never when the bound reaches `cutoff` (what
    another count must beat). A candidate is abandoned once its bound shows it cannot come in under
    `limit` (what another count achieved) or the best candidate so far. None when no candidate fits
    or none comes in under the cutoff and limit."""
    cands = prob.split_cache.get(M)
    if cands is None:  # the same for every search of this problem
        cands = prob.split_cache[M] = microbatch.candidates(prob.work, prob.tok, M, prob.num_ranks, prob.cap,
                                                            prob.orders())
    if not cands:
        return None
    ranked = sorted(((part_bounds(prob, parts, alone), i, parts) for i, (_, parts) in enumerate(cands)),
                    key=lambda c: (float(c[0].sum()), c[1]))
    best = None
    for bounds, _, parts in ranked:
        bound = float(bounds.sum())
        if bound >= cutoff or (best is not None and bound >= best[0] * (1 - _SPLIT_MARGIN)):
            break
        got = solve_parts(prob, parts, allowed, packing, factors, bounds, min(limit, np.inf if best is None else best[0]))
        if got is not None:
            best = got
    return best


def dissolve_micro_batch(prob: Problem, sols: list, allowed: np.ndarray, packing: bool,
                        factors: Sequence[float] | None, total: float, alone: np.ndarray
                        ) -> tuple[float, list] | None:
    """The solved split `sols` with one micro-batch fewer, if that lowers the summed makespans below
    `total`: the micro-batch of least makespan is dissolved, its sequences (heaviest first) each
    going to the micro-batch of least estimated makespan (makespan + added work / N) that has
    memory room; the micro-batches that received sequences are solved again. None when a sequence
    fits nowhere or the result is not lower. The count search climbs from the token bound and
    stops at the first count that does not win; this is its step back from the count it kept,
    with a split that keeps that count's placement of the long sequences."""
    N, room = prob.num_ranks, prob.num_ranks * prob.cap
    M = len(sols)
    if M < 2:
        return None
    parts = [np.asarray(sorted(k for g in s[0] for k in g), dtype=np.int64) for s in sols]
    mk = np.asarray([s[2] for s in sols])
    src = int(np.argmin(mk))
    keep = [m for m in range(M) if m != src]
    est = mk[keep].tolist()
    tok = [float(prob.tok[parts[m]].sum()) for m in keep]
    moved = parts[src][np.lexsort((parts[src], -prob.work[parts[src]]))]
    dest = np.empty(len(moved), dtype=np.int64)
    # an even fill first: a micro-batch near its memory cap needs large, slow groups
    even = min(room, float(prob.tok.sum()) / (M - 1) * (1 + _DISSOLVE_SLACK))
    near = range(M - 1)
    for i, (tk, wk) in enumerate(zip(prob.tok[moved].tolist(), prob.work[moved].tolist())):
        ok = [j for j in near if tok[j] + tk <= even] or [j for j in near if tok[j] + tk <= room]
        if not ok:
            return None
        j = min(ok, key=est.__getitem__)  # the first of the least estimates
        dest[i] = j
        est[j] += wk / N
        tok[j] += tk
    hit = [j for j in range(M - 1) if np.any(dest == j)]
    grown = [np.sort(np.concatenate([parts[keep[j]], moved[dest == j]])) for j in hit]
    same = sum(float(mk[keep[j]]) for j in range(M - 1) if j not in hit)
    got = solve_parts(prob, grown, allowed, packing, factors, part_bounds(prob, grown, alone),
                      total * (1 - 1e-9) - same)
    if got is None:
        return None
    new = [sols[m] for m in keep]
    for j, s in zip(hit, got[1]):
        new[j] = s
    return same + got[0], new


def move_sequences(prob: Problem, sols: list, allowed: np.ndarray, packing: bool,
                   factors: Sequence[float] | None) -> list:
    """Local moves between solved micro-batches, scored by the estimated step time: the micro-batch
    furthest above its work bound (makespan - work / N - b1) hands its heaviest, then its lightest,
    sequence to the one least above its bound that has memory room; both are solved again and the
    move is kept when their makespans sum lower. At most _MOVES tries (deterministic order).

    Granularities (`factors` None): when both micro-batches are within _MOVE_NEAR of their work
    bounds (makespan - work / N - b1 below that fraction of the makespan), one sequence more or
    less keeps the packing that fits them, so they are solved again at the granularities that won
    for them (trying their neighbours too costs solve time and rarely changes the plan). A
    micro-batch further above its bound is held back by memory or a long sequence, and a move can
    change which granularity fits it best, so then every granularity is tried."""
    N, b1, room = prob.num_ranks, prob.cost.b1, prob.num_ranks * prob.cap
    parts = [np.asarray(sorted(k for g in s[0] for k in g), dtype=np.int64) for s in sols]
    sols = list(sols)
    tries = 0
    while tries < _MOVES and len(sols) > 1:
        excess = [s[2] - float(prob.work[p].sum()) / N - b1 for s, p in zip(sols, parts)]
        src = int(np.argmax(excess))
        dsts = [m for m in np.argsort(excess, kind="stable").tolist()
                if m != src and float(prob.tok[parts[m]].sum()) < room]
        if not dsts:
            return sols
        dst = dsts[0]
        free = room - float(prob.tok[parts[dst]].sum())
        movable = parts[src][prob.tok[parts[src]] <= free]
        if movable.size == 0 or parts[src].size == 1:
            return sols
        w = prob.work[movable]
        moved = False
        for k in dict.fromkeys((int(movable[np.argmax(w)]), int(movable[np.argmin(w)]))):
            tries += 1
            a = parts[src][parts[src] != k]
            b = np.sort(np.append(parts[dst], k))
            limit = (sols[src][2] + sols[dst][2]) * (1 - 1e-9)
            # no solve of b comes in under its work bound: b is solved only if the move can still win
            bound_b = float(prob.work[b].sum()) / N + b1
            fs = factors
            if fs is None and max(excess[src] / sols[src][2], excess[dst] / sols[dst][2]) < _MOVE_NEAR:
                fs = sorted({sols[src][3], sols[dst][3]})
            sa = solve_microbatch(prob, a, allowed, packing, False, fs, limit - bound_b)
            sb = None if sa is None or sa[2] + bound_b >= limit else \
                solve_microbatch(prob, b, allowed, packing, False, fs, limit - sa[2])
            if sa is not None and sb is not None and sa[2] + sb[2] < limit:
                parts[src], parts[dst], sols[src], sols[dst] = a, b, sa, sb
                moved = True
                break
            if tries >= _MOVES:
                break
        if not moved:
            return sols
    return sols


def _groups(done: list) -> list[tuple[tuple[int, ...], list[int]]]:
    """(ranks, sample ids) of every group of finished micro-batches, in order."""
    return [(tuple(r), g) for gs, ranks, _ in done for g, r in zip(gs, ranks)]


def _kinds(prob: Problem, done: list, attention: str) -> list[str]:
    """The attention kind `build_plan` gives each group of finished micro-batches (`_groups` order):
    the fastest one (`pricing.best_kinds`) in "best" mode, else `attention_for`."""
    groups = _groups(done)
    if attention == "best":
        return best_kinds(prob.cost, groups, (prob.attn, prob.lin, prob.tok))
    return [attention_for(len(r), prob.cost, attention) for r, _ in groups]


def _kind_group_times(prob: Problem, done: list, attention: str) -> tuple[list[str], np.ndarray]:
    """The kinds `_kinds` gives the groups of finished micro-batches and each group's time on its
    kind (`_groups` order), as `build_plan` prices them."""
    groups = _groups(done)
    terms = (prob.attn, prob.lin, prob.tok)
    if attention == "best":
        return best_kind_times(prob.cost, groups, terms)
    kinds = [attention_for(len(r), prob.cost, attention) for r, _ in groups]
    return kinds, price_groups(prob.cost, groups, terms, kinds, prob.cost.ranks_per_node)[0]


def _kind_makespans(prob: Problem, done: list, attention: str) -> tuple[list[str], list[float]]:
    """The kinds `_kinds` gives the groups of finished micro-batches and the makespan of each
    micro-batch with every group on its kind, as `build_plan` prices the plan."""
    kinds, t = _kind_group_times(prob, done, attention)
    d = np.fromiter((len(r) for _, ranks, _ in done for r in ranks), dtype=np.int64)
    mb = np.repeat(np.arange(len(done)), [len(gs) for gs, _, _ in done])
    return kinds, makespans(prob.cost, t, d, mb, len(done)).tolist()


def _compile_price(prob: Problem, done: list, programs: ProgramCache | None, attention: str = "ring",
                   kinds: list[str] | None = None) -> float:
    """Seconds a candidate pays for the programs (degree, padded tokens, attention kind) it needs
    that no earlier plan needed (at the padded length the executor runs, `ProgramCache.padded`);
    the kinds are those `build_plan` will give its groups (`_kinds`, computed here unless given)."""
    if programs is None or not programs.compile_s:
        return 0.0
    groups = _groups(done)
    if kinds is None:
        kinds = _kinds(prob, done, attention)
    keys = [(len(r), programs.padded(len(r), g, padded_tokens(prob.tok[np.asarray(g, dtype=np.int64)].sum(), len(r),
                                                              prob.cost)), (), kind)
            for (r, g), kind in zip(groups, kinds)]
    return programs.compile_s * len(programs.new_programs(keys))


def finish_microbatch(prob: Problem, sol: tuple, allowed: np.ndarray, refine: bool, node_aware: bool
                      ) -> tuple[list[list[int]], list[tuple[int, ...]], float]:
    """Refine, place on ranks, shrink node-spanning groups where that is faster; placed makespan."""
    if refine:
        sol = refine_microbatch(prob, sol, allowed)
    return _place_priced(prob, sol[0], [int(d) for d in sol[1]], node_aware)


def repack_groups(prob: Problem, groups: list[list[int]], deg: list[int], mk: float | None = None,
                  times: np.ndarray | None = None, by_work: bool = False) -> tuple[list[list[int]], float] | None:
    """The sequences of one micro-batch dealt again over its groups at their degrees `deg`: heaviest
    first (ties by id), each to the group in which it would finish first among those whose memory
    holds it (degree at least its least degree, tokens within the degree's share), each group priced
    by the search's pricing (`allocate.scalar_time` on `prob.kind`).

    `times`: the groups' times as the plan prices them (placed on ranks, on their kinds); a group
    whose time differs from the search's price of it (a group cut by a node boundary, a kind the
    search does not price) is priced at the search's price scaled by that ratio. Without `times` the
    search's prices are the groups' times. `mk`: the micro-batch's makespan (the largest time unless
    given).

    Returns the new groups (sample ids sorted) and their predicted makespan when every group holds
    a sequence and that makespan is below `mk`; else None. Skipped (None) where the groups' ranks
    idle less than _REPACK_IDLE of the makespan: their finishing times leave nothing to win.
    Among groups of one degree and one scale the least loaded finishes a sequence first, so each
    sequence prices one group per such class. `by_work`: "finish first" judged by the groups' work
    over their degrees plus b1 (scaled as above) instead of their priced times, which the padded
    buckets make step-shaped; the dealt groups are priced either way."""
    P = len(groups)
    if P < 2:
        return None
    cost = prob.cost
    t = scalar_time(cost, prob.kind)
    deg_a = np.asarray(deg, dtype=np.int64)
    A, B, S = bin_sums(groups, prob.attn, prob.lin, prob.tok)
    own = (t.times(A, B, S, deg_a) if t.tabled else
           np.asarray([t(float(A[i]), float(B[i]), float(S[i]), int(deg[i])) for i in range(P)], dtype=np.float64))
    T = own if times is None else np.asarray(times, dtype=np.float64)
    if mk is None:
        mk = makespan(cost, T, deg_a)
    if not np.isfinite(mk) or mk <= 0 or not np.all(own > 0):
        return None
    if float(np.dot(deg_a, mk - T)) < _REPACK_IDLE * mk * float(deg_a.sum()):
        return None
    ratio = (T / own).tolist()
    ids = np.fromiter((k for g in groups for k in g), dtype=np.int64)
    ids = ids[np.lexsort((ids, -prob.work[ids]))]
    per_rank = max_tokens_per_rank(cost)
    attn, lin, tok = prob.attn.tolist(), prob.lin.tolist(), prob.tok.tolist()
    dmin = prob.dmin.tolist()
    a, b, s, cur = [0.0] * P, [0.0] * P, [0.0] * P, [0.0] * P  # cur: each group's time so far (0: empty)
    cap = [d * per_rank for d in deg]
    b1 = cost.b1
    scale = [1.0 if abs(r - 1.0) < 1e-12 else r for r in ratio]
    # groups of one degree whose scales agree within _REPACK_SCALE_STEP form a class; each class a
    # lazy heap of (time so far, group): an entry whose time is stale is skipped
    cls = [(d, round(math.log(r) / _REPACK_SCALE_STEP)) for d, r in zip(deg, scale)]
    classes: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for i, c in enumerate(cls):
        classes.setdefault(c, []).append((0.0, i))
    keys = sorted(classes)
    out: list[list[int]] = [[] for _ in range(P)]
    dense = bool(cost.padded_attention)
    for k in ids.tolist():
        ak, bk, sk, dk = attn[k], lin[k], tok[k], dmin[k]
        tops = []  # per class, its least loaded group with room and that group's floor
        for key in keys:
            d = key[0]
            if d < dk:
                continue
            h = classes[key]
            while h and h[0][0] != cur[h[0][1]]:
                heapq.heappop(h)
            j = h[0][1] if h else -1
            if j < 0 or s[j] + sk > cap[j]:  # the least loaded has no room: the least loaded that has
                room = [i for ti, i in h if ti == cur[i] and s[i] + sk <= cap[i]]
                if not room:
                    continue
                j = min(room, key=lambda i: (cur[i], i))
            # no group is faster than its work over its ranks plus b1 (the dense blocks of a padded
            # stream: its linear work alone); "by work" this is the criterion itself
            w = (b[j] + bk) if dense and not by_work else (a[j] + ak + b[j] + bk)
            tops.append(((w / d + b1) * scale[j], j))
        if not tops:
            return None
        if by_work:
            best = min(tops)
        else:
            tops.sort()
            best = None
            for floor, j in tops:
                if best is not None and floor > best[0]:
                    break
                tj = t(a[j] + ak, b[j] + bk, s[j] + sk, deg[j]) * scale[j]
                if best is None or tj < best[0] or (tj == best[0] and j < best[1]):
                    best = (tj, j)
        if best is None:
            return None
        tj, j = best
        out[j].append(k)
        a[j] += ak
        b[j] += bk
        s[j] += sk
        cur[j] = tj
        heapq.heappush(classes[cls[j]], (tj, j))
    if any(not g for g in out):
        return None
    if by_work:  # the groups' times priced
        A, B, S = bin_sums(out, prob.attn, prob.lin, prob.tok)
        cur = (t.times(A, B, S, deg_a) if t.tabled else np.asarray(
            [t(float(A[i]), float(B[i]), float(S[i]), int(deg[i])) for i in range(P)])) * np.asarray(scale)
    new = makespan(cost, np.asarray(cur), deg_a)
    return ([sorted(g) for g in out], new) if new < mk * (1 - 1e-12) else None


def repack_plan(prob: Problem, cand: list, attention: str, limit: float = np.inf) -> list[list]:
    """A finished plan (micro-batches of (ranks, sample ids)) with each micro-batch whose ranks idle
    repacked at its own groups' ranks (`repack_groups`, each group's time as the plan prices it on
    the kinds of `attention`), once per way of judging "finish first" (priced times, work over
    degree): the plans that differ from `cand` (none, one or two). None is tried where the plan's
    micro-batches, each at its groups' mean time (weighted by degree: what a perfect balance of
    their times would reach), sum to `limit` or more. The caller keeps one only if the plan's own
    price is lower."""
    out: list[list] = []
    groups = [[list(g) for _, g in mb] for mb in cand]
    degs = [[len(r) for r, _ in mb] for mb in cand]
    times = [_kind_group_times(prob, [(gs, [r for r, _ in mb], 0.0)], attention)[1] for gs, mb in zip(groups, cand)]
    if limit < np.inf and sum(float(np.dot(t, d)) / sum(d) for t, d in zip(times, degs)) >= limit:
        return out
    for by_work in _REPACK_WAYS:
        new, changed = [], False
        for mb, gs, deg, t in zip(cand, groups, degs, times):
            got = repack_groups(prob, gs, deg, None, t, by_work)
            if got is None:
                new.append(mb)
            else:
                new.append([(r, g) for (r, _), g in zip(mb, got[0])])
                changed = True
        if changed and new not in out:
            out.append(new)
    return out


def _place_priced(prob: Problem, groups: list[list[int]], deg: list[int], node_aware: bool
                  ) -> tuple[list[list[int]], list[tuple[int, ...]], float]:
    """Groups at degrees `deg` placed on ranks (a node-spanning group shrunk to its largest piece
    where that is faster), and their placed makespan."""
    N, cost = prob.num_ranks, prob.cost
    ranks = place(deg, N, cost.ranks_per_node, node_aware)
    A, B, S = bin_sums(groups, prob.attn, prob.lin, prob.tok)
    rpn = cost.ranks_per_node
    inter = np.array([spans_nodes(r, rpn) for r in ranks], dtype=bool)
    deg_a = np.asarray(deg)
    st = scalar_time(cost, prob.kind)
    if st.tabled and np.array_equal(inter, deg_a > rpn):  # the search's tables, the same floats
        times = st.times(A, B, S, deg_a)
    else:
        times = (best_times(cost, A, B, S, deg_a, inter) if prob.kind == "best"
                 else group_times(cost, A, B, S, deg_a, inter))
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
            t = st(float(A[i]), float(B[i]), float(S[i]), d)  # d <= ranks_per_node: inside one node
            if t < times[i]:
                ranks[i], times[i] = tuple(piece), t
    return groups, ranks, makespan(cost, times, [len(r) for r in ranks])
