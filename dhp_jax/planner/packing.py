"""Memory-aware packing of one micro-batch into atomic groups (the bins the allocation sizes).

Each sequence that needs more than one rank of memory, or carries at least a fair rank's share of
the micro-batch's work (W = total work / N), opens its own bin. The shorter ones are spread over
about (their work / W) single-rank bins, longest first onto the least loaded bin (LPT), opening a
new bin only when a bin's one-rank memory would overflow. Leftover headroom next to long sequences
is filled later, once degrees are known (refine.py), where it lowers the makespan.
"""

from __future__ import annotations

import heapq

import numpy as np


def pack(work: np.ndarray, tokens: np.ndarray, dmin: np.ndarray, num_ranks: int,
         max_tokens_per_rank: float) -> list[list[int]]:
    """Bins of positions into `work`/`tokens` (deterministic: ties broken by position)."""
    K = len(work)
    if K == 0:
        return []
    W = float(work.sum()) / num_ranks
    order = np.lexsort((np.arange(K), -work))  # longest work first, stable
    is_long = (dmin >= 2) | (work >= W)
    bins: list[list[int]] = [[int(k)] for k in order if is_long[k]]
    shorts = [int(k) for k in order if not is_long[k]]
    if not shorts:
        return bins
    short_work = float(work[shorts].sum())
    room = max(1, num_ranks - len(bins))
    n_bins = int(min(room, max(1, round(short_work / W)))) if W > 0 else 1
    n_bins = min(n_bins, len(shorts))
    first = len(bins)
    bins.extend([] for _ in range(n_bins))
    btok = [0.0] * n_bins
    heap = [(0.0, b) for b in range(n_bins)]
    for k in shorts:
        tk = float(tokens[k])
        skipped = []
        placed = False
        while heap:
            load, b = heapq.heappop(heap)
            if btok[b] + tk <= max_tokens_per_rank:
                bins[first + b].append(k)
                btok[b] += tk
                heapq.heappush(heap, (load + float(work[k]), b))
                placed = True
                break
            skipped.append((load, b))
        for item in skipped:
            heapq.heappush(heap, item)
        if not placed:  # every open bin is full at one rank: open another
            b = len(btok)
            btok.append(tk)
            bins.append([k])
            heapq.heappush(heap, (float(work[k]), b))
    return [b for b in bins if b]
