"""Split a global batch into micro-batches of balanced work (longest first onto the lightest)."""

from __future__ import annotations

import heapq
import math

import numpy as np


def min_micro_batches(tokens: np.ndarray, num_ranks: int, max_tokens_per_rank: float) -> int:
    """A lower bound on the micro-batch count: all activations must fit on the ranks at once."""
    return max(1, math.ceil(float(tokens.sum()) / (num_ranks * max_tokens_per_rank) - 1e-12))


_LPT_ITEMS_PER_PART = 8  # the heaviest items go by LPT; the light rest by a vectorised snake deal


def split(work: np.ndarray, num_micro_batches: int) -> list[np.ndarray]:
    """`num_micro_batches` arrays of sample positions, each sorted, of balanced work.

    Heaviest first: the first few items per part by LPT (least loaded part), the rest dealt in
    boustrophedon order (0..M-1, M-1..0, ...), whose imbalance is at most one light item.
    Deterministic: ties broken by position.
    """
    K = len(work)
    M = max(1, min(num_micro_batches, K))
    if M == 1:
        return [np.arange(K, dtype=np.int64)]
    order = np.lexsort((np.arange(K), -work))
    head = min(K, _LPT_ITEMS_PER_PART * M)
    owner = np.empty(K, dtype=np.int64)
    heap = [(0.0, 0, m) for m in range(M)]  # (work, count, part): equal work fills by count
    for k in order[:head].tolist():
        load, n, m = heapq.heappop(heap)
        owner[k] = m
        heapq.heappush(heap, (load + float(work[k]), n + 1, m))
    rest = order[head:]
    if rest.size:
        # continue the deal from the lightest part so the heavy head's imbalance shrinks first
        by_load = [m for _, _, m in sorted(heap)]
        pos = np.arange(rest.size)
        rnd, off = pos // M, pos % M
        lane = np.where(rnd % 2 == 0, off, M - 1 - off)
        owner[rest] = np.asarray(by_load)[lane]
    return [np.flatnonzero(owner == m) for m in range(M) if np.any(owner == m)]
