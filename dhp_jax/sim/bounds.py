"""A lower bound on the step time of ANY plan of a batch under the paper-form cost model.

Notation: N ranks, cap = the tokens a rank may hold (`memory.max_tokens_per_rank`), C = N cap. A
plan is micro-batches m; micro-batch m runs groups g of degree d_g (sum_g d_g <= N) side by side
and lasts tau_m >= max_g T_g; the step is sum_m tau_m plus the gradient all-reduce, which every
plan pays once.

Premises, read off `pricing.group_times` (`closed_form`, `padded_terms`):

(P1) Every kind prices a group at T >= (A' + B')/p + b1 d/p + X >= (A' + B')/d + b1 + X, p =
     min(d, lanes) <= d, where A' >= sum_k a_k and B' >= sum_k b_k over the group's sequences:
     b_k is the unpadded linear work (padding only adds linear tokens) and a_k the attention work,
     a1 L_k^2 instead of a1 (1 + eta_k) L_k^2 where the padded stream's dense attention
     a1 P^2 >= a1 (sum_k L_k)^2 replaces it (`padded_attention`). X is the traffic a rank does not
     hide: without `comm_overlap` all of it, c_ring x ring tokens + c_a2a x all-to-all tokens
     (`pricing.traffic`), linear in the stream's P >= sum_k L_k tokens, so d X >= kappa(d) sum_k L_k
     with kappa(d) the least rank-seconds per token over the kinds and link classes a group of d
     ranks may have; with overlap X >= 0 (kappa = 0: the ring may hide all of its traffic).
     The group's d is at least each member's memory-minimal degree dmin_k, so d (T - b1) >=
     sum_k w_k with w_k = a_k + b_k + L_k min_{d >= dmin_k} kappa(d).
(P2) Priced with the linear layers on each rank's real tokens, ceil(S/d), instead of whole chunks
     of them, T never decreases when a sequence joins a group (A, B, S and the padded length only
     grow; the ring's hidden traffic enters as max(A/p, traffic)), and it is at most the priced T.
     So a group holding a set G at degree d lasts at least f_G(d) := that T of G alone, minimised
     over every attention kind and both link classes (a group of d > ranks_per_node spans nodes),
     +inf below G's memory-minimal degree.
(P3) A micro-batch holds at most C tokens (each group at most d_g cap).

Bounds, each valid for every plan:

- Micro-batch count: M >= M_min, the Martello-Toth L2 bound of bin packing the lengths into bins
  of C tokens (S. Martello, P. Toth, Discrete Applied Mathematics 28 (1990) 59-70), by (P3).
- Work: by (P1), with W_g the sum of w_k over group g,
  max_g T_g >= (sum_g W_g)/(sum_g d_g) + b1 >= W_m/N + b1, so
  sum_m tau_m >= W/N + M_min b1 with W = sum_k w_k.
- Longest sequence: tau_m >= min_d f_{k}(d) for each sequence k of m, by (P2).
- Micro-batch structure (combines both). Take the J sequences of largest min_d f_k (the top set).
  In any plan they fall into micro-batches: a set partition of the top set into blocks b, each in
  its own micro-batch, each block within C tokens. For block b, t_b <= tau_m: the top sequences of
  b that share a plan group form sets G, and the micro-batch needs degrees d_G with sum d_G <= N
  and f_G(d_G) <= tau_m, by (P2); t_b is the least tau for which the least such degrees fit in N,
  minimised over the ways to split b into sets G (blocks of more than three: the largest t of
  their sub-blocks of three). Writing x_b for the other sequences' work in b's micro-batch,
  tau_m >= max(t_b, b1 + (W_b + x_b)/N) and every other micro-batch lasts >= b1 + its work / N;
  summed: step - all-reduce >= W/N + M b1 + sum_b max(0, s_b - x_b/N) with s_b = t_b - b1 -
  W_b/N and M >= max(M_min, number of blocks). The x_b are at most the rest's total work R and,
  by (P3), at most the most work of the rest (fractional, densest per token first) within
  C - tokens of b. So the penalty is at least sum_b s_b^+ - min(R, sum_b min(N s_b^+, room_b))/N.
  The least value over all partitions is a lower bound, at least the work bound and the
  longest-sequence bound (a single block holding the longest sequence gives t_b >= its time).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterator, Sequence

import numpy as np

from dhp_jax.checks import positive_int
from dhp_jax.geometry.layout import linear_tokens
from dhp_jax.planner.cost.geometry import padded_length
from dhp_jax.planner.cost.memory import max_tokens_per_rank, min_degree
from dhp_jax.planner.cost.pricing import allreduce_time, comm_per_token, group_times, sample_terms

TOP = 6            # sequences whose micro-batch partition is enumerated (Bell(6) = 203 partitions)
LONGEST = 16       # sequences (heaviest first) whose best single time is evaluated
EXACT_BLOCK = 3    # blocks up to this size are split into groups exactly
_SLACK = 1e-9      # memory checks allow budget (1 + 1e-9): the bound's bins are as large


@dataclasses.dataclass(frozen=True)
class LowerBound:
    work_s: float  # W/N + M_min b1
    longest_s: float  # max_k min_d T({k}, d)
    allreduce_s: float
    min_micro_batches: int
    micro_batch_s: float = 0.0  # the micro-batch structure bound (module doc), >= both above

    @property
    def step_s(self) -> float:
        return max(self.work_s, self.longest_s, self.micro_batch_s) + self.allreduce_s


def lower_bound(lengths: Sequence[int], num_ranks: int, cost: Any, etas: Sequence[float] | None = None
                ) -> LowerBound:
    """Lower bound on the step time of any plan of this batch on `num_ranks` ranks (see module doc)."""
    positive_int(num_ranks, "num_ranks")
    L = np.asarray(lengths, dtype=np.float64).reshape(-1)
    if L.size == 0:
        raise ValueError("empty batch: no lengths given")
    attn, lin, tok = sample_terms(cost, L, etas)
    N = int(num_ranks)
    dmin = min_degree(cost, L)
    if int(dmin.max()) > N:
        k = int(np.argmax(dmin))
        raise ValueError(f"sample {k} ({int(L[k])} tokens) needs {int(dmin[k])} ranks, more than {N}")
    w = work_floor(cost, L, attn, lin) + L * traffic_floor(cost, N)[dmin - 1]
    bin_tokens = N * max_tokens_per_rank(cost) * (1 + _SLACK)
    m_min = min_bins(tok, bin_tokens)
    W = float(w.sum())
    work = W / N + m_min * cost.b1
    times = _Times(cost, attn, lin, tok, N)
    order = np.argsort(-(attn + lin), kind="stable")[: min(L.size, LONGEST)]
    best = {int(k): float(times.curve((int(k),)).min()) for k in order}
    longest = max(best.values())
    top = sorted(best, key=lambda k: (-best[k], k))[: min(len(best), TOP)]
    structure = _structure_bound(cost, times, top, w, tok, N, bin_tokens, m_min, W)
    return LowerBound(work, longest, float(allreduce_time(cost, N)), m_min, max(structure, work, longest))


def work_floor(cost: Any, lengths: np.ndarray, attn: np.ndarray, lin: np.ndarray) -> np.ndarray:
    """w_k of premise (P1): per-sequence work that any group holding the sequence computes."""
    if cost.geometry.bucket_min and cost.padded_attention:
        return cost.a1 * lengths * lengths + lin
    return attn + lin


def traffic_floor(cost: Any, num_ranks: int) -> np.ndarray:
    """kappa(d0) of premise (P1), d0 = 1..N: the least rank-seconds per token that a group of
    degree d >= d0 spends on its traffic, over every kind and link class; 0 where the ring's traffic
    may hide behind the attention (`comm_overlap`)."""
    N = int(num_ranks)
    if cost.comm_overlap:
        return np.zeros(N)
    d = np.arange(1, N + 1, dtype=np.float64)
    rpn = cost.ranks_per_node
    ul, hybrids = _plan_kinds(cost, N)
    k = np.full(N, np.inf)
    for over_nodes in (False, True):
        inter = (d > rpn) | over_nodes
        ring = comm_per_token(cost, inter, "ring")
        k = np.minimum(k, d * ring * (d - 1.0) / d)                       # ring: S (d-1)/d a rank
        a2a = comm_per_token(cost, inter, "ulysses")
        k = np.where(ul, np.minimum(k, d * a2a * (d - 1.0) / (d * d)), k)   # (S/d) (d-1)/d
        for u in hybrids:
            m = (d % u == 0) & (d >= 2 * u)
            r = d / u
            a2a_u = comm_per_token(cost, u > rpn, "ulysses")
            hyb = d * (ring * (r - 1.0) / (u * r) + a2a_u * (u - 1.0) / (d * u))
            k = np.where(m, np.minimum(k, hyb), k)
    k[0] = 0.0
    return np.minimum.accumulate(k[::-1])[::-1]  # least over d >= d0


def _plan_kinds(cost: Any, num_ranks: int) -> tuple[np.ndarray, list[int]]:
    """Every kind a plan may give a group of degree d = 1..N, whatever it costs: (where Ulysses may
    run: the heads split d ways or the cost model allows it, the all-to-all sizes u of the hybrids)."""
    N, h = int(num_ranks), cost.num_heads
    menu = bool(cost.geometry.menu_kinds)
    ulysses = np.array([(h % x == 0) or cost.ulysses_ok(int(x)) for x in range(1, N + 1)])
    return ulysses, [u for u in range(2, N // 2 + 1) if menu or h % u == 0]


def min_bins(sizes: np.ndarray, capacity: float) -> int:
    """Martello-Toth L2 lower bound on the bins of `capacity` that hold items of `sizes` (>= 1)."""
    s = np.sort(np.asarray(sizes, dtype=np.float64))
    C = float(capacity)
    csum = np.concatenate([[0.0], np.cumsum(s)])
    best = max(1, int(np.ceil(csum[-1] / C - 1e-12)))
    half = np.searchsorted(s, C / 2, side="right")  # s[:half] <= C/2 < s[half:]
    alphas = np.concatenate([[0.0], np.unique(s[:half])])
    lo3 = np.searchsorted(s, alphas, side="left")          # J3 = alpha <= s <= C/2
    hi2 = np.searchsorted(s, C - alphas, side="right")     # J2 = C/2 < s <= C - alpha; J1 above
    n1 = s.size - hi2
    n2 = hi2 - half
    sum2 = csum[hi2] - csum[half]
    sum3 = csum[half] - csum[lo3]
    extra = np.ceil((sum3 - (n2 * C - sum2)) / C - 1e-12)
    l2 = n1 + n2 + np.maximum(0.0, extra)
    return max(best, int(l2.max()))


class _Times:
    """f_G(d) of premise (P2) for sets G of sequences, d = 1..N, cached per set."""

    def __init__(self, cost: Any, attn: np.ndarray, lin: np.ndarray, tok: np.ndarray, N: int) -> None:
        self.cost, self.attn, self.lin, self.tok, self.N = cost, attn, lin, tok, N
        self.d = np.arange(1, N + 1)
        self.inter = self.d > cost.ranks_per_node
        self._curves: dict[tuple[int, ...], np.ndarray] = {}
        self._floors: dict[tuple[int, ...], np.ndarray] = {}
        self.ulysses, self.hybrid = _plan_kinds(cost, N)

    def curve(self, G: tuple[int, ...]) -> np.ndarray:
        if G in self._curves:
            return self._curves[G]
        c, d = self.cost, self.d
        idx = list(G)
        A, B, S = float(self.attn[idx].sum()), float(self.lin[idx].sum()), float(self.tok[idx].sum())
        g = c.geometry
        if g.bucket_min and g.linear_chunk > 0:
            # (P2) on the linear layers' real tokens per rank, ceil(S/d): take back the chunk rounding
            # `padded_terms` adds, which need not grow with S where the padded length changes the chunk
            B = B - c.a2 * d * (linear_tokens(S, padded_length(c, S, d), d, g.linear_chunk) - np.ceil(S / d))
        B = np.broadcast_to(np.asarray(B, dtype=np.float64), d.shape)
        t = np.full(self.N, np.inf)
        # both link classes where a group fits a node (it may be placed over nodes)
        for over_nodes in (False, True):
            fl = self.inter | over_nodes
            t = np.minimum(t, group_times(c, A, B, S, d, fl, "ring"))
            if self.ulysses.any():
                m = self.ulysses
                t[m] = np.minimum(t[m], group_times(c, A, B[m], S, d[m], fl[m], "ulysses"))
            for u in self.hybrid:
                m = (d % u == 0) & (d >= 2 * u)
                if m.any():
                    t[m] = np.minimum(t[m], group_times(c, A, B[m], S, d[m], fl[m], "hybrid", ulysses=u))
        need = int(min_degree(c, np.array([S]))[0])
        t[: max(0, min(need, self.N + 1) - 1)] = np.inf
        self._curves[G] = t
        return t

    def floor(self, G: tuple[int, ...]) -> np.ndarray:
        """Running minimum of f_G over d = 1..N: the least degree that reaches tau is the first
        d with floor(d) <= tau."""
        if G not in self._floors:
            self._floors[G] = np.minimum.accumulate(self.curve(G))
        return self._floors[G]


def _set_partitions(items: list[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


def _least_makespan(times: _Times, groups: list[tuple[int, ...]]) -> float:
    """The least tau at which every set of `groups` has a degree d_G with f_G(d_G) <= tau and
    sum_G d_G <= N (inf if none)."""
    floors = [times.floor(G) for G in groups]
    if len(floors) == 1:
        return float(floors[0][-1])
    N = times.N
    cand = np.unique(np.concatenate([f[np.isfinite(f)] for f in floors]))
    if cand.size == 0:
        return np.inf
    lo = max(float(f[-1]) for f in floors)  # each set's best time
    cand = cand[cand >= lo]

    def fits(tau: float) -> bool:
        used = 0
        for f in floors:
            i = int(np.searchsorted(-f, -tau, side="left"))  # first d (0-based) with f[d] <= tau
            if i >= N:
                return False
            used += i + 1
        return used <= N

    a, b = 0, cand.size - 1
    if not fits(float(cand[b])):
        return np.inf
    while a < b:
        mid = (a + b) // 2
        if fits(float(cand[mid])):
            b = mid
        else:
            a = mid + 1
    return float(cand[a])


def _structure_bound(cost: Any, times: _Times, top: list[int], w: np.ndarray, tok: np.ndarray, N: int,
                     bin_tokens: float, m_min: int, W: float) -> float:
    """The micro-batch structure bound of the module doc (step time less the all-reduce)."""
    top_set = set(top)
    rest = np.array([k for k in range(w.size) if k not in top_set], dtype=np.int64)
    R = float(w[rest].sum()) if rest.size else 0.0
    if rest.size:  # fractional knapsack of the rest by work per token, densest first
        dens = w[rest] / tok[rest]
        o = np.argsort(-dens, kind="stable")
        cum_t = np.concatenate([[0.0], np.cumsum(tok[rest][o])])
        cum_w = np.concatenate([[0.0], np.cumsum(w[rest][o])])
        dens = dens[o]

    def room_work(room: float) -> float:
        if not rest.size or room <= 0:
            return 0.0
        i = int(np.searchsorted(cum_t, room, side="right"))  # cum_t[i-1] <= room < cum_t[i]
        if i > dens.size:
            return float(cum_w[-1])
        return float(cum_w[i - 1] + dens[i - 1] * (room - cum_t[i - 1]))

    block_t: dict[tuple[int, ...], float] = {}

    def t_block(b: tuple[int, ...]) -> float:
        if b not in block_t:
            if len(b) <= EXACT_BLOCK:
                block_t[b] = min(_least_makespan(times, [tuple(g) for g in q]) for q in _set_partitions(list(b)))
            else:
                block_t[b] = max(t_block(s) for s in itertools.combinations(b, EXACT_BLOCK))
        return block_t[b]

    best = np.inf
    for part in _set_partitions(sorted(top)):
        blocks = [tuple(sorted(b)) for b in part]
        if any(float(tok[list(b)].sum()) > bin_tokens for b in blocks):
            continue
        pen, fill = 0.0, 0.0
        for b in blocks:
            s = t_block(b) - cost.b1 - float(w[list(b)].sum()) / N
            if s > 0:
                pen += s
                fill += min(N * s, room_work(bin_tokens - float(tok[list(b)].sum())))
        total = W / N + max(m_min, len(blocks)) * cost.b1 + pen - min(R, fill) / N
        best = min(best, total)
    return float(best)
