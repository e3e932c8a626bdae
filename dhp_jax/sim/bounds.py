"""A lower bound on the step time of ANY plan of a batch under the paper-form cost model.

For a group of degree d the cost model gives T = (A + B)/d + b1 + max(0, T_cm - A/d) >= (A + B)/d + b1
(A: attention work, B: linear work, both summed over the group's sequences), and T never decreases when
a sequence is added. Hence, for every plan:

- work bound: each micro-batch lasts at least (its work)/N + b1, since sum_p d_p <= N and the slowest
  group lasts at least (sum_p W_p)/(sum_p d_p) + b1; summed over micro-batches: W/N + M b1, where M is
  at least the number of micro-batches the memory budget forces (tokens / (N x tokens-per-rank));
- longest-sequence bound: the micro-batch holding sequence k lasts at least min over the degrees d it
  fits in and the attention kinds of T({k}, d) (ring, all-to-all, or all-to-all over u ranks x a
  ring over d/u; intra-node links where d fits one node).

Step >= max(work bound, longest-sequence bound) + the gradient all-reduce, which every plan pays.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from dhp_jax.checks import positive_int
from dhp_jax.planner.cost.memory import max_tokens_per_rank, min_degree
from dhp_jax.planner.cost.pricing import allreduce_time, group_times, sample_terms


@dataclasses.dataclass(frozen=True)
class LowerBound:
    work_s: float  # W/N + M_min b1
    longest_s: float  # max_k min_d T({k}, d)
    allreduce_s: float
    min_micro_batches: int

    @property
    def step_s(self) -> float:
        return max(self.work_s, self.longest_s) + self.allreduce_s


def lower_bound(lengths: Sequence[int], num_ranks: int, cost: Any, etas: Sequence[float] | None = None
                ) -> LowerBound:
    """Lower bound on the step time of any plan of this batch on `num_ranks` ranks (see module doc)."""
    positive_int(num_ranks, "num_ranks")
    L = np.asarray(lengths, dtype=np.float64).reshape(-1)
    if L.size == 0:
        raise ValueError("empty batch: no lengths given")
    attn, lin, tok = sample_terms(cost, L, etas)
    N = int(num_ranks)
    # The memory budget caps each micro-batch at N * tokens-per-rank tokens.
    m_min = max(1, int(np.ceil(tok.sum() / (N * max_tokens_per_rank(cost)) - 1e-12)))
    work = float((attn.sum() + lin.sum()) / N + m_min * cost.b1)
    dmin = min_degree(cost, L)
    if int(dmin.max()) > N:
        k = int(np.argmax(dmin))
        raise ValueError(f"sample {k} ({int(L[k])} tokens) needs {int(dmin[k])} ranks, more than {N}")
    # Only the heaviest sequences can attain the max; evaluate every degree for the top few by work.
    order = np.argsort(-(attn + lin))[: min(L.size, 16)]
    d = np.arange(1, N + 1)
    inter = d > cost.ranks_per_node
    longest = 0.0
    for k in order:
        ok = d >= dmin[k]
        t = group_times(cost, attn[k], lin[k], tok[k], d, inter, "ring")
        ul = np.array([cost.ulysses_ok(int(x)) for x in d]) if cost.a2a_bytes_per_token > 0 else np.zeros(N, bool)
        if ul.any():
            t = np.where(ul, np.minimum(t, group_times(cost, attn[k], lin[k], tok[k], d, inter, "ulysses")), t)
        for u in _hybrid_sizes(cost, N):         # Ulysses over u ranks x a ring over d/u >= 2
            h = np.flatnonzero((d % u == 0) & (d >= 2 * u))
            t[h] = np.minimum(t[h], group_times(cost, attn[k], lin[k], tok[k], d[h], inter[h], "hybrid", ulysses=u))
        longest = max(longest, float(t[ok].min()))
    return LowerBound(work, longest, float(allreduce_time(cost, N)), m_min)


def _hybrid_sizes(cost: Any, num_ranks: int) -> list[int]:
    """Ulysses sizes u >= 2 of any hybrid the head count allows (u divides it, 2u <= num_ranks)."""
    if cost.a2a_bytes_per_token <= 0:
        return []
    return [u for u in range(2, num_ranks // 2 + 1) if cost.num_heads % u == 0]
