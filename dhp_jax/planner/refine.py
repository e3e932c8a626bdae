"""Re-balance short sequences across groups once degrees are known.

Repeatedly takes the slowest group and moves one of its sequences to one of the currently fastest
groups when both resulting times stay below the old makespan (memory permitting). Moving work into
the slack of groups sized for a long sequence is the paper's "fill the leftover headroom" step,
done with times instead of bytes. Deterministic; bounded number of moves.
"""

from __future__ import annotations

import numpy as np

from dhp_jax.planner.allocate import _ScalarTime
from dhp_jax.planner.cost import CostModel

_CANDIDATES = 4  # receiving groups tried per move: the fastest few


def refine(groups: list[list[int]], degrees: np.ndarray, attn: np.ndarray, lin: np.ndarray, tok: np.ndarray,
           cost: CostModel, attention: str = "ring", max_moves: int | None = None) -> list[list[int]]:
    """Return new groups (same degrees) whose makespan is no larger than the input's."""
    t = _ScalarTime(cost, attention)
    P = len(groups)
    if P < 2:
        return [list(g) for g in groups]
    groups = [list(g) for g in groups]
    deg = [int(d) for d in degrees]
    A = [float(attn[g].sum()) for g in groups]
    B = [float(lin[g].sum()) for g in groups]
    S = [float(tok[g].sum()) for g in groups]
    cap = [d * cost.max_tokens_per_rank for d in deg]
    T = [t(A[i], B[i], S[i], deg[i]) for i in range(P)]
    limit = 4 * P + 16 if max_moves is None else max_moves
    for _ in range(limit):
        i = max(range(P), key=lambda j: (T[j], -j))
        if len(groups[i]) < 2:
            break
        receivers = sorted((j for j in range(P) if j != i), key=lambda j: (T[j], j))[:_CANDIDATES]
        best = None
        for k in groups[i]:
            ak, bk, sk = float(attn[k]), float(lin[k]), float(tok[k])
            ti = t(A[i] - ak, B[i] - bk, S[i] - sk, deg[i])
            for j in receivers:
                if S[j] + sk > cap[j]:
                    continue
                tj = t(A[j] + ak, B[j] + bk, S[j] + sk, deg[j])
                worst = max(ti, tj)
                if worst < T[i] * (1 - 1e-12) and (best is None or worst < best[0]):
                    best = (worst, k, j, ti, tj)
        if best is None:
            break
        _, k, j, ti, tj = best
        groups[i].remove(k)
        groups[j].append(k)
        A[i] -= float(attn[k]); B[i] -= float(lin[k]); S[i] -= float(tok[k])
        A[j] += float(attn[k]); B[j] += float(lin[k]); S[j] += float(tok[k])
        T[i], T[j] = ti, tj
    return [sorted(g) for g in groups]
