"""Re-balance short sequences across groups once degrees are known.

Repeatedly takes the slowest group and moves one of its sequences to one of the currently fastest
groups when both resulting times stay below the old makespan (memory permitting). Moving work into
the slack of groups sized for a long sequence is the paper's "fill the leftover headroom" step,
done with times instead of bytes. Deterministic; bounded number of moves.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

from dhp_jax.planner.cost.memory import max_tokens_per_rank
from dhp_jax.planner.cost.model import CostModel
from dhp_jax.planner.cost.pricing import bin_sums
from dhp_jax.planner.solvers.allocate import scalar_time

_CANDIDATES = 4  # receiving groups tried per move: the fastest few
_ITEMS = 8  # sequences of the bottleneck group tried per move
_VECTOR_MIN = 64  # groups from which their first times are priced in one vectorised call


def refine(groups: list[list[int]], degrees: np.ndarray, attn: np.ndarray, lin: np.ndarray, tok: np.ndarray,
           cost: CostModel, attention: str = "ring", max_moves: int | None = None) -> list[list[int]]:
    """Return new groups (same degrees) whose makespan is no larger than the input's."""
    t = scalar_time(cost, attention)
    P = len(groups)
    if P < 2:
        return [list(g) for g in groups]
    groups = [list(g) for g in groups]
    deg = [int(d) for d in degrees]
    A, B, S = (x.tolist() for x in bin_sums(groups, attn, lin, tok))
    work = (attn + lin).tolist()
    attn, lin, tok = attn.tolist(), lin.tolist(), tok.tolist()
    per_rank = max_tokens_per_rank(cost)
    dense, b1 = bool(cost.padded_attention), cost.b1
    cap = [d * per_rank for d in deg]
    if P >= _VECTOR_MIN and t.tabled:  # many groups: one vectorised call (the same floats)
        T = t.times(np.asarray(A), np.asarray(B), np.asarray(S), np.asarray(deg, dtype=np.int64)).tolist()
    else:
        T = [t(A[i], B[i], S[i], deg[i]) for i in range(P)]
    # lazy heaps keyed by (time, index); an entry is stale when its time no longer matches
    slow = [(-T[i], i) for i in range(P)]
    fast = [(T[i], i) for i in range(P)]
    heapq.heapify(slow)
    heapq.heapify(fast)
    limit = 2 * P + 16 if max_moves is None else max_moves
    for _ in range(limit):
        while -slow[0][0] != T[slow[0][1]]:
            heapq.heappop(slow)
        i = slow[0][1]
        if len(groups[i]) < 2:
            break
        receivers = []
        while fast and len(receivers) < _CANDIDATES:
            tj, j = heapq.heappop(fast)
            if tj == T[j] and j != i and j not in receivers:
                receivers.append(j)
        for j in receivers:
            heapq.heappush(fast, (T[j], j))
        heapq.heappush(fast, (T[i], i))
        best = None
        members = groups[i]
        if len(members) > _ITEMS:
            # the work that would level the bottleneck with the fastest receiver; the items just
            # around it are the useful moves (one rank's worth moves 1/d of its work in time)
            j0 = receivers[0] if receivers else i
            target = (T[i] - T[j0]) / (1.0 / deg[i] + 1.0 / deg[j0])
            by_work = sorted(members, key=lambda k: (work[k], k))
            keys = [work[k] for k in by_work]
            at = bisect.bisect_right(keys, target)
            members = by_work[max(0, at - _ITEMS + 2):at + 2]
        goal = T[i] * (1 - 1e-12)
        for k in members:
            ak, bk, sk = attn[k], lin[k], tok[k]
            ti = t(A[i] - ak, B[i] - bk, S[i] - sk, deg[i])
            if ti >= goal or (best is not None and ti >= best[0]):
                continue  # no receiver makes this move win
            for j in receivers:
                if S[j] + sk > cap[j]:
                    continue
                # a group's time is at least its work over its ranks plus b1 (the dense blocks of
                # a padded stream may be less attention work than its sequences': then B alone):
                # a receiver that reaches what the move must beat is not priced
                floor = ((B[j] + bk if dense else (A[j] + ak) + (B[j] + bk)) / deg[j]) + b1
                if floor >= goal or (best is not None and floor >= best[0]):
                    continue
                tj = t(A[j] + ak, B[j] + bk, S[j] + sk, deg[j])
                worst = ti if ti > tj else tj
                if worst < T[i] * (1 - 1e-12) and (best is None or worst < best[0]):
                    best = (worst, k, j, ti, tj)
        if best is None:
            break
        _, k, j, ti, tj = best
        groups[i].remove(k)
        groups[j].append(k)
        A[i] -= attn[k]; B[i] -= lin[k]; S[i] -= tok[k]
        A[j] += attn[k]; B[j] += lin[k]; S[j] += tok[k]
        T[i], T[j] = ti, tj
        for g in (i, j):
            heapq.heappush(slow, (-T[g], g))
            heapq.heappush(fast, (T[g], g))
    return [sorted(g) for g in groups]
