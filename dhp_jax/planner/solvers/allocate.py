"""Exact degree allocation for a fixed packing: least makespan of atomic groups on N ranks.

Given K' atomic groups with summed cost terms (A_i, B_i, S_i) and minimal degrees dmin_i, choose a
degree d_i from the allowed set for each so that sum d_i <= N and max_i T_i(d_i) is least.

Instead of the paper's O(K' N^2) table DP this runs a parametric search on the makespan, in its
incremental form: every group starts at its least feasible degree; the bottleneck group is raised
to the next degree at which its time strictly drops below its current time; it stops when that raise
does not fit in N. Invariant: every degree below d_i has time >= the makespan at which group i was
last raised, so any plan with a smaller makespan needs more than N ranks; hence the result is
optimal (ties included) for any per-group times, monotone in d or not. Exactness is for this
per-group model (makespan = max_i T_i); on shared-core hosts (`CostModel.compute_lanes`) the
machine-wide lanes cap of `pricing.makespans` is applied by the caller when comparing candidates. Each raise costs O(log K')
plus the scalar evaluations walked, O((K' + N) log K') overall.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
from typing import Any, Callable, Sequence

import numpy as np

from dhp_jax.geometry.layout import ladders, linear_tokens, rung_list, scalar_bucketer
from dhp_jax.planner.contract.plan import attention_split
from dhp_jax.planner.cost.memory import max_tokens_per_rank
from dhp_jax.planner.cost.model import CostModel
from dhp_jax.planner.cost.pricing import (best_times, closed_form, comm_per_token, group_times, hybrid_floor,
                                          program_kind, program_rule, program_sizes, sorted_unique, ulysses_sizes)


def allowed_degrees(num_ranks: int, degrees: str | Sequence[int] = "any", cost: CostModel | None = None,
                    attention: str = "ring") -> np.ndarray:
    """Sorted int64 array of degrees a group may take ("any", "pow2" or an explicit list)."""
    if isinstance(degrees, str):
        if degrees == "any":
            ds = np.arange(1, num_ranks + 1)
        elif degrees == "pow2":
            ds = 2 ** np.arange(0, int(np.log2(num_ranks)) + 1)
        else:
            raise ValueError(f"degrees must be 'any', 'pow2' or a list of integers, got {degrees!r}")
    else:
        ds = sorted_unique(np.asarray(list(degrees), dtype=np.int64))
        if ds.size == 0 or ds.min() < 1:
            raise ValueError(f"degrees must be positive integers, got {list(degrees)}")
    ds = ds[ds <= num_ranks]
    if attention == "ulysses" and cost is not None:
        ds = np.array([d for d in ds if cost.ulysses_ok(int(d))], dtype=np.int64)
    return ds.astype(np.int64)


def _linear_whole(S: float, P: float, d: int, chunk: int) -> float:
    """`d * layout.linear_tokens(S, P, d, chunk)` for chunk > 0 and a stream of P slots whose shards
    P / d are whole (the ladder's streams are multiples of 2d), with the same floats: the scalar
    search calls it thousands of times, so without the type checks and the call of `chunk_size`."""
    shard = int(P / d)
    c = (shard or 1) if shard <= chunk else -(-shard // -(-shard // chunk))
    return d * float(math.ceil(math.ceil(S / d) / c) * c)


class _ScalarTime:
    """`pricing.group_times` (or `pricing.best_times`, attention "best") at scalar or tabulated speed:
    the search evaluates a few thousand group times, one at a time.

    No formula of its own: each time is `pricing.closed_form` (the one formula `group_times` calls),
    called on Python floats (`__call__`, `group_times_of`) or on arrays (`times`), after the same
    bucket rule (`geometry.layout.bucket_lengths`, walked inline on its ladder) and linear padding,
    so the figures agree bit for bit with the model's. What it saves is the rest of `group_times`:
    per-degree constants (the memory clamp of the bucket rule, the link's per-token and per-message
    seconds) are tabulated once per model and attention kind; `group_times_of` also takes each
    group's ladder rung once, since the rung depends on the tokens only.

    `attention` "best" prices each group at its least time over the kinds the per-group choice may
    give it (`pricing.best_times`: the ring, and Ulysses over u times a ring over d / u for each u
    of `pricing.ulysses_sizes`), so the search sees the kind the plan will run. Under the padded
    ladder's one kind per program (`pricing.program_rule`) a group is priced on its program's kind
    instead (`pricing.program_kind` of its degree and padded length, looked up once per program),
    as `pricing.best_times` prices it: the same floats, from the same tables."""

    def __init__(self, cost: CostModel, attention: str):
        # shared lanes: the closed form below does not hold; price every evaluation with the
        # cost model itself so the search stays exact for it
        self.exact = None
        if cost.compute_lanes is not None:
            self.exact = (cost, attention)
        # one kind per (degree, bucket) program: each group's Ulysses size u (1: the ring, d: Ulysses
        # over all its ranks) by program, filled on first use
        self.program = attention == "best" and program_rule(cost)
        self._program_u: dict[tuple[int, float], int] = {}
        self._split: dict[tuple[str, int], int] = {}
        self._sorted_sizes: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0))
        self.cost = cost  # padded buckets: the scalar bucket rule, then the closed form
        g = cost.geometry
        self.bucket = scalar_bucketer(g.bucket_min, g.bucket_growth, max_tokens_per_rank(cost),
                                      g.bucket_menu) if g.bucket_min else None
        # the ladder walked inline (no menu: a menu's buckets replace it per degree, so that case
        # keeps calling the scalar bucketer)
        self.rungs = rung_list(g.bucket_min, g.bucket_growth) if g.bucket_min and not g.bucket_menu else None
        self.mpd = max_tokens_per_rank(cost)
        self.padded_attention = bool(cost.padded_attention)
        self.a1, self.a2 = cost.a1, cost.a2
        self.chunk = int(g.linear_chunk)
        self.best = attention == "best"
        self.overlap = bool(cost.comm_overlap)
        self.b1 = cost.b1
        self.rpn = cost.ranks_per_node
        self.c_intra = float(comm_per_token(cost, False, "ring"))
        self.c_inter = float(comm_per_token(cost, True, "ring"))
        self.c_a2a = float(comm_per_token(cost, False, "ulysses"))  # a hybrid's all-to-all: inside a node
        self.c_a2a_inter = float(comm_per_token(cost, True, "ulysses"))  # Ulysses over nodes
        self._us: dict[int, tuple[int, ...]] = {}
        self.l_intra, self.l_inter = cost.lat_intra, cost.lat_inter
        self._floor = hybrid_floor(cost)
        self.ring = attention in ("ring", "best")
        self.attention = attention
        self._tables: tuple[list, list, list, list] = ([], [], [], [])
        self._degrees(64)
        self._vec: tuple = ((),)
        self._vector_tables(64)

    def _degrees(self, top: int) -> tuple[list, list, list, list]:
        """Per-degree tables for degrees 0..top: 2d, the bucket rule's memory clamp, the link's
        per-token seconds (the ring's, or the all-to-all's for a "ulysses" search) and its seconds
        per message (entry 0 unused)."""
        step, clamp, coef, lat = self._tables
        if len(step) > top:
            return self._tables
        step, clamp, coef, lat = [], [], [], []
        mpd = self.mpd
        c_in, c_out = (self.c_intra, self.c_inter) if self.ring else (self.c_a2a, self.c_a2a_inter)
        for d in range(0, 2 * top + 1):
            s = 2.0 * d
            step.append(s)
            clamp.append((mpd * d // s) * s if d and mpd is not None else None)
            coef.append(c_out if d > self.rpn else c_in)
            lat.append(self.l_inter if d > self.rpn else self.l_intra)
        self._tables = (step, clamp, coef, lat)
        return self._tables

    @property
    def tabled(self) -> bool:
        """Whether `times` prices from the per-degree tables (ring groups, no shared lanes, no
        bucket menu), so `group_times_of` gives the same floats as `times`."""
        return self.exact is None and self.ring and not (self.bucket is not None and self.rungs is None)

    def _kind(self, A: Any, B: Any, P: Any, d: Any, coef: Any, lat: Any) -> Any:
        """`closed_form` on the search's kind (the ring, or Ulysses over all d ranks)."""
        if self.ring:
            return closed_form(A, B, P, d, 1, d, self.b1, coef, 0.0, lat, True, False, self.overlap)
        return closed_form(A, B, P, d, d, d, self.b1, 0.0, coef, lat, False, True, self.overlap)

    def times(self, A: Any, B: Any, S: Any, degree: np.ndarray) -> np.ndarray:
        """`pricing.group_times(A, B, S, degree, attention=...)` (integer degrees, inter-node
        exactly above a node), the same floats with fewer NumPy calls: the per-degree terms are
        taken from tables. Ring groups without shared lanes or a bucket menu; others call the model."""
        if not self.tabled:
            if self.best:
                return best_times(self.cost, A, B, S, degree)
            return group_times(self.cost, A, B, S, degree, attention="ring" if self.ring else self.attention)
        out, A, B, P, d = self._tabled_ring(A, B, S, degree)
        if self.program:
            out = self._programs(A, B, P, d, out)
        elif self.best:
            out = self._hybrids(A, B, P, d, out)
        return out

    def least(self, A: Any, B: Any, S: Any, degree: np.ndarray, ok: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray | None]:
        """Row by row, the least of `times(A, B, S, degree)` over the entries where `ok` (inf where
        none), the same floats; and, from the tables in "best" mode, the least of the ring's times
        too (what a ring search's `least` gives; else None). There the other kinds are priced only
        where their floor (`pricing.hybrid_floor`) is below the row's least ring time: elsewhere
        they cannot lower the row's least."""
        if not (self.tabled and self.best):
            return np.where(ok, self.times(A, B, S, degree), np.inf).min(axis=1), None
        out, A, B, P, d = self._tabled_ring(A, B, S, degree)
        A, B, P, d, ok = np.broadcast_arrays(A, B, P, d, ok)
        out = np.where(ok, out, np.inf)
        ring_least = out.min(axis=1)
        if self.program:  # a program's kind may price a group above its ring time: every entry
            out[ok] = self._programs(A[ok], B[ok], P[ok], d[ok], out[ok])
            return out.min(axis=1), ring_least
        cand = ok & ((A + B) / d + self.b1 + self._floor * P / d < ring_least[:, None])
        if np.any(cand):
            out[cand] = self._hybrids(A[cand], B[cand], P[cand], d[cand], out[cand])
        return out.min(axis=1), ring_least

    def _tabled_ring(self, A: Any, B: Any, S: Any, degree: np.ndarray) -> tuple[np.ndarray, Any, Any, Any, np.ndarray]:
        """`times` on the ring from the tables, and the padded terms A, B, P and the int degrees."""
        d = np.asarray(degree, dtype=np.int64)
        top = int(d.max()) if d.size else 0
        if top >= len(self._vec[0]):
            self._vector_tables(top)
        step, clamp, coef, lat, df = (t[d] for t in self._vec)
        S = np.asarray(S, dtype=np.float64)
        if self.rungs is not None:  # bucket_lengths (no menu), as geometry.padded_length calls it
            rung = ladders(S, self.cost.geometry.bucket_min, self.cost.geometry.bucket_growth)
            if self.mpd is not None:
                rung = np.maximum(np.minimum(rung, clamp), S)
            P = np.ceil(rung / step) * step
            if self.padded_attention:
                A = self.a1 * P * P
            B = B + self.a2 * (df * linear_tokens(S, P, df, self.chunk) - S)
        else:
            P = S
        A, B = np.asarray(A, dtype=np.float64), np.asarray(B, dtype=np.float64)
        return np.asarray(self._kind(A, B, P, df, coef, lat), dtype=np.float64), A, B, P, d

    def sizes(self, d: int) -> tuple[int, ...]:
        """The Ulysses sizes of the hybrids a "best" search prices on degree d (cached, as
        `pricing.best_times`): `pricing.ulysses_sizes`, over nodes only those dividing ranks_per_node;
        0 last when Ulysses over all d ranks across nodes is priced too (d > ranks_per_node, heads allow)."""
        us = self._us.get(d)
        if us is None:
            across = (0,) if d > self.rpn and self.cost.num_heads % d == 0 else ()
            us = self._us[d] = tuple(u for u in ulysses_sizes(self.cost, d)
                                     if d <= self.rpn or self.rpn % u == 0) + across
        return us

    def program_u(self, d: int, P: float) -> int:
        """The Ulysses size of the kind of program (d, P) (`pricing.program_kind`): 1 the ring, d
        Ulysses over all d ranks, else a hybrid Ulysses over u times a ring over d / u."""
        key = (d, P)
        u = self._program_u.get(key)
        if u is None:
            if d <= 1:
                u = 1
            else:
                kind = program_kind(self.cost, d, int(P))
                u = 1 if kind == "ring" else d if kind == "ulysses" else self._split.get((kind, d))
                if u is None:
                    u = self._split[(kind, d)] = attention_split(kind, d)[0]
            self._program_u[key] = u
        return u

    def _sizes_of(self, d: np.ndarray, P: np.ndarray) -> np.ndarray:
        """`program_u` of every (d[i], P[i]) (d > 1), vectorised: a sorted array of the (degree,
        length) keys met so far, extended where a program is not in it yet."""
        key = d.astype(np.float64) * 2.0 ** 40 + P  # exact in float64: P < 2**40, d < 2**13
        keys, sizes = self._sorted_sizes
        at = np.minimum(np.searchsorted(keys, key), max(keys.size - 1, 0))
        if keys.size:
            miss = keys[at] != key
            if not miss.any():
                return sizes[at]
        else:
            miss = np.ones(key.shape, dtype=bool)
        add_k = sorted_unique(key[miss])  # the new (degree, length) keys, sorted
        nd = np.floor(add_k / 2.0 ** 40)
        # priced together (`pricing.program_sizes`: `program_u`'s sizes, the same choices)
        add_u = program_sizes(self.cost, nd, add_k - nd * 2.0 ** 40).astype(np.float64)
        keys, sizes = np.concatenate([keys, add_k]), np.concatenate([sizes, add_u])
        order = np.argsort(keys, kind="stable")
        keys, sizes = keys[order], sizes[order]
        self._sorted_sizes = (keys, sizes)
        return sizes[np.searchsorted(keys, key)]

    def program_time(self, Ai: float, Bi: float, P: float, d: int, t: float) -> float:
        """The time of a group with padded terms Ai, Bi, P on d ranks on its program's kind (`t`: its
        ring time): `_programs` in scalars, the same floats."""
        u = self._program_u.get((d, P))
        if u is None:
            u = self.program_u(d, P)
        if u == 1:
            return t
        return self.kind_form(Ai, Bi, P, float(d), float(u), d > self.rpn)

    def kind_form(self, A: Any, B: Any, P: Any, d: Any, u: Any, inter: Any) -> Any:
        """`closed_form` of Ulysses over u ranks times a ring over d / u (u > 1; u = d: Ulysses over
        all d ranks, its all-to-all on the nodes' links where the group spans nodes; a hybrid's
        all-to-all stays inside a node), on Python floats (float d, u; bool inter) or arrays. The
        one formula of a program's kind other than the ring (`program_time`, `_programs`,
        `group_times_of`): at u = d the ring's term is 0.0 exactly, so it gives Ulysses' floats."""
        if isinstance(d, float):
            c_ring, lat = (self.c_inter, self.l_inter) if inter else (self.c_intra, self.l_intra)
            c_a2a = self.c_a2a_inter if inter and u == d else self.c_a2a
        else:
            c_ring = np.where(inter, self.c_inter, self.c_intra)
            lat = np.where(inter, self.l_inter, self.l_intra)
            c_a2a = np.where(inter & (u == d), self.c_a2a_inter, self.c_a2a)
        return closed_form(A, B, P, d, u, d, self.b1, c_ring, c_a2a, lat, False, False, self.overlap)

    def _programs(self, A: Any, B: Any, P: Any, d: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`out` (ring times) replaced by each group's time on its program's kind (`program_kind`,
        as `pricing.best_times` prices it under the program rule), vectorised."""
        arrays = np.broadcast_arrays(*(np.asarray(x) for x in (A, B, P, d, out)))
        shape = arrays[0].shape
        A, B, P, d, out = (x.reshape(-1) for x in arrays)
        out = np.array(out, dtype=np.float64)
        live = np.flatnonzero(d > 1)
        if not live.size:
            return out.reshape(shape)
        us = self._sizes_of(d[live], P[live])
        dm = d[live].astype(np.float64)
        hyb = us > 1.0
        if not np.any(hyb):
            return out.reshape(shape)
        i, u, dm = live[hyb], us[hyb], dm[hyb]
        out[i] = self.kind_form(A[i], B[i], P[i], dm, u, dm > self.rpn)
        return out.reshape(shape)

    def _hybrids(self, A: Any, B: Any, P: Any, d: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`out` (ring times) lowered to each group's least hybrid time (vectorised `hybrid`)."""
        arrays = np.broadcast_arrays(*(np.asarray(x) for x in (A, B, P, d, out)))
        shape = arrays[0].shape
        A, B, P, d, out = (x.reshape(-1) for x in arrays)
        out = np.array(out, dtype=np.float64)
        # only groups above the hybrids' floor may get lower (`pricing.hybrid_floor`)
        rest = np.flatnonzero(out > (A + B) / d + self.b1 + self._floor * P / d)
        if rest.size < out.size:
            if rest.size:
                out[rest] = self._hybrids(A[rest], B[rest], P[rest], d[rest], out[rest])
            return out.reshape(shape)
        top = int(d.max()) if d.size else 0
        for u in range(2, min(top, self.rpn) + 1):
            if self.cost.num_heads % u:
                continue
            m = (d % u == 0) & ((d <= self.rpn) | (self.rpn % u == 0))  # `sizes`
            if not np.any(m):
                continue
            dm = d[m].astype(np.float64)
            out[m] = np.minimum(out[m], self.kind_form(A[m], B[m], P[m], dm, np.full(dm.shape, float(u)),
                                                       dm > self.rpn))
        m = (d > self.rpn) & (self.cost.num_heads % np.maximum(d, 1) == 0)
        if np.any(m):  # Ulysses over nodes: `pricing.group_times(..., True, "ulysses")`
            dm = d[m].astype(np.float64)
            out[m] = np.minimum(out[m], self.kind_form(A[m], B[m], P[m], dm, dm, np.ones(dm.shape, dtype=bool)))
        return out.reshape(shape)

    def hybrid(self, Ai: float, Bi: float, P: float, d: int, t: float) -> float:
        """min(t, the time of every hybrid `sizes(d)` names for a group with padded terms Ai, Bi, P
        on d ranks): `_hybrids` in scalars, the same floats."""
        us = self._us.get(d)
        if us is None:
            us = self.sizes(d)
        if not us:
            return t
        df = float(d)
        if t <= (Ai + Bi) / df + self.b1 + self._floor * P / df:  # no hybrid can come in under t
            return t
        inter, form = d > self.rpn, self.kind_form
        for u in us:
            # u 0: Ulysses over all d ranks, across nodes
            ti = form(Ai, Bi, P, df, df, True) if u == 0 else form(Ai, Bi, P, df, float(u), inter)
            if ti < t:
                t = ti
        return t

    def _vector_tables(self, top: int) -> None:
        """Arrays over degrees 0..top of `times`: 2d, the memory clamp (as `bucket_lengths` computes
        it), the link's per-token seconds, its seconds per message and d (entry 0 unused)."""
        d = np.arange(max(top, 64) + 1, dtype=np.float64)
        inter = d > self.rpn
        with np.errstate(divide="ignore", invalid="ignore"):
            step = 2.0 * d
            clamp = np.floor(self.mpd * d / step) * step if self.mpd is not None else d
        coef = np.where(inter, self.c_inter, self.c_intra) if self.ring else np.where(inter, self.c_a2a_inter,
                                                                                       self.c_a2a)
        lat = np.where(inter, self.l_inter, self.l_intra)
        self._vec = (step, clamp, coef, lat, d)

    def __call__(self, A: float, B: float, S: float, d: int) -> float:
        if self.exact is not None:
            if self.best:
                return float(best_times(self.exact[0], A, B, S, d))
            return float(group_times(self.exact[0], A, B, S, d, attention=self.exact[1]))
        step, clamp, coef, lat = self._tables if d < len(self._tables[0]) else self._degrees(d)
        if self.rungs is not None:  # the bucket rule inline (`_rung_scalar`), per-degree constants tabulated
            st = step[d]
            r = self.rungs[bisect.bisect_left(self.rungs, max(math.ceil(S), 1))]
            if self.mpd is not None:
                r = max(min(r, clamp[d]), S)
            P = math.ceil(r / st) * st
            if self.padded_attention:
                A = self.a1 * P * P
            B = B + self.a2 * ((_linear_whole(S, P, d, self.chunk) if self.chunk else P) - S)
        elif self.bucket is not None:
            P = self.bucket(S, d)  # = c.padded_length(S, d)
            if self.padded_attention:
                A = self.a1 * P * P
            B = B + self.a2 * (d * linear_tokens(S, P, d, self.chunk) - S)
        else:
            P = S
        if self.program and self.program_u(d, P) != 1:
            return self.program_time(A, B, P, d, 0.0)  # not the ring: its time is not needed
        if self.ring:
            t = closed_form(A, B, P, d, 1, d, self.b1, coef[d], 0.0, lat[d], True, False, self.overlap)
            return self.hybrid(A, B, P, d, t) if self.best and not self.program else t
        return closed_form(A, B, P, d, d, d, self.b1, 0.0, coef[d], lat[d], False, True, self.overlap)

    def group_times_of(self, A: Any, B: Any, S: Any, top: int = 64) -> Callable[[int, int], float]:
        """`ev(i, d)` = this T for group i (terms A[i], B[i], S[i], indexable) at degree d; each
        group's ladder rung is looked up once, on first use. `top`: the largest degree expected
        (larger ones extend the tables)."""
        if self.exact is not None or (self.bucket is not None and self.rungs is None):
            return lambda i, d: self(A[i], B[i], S[i], d)  # shared lanes, or a menu of buckets
        step, clamp, coef, lat = self._degrees(top)
        lst, bisect_left, ceil = self.rungs, bisect.bisect_left, math.ceil
        rung: dict[int, float] = {}
        a1, a2, b1, dense, overlap = self.a1, self.a2, self.b1, self.padded_attention, self.overlap
        chunk = self.chunk
        ring, clamped, padded = self.ring, self.mpd is not None, self.rungs is not None
        tables = self._degrees
        hybrid = self.hybrid if self.best else None
        form = closed_form
        program, kinds, kind_of, kind_form = self.program, self._program_u, self.program_u, self.kind_form
        rpn = self.rpn

        def ev(i: int, d: int) -> float:
            nonlocal step, clamp, coef, lat
            if d >= len(step):
                step, clamp, coef, lat = tables(d)
            if padded:
                Si = S[i]
                r = rung.get(i)
                if r is None:
                    r = rung[i] = lst[bisect_left(lst, max(ceil(Si), 1))]
                st = step[d]
                if clamped:  # the rung clamped to the memory of d ranks, never below the tokens:
                    c = clamp[d]  # max(min(r, c), Si) without the builtins' call overhead
                    if c < r:
                        r = c
                    if Si > r:
                        r = Si
                P = ceil(r / st) * st
                Ai = a1 * P * P if dense else A[i]
                Bi = B[i] + a2 * ((_linear_whole(Si, P, d, chunk) if chunk else P) - Si)
            else:
                P, Ai, Bi = S[i], A[i], B[i]
            if program:  # `program_time`, inline: the program's kind alone is priced
                u = kinds.get((d, P))
                if u is None:
                    u = kind_of(d, P)
                if u != 1:
                    return kind_form(Ai, Bi, P, float(d), float(u), d > rpn)
                return form(Ai, Bi, P, d, 1, d, b1, coef[d], 0.0, lat[d], True, False, overlap)
            if ring:
                t = form(Ai, Bi, P, d, 1, d, b1, coef[d], 0.0, lat[d], True, False, overlap)
            else:
                t = form(Ai, Bi, P, d, d, d, b1, 0.0, coef[d], lat[d], False, True, overlap)
            return t if hybrid is None else hybrid(Ai, Bi, P, d, t)

        return ev


class _LazyFloats:
    """Read-only float view of an array, converting only the entries the search touches."""

    def __init__(self, arr: np.ndarray):
        self.arr = arr

    def __getitem__(self, i: int) -> float:
        return self.arr.item(i)


@functools.lru_cache(maxsize=64)
def _scalar_time(cost: CostModel, attention: str) -> _ScalarTime:
    return _ScalarTime(cost, attention)


_last: tuple = (None, None, None)  # (cost, attention, _ScalarTime) of the latest call, one reference


def scalar_time(cost: CostModel, attention: str = "ring") -> _ScalarTime:
    """A cached `_ScalarTime` (CostModel is frozen, hence hashable). The same model object as the
    latest call skips hashing it: a plan asks hundreds of times, and a model's hash walks all its
    fields. (The tuple is read and replaced whole, so planner threads never mix two entries.)"""
    global _last
    last = _last
    if last[0] is cost and last[1] == attention:
        return last[2]
    t = _scalar_time(cost, attention)
    _last = (cost, attention, t)
    return t


def allocate(A: Sequence[float], B: Sequence[float], S: Sequence[float], dmin: Sequence[int], num_ranks: int,
             cost: CostModel, allowed: np.ndarray | None = None, attention: str = "ring",
             limit: float = math.inf) -> tuple[np.ndarray, float] | None:
    """Optimal degrees (int64[K']) and makespan, or None when the groups cannot fit on `num_ranks`.

    Group times use `cost` with inter-node links exactly when d > ranks_per_node (placement keeps
    smaller groups inside a node where it can). `attention`: the kind every group is priced at ("ring",
    "ulysses"), or "best": each group at its fastest kind (`pricing.best_times`).

    `limit` (what the caller must beat): the result is the same as without it whenever its makespan
    is below `limit`; otherwise the makespan returned is inf (no allocation comes in under `limit`,
    the degrees are not meaningful). Every group then starts at the least degree whose work bound
    (work / d + b1) is below `limit`, which saves the raises below it and decides a hopeless packing
    in a few steps.
    """
    K = len(A)
    if K == 0:
        return np.zeros(0, dtype=np.int64), 0.0
    ds = np.arange(1, num_ranks + 1) if allowed is None else np.asarray(allowed, dtype=np.int64)
    ds_list = ds.tolist()
    if not ds_list:
        return None
    t = scalar_time(cost, attention)
    last = len(ds_list)
    # few groups (one, when the tables price it): the set-up in plain Python (NumPy's calls cost more here)
    if K < _WARM_MIN_GROUPS and (K > 1 or t.tabled):
        Al, Bl, Sl = (np.asarray(x, dtype=np.float64).tolist() for x in (A, B, S))
        pos = [bisect.bisect_left(ds_list, d) for d in np.asarray(dmin, dtype=np.int64).tolist()]
        if max(pos) >= last or sum(ds_list[p] for p in pos) > num_ranks:
            return None
        if limit < math.inf:  # as `_limit_start`, the same floats
            room = limit - cost.b1
            if room > 0:
                pos = [max(p, bisect.bisect_left(ds_list, (a + b) / room * (1 - 1e-9))) for p, a, b in zip(pos, Al, Bl)]
            if not room > 0 or max(pos) >= last or sum(ds_list[p] for p in pos) > num_ranks:
                return np.asarray([ds_list[min(p, last - 1)] for p in pos], dtype=np.int64), math.inf
        ev = t.group_times_of(Al, Bl, Sl, ds_list[-1])
        if K == 1:
            return _one_group(ev, Al[0] + Bl[0], cost.b1, ds_list, pos[0], num_ranks, limit)
        t0 = [ev(i, ds_list[p]) for i, p in enumerate(pos)]
    else:
        starts = np.searchsorted(ds, np.asarray(dmin, dtype=np.int64), side="left")
        if np.any(starts >= last) or int(ds[starts].sum()) > num_ranks:
            return None
        if limit < math.inf:
            starts, hopeless = _limit_start(starts, ds, num_ranks, cost, A, B, limit)
            if hopeless:
                return np.asarray(ds[np.minimum(starts, last - 1)], dtype=np.int64), math.inf
        if K == 1:  # one group, priced by the model: the least degree reaching its least time
            cand = ds[starts[0]:]
            cand = cand[cand <= num_ranks]
            times = t.times(A[0], B[0], S[0], cand)  # = cost.group_times(..., attention=attention)
            j = int(np.argmin(times))
            best = float(times[j])
            return np.asarray([cand[j]], dtype=np.int64), best if best < limit else math.inf
        # many groups: a vectorised warm start
        An, Bn, Sn = (np.asarray(x, dtype=np.float64) for x in (A, B, S))
        starts = _warm_start(starts, ds, num_ranks, cost, An, Bn, Sn, attention, t.times)
        t0 = t.times(An, Bn, Sn, ds[starts]).tolist()
        ev = t.group_times_of(_LazyFloats(An), _LazyFloats(Bn), _LazyFloats(Sn), ds_list[-1])  # few entries are read
        pos = starts.tolist()
    deg = [ds_list[p] for p in pos]
    used = sum(deg)
    heap = [(-t0[i], i) for i in range(K)]
    heapq.heapify(heap)
    while True:
        neg, i = heap[0]
        cur = -neg
        budget = num_ranks - used + deg[i]  # the most ranks group i could hold
        p = pos[i] + 1
        while p < last:
            d = ds_list[p]
            if d > budget:
                p = last
                break
            ti = ev(i, d)
            if ti < cur:
                break
            p += 1
        if p >= last:
            break
        used += d - deg[i]
        pos[i], deg[i] = p, d
        heapq.heapreplace(heap, (-ti, i))
    span = float(-heap[0][0])
    return np.asarray(deg, dtype=np.int64), span if span < limit else math.inf


def _one_group(ev: Callable[[int, int], float], work: float, b1: float, ds_list: list[int], p: int,
               num_ranks: int, limit: float) -> tuple[np.ndarray, float]:
    """`allocate` of one group (`ev(0, d)` its time at degree d, `work` its A + B) from position `p`
    of `ds_list` (its least degree, raised by `limit`) up: the least degree reaching its least time,
    as the vectorised pricing of every allowed degree finds it.

    The degrees are walked from the largest down. Since T(d) >= work / d + b1, which grows as d
    falls, the walk stops once that bound passes the least time found (or `limit`): no smaller
    degree can reach it, nor tie it, so the result is the same (the least degree of the least time;
    inf when that is not below `limit`) for a few evaluations instead of every degree."""
    best, best_d = math.inf, ds_list[p]
    for j in range(bisect.bisect_right(ds_list, num_ranks) - 1, p - 1, -1):
        d = ds_list[j]
        if work / d + b1 > min(best, limit) * (1 + 1e-9):
            break
        tj = ev(0, d)
        if tj <= best:
            best, best_d = tj, d
    return np.asarray([best_d], dtype=np.int64), best if best < limit else math.inf


def _limit_start(starts: np.ndarray, ds: np.ndarray, num_ranks: int, cost: CostModel, A: Any, B: Any,
                 limit: float) -> tuple[np.ndarray, bool]:
    """Start positions (into `ds`) raised to the least degree whose work bound is below `limit`, and
    whether that already needs more than `num_ranks` ranks (no allocation comes in under `limit`).
    A degree below work / (limit - b1) has time >= work / d + b1 >= limit (the margin covers
    rounding), so no allocation under `limit` uses it, and the search's invariant holds from there."""
    b1 = cost.b1
    if not limit > b1:
        return starts, True
    need = (np.asarray(A, dtype=np.float64) + np.asarray(B, dtype=np.float64)) / (limit - b1) * (1 - 1e-9)
    pos = np.maximum(starts, np.searchsorted(ds, need, side="left"))
    if pos.max() >= len(ds) or int(ds[pos].sum()) > num_ranks:
        return pos, True
    return pos, False


_WARM_MIN_GROUPS = 24  # below this the scalar search is cheaper than the vectorised bisection
_WARM_ITERS = 14  # the bound only needs to be good, not tight: exactness never depends on it
_WARM_LEVELS = 4  # bisection steps decided per vectorised feasibility test (2**4 - 1 mids at once)


def _warm_start(starts: np.ndarray, ds: np.ndarray, num_ranks: int, cost: CostModel,
                A: np.ndarray, B: np.ndarray, S: np.ndarray, attention: str,
                times: Callable[..., np.ndarray] | None = None) -> np.ndarray:
    """Raise the starting degrees without losing exactness.

    If T_ub is the makespan of some feasible degree vector, the optimum V <= T_ub. Since
    T_i(d) >= work_i / d + b1, every degree below work_i / (T_ub - b1) has a time above T_ub >= V,
    so the search may start there: the invariant of `allocate` (degrees below d_i are no better
    than the final makespan) holds. The feasible vector comes from a bisection on the
    communication-free time, whose degrees are the least with work_i / d + b1 <= T.
    """
    work = A + B
    b1 = cost.b1
    last = len(ds) - 1

    def degrees_for(T: Any) -> np.ndarray:  # T: a float, or a column of them (one row each)
        need = np.ceil(work / (T - b1) * (1 - 1e-12))
        return np.maximum(starts, np.searchsorted(ds, need, side="left"))

    hi = b1 + float(np.max(work / ds[starts])) * (1 + 1e-9) + 1e-300
    lo = b1 + float(work.sum()) / num_ranks
    if not hi > lo:
        return starts
    # a degree past the last allowed one costs more than all ranks: such a row is never feasible
    ds_over = np.append(ds, num_ranks + 1)
    lo, hi = _bisect(lo, hi, _WARM_ITERS,
                     lambda T: (ds_over[degrees_for(T[:, None])].sum(axis=1) <= num_ranks).tolist())
    p = degrees_for(hi)
    if p.max() > last or int(ds[p].sum()) > num_ranks:
        return starts
    t_ub = float(np.max(group_times(cost, A, B, S, ds[p], attention=attention) if times is None
                        else times(A, B, S, ds[p])))
    if t_ub <= b1:
        return starts
    return degrees_for(t_ub)


def _bisect(lo: float, hi: float, iters: int, feasible: Callable[[np.ndarray], list]) -> tuple[float, float]:
    """`iters` bisection steps (mid = (lo + hi) / 2; feasible: hi = mid, else lo = mid), the same
    floats as one step at a time, but _WARM_LEVELS steps per call of `feasible`: it gets every mid
    those steps could visit (a binary tree in heap order: node k's children are 2k+1 when k was
    feasible, 2k+2 when not) and says which are feasible."""
    while iters > 0:
        levels = min(_WARM_LEVELS, iters)
        n = 2 ** levels - 1
        los, his, mids = [lo] * n, [hi] * n, [0.0] * n
        for k in range(n):
            m = mids[k] = 0.5 * (los[k] + his[k])
            if 2 * k + 2 < n:
                los[2 * k + 1], his[2 * k + 1] = los[k], m
                los[2 * k + 2], his[2 * k + 2] = m, his[k]
        ok = feasible(np.asarray(mids))
        k = 0
        for _ in range(levels):
            if ok[k]:
                hi, k = mids[k], 2 * k + 1
            else:
                lo, k = mids[k], 2 * k + 2
        iters -= levels
    return lo, hi


def brute_force(A: Sequence[float], B: Sequence[float], S: Sequence[float], dmin: Sequence[int], num_ranks: int,
                cost: CostModel, allowed: np.ndarray | None = None, attention: str = "ring") -> float | None:
    """Reference: least makespan over every degree vector (small instances only, for tests)."""
    ds = list(range(1, num_ranks + 1)) if allowed is None else [int(x) for x in allowed]
    best = [None]

    def rec(i: int, left: int, worst: float) -> None:
        if best[0] is not None and worst >= best[0]:
            return
        if i == len(A):
            best[0] = worst
            return
        for d in ds:
            if d < dmin[i] or d > left:
                continue
            ti = float(best_times(cost, A[i], B[i], S[i], d) if attention == "best"
                       else group_times(cost, A[i], B[i], S[i], d, attention=attention))
            rec(i + 1, left - d, max(worst, ti))

    rec(0, num_ranks, 0.0)
    return best[0]
