"""Runtime counts of the conditional work a program executed: a debug mode for the skip rules.

The kernels skip work under `lax.cond`: the ring's (query tile, key tile) pairs that no query may
attend (`dhp_jax.sharding.tiles`), the linear layers' chunks of padding (`dhp_jax.model.mllm`).
A count made from the skip rule (NumPy `count_ring_tiles`, or the predicate evaluated in JAX)
says what should run, not what ran: a `lax.cond` rewritten as compute-everything-then-select
would leave it unchanged. So the branch that does the work calls `tick(name)`, which, inside
`counting()`, traces a `jax.debug.callback` into that branch: every time the branch runs, on every
device, the host adds 1 to `name`. A branch not taken never calls it; work run unconditionally
calls it every time.

Off (the default), `tick` traces nothing and the programs are unchanged. The mode is read when a
function is traced: build the programs to count (a fresh `jax.jit`, a new `PlanExecutor`) inside
the context; a program traced outside it counts nothing (a jitted function traced earlier is
reused from JAX's cache), and one traced inside it keeps its callbacks (debug use only).

    with counting() as counts:
        jax.block_until_ready(jax.jit(f)(x))
    counts["tile_pairs_fwd"]
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from typing import Any, Iterator

import jax
import jax.numpy as jnp

__all__ = ["Counts", "counting", "tick"]

_ACTIVE: list["Counts"] = []


class Counts:
    """Executions per name, added to by the host callbacks that run while this context is open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()          # the callbacks of several devices run on their own threads
        self._n: collections.Counter[str] = collections.Counter()

    def _add(self, name: str) -> None:
        with self._lock:
            self._n[name] += 1

    def as_dict(self) -> dict[str, int]:
        """Every count so far, once the callbacks of dispatched programs have run."""
        jax.effects_barrier()
        with self._lock:
            return dict(self._n)

    def __getitem__(self, name: str) -> int:
        return self.as_dict().get(name, 0)


@contextlib.contextmanager
def counting() -> Iterator[Counts]:
    """Programs traced inside the context count their executed work; the callbacks that run while it
    is open add to the yielded `Counts` (the innermost context, when they nest)."""
    counts = Counts()
    _ACTIVE.append(counts)
    try:
        yield counts
    finally:
        jax.effects_barrier()
        _ACTIVE.remove(counts)


def _executed(name: str, *_: Any) -> None:
    if _ACTIVE:                 # a program traced while counting, run after: counts nothing
        _ACTIVE[-1]._add(name)


def tick(name: str, *data: jax.Array) -> None:
    """Call inside the branch that does the work: while `counting()`, each execution adds 1 to `name`.

    `data`: the arrays the branch reads that change from one loop iteration to the next (a tile of
    each loop it sits in, a chunk). The callback takes one element of each: a callback on no operand
    is loop-invariant, and autodiff's partial evaluation hoists such work out of a loop, so it would
    run once instead of once per iteration, wherever the branch sits.
    """
    if _ACTIVE:
        jax.debug.callback(functools.partial(_executed, name), *(jnp.ravel(d)[0] for d in data))
