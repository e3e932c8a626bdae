"""Split a global batch into micro-batches of balanced work (longest first onto the lightest)."""

from __future__ import annotations

import heapq
import math

import numpy as np


def min_micro_batches(tokens: np.ndarray, num_ranks: int, max_tokens_per_rank: float) -> int:
    """A lower bound on the micro-batch count: all activations must fit on the ranks at once."""
    return max(1, math.ceil(float(tokens.sum()) / (num_ranks * max_tokens_per_rank) - 1e-12))


def split(work: np.ndarray, num_micro_batches: int) -> list[np.ndarray]:
    """`num_micro_batches` lists of sample positions, each sorted; LPT on work, ties by position."""
    K = len(work)
    M = max(1, min(num_micro_batches, K))
    order = np.lexsort((np.arange(K), -work))
    heap = [(0.0, m) for m in range(M)]
    parts: list[list[int]] = [[] for _ in range(M)]
    for k in order:
        load, m = heapq.heappop(heap)
        parts[m].append(int(k))
        heapq.heappush(heap, (load + float(work[k]), m))
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts if p]
