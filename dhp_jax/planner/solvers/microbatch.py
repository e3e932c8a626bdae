"""Split a global batch into micro-batches: candidate splits per count, checked for memory as they
are cut, ranked by a cheap step-time bound.

Three candidates for a count M:
- "length": sequences sorted longest first and cut into M consecutive runs of about equal tokens, so
  the longest sequences share micro-batches (their groups run side by side instead of each long
  sequence stretching its own micro-batch), as FlexSP cuts its global batch;
- "work": compute balanced (longest first onto the lightest part, then a snake deal);
- "mixed": length-sorted runs cut at equal shares of tokens plus work (half each).
Memory is checked while cutting: a run closes before its tokens exceed what the N ranks hold. Everything is deterministic: ties are broken by position.
"""

from __future__ import annotations

import heapq
import math

import numpy as np


def min_micro_batches(tokens: np.ndarray, num_ranks: int, max_tokens_per_rank: float) -> int:
    """A lower bound on the micro-batch count: all activations must fit on the ranks at once.

    A micro-batch fits memory exactly when its tokens fit `num_ranks * max_tokens_per_rank` (a
    group of d ranks holds d * max_tokens_per_rank tokens, and one group on all ranks holds any
    micro-batch within that), so the least count is a bin-packing optimum with bins of that size
    and this is its fractional bound: valid always, short of the optimum only by the granularity
    of whole sequences. The planner may still use more micro-batches when that is faster."""
    return max(1, math.ceil(float(tokens.sum()) / (num_ranks * max_tokens_per_rank) - 1e-12))


_LPT_ITEMS_PER_PART = 8  # the heaviest items go by LPT; the light rest by a vectorised snake deal


def split(work: np.ndarray, num_micro_batches: int, order: np.ndarray | None = None) -> list[np.ndarray]:
    """`num_micro_batches` arrays of sample positions, each sorted, of balanced work.

    Heaviest first: the first few items per part by LPT (least loaded part), the rest dealt in
    boustrophedon order (0..M-1, M-1..0, ...), whose imbalance is at most one light item.
    Deterministic: ties broken by position. `order` may pass the positions heaviest first (stable).
    """
    K = len(work)
    M = max(1, min(num_micro_batches, K))
    if M == 1:
        return [np.arange(K, dtype=np.int64)]
    if order is None:
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


def by_length(share: np.ndarray, tokens: np.ndarray, num_micro_batches: int, num_ranks: int,
              max_tokens_per_rank: float, order: np.ndarray | None = None) -> list[np.ndarray] | None:
    """Longest first, cut into `num_micro_batches` consecutive runs of about equal `share` each;
    a run also closes before its tokens exceed what `num_ranks` ranks hold. None when the last run
    does not fit (this count is too small for this cut). `order` may pass the positions longest
    first (stable)."""
    K = len(tokens)
    M = max(1, min(num_micro_batches, K))
    if order is None:
        order = np.lexsort((np.arange(K), -tokens))
    sh = share[order].astype(np.float64)
    target = np.cumsum(sh) - sh / 2  # a sequence goes to the run its midpoint falls in
    run = np.minimum((target * M // max(float(sh.sum()), 1e-300)).astype(np.int64), M - 1)
    # memory while cutting: a run closes before its tokens exceed what all N ranks hold at once (one
    # group on every rank holds exactly that much, so every run that passes has a feasible plan)
    room = num_ranks * max_tokens_per_rank
    csum = np.concatenate(([0.0], np.cumsum(tokens[order].astype(np.float64))))
    parts: list[np.ndarray] = []
    start = 0
    for m in range(M):
        end = int(np.searchsorted(run, m, side="right")) if m < M - 1 else K
        end = max(end, start + 1) if start < K else start
        fits = int(np.searchsorted(csum, csum[start] + room * (1 + 1e-12), side="right")) - 1
        if fits < end:
            if m == M - 1 or fits <= start:
                return None
            end = fits
        if end > start:
            parts.append(np.sort(order[start:end]))
        start = end
    if start < K:
        return None
    return parts


def candidates(work: np.ndarray, tokens: np.ndarray, num_micro_batches: int, num_ranks: int,
               max_tokens_per_rank: float, orders: tuple[np.ndarray, np.ndarray] | None = None
               ) -> list[tuple[str, list[np.ndarray]]]:
    """The candidate splits for one count (see the module docstring), those whose cut fits; a split
    equal to an earlier one (as every split of one micro-batch is) is left out. `orders` may pass
    the positions longest first and heaviest first (stable; `sort_orders`), which every count shares."""
    by_tokens, by_work = sort_orders(work, tokens) if orders is None else orders
    out: list[tuple[str, list[np.ndarray]]] = []
    seen: set[bytes] = set()
    tok_share = tokens / max(float(tokens.sum()), 1e-300)
    work_share = work / max(float(work.sum()), 1e-300)
    for name in ("length", "mixed", "work"):
        if name == "work":
            parts = split(work, num_micro_batches, by_work)
            if any(float(tokens[p].sum()) > num_ranks * max_tokens_per_rank for p in parts):
                continue
        else:
            share = tokens if name == "length" else tok_share + work_share
            parts = by_length(share, tokens, num_micro_batches, num_ranks, max_tokens_per_rank, by_tokens)
            if parts is None:
                continue
        key = b"|".join(p.tobytes() for p in sorted(parts, key=lambda q: int(q[0])))
        if key not in seen:
            seen.add(key)
            out.append((name, parts))
    return out


def sort_orders(work: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The positions longest first and heaviest first, ties by position (what `candidates` cuts)."""
    K = len(tokens)
    return np.lexsort((np.arange(K), -tokens)), np.lexsort((np.arange(K), -work))
