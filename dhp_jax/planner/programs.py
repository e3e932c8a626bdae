"""What the executors have compiled, as the planner sees it: programs, executables, reuse placement.

A *program* is one group shape and attention kind, `(degree, padded_tokens, attention)`: the same
XLA computation whatever devices run it. An *executable* is a program bound to one device set,
`(degree, padded_tokens, ranks, attention)` (the executor's key order): XLA binds a compiled
program to its device assignment, so each new rank tuple of a known program is one more compile on
every process it touches (unless the backend can load a compiled program onto other devices;
XLA:CPU cannot).

`ProgramCache` records the plans issued so far. `plan_batch(..., programs=cache)` uses it twice:
- *placement*: within a micro-batch, groups of the same degree and attention kind whose rank
  tuples are equally fast (both inside one node, or both spanning nodes) may swap tuples without
  changing any group time; the planner gives each group the tuple on which its program already
  has an executable, where one is free. Step time is unchanged by construction; executables stop
  multiplying.
- *compile price*: each program the plan needs that no earlier plan needed costs `compile_s`
  seconds in the score that picks between candidate plans (measured compile seconds, spread
  over `amortize_steps` steps when the compile runs in the background).

Pure Python: the planner never imports jax.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Iterable, Sequence

Key = tuple[int, int, tuple[int, ...], str]  # (degree, padded_tokens, ranks, attention)


def group_keys(plan: Any) -> list[Key]:
    """(degree, padded_tokens, ranks, attention) of every group of `plan`, in plan order."""
    out = []
    for m, mb in enumerate(plan.micro_batches):
        for gi, g in enumerate(mb.groups):
            padded = int(getattr(g, "padded_tokens", 0) or 0)
            if not padded:
                raise ValueError(f"micro-batch {m} group {gi} (ranks {list(g.ranks)}) has no padded_tokens: "
                                 f"program counts need plans from plan_batch (schema v2)")
            out.append((int(g.degree), padded, tuple(int(r) for r in g.ranks), str(g.attention)))
    return out


@dataclasses.dataclass
class ProgramCache:
    """Programs and executables that the plans issued so far need (see the module docstring).

    `ranks_per_process`: ranks whose devices one process drives (None: one process for all).
    `compile_s`: the score price of one new program (0: programs are free)."""

    ranks_per_process: int | None = None
    compile_s: float = 0.0
    programs: set = dataclasses.field(default_factory=set)
    executables: set = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        rpp = self.ranks_per_process
        if rpp is not None and (isinstance(rpp, bool) or not isinstance(rpp, int) or rpp < 1):
            raise ValueError(f"ranks_per_process must be None or a positive integer, got {rpp!r}")
        if not self.compile_s >= 0:
            raise ValueError(f"compile_s must be >= 0, got {self.compile_s!r}")

    def new_programs(self, keys: Iterable[Key]) -> set:
        return {(d, p, a) for d, p, _, a in keys} - self.programs

    def add(self, plan: Any) -> int:
        """Record the plan's groups; returns how many executables are new."""
        keys = group_keys(plan)
        before = len(self.executables)
        self.executables.update(keys)
        self.programs.update((d, p, a) for d, p, _, a in keys)
        return len(self.executables) - before

    def processes(self, ranks: Sequence[int]) -> set[int]:
        rpp = self.ranks_per_process
        return {0} if rpp is None else {int(r) // rpp for r in ranks}

    def per_process(self) -> dict[int, tuple[int, int]]:
        """process -> (executables it holds, programs it runs): each counts the groups touching
        one of its ranks (a group spanning processes is compiled on each of them)."""
        exes: dict[int, set] = {}
        progs: dict[int, set] = {}
        for d, p, ranks, a in self.executables:
            for q in self.processes(ranks):
                exes.setdefault(q, set()).add((d, p, ranks, a))
                progs.setdefault(q, set()).add((d, p, a))
        return {q: (len(exes[q]), len(progs[q])) for q in sorted(exes)}

    def summary(self) -> dict[str, Any]:
        per = self.per_process()
        exe = [e for e, _ in per.values()] or [0]
        ratio = [e / p for e, p in per.values() if p] or [0.0]
        return {"programs": len(self.programs), "executables": len(self.executables),
                "executables_per_process_max": max(exe), "executables_per_process_median": statistics.median(exe),
                "executables_per_program_per_process_max": max(ratio),
                "executables_per_program_per_process_median": statistics.median(ratio)}


def reuse_ranks(groups: Sequence[Key], ranks_per_node: int, cache: ProgramCache) -> list[tuple[int, ...]]:
    """New rank tuples for one micro-batch's groups `(degree, padded_tokens, ranks, attention)`:
    tuples are only exchanged between groups of one degree and attention kind whose tuples are both inside a node or both
    spanning nodes (so every group time stays the same); a group gets a tuple on which its program
    already has an executable where one is free, else one on processes that do not run the program
    yet (a new executable there adds a program too, keeping executables per program low).
    Deterministic: ties go to plan order and the lowest tuple."""
    out = [tuple(r) for _, _, r, _ in groups]
    classes: dict[tuple[int, str, bool], list[int]] = {}
    for i, (d, _, r, a) in enumerate(groups):
        span = len({x // ranks_per_node for x in r}) > 1
        classes.setdefault((d, a, span), []).append(i)
    for members in classes.values():
        if len(members) < 2:
            continue
        free = sorted(out[i] for i in members)
        todo = []
        for i in members:  # first pass: programs with an executable on a free tuple keep it
            d, p, _, a = groups[i]
            hit = next((t for t in free if (d, p, t, a) in cache.executables), None)
            if hit is None:
                todo.append(i)
            else:
                out[i] = hit
                free.remove(hit)
        for i in todo:  # the rest: a tuple on processes that already run the program, else the first
            d, p, _, a = groups[i]
            known = {q for dd, pp, t, aa in cache.executables if (dd, pp, aa) == (d, p, a)
                     for q in cache.processes(t)}
            best = min(free, key=lambda t: (len(cache.processes(t) & known), t))
            out[i] = best
            free.remove(best)
    return out


def promote(plan: Any, available: Iterable[Key], cost: Any = None) -> Any:
    """The plan run on compiled executables only, or None when that is impossible.

    In each micro-batch whose groups are not all in `available`, the groups are matched, largest
    first, to compiled executables of their own attention kind: of their own degree and link class
    (inside a node / spanning nodes: the same group time) where one fits, the smallest compiled bucket that holds the group's
    tokens, on a rank tuple that no other group of the micro-batch uses (its own, another group's,
    or idle ranks); failing that, of a larger degree inside a node on idle ranks (more ranks for the
    same work). More padding, nothing to compile. With `cost`, a bucket must also fit
    the memory budget. Estimates stay those of the planned buckets; `solver["promoted_groups"]`
    counts the micro-batches' groups that changed."""
    available = set(available)
    rpn = plan.ranks_per_node or plan.num_ranks

    def span(ranks: Sequence[int]) -> bool:
        return len({r // rpn for r in ranks}) > 1

    by_degree: dict[tuple[int, str], list[tuple[int, tuple[int, ...]]]] = {}
    for d, p, ranks, a in available:
        by_degree.setdefault((int(d), str(a)), []).append((int(p), tuple(ranks)))
    for v in by_degree.values():
        v.sort()
    moved = 0
    mbs = []
    for mb in plan.micro_batches:
        if all((g.degree, g.padded_tokens, tuple(g.ranks), g.attention) in available for g in mb.groups):
            mbs.append(mb)
            continue
        out = list(mb.groups)
        taken: set[int] = set()
        order = sorted(range(len(out)), key=lambda i: (-out[i].tokens, i))
        for i in order:
            g = out[i]
            fits = []
            # its degree first, then larger ones (a kind's name holds for every degree it was compiled at)
            for d in sorted(x for x, a in by_degree if x >= g.degree and a == g.attention):
                fits = [(p, t) for p, t in by_degree[(d, g.attention)] if p >= g.tokens and not taken.intersection(t)
                        and (span(t) == span(g.ranks) or (d > g.degree and not span(t)))
                        and (cost is None or p * cost.mem_per_token / d <= cost.memory_budget)]
                if fits:
                    break
            if not fits:
                return None
            p, t = min(fits, key=lambda pt: (pt[0], pt[1] != tuple(g.ranks), pt[1]))
            taken.update(t)
            if (p, t) != (g.padded_tokens, tuple(g.ranks)):
                out[i] = dataclasses.replace(g, padded_tokens=p, ranks=t, degree=len(t))
                moved += 1
        mbs.append(dataclasses.replace(mb, groups=tuple(sorted(out, key=lambda g: g.ranks[0]))))
    if not moved:
        return plan
    return dataclasses.replace(plan, micro_batches=tuple(mbs), solver={**dict(plan.solver), "promoted_groups": moved})
