"""A menu of programs: the (degree, padded length) shapes a run may use, fitted to a data mix.

A geometric ladder spends its programs evenly over lengths, wherever the tokens are. A menu spends
them where the tokens are: from a calibration sample of planned groups `(degree, tokens)` it keeps
the degrees that carry the most tokens and, per degree, the buckets that minimise the padded tokens
(an exact 1-D quantisation by dynamic programming), within a total program budget. Every degree's
largest bucket is its memory limit, so any group that fits in memory has a bucket.

Pure Python/NumPy: executors never need the menu, since every plan group carries the
`padded_tokens` it runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np


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
    """degree -> sorted padded lengths (each a multiple of 2*degree; the last the memory limit)."""

    buckets: dict[int, tuple[int, ...]]

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
    def fit(cls, groups: Sequence[tuple[int, float]], budget: int, max_tokens_per_rank: float,
            num_ranks: int, max_degrees: int | None = None, resolution: int = 64) -> "BucketMenu":
        """Fit a menu of at most `budget` programs to calibration groups `(degree, tokens)`.

        Degrees are kept by token mass (at most `max_degrees`, and always 1 and `num_ranks` so
        that short and the longest samples have a home); buckets are given out one at a time to
        the degree whose padding falls most (exact quantisation of its groups' token counts,
        binned to `resolution` quantiles to bound the work)."""
        by_d: dict[int, list[float]] = {}
        for d, s in groups:
            by_d.setdefault(int(d), []).append(float(s))
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
        return cls({d: tuple(int(b) for b in _quantise(*data[d], k[d], top_of(d))[0]) for d in keep})

    def as_cost_field(self) -> tuple:
        """The `CostModel.bucket_menu` value: `cost.replace(bucket_menu=menu.as_cost_field())`."""
        return tuple((d, tuple(self.buckets[d])) for d in self.degrees)

    def to_dict(self) -> dict[str, Any]:
        return {str(d): list(b) for d, b in sorted(self.buckets.items())}


def fit_menu(cost: Any, batches: Sequence[Any], num_ranks: int, budget: int = 64, max_degrees: int | None = 16,
             **plan_options: Any) -> BucketMenu:
    """Plan calibration `batches` (lists of samples, or (lengths, etas) pairs) with `cost` (a fine
    ladder) and fit a menu of at most `budget` programs to their groups."""
    from dhp_jax.planner.api import plan_batch

    groups = []
    for b in batches:
        lengths, etas = b if isinstance(b, tuple) else (b, None)
        plan = plan_batch(lengths, num_ranks, cost, etas=etas, **plan_options)
        groups += [(g.degree, g.tokens) for g in plan.groups]
    return BucketMenu.fit(groups, budget, cost.max_tokens_per_rank, num_ranks, max_degrees=max_degrees)
