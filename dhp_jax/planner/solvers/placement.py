"""Place groups of given degrees onto rank ranges, keeping groups inside one node where they fit.

Node-aware placement: groups of at least a node take whole free nodes first; the others go
best-fit-decreasing into the node with the least room that still holds them (so 3 + 5 share a node
of 8); a group that fits in no node's room spans nodes, taking ranks from the emptiest nodes.
Without node awareness groups take consecutive ranks in order.
"""

from __future__ import annotations

from typing import Sequence


def place(degrees: Sequence[int], num_ranks: int, ranks_per_node: int, node_aware: bool = True
          ) -> list[tuple[int, ...]]:
    """Rank tuples, one per group in the order of `degrees` (sum(degrees) <= num_ranks)."""
    if sum(degrees) > num_ranks:
        raise ValueError(f"degrees {list(degrees)} need {sum(degrees)} ranks, only {num_ranks} exist")
    order = sorted(range(len(degrees)), key=lambda i: (-degrees[i], i))
    out: list[tuple[int, ...]] = [()] * len(degrees)
    if not node_aware:
        nxt = 0
        for i in order:
            out[i] = tuple(range(nxt, nxt + degrees[i]))
            nxt += degrees[i]
        return out
    nodes = [list(range(s, min(s + ranks_per_node, num_ranks))) for s in range(0, num_ranks, ranks_per_node)]
    free = [list(n) for n in nodes]  # free ranks per node, ascending
    # nodes by free count: best fit = the smallest count >= need, lowest node index among those
    by_count: list[set[int]] = [set() for _ in range(ranks_per_node + 1)]
    for n, f in enumerate(free):
        by_count[len(f)].add(n)

    def take(n: int, k: int) -> list[int]:
        by_count[len(free[n])].discard(n)
        got, free[n] = free[n][:k], free[n][k:]
        by_count[len(free[n])].add(n)
        return got

    # pass 1: every group takes floor(d / rpn) whole free nodes, largest first, so that later
    # fragments never leave a node-sized group without a node
    got: list[list[int]] = [[] for _ in degrees]
    for i in order:
        for n in sorted(by_count[ranks_per_node]) if degrees[i] >= ranks_per_node else ():
            if len(got[i]) + ranks_per_node > degrees[i]:
                break
            got[i].extend(take(n, ranks_per_node))
    # pass 2: the remainders and the small groups, best fit decreasing into node room
    rest_order = sorted(range(len(degrees)), key=lambda i: (-(degrees[i] - len(got[i])), i))
    for i in rest_order:
        rest = degrees[i] - len(got[i])
        if not rest:
            continue
        fit = next((c for c in range(rest, ranks_per_node + 1) if by_count[c]), None)
        if fit is not None:
            got[i].extend(take(min(by_count[fit]), rest))
            continue
        for c in range(ranks_per_node, 0, -1):  # no node has room: span the emptiest nodes
            for n in sorted(by_count[c]):
                got[i].extend(take(n, min(rest, c)))
                rest = degrees[i] - len(got[i])
                if not rest:
                    break
            if not rest:
                break
    for i in range(len(degrees)):
        out[i] = tuple(sorted(got[i]))
    return out
