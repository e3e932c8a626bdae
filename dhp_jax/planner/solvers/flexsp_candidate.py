"""FlexSP-style packings as candidates of the "dhp" strategy.

FlexSP's planner (`flexsp.py`, after FlexSP, arXiv 2412.01523) cuts the length-sorted batch into
micro-batches of about equal tokens and gives each micro-batch power-of-two sequence-parallel
groups, all-to-all where the head count allows it. Such a plan is a valid DHP plan: groups of
power-of-two degrees are points of DHP's search space, and their kinds are kinds a DHP group may
run. `solve_dhp` hands its best plan so far (its search's, or a static plan's) to `best_flexsp`,
which keeps a FlexSP-style packing when that is faster under the objective DHP minimises (summed
micro-batch makespans as `build_plan` prices them plus new programs' compile prices), priced with
FlexSP's own kinds and with each group on its fastest kind (`pricing.best_kinds`), the lower of
the two. The earlier plan wins ties.

The packings (`homogeneous_plans`): for the micro-batch counts FlexSP tries, its length-sorted
micro-batches, each packed onto the N / d groups of one power-of-two degree d (longest sequence
first onto the least loaded group with memory room: the plan FlexSP's MILP starts from), the d of
least makespan per micro-batch, re-balanced by DHP's refinement (`refine.py`) where the packing
alone does not come in under the price to beat (so which packings are re-balanced does not depend
on how close that price is). FlexSP's groups in one micro-batch may also mix degrees, which one
degree leaves out where the ranks are not a power of two (14 ranks: 8 + 4 + 2, `_mixed`, `_cuts`);
so there, and for micro-batches of a few sequences on any rank count (in batches of at most
_ALT_MAX_BATCH sequences, where FlexSP's exact assignment matters most), mixed cuts are packed too
(each sequence onto the group where it would finish first), and a micro-batch of at most
_EXCHANGE_MAX sequences near the price it must beat is improved by moves and swaps of single
sequences out of its slowest group (`_exchange`), the local counterpart of FlexSP's exact
assignment (`_alternative`). Where that is faster for some micro-batch, the count offers a second
packing with those micro-batches beside the homogeneous one: mixed degrees need programs the
homogeneous packing does not, which the exact price (compile prices included) weighs. They cost milliseconds; FlexSP's MILPs (hundreds of milliseconds to seconds
each) are not solved for DHP, so DHP is never slower than these packings by construction, and
than FlexSP's own plan only where its MILP finds nothing better than these packings.
"""

from __future__ import annotations

import heapq
from typing import Callable

import numpy as np

from dhp_jax.planner.cost.pricing import attention_for, bin_sums, group_times, kind_times
from dhp_jax.planner.solvers import microbatch
from dhp_jax.planner.solvers.allocate import allowed_degrees
from dhp_jax.planner.solvers.flexsp import alone_bounds, flexsp_counts
from dhp_jax.planner.solvers.placement import place
from dhp_jax.planner.solvers.problem import Problem
from dhp_jax.planner.solvers.refine import refine as refine_groups

__all__ = ["best_flexsp", "homogeneous_plans"]

_MIXED_MAX = 256  # micro-batches of at most this many sequences are also packed on mixed degrees
_MIXED_GROUPS = 16  # mixed-degree packings of at most this many groups
_ALT_MAX_BATCH = 64  # batches of at most this many sequences also get mixed and exchanged packings
_EXCHANGE_MAX = 48  # micro-batches of at most this many sequences are improved by moves and swaps
_EXCHANGE_NEAR = 0.05  # packings this far above what they must beat are not exchanged
_EXCHANGED_CUTS = 1  # mixed cuts whose packings `_exchange` improves (a few sequences)
_EXCHANGE_ROUNDS = 8  # rounds of `_exchange` at most
_DROPPED = 2  # counts in a row that give no plan under the limit end the homogeneous packings' search


def _lpt(order: np.ndarray, t: list[float], tok: list[float], slots: int, room: float) -> list[list[int]] | None:
    """Sequences (`order`, longest first; their times `t` and tokens `tok`) each onto the least
    loaded of `slots` groups that still has memory room (ties: the lower group); None when one fits
    nowhere. The used groups' sequences, in group order."""
    seq = order.tolist()
    heap = [(0.0, p) for p in range(slots)]
    left = [room] * slots
    groups: list[list[int]] = [[] for _ in range(slots)]
    n0 = min(slots, len(seq))
    if n0 and min(t[:n0]) > 0.0 and max(tok[:n0]) * (1 - 1e-12) <= room:
        # the first `slots` sequences each open the next empty group (ties go to the lower group,
        # and a group with a sequence is loaded): what the loop below does one step at a time
        for p in range(n0):
            groups[p].append(seq[p])
            left[p] = room - tok[p]
            heap[p] = (t[p], p)
        heapq.heapify(heap)
    else:
        n0 = 0
    replace, pop, push = heapq.heapreplace, heapq.heappop, heapq.heappush
    for k, tk, tt in zip(seq[n0:], tok[n0:], t[n0:]):
        need = tk * (1 - 1e-12)
        load, p = heap[0]
        if left[p] >= need:  # the least loaded group has room (the common case): one heap step
            groups[p].append(k)
            left[p] -= tk
            replace(heap, (load + tt, p))
            continue
        full = []
        while heap and left[heap[0][1]] < need:
            full.append(pop(heap))
        if not heap:
            return None
        load, p = pop(heap)
        groups[p].append(k)
        left[p] -= tk
        push(heap, (load + tt, p))
        for item in full:
            push(heap, item)
    return [g for g in groups if g]


def _price(cost, groups: list[list[int]], degs: np.ndarray, kind: str | None, terms: tuple) -> float:
    """Makespan of `groups` on degrees `degs`, each on `kind` (None: FlexSP's kind for its degree)."""
    A, B, S = bin_sums(groups, *terms)
    if kind is not None:
        return float(group_times(cost, A, B, S, degs, attention=kind).max())
    kinds = [attention_for(int(d), cost, "auto") for d in degs.tolist()]
    return float(kind_times(cost, A, B, S, degs, degs > cost.ranks_per_node, kinds).max())


def _exchange(prob: Problem, groups: list[list[int]], degs: np.ndarray, kind: str | None
              ) -> tuple[list[list[int]], float]:
    """Groups (degrees fixed) improved by single moves and pairwise swaps: the slowest group hands
    one sequence to another group, or swaps one with it, whichever pair of new times has the least
    maximum below the makespan (memory permitting; ties: the first candidate); at most
    _EXCHANGE_ROUNDS rounds, each priced in one vectorised call per kind. Groups are priced on
    `kind` (None: FlexSP's kind per degree, `attention_for`). Returns the groups and their makespan."""
    cost, terms = prob.cost, (prob.attn, prob.lin, prob.tok)
    groups = [list(g) for g in groups]
    degs = np.asarray(degs, dtype=np.int64)
    kinds = np.asarray([kind if kind is not None else attention_for(int(d), cost, "auto") for d in degs.tolist()],
                       dtype=object)
    room = degs * prob.cap * (1 + 1e-12)
    inter = degs > cost.ranks_per_node

    def times(A, B, S, gi):
        return kind_times(cost, A, B, S, degs[gi], inter[gi], kinds[gi].tolist())

    A, B, S = bin_sums(groups, *terms)
    T = times(A, B, S, np.arange(len(groups)))
    for _ in range(_EXCHANGE_ROUNDS):
        g = int(np.argmax(T))
        mk = float(T[g])
        gi = np.asarray(groups[g], dtype=np.int64)
        # candidates (i out of g, j out of h or none, into h): one row each
        rows_i, rows_j, rows_h = [], [], []
        for h in range(len(groups)):
            if h == g:
                continue
            hj = np.asarray(groups[h] + [-1], dtype=np.int64)
            rows_i.append(np.repeat(gi, hj.size))
            rows_j.append(np.tile(hj, gi.size))
            rows_h.append(np.full(gi.size * hj.size, h, dtype=np.int64))
        if not rows_i:
            break
        ii, jj, hh = np.concatenate(rows_i), np.concatenate(rows_j), np.concatenate(rows_h)
        has = jj >= 0
        j0 = np.where(has, jj, 0)
        dA, dB, dS = ((np.where(has, v[j0], 0.0) - v[ii]) for v in terms)
        Sg, Sh = S[g] + dS, S[hh] - dS
        fits = (Sg <= room[g]) & (Sh <= room[hh])
        if not fits.any():
            break
        tg = times(A[g] + dA, B[g] + dB, Sg, np.full(ii.size, g))
        th = times(A[hh] - dA, B[hh] - dB, Sh, hh)
        worst = np.where(fits, np.maximum(tg, th), np.inf)
        c = int(np.argmin(worst))
        if not worst[c] < mk * (1 - 1e-12):
            break
        i, j, h = int(ii[c]), int(jj[c]), int(hh[c])
        groups[g].remove(i)
        groups[h].append(i)
        if j >= 0:
            groups[h].remove(j)
            groups[g].append(j)
        if not groups[g]:
            break  # a group left empty: the degrees no longer match; stop here
        A, B, S = bin_sums(groups, *terms)
        T = times(A, B, S, np.arange(len(groups)))
    groups = [sorted(gr) for gr in groups]
    if any(not gr for gr in groups):
        return groups, np.inf
    A, B, S = bin_sums(groups, *terms)
    return groups, float(times(A, B, S, np.arange(len(groups))).max())


def _cuts(N: int, tops: list[int], ds: list[int], few: bool) -> list[list[int]]:
    """Ways to cut N ranks into groups of the powers of two `ds`, each with more than one degree
    (one degree: a homogeneous packing) and at most _MIXED_GROUPS groups: for each largest degree d
    of `tops`, one group of d and the rest cut greedily into the largest powers of two up to c (14
    ranks, d = c = 8: 8 + 4 + 2), for c = d, and with `few` sequences (where the cut matters most
    and a packing costs little) also c = d / 2 (32 ranks, d = 16, c = 8: 16 + 8 + 8)."""
    allowed = set(ds)
    out: list[list[int]] = []
    for d in tops:
        for c in [x for x in ds if x in (d, d // 2)] if few else [d]:
            degs, left = [d], N - d
            while left >= ds[0]:
                g = min(c, 1 << (left.bit_length() - 1))
                if g not in allowed:
                    break
                degs.append(g)
                left -= g
            if len(set(degs)) > 1 and len(degs) <= _MIXED_GROUPS and degs not in out:
                out.append(degs)
    return out


def _mixed(prob: Problem, order: np.ndarray, ds: list[int], tops: list[int], times: np.ndarray, best: tuple | None,
           room: float = np.inf) -> tuple | None:
    """`best` (makespan, degree, groups, kind) or a packing on mixed power-of-two degrees if faster:
    for each largest degree d of `tops` (those that hold the longest sequence), the ranks cut
    greedily into the powers of two `ds` up to d (14 ranks, d = 8: 8 + 4 + 2), the sequences (`order`, longest first) each onto the group where it would
    finish first by its time alone on that degree (`times`, rows by `ds`), memory permitting; kinds
    FlexSP's (None in the result's kind: per degree). With few sequences the best cuts within
    _EXCHANGE_NEAR of `room` (the makespan the micro-batch must beat) are improved by `_exchange`."""
    N, cost = prob.num_ranks, prob.cost
    terms = (prob.attn, prob.lin, prob.tok)
    tok = prob.tok[order]
    row = {d: i for i, d in enumerate(ds)}
    few = len(order) <= _EXCHANGE_MAX
    found = []
    for degs in _cuts(N, tops, ds, few):
        degs_a = np.asarray(degs, dtype=np.int64)
        t = times[[row[g] for g in degs]][:, order]  # groups x sequences
        free = degs_a * prob.cap
        load = np.zeros(len(degs))
        groups: list[list[int]] = [[] for _ in degs]
        ok = True
        for j, k in enumerate(order.tolist()):
            fin = np.where(free >= tok[j] * (1 - 1e-12), load + t[:, j], np.inf)
            g = int(np.argmin(fin))
            if fin[g] == np.inf:
                ok = False
                break
            groups[g].append(k)
            load[g] += t[g, j]
            free[g] -= tok[j]
        if not ok:
            continue
        used = [i for i, gr in enumerate(groups) if gr]
        groups, degs_a = [groups[i] for i in used], degs_a[used]
        found.append((_price(cost, groups, degs_a, None, terms), degs_a, groups, None))
    found.sort(key=lambda c: c[0])
    if few:  # a few sequences: the best cuts' packings near `room` improved by moves and swaps first
        for i, (mk, degs_a, groups, _) in enumerate(found[:_EXCHANGED_CUTS]):
            if mk > room * (1 + _EXCHANGE_NEAR):
                break
            new, t_new = _exchange(prob, groups, degs_a, None)
            if t_new < mk:
                found[i] = (t_new, degs_a, new, None)
        found.sort(key=lambda c: c[0])
    if found and (best is None or found[0][0] < best[0]):
        best = found[0]
    return best


def _placed(sol: tuple, N: int, cost) -> list:
    """A micro-batch's (makespan, degree or degrees, groups, kind) as (ranks, samples) pairs, placed
    node-aware."""
    degs = [sol[1]] * len(sol[2]) if np.ndim(sol[1]) == 0 else [int(x) for x in sol[1]]
    return list(zip(place(degs, N, cost.ranks_per_node, True), sol[2]))


def _alternative(prob: Problem, idx: np.ndarray, order: np.ndarray, ds: list[int], first: int, times_all: np.ndarray,
                 unrefined: tuple | None, best: tuple | None, room: float) -> tuple | None:
    """The micro-batch's packing for the alternative candidate: `best` (its homogeneous packing),
    or, where faster, a packing on mixed power-of-two degrees (rank counts that are not a power of
    two, or a few sequences: `_mixed`) or one improved by moves and swaps (at most _EXCHANGE_MAX
    sequences: `_exchange`, from the packing before and after re-balancing). `room`: the makespan
    it must come in under."""
    N = prob.num_ranks
    few = len(idx) <= _EXCHANGE_MAX
    out = best
    if (N & (N - 1) and len(idx) <= _MIXED_MAX) or few:
        # FlexSP's groups may mix degrees: 8 + 4 + 2 on 14 ranks, where one degree per micro-batch
        # leaves ranks idle, or 16 + 8 + 8 on 32 for a few sequences
        out = _mixed(prob, order, ds, ds[first:], times_all, out, room)
    if few:
        # FlexSP's MILP assigns a few sequences exactly; moves and swaps of single sequences out
        # of the slowest group, priced on FlexSP's kinds, come close to it (from the packing and
        # from its re-balanced form: they end in different local optima)
        for cand in dict.fromkeys(id(c) for c in (unrefined, best) if c is not None):
            mk0, d, groups, kind = next(c for c in (unrefined, best) if id(c) == cand)
            if len(groups) < 2 or mk0 > room * (1 + _EXCHANGE_NEAR):
                continue  # one group, or too far above what the micro-batch must beat
            new, t_new = _exchange(prob, groups, np.full(len(groups), d), kind)
            if out is None or t_new < out[0]:
                out = (t_new, d, new, kind)
    return out


def homogeneous_plans(prob: Problem, counts: list[int], limit: float) -> list[list]:
    """For each count of `counts`: FlexSP's length-sorted micro-batches (`microbatch.by_length`),
    each on the groups of the one power-of-two degree whose packing (`_lpt`, sequences weighed by
    their time alone on that degree and kind) has the least makespan, placed node-aware.

    Counts go in order; as in FlexSP's count search, once one has given a plan the first that does
    not improve on it ends the search (before that, _DROPPED in a row that give none). Only what
    can come in under `limit` is built: a count is dropped once its micro-batches so far plus the
    others' bounds (work / N + b1, and their slowest sequence alone: `flexsp.alone_bounds`) reach
    it, and one whose bounds alone reach it ends the search. Degrees are packed in the order of
    their longest sequence's time alone, until that reaches the best makespan so far (a group takes
    at least as long as each of its sequences alone)."""
    N, cost = prob.num_ranks, prob.cost
    ds = allowed_degrees(N, "pow2").tolist()
    terms = (prob.attn, prob.lin, prob.tok)
    total_work = float(prob.work.sum())
    alone = alone_bounds(prob, np.asarray(ds))
    last, dropped = np.inf, 0
    # every sequence alone on every degree, on the kind FlexSP gives that degree (one call a kind)
    kinds_all = [attention_for(d, cost, "auto") for d in ds]
    times_all = np.empty((len(ds), len(prob.lengths)))
    for kind in set(kinds_all):
        rows = [i for i, k in enumerate(kinds_all) if k == kind]
        times_all[rows] = group_times(cost, prob.attn[None, :], prob.lin[None, :], prob.tok[None, :],
                                      np.asarray(ds, float)[rows, None], attention=kind)
    K = len(prob.lengths)
    out = []
    for M in counts:
        if total_work / N + M * cost.b1 >= limit:
            break
        parts = microbatch.by_length(prob.tok, prob.tok, M, N, prob.cap)
        if parts is None:
            continue
        bounds = [max(float(prob.work[idx].sum()) / N + cost.b1, float(alone[idx].max())) for idx in parts]
        rest = float(sum(bounds))
        if rest >= limit:
            break
        mbs, done = [], 0.0
        alt: list | None = []
        done_alt = 0.0  # the same micro-batches where a mixed or exchanged packing is faster
        for idx, bound in zip(parts, bounds):
            rest -= bound
            order = idx[np.lexsort((idx, -prob.tok[idx]))]
            first = int(np.searchsorted(ds, int(prob.dmin[idx].max())))
            dd, kinds = ds[first:], kinds_all[first:]
            t = times_all[first:, order]
            longest = t.max(axis=1)
            tok = prob.tok[order].tolist()
            best = None
            room = limit - done - rest  # what this micro-batch's makespan must come in under
            for i in np.argsort(longest, kind="stable").tolist():
                if longest[i] >= (room if best is None else min(best[0], room)):
                    break  # a group's time is at least each of its sequences' alone
                d = dd[i]
                groups = _lpt(order, t[i].tolist(), tok, N // d, d * prob.cap)
                if groups is None:
                    continue
                mk = float(group_times(cost, *bin_sums(groups, *terms), d, attention=kinds[i]).max())
                if best is None or mk < best[0]:
                    best = (mk, d, groups, kinds[i])
            unrefined = best
            if best is not None and limit <= done + best[0] + rest:
                # FlexSP's MILP improves on its start; here DHP's re-balancing does, where that
                # decides whether the count can still come in under the limit
                mk, d, groups, kind = best
                new = [g for g in refine_groups(groups, np.full(len(groups), d), *terms, cost, kind) if g]
                if new != groups:
                    t_new = float(group_times(cost, *bin_sums(new, *terms), d, attention=kind).max())
                    if t_new < mk:
                        best = (t_new, d, new, kind)
            if alt is not None and K <= _ALT_MAX_BATCH:
                other = _alternative(prob, idx, order, ds, first, times_all, unrefined, best,
                                     limit - done_alt - rest)
                if other is None or done_alt + other[0] + rest >= limit:
                    alt = None
                else:
                    done_alt += other[0]
                    alt.append(_placed(other, N, cost))
            if best is None or done + best[0] + rest >= limit:
                break
            done += best[0]
            mbs.append(_placed(best, N, cost))
        if alt and len(alt) == len(parts) and alt != mbs and done_alt < last * (1 - 1e-12):
            out.append(alt)  # a candidate beside the count's homogeneous packing, which goes on below
        if len(mbs) < len(parts) or done >= last * (1 - 1e-12):
            dropped += 1
            if out or dropped >= _DROPPED:
                break  # as FlexSP's count search: a count that does not improve ends it
            continue
        dropped = 0
        out.append(mbs)
        last = done
    return out


def best_flexsp(prob: Problem, allowed: np.ndarray, attention: str, num_micro_batches: int | None, packing: bool,
                node_aware: bool, limit: float, exact_price: Callable[[list, str], float]
                ) -> tuple[float, str, list, str] | None:
    """The FlexSP-style plan (module docstring) that is strictly faster than `limit` (the price of
    DHP's best plan so far), if one is: (price, its name "flexsp-packing", micro-batches, attention
    mode: "auto" for FlexSP's own kinds, "best" for each group's fastest), else None.

    Offered only in "best" mode (the "ring" ablation keeps every group on the ring), with node-aware
    placement (FlexSP places its groups so), and only where the options allow its plans: every
    power of two up to the ranks in `allowed`, the micro-batch count `num_micro_batches` when given,
    one sequence a group without `packing`. `exact_price(mbs, mode)` prices a plan as DHP's search
    does."""
    if attention != "best" or not node_aware:
        return None
    if not set(allowed_degrees(prob.num_ranks, "pow2").tolist()) <= set(allowed.tolist()):
        return None  # FlexSP's groups may take any power of two
    cands = [("flexsp-packing", mbs) for mbs in homogeneous_plans(prob, flexsp_counts(prob, num_micro_batches), limit)]
    best = None
    for name, mbs in cands:
        if not packing and any(len(samples) > 1 for mb in mbs for _, samples in mb):
            continue
        for mode in ("auto", "best"):
            price = float(exact_price(mbs, mode))
            if price < (limit if best is None else best[0]) * (1 - 1e-12):
                best = (price, name, mbs, mode)
    return best
