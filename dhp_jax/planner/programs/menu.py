"""A menu of programs: the (degree, padded length) shapes a run may use, fitted to a data mix.

A geometric ladder spends its programs evenly over lengths, wherever the tokens are. A menu spends
them where the tokens are: from a calibration sample of planned groups `(degree, tokens)` it keeps
the degrees that carry the most tokens and, per degree, the buckets that minimise the padded tokens
(an exact 1-D quantisation by dynamic programming), within a total program budget. Every degree's
largest bucket is its memory limit, so any group that fits in memory has a bucket.

A program is also its attention kind (`dhp_jax.planner.programs.cache`): a degree whose groups choose
between ring and Ulysses x ring hybrids per group would run up to one program per kind and bucket.
So each menu program carries one kind (`BucketMenu.kinds`), the one that prices its calibration
groups fastest in total (per bucket, or per degree), and the planner's kind choice respects it
(`CostModel.geometry.menu_kinds`): the budget bounds the programs that run.

Pure Python/NumPy: executors never need the menu, since every plan group carries the
`padded_tokens` it runs.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from dhp_jax.data.sample import sample_etas, sample_lengths
from dhp_jax.planner.cost.memory import max_tokens_per_rank
from dhp_jax.planner.cost.pricing import group_kind_times


def _quantise(values: np.ndarray, weights: np.ndarray, k: int, top: float) -> tuple[list[float], float]:
    """At most k buckets, the last one `top`, covering `values` (sorted ascending, <= top): the
    least weighted padding sum_i w_i (bucket(v_i) - v_i). Exact: the items fall into contiguous
    runs, each padded to its largest value, except the last run, padded to `top`. O(k n^2)."""
    n = len(values)
    pre_w = np.concatenate([[0.0], np.cumsum(weights)])
    pre_wv = np.concatenate([[0.0], np.cumsum(weights * values)])

    def run(i: int, j: int, b: float) -> float:  # items i..j-1 padded to b
        return float(b * (pre_w[j] - pre_w[i]) - (pre_wv[j] - pre_wv[i]))

    # f[m][j]: least padding of items 0..j-1 in m runs, each padded to its own largest value
    f = [[math.inf] * (n + 1) for _ in range(k)]
    back = [[0] * (n + 1) for _ in range(k)]
    f[0][0] = 0.0
    for m in range(1, k):
        for j in range(1, n + 1):
            for i in range(j):
                if f[m - 1][i] < math.inf:
                    c = f[m - 1][i] + run(i, j, values[j - 1])
                    if c < f[m][j]:
                        f[m][j], back[m][j] = c, i
    best = (math.inf, 0, 0)
    for m in range(k):
        for i in range(n + 1):
            if f[m][i] < math.inf:
                c = f[m][i] + run(i, n, top)
                if c < best[0] - 1e-9:
                    best = (c, m, i)
    total, m, j = best
    buckets = [top]
    while m > 0:
        buckets.append(float(values[j - 1]))
        j, m = back[m][j], m - 1
    return sorted(set(buckets)), total


@dataclasses.dataclass(frozen=True)
class BucketMenu:
    """degree -> sorted padded lengths (each a multiple of 2*degree; the last the memory limit);
    `kinds`: (degree, bucket) -> the attention kind that program runs (absent: chosen per group)."""

    buckets: dict[int, tuple[int, ...]]
    kinds: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)

    KIND_PER = ("bucket", "degree")

    @property
    def degrees(self) -> list[int]:
        return sorted(self.buckets)

    @property
    def num_programs(self) -> int:
        return sum(len(b) for b in self.buckets.values())

    def padded(self, tokens: int, degree: int) -> int | None:
        """The smallest menu bucket of `degree` holding `tokens` (None: not on the menu)."""
        for b in self.buckets.get(int(degree), ()):
            if b >= tokens:
                return b
        return None

    @classmethod
    def fit(cls, groups: Sequence[tuple], budget: int, max_tokens_per_rank: float,
            num_ranks: int, max_degrees: int | None = None, resolution: int = 64,
            kind_per: str = "bucket") -> "BucketMenu":
        """Fit a menu of at most `budget` programs to calibration groups `(degree, tokens)` or
        `(degree, tokens, times)`, `times` the group's seconds under each attention kind it can run
        ({kind: s}, "ring" always among them).

        Degrees are kept by token mass (at most `max_degrees`, and always 1 and `num_ranks` so
        that short and the longest samples have a home); buckets are given out one at a time to
        the degree whose padding falls most (exact quantisation of its groups' token counts,
        binned to `resolution` quantiles to bound the work). With `times`, each program gets the
        kind of least total time over its groups (`kind_per="bucket"`) or each degree one kind for
        all its buckets (`"degree"`); a group that cannot run that kind counts its ring time."""
        if kind_per not in cls.KIND_PER:
            raise ValueError(f"kind_per must be one of {cls.KIND_PER}, got {kind_per!r}")
        by_d: dict[int, list[float]] = {}
        timed: dict[int, list[tuple[float, Mapping[str, float]]]] = {}
        for g in groups:
            d, s = int(g[0]), float(g[1])
            by_d.setdefault(d, []).append(s)
            if len(g) > 2 and g[2] is not None:
                if "ring" not in g[2]:
                    raise ValueError(f"calibration group (degree {d}, {s:g} tokens): its times need a 'ring' entry")
                timed.setdefault(d, []).append((s, g[2]))
        mass = sorted(by_d, key=lambda d: -sum(by_d[d]))
        keep = set(mass[: max_degrees or len(mass)]) | {1, int(num_ranks)}
        keep = sorted(d for d in keep if d <= num_ranks)
        if budget < len(keep):
            raise ValueError(f"a budget of {budget} programs cannot give {len(keep)} degrees one bucket each")

        def top_of(d: int) -> float:
            step = 2 * d
            v = data[d][0]
            return max(math.floor(max_tokens_per_rank * d / step) * step, float(v[-1]) if v.size else 0.0, step)

        data = {}
        for d in keep:
            v = np.sort(np.asarray(by_d.get(d, []), dtype=np.float64))
            if v.size > resolution:  # bin to quantiles: the bucket edges land on the data anyway
                edges = np.quantile(v, np.linspace(0, 1, resolution + 1)[1:], method="higher")
                idx = np.searchsorted(edges, v, side="left")
                w = np.bincount(idx, minlength=resolution).astype(np.float64)
                vals = edges
                ok = w > 0
                v, wts = vals[ok], w[ok]
            else:
                wts = np.ones(v.size)
            step = 2 * d
            v = np.ceil(v / step) * step  # every bucket splits into 2*degree zigzag chunks
            data[d] = (v, wts)
        k = {d: 1 for d in keep}
        pad = {d: _quantise(*data[d], 1, top_of(d))[1] for d in keep}
        while sum(k.values()) < budget:
            gains = []
            for d in keep:
                new = _quantise(*data[d], k[d] + 1, top_of(d))[1]
                gains.append((pad[d] - new, -d, d, new))
            g, _, d, new = max(gains)
            if g <= 0:
                break
            k[d] += 1
            pad[d] = new
        buckets = {d: tuple(int(b) for b in _quantise(*data[d], k[d], top_of(d))[0]) for d in keep}
        return cls(buckets, _menu_kinds(buckets, timed, kind_per) if timed else {})

    @property
    def num_kinds(self) -> int:
        """Programs whose kind the menu fixes."""
        return len(self.kinds)

    def kind(self, degree: int, bucket: int) -> str | None:
        return self.kinds.get((int(degree), int(bucket)))

    def as_cost_field(self) -> tuple:
        """The `CostModel.geometry.bucket_menu` value: `cost.replace(bucket_menu=menu.as_cost_field())`."""
        return tuple((d, tuple(self.buckets[d])) for d in self.degrees)

    def kinds_field(self) -> tuple:
        """The `CostModel.geometry.menu_kinds` value ((degree, bucket, kind), ...), sorted."""
        return tuple((d, b, k) for (d, b), k in sorted(self.kinds.items()))

    def apply(self, cost: Any) -> Any:
        """`cost` planning with this menu: its buckets and its kinds."""
        return cost.replace(bucket_menu=self.as_cost_field(), menu_kinds=self.kinds_field())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {str(d): list(b) for d, b in sorted(self.buckets.items())}
        if self.kinds:
            out["kinds"] = {f"{d},{b}": k for (d, b), k in sorted(self.kinds.items())}
        return out


def _menu_kinds(buckets: Mapping[int, Sequence[int]], timed: Mapping[int, Sequence[tuple[float, Mapping[str, float]]]],
                kind_per: str) -> dict[tuple[int, int], str]:
    """(degree, bucket) -> the kind of least summed time over the calibration groups that bucket
    holds (its smallest bucket >= the tokens); per degree with `kind_per="degree"`. A group lacking
    a kind (it cannot run it) counts its ring time; ties and buckets without groups take the ring."""
    out = {}
    for d, bs in buckets.items():
        groups = timed.get(d, ())
        names = sorted({kind for _, times in groups for kind in times} | {"ring"})
        total = {b: dict.fromkeys(names, 0.0) for b in bs}
        for s, times in groups:
            k = bisect.bisect_left(bs, s)
            if k < len(bs):
                sums = total[bs[0] if kind_per == "degree" else bs[k]]
                for kind in names:
                    sums[kind] += times.get(kind, times["ring"])
        for b in bs:
            sums = total[bs[0] if kind_per == "degree" else b]
            out[(int(d), int(b))] = min(names, key=lambda kind: (sums[kind], kind != "ring", kind))
    return out


DEGREE_SETS = ("aligned", "any")


def aligned_degrees(num_ranks: int, ranks_per_node: int) -> list[int]:
    """Degrees that tile nodes: divisors of `ranks_per_node` (a group inside one node, placed on an
    aligned block) and multiples of it (whole nodes). No group of these degrees leaves a partial node
    behind, so device sets repeat and executables per process stay near the programs it runs."""
    n, r = int(num_ranks), int(ranks_per_node)
    if n < 1 or r < 1:
        raise ValueError(f"aligned_degrees needs positive num_ranks and ranks_per_node, got {num_ranks}, {ranks_per_node}")
    return [d for d in range(1, n + 1) if r % d == 0 or d % r == 0]


def fit_menu(cost: Any, batches: Sequence[Any], num_ranks: int, budget: int = 64, max_degrees: int | None = 8,
             kind_per: str | None = "bucket", degree_set: str = "any", **plan_options: Any) -> BucketMenu:
    """Plan calibration `batches` (lists of samples, or (lengths, etas) pairs) with `cost` (a fine
    ladder) and fit a menu of at most `budget` programs to their groups, each program with one
    attention kind (`kind_per`: "bucket" or "degree", see `BucketMenu.fit`; None: kinds stay a
    per-group choice, so a budget of programs does not bound the (degree, bucket, kind) programs).
    `degree_set`: "any" degree, or "aligned" (`aligned_degrees`: the calibration plans, hence the
    menu, use only degrees that tile the cost model's nodes)."""
    if degree_set not in DEGREE_SETS:
        raise ValueError(f"fit_menu: degree_set must be one of {DEGREE_SETS}, got {degree_set!r}")
    if degree_set == "aligned":
        if "degrees" in plan_options:
            raise ValueError("fit_menu: give either degree_set='aligned' or degrees=, not both")
        plan_options["degrees"] = aligned_degrees(num_ranks, cost.ranks_per_node or num_ranks)
    # lazy: plan_batch's solvers import this room (programs <- solvers <- api), so the menu plans
    # its calibration batches through an import at call time
    from dhp_jax.planner.api import plan_batch

    groups: list[tuple] = []
    for b in batches:
        lengths, etas = b if isinstance(b, tuple) else (sample_lengths(b), sample_etas(b))
        plan = plan_batch(lengths, num_ranks, cost, etas=etas, **plan_options)
        if kind_per is None:
            groups += [(g.degree, g.tokens) for g in plan.groups]
        else:
            times = group_kind_times(cost, plan, lengths, etas)
            groups += [(g.degree, g.tokens, t) for g, t in zip(plan.groups, times)]
    return BucketMenu.fit(groups, budget, max_tokens_per_rank(cost), num_ranks, max_degrees=max_degrees,
                          kind_per=kind_per or "bucket")
