"""Memory-aware packing of one micro-batch into atomic groups (the bins the allocation sizes).

Let W = total work / N, the fair work of one rank. Each sequence that needs more than one rank of
memory, or carries at least W of work, opens its own bin; such a bin will get about
ceil(work / W) ranks, so it has headroom ceil(work / W) * W - work, which the shorter sequences
fill first (largest that fits, best fit, memory permitting; the paper's "short sequences fill the
leftover headroom", measured in work as well as bytes). The remaining short sequences are spread
over about (their work / W) single-rank bins, longest first onto the least loaded bin (LPT),
opening a new bin only when a bin's one-rank memory would overflow.
"""

from __future__ import annotations

import bisect
import itertools
import heapq
import math

import numpy as np


def pack(work: np.ndarray, tokens: np.ndarray, dmin: np.ndarray, num_ranks: int,
         max_tokens_per_rank: float, coarsen: float = 1.0) -> list[list[int]]:
    """Bins of positions into `work`/`tokens` (deterministic: ties broken by position).

    `coarsen` >= 1 scales the fair share W (bins of about `coarsen` ranks' work, so fewer, larger
    groups; coarsen = N packs everything into one bin).
    """
    K = len(work)
    if K == 0:
        return []
    W = float(work.sum()) / num_ranks * coarsen
    slots = max(1, int(coarsen))  # ranks a short bin is expected to get: its memory room
    max_tokens_per_rank = max_tokens_per_rank * slots
    order = np.lexsort((np.arange(K), -work))  # heaviest first, stable
    is_long = (dmin > slots) | (work >= W)
    longs = order[is_long[order]].tolist()
    bins: list[list[int]] = [[k] for k in longs]
    # shorts kept ascending by work so bisect finds the largest that fits a headroom
    rev = order[::-1]
    short_arr = rev[~is_long[rev]]
    shorts = short_arr.tolist()
    if not shorts:
        return bins
    keys = work[short_arr].tolist()
    work_l, tok_l = work.tolist(), tokens.tolist()
    if W > 0:
        ranks_taken = 0
        for b, k in enumerate(longs):
            share = max(int(dmin[k]), math.ceil(work_l[k] / W - 1e-9))
            ranks_taken += share * slots
            head = share * W - work_l[k]
            room = share * max_tokens_per_rank - tok_l[k]
            while shorts and head > 0:
                j = bisect.bisect_right(keys, head) - 1
                while j >= 0 and tok_l[shorts[j]] > room:
                    j -= 1
                if j < 0:
                    break
                s = shorts.pop(j)
                keys.pop(j)
                bins[b].append(s)
                head -= work_l[s]
                room -= tok_l[s]
    else:
        ranks_taken = len(longs)
    if not shorts:
        return bins
    shorts.reverse()  # heaviest first for LPT
    rest = float(sum(keys))
    free = max(1, (num_ranks - ranks_taken) // slots)
    n_bins = min(free, len(shorts), max(1, round(rest / W) if W > 0 else 1))
    first = len(bins)
    fast = _deal(shorts, work_l, tok_l, n_bins, max_tokens_per_rank)
    if fast is not None:
        bins.extend(fast)
        return [b for b in bins if b]
    bins.extend([] for _ in range(n_bins))
    btok = [0.0] * n_bins
    heap = [(0.0, b) for b in range(n_bins)]
    for k in shorts:
        tk = tok_l[k]
        skipped = []
        placed = False
        while heap:
            load, b = heapq.heappop(heap)
            if btok[b] + tk <= max_tokens_per_rank:
                bins[first + b].append(k)
                btok[b] += tk
                heapq.heappush(heap, (load + work_l[k], b))
                placed = True
                break
            skipped.append((load, b))
        for item in skipped:
            heapq.heappush(heap, item)
        if not placed:  # every open bin is full at one rank: open another
            b = len(btok)
            btok.append(tk)
            bins.append([k])
            heapq.heappush(heap, (work_l[k], b))
    return [b for b in bins if b]


_LPT_ITEMS_PER_BIN = 4


def _deal(shorts: list[int], work_l: list[float], tok_l: list[float], n_bins: int, cap: float
          ) -> list[list[int]] | None:
    """Fast path: LPT for the heaviest few items per bin, then a boustrophedon deal of the light
    rest starting from the lightest bin. None when a bin would overflow one rank's memory (the
    caller then runs the memory-checked LPT)."""
    head = min(len(shorts), _LPT_ITEMS_PER_BIN * n_bins)
    out: list[list[int]] = [[] for _ in range(n_bins)]
    heap = [(0.0, b) for b in range(n_bins)]
    for k in shorts[:head]:
        load, b = heap[0]
        out[b].append(k)
        heapq.heapreplace(heap, (load + work_l[k], b))
    rest = shorts[head:]
    if rest:
        lanes = [b for _, b in sorted(heap)]
        back = lanes[::-1]
        for r in range(0, len(rest), n_bins):
            row = rest[r:r + n_bins]
            for k, b in zip(row, lanes if (r // n_bins) % 2 == 0 else back):
                out[b].append(k)
    for b in out:
        if sum(tok_l[k] for k in b) > cap:
            return None
    return out


def bin_sums(bins: list[list[int]], *values: np.ndarray) -> list[np.ndarray]:
    """Per-bin sums of each array in `values` (one bincount per array, not one sum per bin)."""
    sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    flat = np.fromiter(itertools.chain.from_iterable(bins), dtype=np.int64, count=int(sizes.sum()))
    gid = np.repeat(np.arange(len(bins)), sizes)
    return [np.bincount(gid, v[flat], minlength=len(bins)) for v in values]
