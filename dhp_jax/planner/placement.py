"""Place groups of given degrees onto rank ranges, keeping groups inside one node where they fit.

Node-aware placement: groups of at least a node take whole free nodes first; the others go
best-fit-decreasing into the node with the least room that still holds them (so 3 + 5 share a node
of 8); a group that fits in no node's room spans nodes, taking ranks from the emptiest nodes.
Without node awareness groups take consecutive ranks in order.
"""

from __future__ import annotations

from typing import Sequence


def spans_nodes(ranks: Sequence[int], ranks_per_node: int) -> bool:
    return len({r // ranks_per_node for r in ranks}) > 1


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
    for i in order:
        d = degrees[i]
        ranks: list[int] = []
        if d >= ranks_per_node:
            for n, f in enumerate(free):  # whole free nodes first
                if len(ranks) + len(f) <= d and len(f) == len(nodes[n]):
                    ranks.extend(f)
                    free[n] = []
        rest = d - len(ranks)
        if rest:
            fits = [n for n, f in enumerate(free) if len(f) >= rest]
            if fits:
                n = min(fits, key=lambda n: (len(free[n]), n))
                ranks.extend(free[n][:rest])
                free[n] = free[n][rest:]
            else:
                for n in sorted(range(len(free)), key=lambda n: (-len(free[n]), n)):
                    take = min(rest, len(free[n]))
                    ranks.extend(free[n][:take])
                    free[n] = free[n][take:]
                    rest -= take
                    if not rest:
                        break
        out[i] = tuple(sorted(ranks))
    return out
