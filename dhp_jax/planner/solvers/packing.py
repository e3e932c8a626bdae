"""Memory-aware packing of one micro-batch into atomic groups (the bins the allocation sizes).

Let W = total work / N, the fair work of one rank (times `coarsen` for coarser packings). Each
sequence that needs more memory than a bin's ranks hold, or carries at least W of work, opens its
own bin; such a bin will get about ceil(work / W) ranks, so it has headroom ceil(work / W) * W - work,
which the shorter sequences fill first (largest that fits, memory permitting: the paper's "short
sequences fill the leftover headroom", measured in work as well as bytes). The remaining short
sequences are spread over about (their work / W) bins: two rounds longest-first onto the least
loaded bin (LPT), then a boustrophedon deal of the light rest; if a bin would overflow its memory,
a memory-checked LPT that opens new bins when needed runs instead.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math

import numpy as np

_LPT_ROUNDS = 2


def pack(work: np.ndarray, tokens: np.ndarray, dmin: np.ndarray, num_ranks: int,
         max_tokens_per_rank: float, coarsen: float = 1.0, order: np.ndarray | None = None) -> np.ndarray:
    """Bin id (0..n-1) of every position of `work`/`tokens`; deterministic (ties by position).

    `coarsen` >= 1 scales the fair share W (bins of about `coarsen` ranks' work, so fewer, larger
    groups; coarsen = N packs everything into one bin when memory allows). `order` may pass the
    positions sorted heaviest first (stable) to save the sort. (`Packer` packs one micro-batch at
    several granularities with the set-up done once.)
    """
    return Packer(work, tokens, dmin, num_ranks, max_tokens_per_rank, order)(coarsen)


class Packer:
    """`pack` of one set of sequences at any granularity: what does not depend on the granularity
    (the total work and tokens, the heaviest-first order, the values in that order) is computed once."""

    def __init__(self, work: np.ndarray, tokens: np.ndarray, dmin: np.ndarray, num_ranks: int,
                 max_tokens_per_rank: float, order: np.ndarray | None = None):
        K = len(work)
        self.K, self.num_ranks, self.max_tokens_per_rank = K, num_ranks, max_tokens_per_rank
        self.total = float(work.sum())
        self.total_tokens = float(tokens.sum())
        if order is None:
            order = np.lexsort((np.arange(K), -work))
        self.order = order
        # work, tokens and least degrees in heaviest-first order
        self.w, self.t, self.d = work[order], tokens[order], dmin[order]
        # the work negated and the least degrees, both ascending: bisect finds how many sequences
        # reach a share of work and how many need more than a bin's ranks, without a pass over all
        self._neg_w = (-self.w).tolist()
        self._d_asc = np.sort(self.d).tolist()

    def __call__(self, coarsen: float = 1.0) -> np.ndarray:
        K, num_ranks, order = self.K, self.num_ranks, self.order
        assign = np.full(K, -1, dtype=np.int64)
        if K == 0:
            return assign
        W = self.total / num_ranks * coarsen
        slots = max(1, int(coarsen))  # ranks a short bin is expected to get: its memory room
        cap = self.max_tokens_per_rank * slots
        # long: more least degree than the bin's ranks, or at least W of work (heaviest first, so
        # the heavy ones are a prefix; a sequence of large least degree past it needs the mask)
        heavy = bisect.bisect_right(self._neg_w, -W) if W > 0 else 0
        wide = K - bisect.bisect_right(self._d_asc, slots)  # least degrees above the bin's ranks
        if wide and heavy < K and self.d[heavy:].max() > slots:
            long_at = (self.d > slots) | ((self.w >= W) & (W > 0))
            short_at, n_long = ~long_at, int(np.count_nonzero(long_at))
        else:
            long_at, short_at, n_long = slice(0, heavy), slice(heavy, K), heavy
        if slots >= num_ranks and n_long == 0 and self.total_tokens <= cap * (1 - 1e-12):
            assign[:] = 0  # the coarsest packing: one bin holds everything (what the deal below gives)
            return assign
        longs = order[long_at]
        assign[longs] = np.arange(n_long)
        if n_long == K:
            return assign
        # ascending by work, so bisect finds the largest that fits
        shorts = order[short_at][::-1].tolist()
        keys = self.w[short_at][::-1].tolist()
        stoks = self.t[short_at][::-1].tolist()  # aligned with shorts / keys
        ranks_taken = 0
        filled, fill_bin = [], []  # shorts placed into the long bins' headroom, and those bins
        for b, (wk, tk, dk) in enumerate(zip(self.w[long_at].tolist(), self.t[long_at].tolist(),
                                             self.d[long_at].tolist())):
            share = max(dk, math.ceil(wk / W - 1e-9)) if W > 0 else dk
            ranks_taken += share * slots
            head = share * W - wk
            room = share * cap - tk
            while shorts and head > 0:
                j = bisect.bisect_right(keys, head) - 1
                while j >= 0 and stoks[j] > room:
                    j -= 1
                if j < 0:
                    break
                filled.append(shorts.pop(j))
                fill_bin.append(b)
                head -= keys.pop(j)
                room -= stoks.pop(j)
        assign[filled] = fill_bin
        if not shorts:
            return assign
        shorts.reverse()  # heaviest first
        keys.reverse()
        stoks.reverse()
        rest = float(sum(keys))
        free = max(1, (num_ranks - ranks_taken) // slots)
        n_bins = min(free, len(shorts), max(1, round(rest / W) if W > 0 else 1))
        # more tokens than the bins hold in all: the deal would overflow one, so it is not tried
        local = _deal(keys, np.asarray(stoks), n_bins, cap) if sum(stoks) <= n_bins * cap * (1 + 1e-9) else None
        if local is None:
            local = _lpt_with_memory(keys, stoks, n_bins, cap)
        assign[shorts] = n_long + local
        return assign


def _deal(wl: list[float], toks: np.ndarray, n_bins: int, cap: float) -> np.ndarray | None:
    """LPT for the first rounds, then a vectorised boustrophedon deal starting from the lightest
    bin; None if a bin would overflow `cap` tokens. `wl`: the items' work, heaviest first; `toks`:
    their tokens."""
    m = len(wl)
    if n_bins == 1:
        return None if sum(toks.tolist()) > cap else np.zeros(m, dtype=np.int64)  # bincount's order of sums
    head = min(m, _LPT_ROUNDS * n_bins)
    out = np.empty(m, dtype=np.int64)
    first = min(head, n_bins)
    if min(wl[:first], default=1.0) > 0:
        # the first round goes to bins 0, 1, ... in turn (each empty bin is the least loaded, ties
        # by bin id); the heap's pop order depends only on its (load, bin) entries, not its layout
        heap = list(zip(wl[:first], range(first))) + [(0.0, b) for b in range(first, n_bins)]
        heapq.heapify(heap)
        got = list(range(first))
    else:
        heap, got, first = [(0.0, b) for b in range(n_bins)], [], 0
    replace = heapq.heapreplace
    for i in range(first, head):
        load, b = heap[0]
        got.append(b)
        replace(heap, (load + wl[i], b))
    out[:head] = got
    if head < m:
        lanes = np.asarray([b for _, b in sorted(heap)], dtype=np.int64)
        out[head:] = lanes[_boustrophedon(n_bins, m - head)[:m - head]]
    if np.bincount(out, toks, minlength=n_bins).max() > cap:
        return None
    return out


_LANES: dict[int, np.ndarray] = {}  # lanes of the deal per bin count, grown as needed (read-only)


def _boustrophedon(n_bins: int, m: int) -> np.ndarray:
    """Lanes of at least m items dealt back and forth over n_bins lanes (0, 1, .., n-1, n-1, .., 0,
    0, ..); read-only, shared between calls (one array per bin count, extended when too short)."""
    lanes = _LANES.get(n_bins)
    if lanes is None or lanes.size < m:
        pos = np.arange(max(m, 512))
        rnd, off = pos // n_bins, pos % n_bins
        lanes = np.where(rnd % 2 == 0, off, n_bins - 1 - off)
        lanes.flags.writeable = False
        _LANES[n_bins] = lanes
    return lanes


def _lpt_with_memory(work_l: list[float], toks: list[float], n_bins: int, cap: float) -> np.ndarray:
    """Longest first onto the least loaded bin that has memory room; a new bin when none has.
    `work_l`, `toks`: the items' work (heaviest first) and tokens."""
    btok = [0.0] * n_bins
    heap = [(0.0, b) for b in range(n_bins)]
    # the least tokens of any sequence still to place: a bin with less room than that is full for
    # good and leaves the heap (same result as skipping it every time, without the repeated pops)
    least = list(itertools.accumulate(reversed(toks), min))[::-1]
    n = len(toks)
    out_l = [0] * n
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    for i in range(n):
        tk, wk = toks[i], work_l[i]
        if heap:  # the least loaded bin has room: a plain LPT step
            load, b = heap[0]
            if btok[b] + tk <= cap:
                out_l[i] = b
                btok[b] += tk
                replace(heap, (load + wk, b))
                continue
        skipped = []
        placed = False
        after = least[i + 1] if i + 1 < n else None
        while heap:
            load, b = pop(heap)
            if btok[b] + tk <= cap:
                out_l[i] = b
                btok[b] += tk
                push(heap, (load + wk, b))
                placed = True
                break
            if after is not None and btok[b] + after <= cap:
                skipped.append((load, b))
        for item in skipped:
            push(heap, item)
        if not placed:
            b = len(btok)
            btok.append(tk)
            out_l[i] = b
            push(heap, (wk, b))
    if len(set(out_l)) == len(btok):  # every bin used: the ids are already dense
        return np.asarray(out_l, dtype=np.int64)
    # drop bins left empty (possible only when new ones were opened) and renumber densely
    _, dense = np.unique(np.asarray(out_l, dtype=np.int64), return_inverse=True)
    return dense.astype(np.int64)


def bins_of(assign: np.ndarray, ids: np.ndarray | None = None) -> list[list[int]]:
    """Lists of members per bin id (members as `ids[position]`, or positions), ascending."""
    n = int(assign.max()) + 1 if assign.size else 0
    order = np.argsort(assign, kind="stable")
    cuts = [0] + np.searchsorted(assign[order], np.arange(1, n)).tolist() + [assign.size]
    members = (order if ids is None else np.asarray(ids)[order]).tolist()
    return [members[a:b] for a, b in zip(cuts, cuts[1:])]

