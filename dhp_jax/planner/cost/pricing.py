"""Pricing: the time of a group, of every group of a plan, each micro-batch's makespan and the step time.

The group time model (`group_times`, its traffic counts `traffic` and per-token seconds
`comm_per_token`; the formula is in `dhp_jax.planner.cost.model`'s docstring) and the one place a plan
is priced under a `CostModel`: `build_plan` fills a plan's estimates with it,
the strategy comparison and the simulator (`dhp_jax.sim.step_time`, `sim.evaluate`) time plans
with it. A group is priced under its own attention kind (`Group.attention`), with inter-node links
when its ranks span nodes of `ranks_per_node`. A step is the sum of the micro-batch makespans (the
cost model says how concurrent groups combine, shared CPU lanes included) plus one gradient
all-reduce.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

import numpy as np

from dhp_jax.checks import etas_array, lengths_array, positive_int
from dhp_jax.geometry.layout import linear_tokens, rung_list
from dhp_jax.planner.contract.kinds import attention_kinds, attention_name
from dhp_jax.planner.contract.plan import attention_split, spans_nodes
from dhp_jax.planner.cost.geometry import padded_length
from dhp_jax.planner.cost.model import CostModel

__all__ = ["allreduce_time", "attention_for", "best_kind_times", "best_kinds", "best_times", "bin_sums", "closed_form", "comm_per_token", "compute_divisor", "group_kind_times",
           "group_time", "group_times", "hybrid_floor", "kind_times", "makespan", "makespans", "padded_terms", "plan_group_times", "plan_makespans",
           "price_groups", "sample_terms", "sent_tokens", "spans_nodes", "step_time", "traffic", "ulysses_sizes"]



def bin_sums(bins: list[list[int]], *values: np.ndarray) -> list[np.ndarray]:
    """Per-bin sums of each array in `values` (one bincount per array, not one sum per bin)."""
    sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    flat = np.fromiter(itertools.chain.from_iterable(bins), dtype=np.int64, count=int(sizes.sum()))
    gid = np.repeat(np.arange(len(bins)), sizes)
    return [np.bincount(gid, v[flat], minlength=len(bins)) for v in values]


def sample_terms(cost: CostModel, lengths: Sequence[int] | np.ndarray,
                 etas: Sequence[float] | np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sequence (attention work, linear work, tokens) on one rank: float64[K] each."""
    L = lengths_array(lengths)
    e = etas_array(etas, L.size)
    attn = cost.a1 * (1.0 + e) * L * L
    lin = (cost.a2 + cost.a2_vision * np.sqrt(e)) * L
    return attn, lin, L


def comm_per_token(cost: CostModel, inter_node: bool | np.ndarray, attention: str = "ring") -> np.ndarray | float:
    """Seconds per token one rank puts on the wire (K/V for "ring", Q/K/V/O for "ulysses")."""
    if attention == "ring":
        return cost.kv_bytes_per_token / np.where(inter_node, cost.bw_inter, cost.bw_intra)
    a2a_bw = cost.a2a_bw_intra if cost.a2a_bw_intra > 0 else cost.bw_intra
    return cost.a2a_bytes_per_token / np.where(inter_node, cost.bw_inter, a2a_bw)


def sent_tokens(tokens: Any, degree: Any, attention: str = "ring") -> np.ndarray:
    """Tokens' worth of traffic one rank sends for a stream of `tokens` on `degree` ranks (see
    `dhp_jax.planner.cost.model`'s docstring): S (d-1)/d for the ring, (S/d) (d-1)/d for Ulysses
    (`traffic` counts them)."""
    if attention not in ("ring", "ulysses"):
        raise ValueError(f"unknown attention kind {attention!r}; known: 'ring', 'ulysses'")
    ring_tok, a2a_tok, _, _ = traffic(tokens, degree, attention)
    return np.asarray(ring_tok if attention == "ring" else a2a_tok, dtype=np.float64)


def sorted_unique(x: Any) -> np.ndarray:
    """`np.unique` of a 1-D array (its distinct values, ascending) by a sort: the same values, without
    the check for masked arrays that makes NumPy's first plain `unique` call of a process import
    `numpy.ma`, a one-off cost that would land in the first plan's solve time."""
    a = np.sort(np.asarray(x).reshape(-1))
    if a.size < 2:
        return a
    keep = np.empty(a.size, dtype=bool)
    keep[0] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


def _ulysses_of(S: Any, d: Any, attention: str, ulysses: Any) -> Any:
    """u, the Ulysses size of each group's kind ("ring" 1, "ulysses" d, a named hybrid its own u,
    the family "hybrid" `ulysses`: one size, or one per group); raises ValueError on a bad one."""
    if attention == "ring":
        return 1.0
    if attention == "ulysses":
        return d
    if attention == "hybrid":
        u = None if ulysses is None else np.asarray(ulysses, dtype=np.float64)
        if u is None or np.any(u < 1) or np.any(u != np.round(u)) or np.any(d % np.maximum(u, 1)):
            raise ValueError(f"attention 'hybrid' needs ulysses = u dividing every degree, got {ulysses!r}")
        return np.broadcast_to(u, np.shape(d)).astype(np.float64)
    degrees = sorted_unique(d).astype(int).tolist()
    if len(degrees) != 1:
        raise ValueError(f"attention {attention!r} priced for groups of degrees {degrees}")
    return np.broadcast_to(float(attention_split(attention, degrees[0])[0]), np.shape(d)).astype(np.float64)


def _counts(S: Any, d: Any, u: Any, ring: bool = True, a2a: bool = True) -> tuple[Any, Any, Any]:
    """(ring tokens, all-to-all tokens, messages) of one rank of a group of d ranks on a stream of S
    tokens as Ulysses over u times a ring over r = d / u (`traffic`'s table; u = 1 is the ring,
    u = d Ulysses, with the same floats as their own rows). Plain arithmetic: Python floats or
    arrays. `ring` / `a2a` False: that count is 0.0 (the kind has no such traffic), not computed."""
    r = d / u
    return (S / u * (r - 1.0) / r if ring else 0.0), (S / d * (u - 1.0) / u if a2a else 0.0), u + r - 2.0


def traffic(S: Any, degree: Any, attention: str = "ring", ulysses: int | None = None
            ) -> tuple[Any, Any, Any, Any]:
    """What one rank of a group moves per step, in tokens' worth at the ring's per-token K/V size
    and at the all-to-all's per-token Q/K/V/O size, and how many messages in sequence:

    ring:           S (d-1)/d ring tokens,              d-1 messages
    ulysses:        (S/d) (d-1)/d all-to-all tokens,    d-1 messages
    hybrid:<u>x<r>: S/u (r-1)/r ring tokens (1/u of the K/V heads) and (S/d) (u-1)/u all-to-all
                    tokens (Ulysses over u on the sub-group's S/r: a rank holds S/d of them and
                    keeps 1/u of the heads), (u-1) + (r-1) messages.
    The one home of these counts (`_counts`; `closed_form` prices them, written out, and a test holds
    the two to the same floats); `fit_cost_model` fits their
    per-token and per-message seconds. Returns (ring tokens, all-to-all tokens, messages, u);
    the family "hybrid" takes u from `ulysses` (one size, or one per group) and r = d / u per group."""
    S, d = np.asarray(S, dtype=np.float64), np.asarray(degree, dtype=np.float64)
    u = _ulysses_of(S, d, attention, ulysses)
    ring_tok, a2a_tok, msgs = _counts(S, d, u, attention != "ulysses", attention != "ring")
    return ring_tok, a2a_tok, msgs, u


def compute_divisor(cost: CostModel, degree: Any) -> np.ndarray:
    """p = min(d, compute_lanes): how many ways a group's compute is really split."""
    d = np.asarray(degree, dtype=np.float64)
    return d if cost.compute_lanes is None else np.minimum(d, float(cost.compute_lanes))


def closed_form(A: Any, B: Any, S: Any, d: Any, u: Any, p: Any, b1: float, c_ring: Any, c_a2a: Any, lat: Any,
                ring_only: bool, ulysses_only: bool, overlap: bool) -> Any:
    """T (`dhp_jax.planner.cost.model`'s docstring) of groups with terms A, B (padding priced in) on a
    stream of S tokens (padded) over d ranks as Ulysses over u times a ring over d / u: compute split
    p ways (p = d, or the shared lanes' min(d, n)), b1 per rank, `c_ring` / `c_a2a` seconds per
    ring / all-to-all token (`comm_per_token` on the group's links), `lat` seconds per message.
    `ring_only` (u = 1): no all-to-all, and the hand-overs may hide behind the attention with the
    ring traffic; `ulysses_only` (u = d): no ring. `overlap` (`comm_overlap`): ring traffic hides
    behind the attention blocks; all-to-alls sit between attention and the layers around it and
    never do.

    The one formula of a group's time: `group_times` calls it on arrays, the allocation's scalar
    search (`solvers.allocate`) on Python floats, with the same floats. Plain arithmetic, so it
    takes either (the clamp at 0 is the only operation chosen by type)."""
    # `traffic`'s counts (`_counts`), written out: the search calls this thousands of times
    r = d / u
    share = d / p
    if ring_only:  # u = 1: no all-to-all; the ring's hand-overs hide with its traffic
        hidden, exposed = c_ring * (S / u * (r - 1.0) / r) + lat * (u + r - 2.0) * share, 0.0
    elif ulysses_only:  # u = d: no ring
        hidden, exposed = 0.0, c_a2a * (S / d * (u - 1.0) / u) + lat * (u + r - 2.0) * share
    else:
        hidden = c_ring * (S / u * (r - 1.0) / r)
        exposed = c_a2a * (S / d * (u - 1.0) / u) + lat * (u + r - 2.0) * share
    if overlap:
        hidden = hidden - A / p
        if hidden.__class__ is float:  # the scalar search's floats: no NumPy call
            if hidden < 0.0:
                hidden = 0.0
        else:
            hidden = np.maximum(hidden, 0.0)
    return (A + B) / p + b1 * share + exposed + hidden


def padded_terms(cost: CostModel, A: Any, B: Any, S: Any, d: Any) -> tuple[Any, Any, Any]:
    """(A, B, S) of groups as the executor runs them on d ranks: the stream padded to its bucket
    (`geometry.padded_length`), the dense attention blocks of the padded stream (`padded_attention`)
    and the pad tokens the linear layers compute (all of them with linear_chunk 0, or the busiest
    rank's real tokens rounded up to whole chunks). Unchanged without a bucket rule."""
    A, B, S = np.asarray(A, float), np.asarray(B, float), np.asarray(S, float)
    if not cost.geometry.bucket_min:
        return A, B, S
    P = padded_length(cost, S, d)
    if cost.padded_attention:
        A = cost.a1 * P * P
    return A, B + cost.a2 * (d * linear_tokens(S, P, d, cost.geometry.linear_chunk) - S), P


def group_times(cost: CostModel, A: Any, B: Any, S: Any, degree: Any, inter_node: Any = None,
                attention: str = "ring", ulysses: int | None = None) -> np.ndarray:
    """Vectorised T (`dhp_jax.planner.cost.model`'s docstring, `closed_form`) for groups with summed
    terms A, B, S at `degree` (all broadcast together).

    `attention` is a group's kind; the family "hybrid" with `ulysses` = u (one size, or one per
    group) prices Ulysses over u ranks times a ring over degree/u for groups of varying degree
    (e.g. every degree at once)."""
    d = np.asarray(degree, dtype=np.float64)
    inter = d > cost.ranks_per_node if inter_node is None else np.asarray(inter_node, bool)
    A, B, P = padded_terms(cost, A, B, S, d)
    return _padded_times(cost, A, B, P, d, inter, attention, ulysses)


def _padded_times(cost: CostModel, A: Any, B: Any, P: Any, d: np.ndarray, inter: Any, attention: str,
                  ulysses: Any = None) -> np.ndarray:
    """`group_times` of groups whose terms are already padded (`padded_terms`): float degrees `d`,
    inter-node flags `inter`."""
    lat = np.where(inter, cost.lat_inter, cost.lat_intra)
    u = _ulysses_of(P, d, attention, ulysses)
    ring_only, ulysses_only = attention == "ring", attention == "ulysses"
    c_ring = 0.0 if ulysses_only else comm_per_token(cost, inter, "ring")
    # a hybrid's all-to-all runs inside its Ulysses sub-groups: one node each when u fits a node
    c_a2a = 0.0 if ring_only else comm_per_token(cost, inter if ulysses_only else u > cost.ranks_per_node, "ulysses")
    return np.asarray(closed_form(A, B, P, d, u, compute_divisor(cost, d), cost.b1, c_ring, c_a2a, lat,
                                  ring_only, ulysses_only, bool(cost.comm_overlap)), dtype=np.float64)


def _above_floor(cost: CostModel, ring: np.ndarray, A: np.ndarray, B: np.ndarray, P: np.ndarray,
                 d: np.ndarray) -> np.ndarray:
    """Which groups (ring times `ring`, padded terms) another kind could price lower: those above
    the floor of `hybrid_floor` (every group on shared lanes)."""
    if cost.compute_lanes is not None:
        return np.ones(np.shape(ring), dtype=bool)
    return ring > (A + B) / d + cost.b1 + hybrid_floor(cost) * P / d


def ulysses_sizes(cost: CostModel, degree: int) -> list[int]:
    """The Ulysses sizes u > 1 a group of `degree` ranks may run under the per-group kind choice
    (`best_kinds`, `kinds.attention_kinds`): u divides the degree and the head count, u <= ranks_per_node."""
    rpn, h = cost.ranks_per_node, cost.num_heads
    return [u for u in range(2, min(int(degree), rpn) + 1) if degree % u == 0 and h % u == 0]


def hybrid_floor(cost: CostModel) -> float:
    """f such that every kind but the ring prices a group with padded terms A, B on a stream of P
    tokens over d > 1 ranks above (A + B) / d + b1 + f P / d, with the same floats: its all-to-all
    sends (P/d) (u-1)/u >= P / (2d) tokens at no less than the cheaper of the all-to-all's per-token
    seconds inside and across nodes, exposed; f is half that (so that rounding never takes a kind
    under the floor). A group whose ring time is at or below the floor keeps the ring, and its other
    kinds need not be priced. 0 on shared lanes (compute over p = min(d, lanes): not this floor)."""
    if cost.compute_lanes is not None:
        return 0.0
    c = min(float(comm_per_token(cost, False, "ulysses")), float(comm_per_token(cost, True, "ulysses")))
    return 0.5 * 0.5 * c


def best_times(cost: CostModel, A: Any, B: Any, S: Any, degree: Any, inter_node: Any = None) -> np.ndarray:
    """Each group's least `group_times` over the kinds the per-group choice may give it (ring,
    Ulysses over u times a ring over d / u for every u of `ulysses_sizes`, with every Ulysses
    sub-group inside one node: any u inside a node, u dividing ranks_per_node for a group over
    nodes whose ranks start at a node's first, as placement puts them; and, for a group over nodes,
    Ulysses over all of it where the head count allows). Ties keep the ring's time. The search's price of a group in
    "best" mode; the plan's own kinds are chosen on its placed ranks (`best_kind_times`). Under
    `geometry.kind_rule` "program" on a padded ladder (no menu) each group is priced on its
    program's kind instead (`program_kind`; the ring where a group over nodes placed on whole
    nodes could not run it), as `best_kind_times` will give it."""
    A, B, S, d = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (A, B, S, degree)))
    inter = d > cost.ranks_per_node if inter_node is None else np.broadcast_to(np.asarray(inter_node, bool), d.shape)
    A, B, P = padded_terms(cost, A, B, S, d)  # once for every kind
    out = _padded_times(cost, A, B, P, d, inter, "ring")
    if program_rule(cost):
        return _program_times(cost, A, B, P, d, inter, out)
    live = _above_floor(cost, out, A, B, P, d)  # the others keep the ring's time
    top = int(d[live].max()) if np.any(live) else 0
    for u in range(2, min(top, cost.ranks_per_node) + 1):
        if cost.num_heads % u:
            continue
        # over nodes, Ulysses sub-groups stay inside nodes only where u divides ranks_per_node
        m = live & (d % u == 0) & (~inter | (cost.ranks_per_node % u == 0))
        if np.any(m):
            out[m] = np.minimum(out[m], _padded_times(cost, A[m], B[m], P[m], d[m], inter[m], "hybrid", u))
    # Ulysses over a whole group that spans nodes (its all-to-all on the inter-node links)
    m = live & inter & (d > 1) & (cost.num_heads % np.maximum(d, 1) == 0)
    if np.any(m):
        out[m] = np.minimum(out[m], _padded_times(cost, A[m], B[m], P[m], d[m], True, "ulysses"))
    return out


def group_time(cost: CostModel, lengths: Sequence[int] | np.ndarray, degree: int,
               etas: Sequence[float] | None = None, inter_node: bool | None = None, attention: str = "ring") -> float:
    """Seconds of fwd+bwd for one group of `degree` ranks holding these sequences."""
    positive_int(degree, "degree")
    attn, lin, tok = sample_terms(cost, lengths, etas)
    return float(group_times(cost, attn.sum(), lin.sum(), tok.sum(), degree, inter_node, attention))


def makespans(cost: CostModel, times: Any, degrees: Any, micro_batch: Any = None, num_micro_batches: int = 1
              ) -> np.ndarray:
    """Makespan of each micro-batch whose groups (times T_g, degrees d_g) run at the same time.

    Groups of a micro-batch run side by side, so the makespan is max_g T_g. With
    `compute_lanes` (p shared cores: fake CPU devices) they also share those p cores, so it is
        max( max_g T_g ,  sum_g T_g min(d_g, p) / p )
    where the second term spreads every group's core-seconds over the p lanes: a machine-wide
    cap for shared-core hosts only. Without lanes (accelerators) only the max is taken.
    `micro_batch[g]` says which micro-batch group g belongs to (default: all in 0).
    """
    t = np.asarray(times, dtype=np.float64).reshape(-1)
    mb = np.zeros(t.size, dtype=np.int64) if micro_batch is None else np.asarray(micro_batch, np.int64)
    out = np.zeros(int(num_micro_batches))
    np.maximum.at(out, mb, t)
    if cost.compute_lanes is not None:
        lanes = float(cost.compute_lanes)
        share = t * compute_divisor(cost, np.asarray(degrees).reshape(-1)) / lanes
        out = np.maximum(out, np.bincount(mb, share, minlength=int(num_micro_batches)))
    return out


def makespan(cost: CostModel, times: Any, degrees: Any) -> float:
    """`makespans` of one micro-batch: max_g T_g, capped below by the shared lanes' load."""
    t = np.asarray(times, dtype=np.float64).reshape(-1)
    if t.size == 0:
        return 0.0
    if cost.compute_lanes is None:
        return float(t.max())
    return float(makespans(cost, t, degrees)[0])


def allreduce_time(cost: CostModel, num_ranks: int) -> float:
    """Gradient all-reduce over all ranks: ring inside each node, then ring across nodes."""
    positive_int(num_ranks, "num_ranks")
    r = min(num_ranks, cost.ranks_per_node)
    n = math.ceil(num_ranks / cost.ranks_per_node)
    g = cost.grad_bytes
    # bandwidth term only: gradients go in large buckets, so message latency is negligible
    t = 2.0 * (r - 1) / r * g / cost.bw_intra
    if n > 1:
        t += 2.0 * (n - 1) / n * (g / r) / cost.bw_inter
    return float(t)


def attention_for(degree: int, cost: CostModel, attention: str) -> str:
    """The kind a group of `degree` ranks records for a strategy's mode: "auto" (FlexSP's groups) is
    all-to-all where the head count allows it, ring otherwise; a single rank has no sequence
    exchange at all, so a degree-1 group is always "ring" (both kinds price it the same)."""
    if degree == 1:
        return "ring"
    if attention == "auto":
        return "ulysses" if cost.ulysses_ok(degree) else "ring"
    return attention


def kind_times(cost: CostModel, A: Any, B: Any, S: Any, degree: Any, inter_node: Any,
               kinds: Sequence[str]) -> np.ndarray:
    """`group_times` of each group (1-d arrays, or broadcast to them) under its own attention kind:
    the terms padded once, the ring's times in one call, then `_times_on`."""
    A, B, S, d, inter = (np.ravel(x) for x in np.broadcast_arrays(*(np.asarray(x) for x in
                                                                     (A, B, S, degree, inter_node))))
    kinds = list(kinds)
    if len(kinds) != d.size:
        raise ValueError(f"kind_times: {len(kinds)} kinds for {d.size} groups")
    df = d.astype(np.float64)
    Ap, Bp, P = padded_terms(cost, A, B, S, df)
    inter = inter.astype(bool)
    return _times_on(cost, Ap, Bp, P, df, inter, kinds, _padded_times(cost, Ap, Bp, P, df, inter, "ring"))


def node_local(ranks: Sequence[int], ulysses: int, ranks_per_node: int) -> bool:
    """Whether every Ulysses sub-group (u consecutive ranks of the group) sits inside one node."""
    return all(len({r // ranks_per_node for r in ranks[i:i + ulysses]}) == 1
               for i in range(0, len(ranks), ulysses))


def program_kinds_rule(cost: CostModel) -> bool:
    """Whether groups of degree > 1 outside a menu's `menu_kinds` run their program's kind
    (`program_kind`): a padded stream (`bucket_min` > 0) under `geometry.kind_rule` "program"."""
    g = cost.geometry
    return bool(g.bucket_min) and g.kind_rule == "program"


def program_rule(cost: CostModel) -> bool:
    """Whether every group of degree > 1 runs its program's kind (`program_kind`): `program_kinds_rule`
    on a padded ladder without a menu (the search's "best" prices; with a menu it prices the ring)."""
    return program_kinds_rule(cost) and not cost.geometry.bucket_menu


def _program_times(cost: CostModel, A: np.ndarray, B: np.ndarray, P: np.ndarray, d: np.ndarray,
                   inter: np.ndarray, ring: np.ndarray) -> np.ndarray:
    """Padded groups' times on their programs' kinds (`ring`: their ring times), a group over nodes
    taken as placed on whole nodes."""
    out = np.array(ring, dtype=np.float64)
    flat = [x.reshape(-1) for x in np.broadcast_arrays(A, B, P, d, inter)]
    A, B, P, d, inter = flat
    o = out.reshape(-1)
    keys = np.flatnonzero(d > 1)
    if not keys.size:
        return out
    pairs, inv = np.unique(np.stack([d[keys], P[keys]]), axis=1, return_inverse=True)
    inv = np.asarray(inv).reshape(-1)
    rpn = cost.ranks_per_node
    for j in range(pairs.shape[1]):
        deg, p = int(pairs[0, j]), int(pairs[1, j])
        kind = program_kind(cost, deg, p)
        u = attention_split(kind, deg)[0]
        if u <= 1:
            continue
        i = keys[inv == j]
        i = i[~inter[i] | (rpn % u == 0) | (u == deg)]  # Ulysses sub-groups inside nodes, or over all
        if i.size:
            o[i] = _padded_times(cost, A[i], B[i], P[i], d[i], inter[i], "ulysses" if u == deg else "hybrid", u)
    return out


def runs_on(kind: str, ranks: Sequence[int], cost: CostModel) -> bool:
    """Whether a group on `ranks` can run attention `kind`: the ring always; Ulysses over u ranks
    (times a ring over d/u) where each Ulysses sub-group sits inside one node, or Ulysses over all
    of a group whose ranks span nodes where the head count allows it."""
    d, rpn = len(ranks), cost.ranks_per_node
    u = attention_split(kind, d)[0]
    if u <= 1:
        return True
    if not spans_nodes(ranks, rpn):
        return True
    return node_local(ranks, u, rpn) or (u == d and cost.ulysses_ok(d))


class _KindTable(dict):
    """One cost model's program kinds, (degree, padded) -> kind, and `priced`: the degrees whose
    whole ladders are in it (`program_kind`); clearing it forgets both."""

    def __init__(self) -> None:
        super().__init__()
        self.priced: set[int] = set()

    def clear(self) -> None:
        super().clear()
        self.priced.clear()


_PROGRAM_KINDS: dict[Any, _KindTable] = {}  # per cost model
_last_kinds: tuple = (None, _KindTable())  # the latest cost model and its table: the same object skips hashing it


def _kinds_table(cost: CostModel) -> _KindTable:
    global _last_kinds
    last = _last_kinds
    if last[0] is cost:
        return last[1]
    table = _PROGRAM_KINDS.get(cost)
    if table is None:
        if len(_PROGRAM_KINDS) > 64:
            _PROGRAM_KINDS.clear()
        table = _PROGRAM_KINDS[cost] = _KindTable()
    _last_kinds = (cost, table)
    return table


def program_kind(cost: CostModel, degree: int, padded: int) -> str:
    """The one attention kind of the padded ladder's program (`degree`, `padded` tokens) under
    `StreamGeometry.kind_rule` "program", fixed without data: the kind the cost model prices
    fastest for a group of `degree` ranks filled to the bucket with `degree` sequences of
    padded / degree tokens each (one rank's share each), on one node (degree <= ranks_per_node)
    or on whole nodes. The kinds are those `best_kinds` may give such a group: the ring; Ulysses
    over u ranks times a ring over degree / u (u dividing the degree and the head count,
    u <= ranks_per_node); for a group over nodes, Ulysses over all its ranks where the head count
    allows. Ties keep the ring, then the smaller u. A group whose ranks cannot run the kind runs
    the ring (`runs_on`).

    The kinds are kept per cost model; the first program asked of a degree not yet priced prices
    every program of the degrees of its block (2-64, 65-128, ...) at once (`program_kinds`): the
    lengths `padded_length` gives at every rung of the ladder up to each degree's memory clamp."""
    d, p = int(degree), int(padded)
    table = _kinds_table(cost)
    kind = table.get((d, p))
    if kind is not None:
        return kind
    if d <= 1:
        return "ring"
    g = cost.geometry
    done = table.priced  # the degrees whose ladders are priced
    if g.bucket_min and d not in done:
        lo = 2 if d <= 64 else (d - 1) // 64 * 64 + 1  # the degrees of d's block of 64
        xs = np.asarray([x for x in range(lo, (d + 63) // 64 * 64 + 1) if x not in done], dtype=np.float64)
        # past a degree's memory clamp every rung pads to one length: the rungs up to the largest clamp
        top = 2.0 * xs.max() * cost.memory_budget / cost.mem_per_token
        rungs = np.asarray([r for r in rung_list(g.bucket_min, g.bucket_growth) if r <= top], dtype=np.float64)
        grid = padded_length(cost, rungs[None, :], xs[:, None])  # (degree, rung)
        pairs = sorted(set(zip(np.broadcast_to(xs[:, None], grid.shape).ravel().tolist(), grid.ravel().tolist())))
        program_kinds(cost, [x for x, _ in pairs], [q for _, q in pairs])
        done.update(int(x) for x in xs.tolist())
        kind = table.get((d, p))
        if kind is not None:
            return kind
    return program_kinds(cost, [d], [p])[0]


def program_kinds(cost: CostModel, degree: Any, padded: Any) -> list[str]:
    """`program_kind` of the programs (degree[i], padded[i]) (degrees > 1), priced together: the
    same floats and the same choices as one at a time. The kinds are kept per cost model."""
    table = _kinds_table(cost)
    D = np.asarray(degree, dtype=np.int64).reshape(-1)
    P = np.asarray(padded, dtype=np.float64).reshape(-1)
    if not P.size:
        return []
    u = program_sizes(cost, D, P)
    if len(table) > 100_000:
        table.clear()
    # each distinct (u, degree) named once: u = 1 the ring, u = degree > 1 Ulysses over all its ranks
    pairs = list(zip(u.tolist(), D.tolist()))
    names = {(x, d): "ring" if x == 1 else "ulysses" if x == d else attention_name(x, d // x) for x, d in set(pairs)}
    out = [names[p] for p in pairs]
    table.update(zip(zip(D.tolist(), np.floor(P).astype(np.int64).tolist()), out))
    return out


def program_sizes(cost: CostModel, degree: Any, padded: Any) -> np.ndarray:
    """The Ulysses size of `program_kind` of each program (degree[i], padded[i]), vectorised and
    not kept: 1 the ring (every degree <= 1 too), the degree for Ulysses over all its ranks, else
    the hybrid's u (Ulysses over u times a ring over degree / u). What `program_kinds` names."""
    D = np.asarray(degree, dtype=np.int64).reshape(-1)
    P = np.floor(np.asarray(padded, dtype=np.float64).reshape(-1))
    if not P.size:
        return np.ones(0, dtype=np.int64)
    rpn, heads = cost.ranks_per_node, cost.num_heads
    df = D.astype(np.float64)
    inter = D > rpn
    A = cost.a1 * P * P / df
    B = cost.a2 * df * linear_tokens(P, P, df, cost.geometry.linear_chunk)
    best = _padded_times(cost, A, B, P, df, inter, "ring")
    win = np.ones(P.shape, dtype=np.int64)  # the Ulysses size of the fastest kind so far (1: the ring)
    # in `program_kind`'s order (ring, then u ascending, then Ulysses over nodes), a kind taking
    # over only where strictly faster
    for u in range(2, min(int(D.max()), rpn) + 1):
        if heads % u:
            continue
        m = np.flatnonzero((D % u == 0) & (~inter | (rpn % u == 0)))
        if not m.size:
            continue
        t = _padded_times(cost, A[m], B[m], P[m], df[m], inter[m], "hybrid", u)
        better = t < best[m]
        best[m[better]] = t[better]
        win[m[better]] = u
    m = np.flatnonzero(inter & (heads % np.maximum(D, 1) == 0))
    if m.size:
        t = _padded_times(cost, A[m], B[m], P[m], df[m], True, "ulysses")
        better = t < best[m]
        win[m[better]] = D[m[better]]
    win[D <= 1] = 1
    return win


def best_kinds(cost: CostModel, groups: Sequence[tuple[Sequence[int], Sequence[int]]],
               terms: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[str]:
    """The fastest attention kind of each group (ranks, sample ids) under the cost model: ring, or
    Ulysses over u ranks times a ring over d/u (`kinds.attention_kinds`: u divides the degree and
    the head count, u <= ranks_per_node) where each Ulysses sub-group sits inside one node, or, for
    a group whose ranks span nodes, Ulysses over all of them where the head count allows. Ties
    keep the ring (then the smaller u, then the node-local kinds); a free choice never prices a
    group above its ring time.

    With `cost.geometry.menu_kinds` (a menu of programs, each with its one kind) a group whose degree and
    padded length are a menu program runs that program's kind, wherever its Ulysses sub-groups sit
    inside nodes (else the ring, a program off the menu). On a padded ladder under
    `geometry.kind_rule` "program" (the default) every other group of degree > 1 runs its
    program's kind (`program_kind`, fixed without data) where its ranks can run it (`runs_on`),
    else the ring; only groups of an unpadded stream or under kind_rule "group" choose.
    (`best_kind_times` without its times.)"""
    return best_kind_times(cost, groups, terms)[0]


def best_kind_times(cost: CostModel, groups: Sequence[tuple[Sequence[int], Sequence[int]]],
                    terms: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[list[str], np.ndarray]:
    """`best_kinds` and each group's time on its kind (as `price_groups` prices it). Every
    (group, Ulysses size) above the floor of `hybrid_floor` is priced in one call of the "hybrid" family (u = d is
    Ulysses over the whole group: the same floats as the named kinds)."""
    A, B, S = bin_sums([samples for _, samples in groups], *terms)
    d = np.fromiter((len(ranks) for ranks, _ in groups), dtype=np.int64, count=len(groups))
    rpn = cost.ranks_per_node
    inter = np.fromiter((spans_nodes(ranks, rpn) for ranks, _ in groups), dtype=bool, count=len(groups))
    kinds = ["ring"] * len(groups)
    df = d.astype(np.float64)
    Ap, Bp, P = padded_terms(cost, A, B, S, df)  # once for every kind
    times = ring = _padded_times(cost, Ap, Bp, P, df, inter, "ring")
    live = _above_floor(cost, times, Ap, Bp, P, df)  # the others cannot beat the ring (`hybrid_floor`)
    free = np.ones(len(groups), dtype=bool)
    fixed_any = False
    geo = cost.geometry
    if geo.fixed_kinds and len(groups):
        fixed = {(deg, b): k for deg, b, k in geo.menu_kinds}
        rule = program_kinds_rule(cost)
        padded = np.broadcast_to(padded_length(cost, S, d), d.shape)
        for i, (deg, p) in enumerate(zip(d.tolist(), padded.tolist())):
            kind = fixed.get((deg, int(p)))
            if kind is None and rule and deg > 1:
                kind = program_kind(cost, deg, int(p))
            if kind is None:
                continue
            free[i] = False
            if kind != "ring" and runs_on(kind, groups[i][0], cost):
                kinds[i], fixed_any = kind, True
    pairs_i, pairs_u = [], []
    for deg in sorted(set(d[free & live].tolist()) - {1}):
        idx = np.flatnonzero((d == deg) & free & live)
        for u in ulysses_sizes(cost, deg):  # the kinds of `attention_kinds` past the ring
            # a group inside one node has node-local sub-groups; only spanning groups need a look
            ok = idx[[not inter[i] or node_local(groups[i][0], u, rpn) for i in idx.tolist()]]
            pairs_i.append(ok)
            pairs_u.append(np.full(ok.size, u, dtype=np.int64))
    if pairs_i:
        i, u = np.concatenate(pairs_i), np.concatenate(pairs_u)
        if i.size:
            t = _padded_times(cost, Ap[i], Bp[i], P[i], df[i], inter[i], "hybrid", u)
            best = times.copy()
            np.minimum.at(best, i, t)
            # the first kind (ring, then u ascending) at the least time, as a scan keeping only
            # strict improvements picks it
            win = (t == best[i]) & (t < times[i])
            ubest = np.full(len(groups), np.iinfo(np.int64).max)
            np.minimum.at(ubest, i[win], u[win])
            for g in np.flatnonzero(ubest < np.iinfo(np.int64).max).tolist():
                kinds[g] = attention_name(int(ubest[g]), int(d[g] // ubest[g]))
            times = best
    # a group over nodes may also run Ulysses over all its ranks (the all-to-all on the inter-node
    # links), where the head count allows: it wins only when strictly faster
    over = np.flatnonzero(free & live & inter & (d > 1) & (cost.num_heads % np.maximum(d, 1) == 0))
    if over.size:
        t = _padded_times(cost, Ap[over], Bp[over], P[over], df[over], True, "ulysses")
        win = t < times[over]
        for g in over[win].tolist():
            kinds[g] = "ulysses"
        times = times.copy()
        times[over[win]] = t[win]
    if fixed_any:  # programs' fixed kinds, priced on their own (`kind_times`: the same floats)
        times = _times_on(cost, Ap, Bp, P, df, inter, kinds, ring)
    return kinds, times


def _times_on(cost: CostModel, A: np.ndarray, B: np.ndarray, P: np.ndarray, d: np.ndarray, inter: np.ndarray,
              kinds: Sequence[str], ring: np.ndarray) -> np.ndarray:
    """`kind_times` of groups with padded terms (`ring`: their ring times): Ulysses over whole
    groups in one call, the hybrids in one call of the "hybrid" family."""
    sizes: dict[tuple[str, int], int] = {}
    u = np.ones(d.shape, dtype=np.float64)
    for i, (kind, x) in enumerate(zip(kinds, d.tolist())):
        if kind != "ring":
            key = (kind, int(x))
            v = sizes.get(key)
            if v is None:
                v = sizes[key] = attention_split(kind, int(x))[0]
            u[i] = v
    out = np.array(ring, dtype=np.float64)
    full = np.flatnonzero((u > 1) & (u == d))
    if full.size:
        out[full] = _padded_times(cost, A[full], B[full], P[full], d[full], inter[full], "ulysses")
    part = np.flatnonzero((u > 1) & (u < d))
    if part.size:
        out[part] = _padded_times(cost, A[part], B[part], P[part], d[part], inter[part], "hybrid", u[part])
    return out


def group_kind_times(cost: CostModel, plan: Any, lengths: Sequence[int] | np.ndarray,
                     etas: Sequence[float] | np.ndarray | None = None) -> list[dict[str, float]]:
    """Each group of `plan` (plan order): its seconds under every attention kind it can run on its
    ranks (the kinds `best_kinds` considers: ring, and each Ulysses size whose sub-groups sit inside
    nodes), {kind: s}."""
    attn, lin, tok = sample_terms(cost, np.asarray(lengths), etas)
    groups = list(plan.groups)
    A, B, S = bin_sums([list(g.samples) for g in groups], attn, lin, tok)
    rpn = cost.ranks_per_node
    out = []
    for i, g in enumerate(groups):
        inter = spans_nodes(g.ranks, rpn)
        kinds = [k for k in attention_kinds(g.degree, cost.num_heads, rpn)
                 if k == "ring" or not inter or node_local(g.ranks, attention_split(k, g.degree)[0], rpn)]
        if inter and g.degree > 1 and cost.ulysses_ok(g.degree) and "ulysses" not in kinds:
            kinds.append("ulysses")
        out.append({k: float(group_times(cost, A[i], B[i], S[i], g.degree, inter, k)) for k in kinds})
    return out


def price_groups(cost: CostModel, groups: Sequence[tuple[Sequence[int], Sequence[int]]],
                 terms: tuple[np.ndarray, np.ndarray, np.ndarray], kinds: Sequence[str], ranks_per_node: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(time, tokens S, degree) of each group given as (ranks, sample ids) with its attention kind,
    from the per-sample `terms` (attention work, linear work, tokens: `pricing.sample_terms`)."""
    A, B, S = bin_sums([samples for _, samples in groups], *terms)
    d = np.fromiter((len(ranks) for ranks, _ in groups), dtype=np.int64, count=len(groups))
    inter = np.fromiter((spans_nodes(ranks, ranks_per_node) for ranks, _ in groups), dtype=bool, count=len(groups))
    return kind_times(cost, A, B, S, d, inter, kinds), S, d


def plan_group_times(plan: Any, lengths: Sequence[int] | np.ndarray, cost: CostModel,
                     etas: Sequence[float] | np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Time of every group of `plan` (vectorised): (seconds, degree, micro-batch index), one entry
    per group in plan order. Raises ValueError naming the group if it names a missing sample."""
    lengths = np.asarray(lengths)
    attn, lin, tok = sample_terms(cost, lengths, etas)
    groups = [(m, g) for m, mb in enumerate(plan.micro_batches) for g in mb.groups]
    n = len(groups)
    if not n:
        raise ValueError("plan has no groups")
    sizes = np.fromiter((len(g.samples) for _, g in groups), dtype=np.int64, count=n)
    idx = np.fromiter((s for _, g in groups for s in g.samples), dtype=np.int64, count=int(sizes.sum()))
    if idx.size and (idx.min() < 0 or idx.max() >= lengths.size):
        bad = int(np.flatnonzero((idx < 0) | (idx >= lengths.size))[0])
        gi = int(np.searchsorted(np.cumsum(sizes), bad, side="right"))
        m, g = groups[gi]
        raise ValueError(f"micro-batch {m} group with ranks {list(g.ranks)}: sample {int(idx[bad])} is outside "
                         f"the batch of {lengths.size} samples")
    t, _, d = price_groups(cost, [(g.ranks, g.samples) for _, g in groups], (attn, lin, tok),
                           [g.attention for _, g in groups], plan.ranks_per_node or plan.num_ranks)
    mb = np.fromiter((m for m, _ in groups), dtype=np.int64, count=n)
    return t, d, mb


def plan_makespans(plan: Any, lengths: Sequence[int] | np.ndarray, cost: CostModel,
                   etas: Sequence[float] | np.ndarray | None = None) -> np.ndarray:
    """Makespan of each micro-batch of `plan` (lanes-aware on shared cores: `pricing.makespans`)."""
    t, d, mb = plan_group_times(plan, lengths, cost, etas)
    return makespans(cost, t, d, mb, len(plan.micro_batches))


def step_time(plan: Any, lengths: Sequence[int] | np.ndarray, cost: CostModel,
              etas: Sequence[float] | np.ndarray | None = None) -> float:
    """Seconds of one training step of `plan`: its micro-batch makespans plus the gradient
    all-reduce over all ranks (groups of a micro-batch run concurrently; with
    `cost.compute_lanes` they also share those cores)."""
    return float(plan_makespans(plan, lengths, cost, etas).sum() + allreduce_time(cost, plan.num_ranks))
