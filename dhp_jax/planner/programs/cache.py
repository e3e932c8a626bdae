"""What the executors have compiled, as the planner sees it: programs, executables, reuse placement.

A *program* is one group shape and attention kind, `(degree, padded_tokens, attention)`: the same
XLA computation whatever devices run it. An *executable* is a program bound to one device set,
`(degree, padded_tokens, ranks, attention)` (the executor's key order): XLA binds a compiled
program to its device assignment, so each new rank tuple of a known program is one more executable
on every process it touches: a compile, unless the executor loads the compiled program onto the
other devices (the JAX executor does on CPU devices within a process, `dhp_jax.sharding.rebind`;
then only programs cost compiles).

`ProgramCache` records the plans issued so far: what the planner may assume compiled when it plans
step t is a function of the plans of steps before t only, never of when compiles finish, so two
runs of one config (and a resumed run, which restores the cache) make the same plans.
`plan_batch(..., programs=cache)` uses it twice:
- *placement*: within a micro-batch, groups of the same degree and attention kind whose rank
  tuples are equally fast (both inside one node, or both spanning nodes) may swap tuples without
  changing any group time; the planner gives each group the tuple on which its program already
  has an executable, where one is free. Step time is unchanged by construction; executables stop
  multiplying.
- *compile price*: each program the plan needs that no earlier plan needed costs `compile_s`
  seconds in the score that picks between candidate plans: a fixed figure of the run's config
  (`planner.compile_price_s`), never a live measurement, which would make plans depend on timing.

A plan made at other token counts than the executor runs (full-size planning of a scaled batch)
names other buckets than the executor compiles: `executed` (set per batch by the caller) gives
the padded length the executor runs for a group, and the cache records and prices those.

Pure Python: the planner never imports jax.
"""

from __future__ import annotations

import dataclasses
import statistics
import zlib
from typing import Any, Callable, Iterable, Sequence

from dhp_jax.planner.contract.plan import spans_nodes

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
    `compile_s`: the score price of one new program (0: programs are free).
    `executed(degree, samples)`: the padded length the executor runs for a group of `degree` ranks
    holding these sample indices of the batch being planned (None: the plan's `padded_tokens`)."""

    ranks_per_process: int | None = None
    compile_s: float = 0.0
    programs: set = dataclasses.field(default_factory=set)
    executables: set = dataclasses.field(default_factory=set)
    executed: Callable[[int, Sequence[int]], int] | None = dataclasses.field(default=None, repr=False,
                                                                           compare=False)

    def __post_init__(self) -> None:
        rpp = self.ranks_per_process
        if rpp is not None and (isinstance(rpp, bool) or not isinstance(rpp, int) or rpp < 1):
            raise ValueError(f"ranks_per_process must be None or a positive integer, got {rpp!r}")
        if not self.compile_s >= 0:
            raise ValueError(f"compile_s must be >= 0, got {self.compile_s!r}")

    def padded(self, degree: int, samples: Sequence[int], planned: int) -> int:
        """The padded length of a group's program: the executor's (`executed`) or the planned one."""
        return int(planned) if self.executed is None else int(self.executed(int(degree), samples))

    def keys(self, plan: Any) -> list[Key]:
        """`group_keys` of a plan with each group's padded length as the executor runs it."""
        keys = group_keys(plan)
        if self.executed is None:
            return keys
        groups = [g for mb in plan.micro_batches for g in mb.groups]
        return [(d, self.padded(d, g.samples, p), r, a) for (d, p, r, a), g in zip(keys, groups)]

    def new_programs(self, keys: Iterable[Key]) -> set:
        return {(d, p, a) for d, p, _, a in keys} - self.programs

    def add(self, plan: Any) -> int:
        """Record the plan's groups (`keys`); returns how many executables are new."""
        before = len(self.executables)
        self.add_keys(self.keys(plan))
        return len(self.executables) - before

    def add_keys(self, keys: Iterable[Key]) -> None:
        """Record executables (e.g. restored from a checkpoint) and their programs."""
        for d, p, r, a in keys:
            self.executables.add((int(d), int(p), tuple(int(x) for x in r), str(a)))
            self.programs.add((int(d), int(p), str(a)))

    def to_json(self) -> list[list]:
        """The executables, sorted, as JSON lists (what a checkpoint stores; `add_keys` reads them)."""
        return [[d, p, list(r), a] for d, p, r, a in sorted(self.executables)]

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


def executed_view(plan: Any, keys: Sequence[Key], tokens: Sequence[int]) -> Any:
    """The plan as an executor runs it: each group's `tokens` the total of `tokens` (the executed
    samples' token counts, e.g. of a scaled-down batch) over its samples and `padded_tokens` the
    bucket of `keys` (`PlanExecutor.plan_keys`, one per group in plan order, ranks as plan ranks);
    one node (`ranks_per_node` = the plan's ranks: the executor's devices share a host). Estimates
    stay the plan's. The run log's one format for a plan made at other token counts (full-size
    planning): the same decisions, with the token counts and buckets the devices ran."""
    groups = [g for mb in plan.micro_batches for g in mb.groups]
    if len(keys) != len(groups):
        raise ValueError(f"executed_view: {len(keys)} keys for {len(groups)} groups")
    it = iter(keys)
    mbs = []
    for mb in plan.micro_batches:
        out = []
        for g in mb.groups:
            d, bucket, ranks, _ = next(it)
            if (int(d), tuple(ranks)) != (g.degree, tuple(g.ranks)):
                raise ValueError(f"executed_view: key ({d}, {bucket}, {tuple(ranks)}) does not match the group on "
                                 f"ranks {list(g.ranks)}")
            out.append(dataclasses.replace(g, tokens=int(sum(int(tokens[s]) for s in g.samples)),
                                           padded_tokens=int(bucket)))
        mbs.append(dataclasses.replace(mb, groups=tuple(out)))
    return dataclasses.replace(plan, micro_batches=tuple(mbs), ranks_per_node=plan.num_ranks)


def reuse_ranks(groups: Sequence[Key], ranks_per_node: int, cache: ProgramCache,
                num_ranks: int | None = None) -> list[tuple[int, ...]]:
    """New rank tuples for one micro-batch's groups `(degree, padded_tokens, ranks, attention)`,
    every group time unchanged: a group inside one node stays inside one node and a group spanning
    nodes spans as many nodes with the same number of ranks in each (group times depend on nothing
    else). `num_ranks` (default: the highest rank used, rounded up to a node). Deterministic.

    - Nodes are permuted (each node's content moves whole to another node of the same size):
      spanning groups, largest first, go onto the nodes of an executable of their program where
      the permutation so far allows it, else onto their own nodes where still free (else the lowest).
    - Within a node, a spanning group's part takes an executable's ranks there, else the node's
      last free ranks (any program's part smaller than a node sits at the node's end, so a group
      inside the node, e.g. of degree 7 beside a one-rank part, keeps its aligned block and one
      executable, whichever spanning program shares its node).
    - Groups inside a node keep the degrees of each node's content, but any group of a degree may
      take any node's place of that degree, on the ranks no spanning group holds (idle ranks too):
      largest first, a device set on which the program has an executable where one is free; the
      others take the node whose process does not run the program yet where one can (a new
      executable there adds a program too), else the lowest, and there the free ranks from the
      program's canonical offset on, so that a program keeps landing on the same device sets."""
    rpn = int(ranks_per_node)
    out = [tuple(int(r) for r in t) for _, _, t, _ in groups]
    if not out:
        return out
    n_ranks = int(num_ranks) if num_ranks else -(-(max(r for t in out for r in t) + 1) // rpn) * rpn
    num_nodes = -(-n_ranks // rpn)
    size = {n: min(rpn, n_ranks - n * rpn) for n in range(num_nodes)}
    span = [spans_nodes(t, rpn) for t in out]
    known: dict[tuple[int, int, str], list[tuple[int, ...]]] = {}
    for d, p, t, a in cache.executables:
        known.setdefault((d, p, a), []).append(t)
    for v in known.values():
        v.sort()

    def runs(d: int, p: int, a: str) -> set[int]:
        return {q for t in known.get((d, p, a), ()) for q in cache.processes(t)}

    def parts(t: Sequence[int]) -> dict[int, list[int]]:
        got: dict[int, list[int]] = {}
        for r in t:
            got.setdefault(r // rpn, []).append(r)
        return got

    def from_anchor(free: Iterable[int], node: int, k: int, start: int) -> list[int]:
        return sorted(sorted(free, key=lambda r: (r - node * rpn - start) % rpn)[:k])

    def slot(free: set[int], node: int, k: int, start: int) -> tuple[int, tuple[int, ...]]:
        # an aligned block (offset a multiple of the power of two >= k) from the canonical offset
        # on, where one is free; else the free ranks from that offset on. (its rank in that order, ranks)
        w = 1 << (k - 1).bit_length()
        offs = sorted(range(0, size[node] - k + 1, w), key=lambda o: (o - start) % rpn) if w <= size[node] else []
        for j, o in enumerate(offs):
            t = tuple(range(node * rpn + o, node * rpn + o + k))
            if free.issuperset(t):
                return j, t
        return len(offs), tuple(from_anchor(free, node, k, start))

    # 1. spanning groups: a node permutation pi (original node -> node) and their ranks
    pi: dict[int, int] = {}
    taken: set[int] = set()
    for i in sorted((i for i in range(len(out)) if span[i]), key=lambda i: (-groups[i][0], i)):
        d, p, _, a = groups[i]
        mine = parts(out[i])
        placed = None
        for t in known.get((d, p, a), ()):  # an executable of the program, where pi allows it
            theirs = parts(t)
            if len(theirs) != len(mine) or taken.intersection(t):
                continue
            m = _match(mine, theirs, pi, size)
            if m is not None:
                placed = (m, t)
                break
        if placed is None:
            m = dict((n, pi[n]) for n in mine if n in pi)
            free_nodes = [x for x in range(num_nodes) if x not in pi.values()]
            for n in sorted((n for n in mine if n not in m), key=lambda n: (-len(mine[n]), n)):
                # its own node where still free (the node-aware placement's choice), else the lowest
                cands = sorted((x for x in free_nodes if size[x] == size[n] and x not in m.values()),
                               key=lambda x: (x != n, x))
                m[n] = cands[0] if cands else n   # a node of its size is always free (pi is a bijection)
            # each part on its node's last free ranks, whatever the program: the groups inside the
            # node then keep the aligned blocks from its start and meet the same device sets again
            t = tuple(sorted(r for n in mine for r in sorted(
                (x for x in range(m[n] * rpn, m[n] * rpn + size[m[n]]) if x not in taken), reverse=True)[:len(mine[n])]))
            placed = (m, t)
        m, t = placed
        pi.update(m)
        taken.update(t)
        out[i] = t
    rest = [x for x in range(num_nodes) if x not in pi.values()]
    for n in range(num_nodes):  # the other nodes: in order, onto the nodes left of their size
        if n not in pi:
            x = next(x for x in rest if size[x] == size[n])
            pi[n] = x
            rest.remove(x)
    # 2. groups inside a node: places (node, degree) moved by pi, on ranks no spanning group holds
    inside = [i for i in range(len(out)) if not span[i]]
    places: dict[int, dict[int, int]] = {}
    for i in inside:
        n = pi[out[i][0] // rpn]
        places.setdefault(n, {}).setdefault(len(out[i]), 0)
        places[n][len(out[i])] += 1
    free_at = {n: {r for r in range(n * rpn, n * rpn + size[n]) if r not in taken} for n in places}
    todo = []
    # an executable of the program on free ranks: largest first, and among groups of a degree the
    # programs with the fewest spare executables (held device sets less groups) first, so that a
    # program with a spare set does not take the one set another program has no spare for
    def program(i: int) -> tuple[int, int, str]:
        return groups[i][0], groups[i][1], groups[i][3]

    need: dict[tuple[int, int, str], int] = {}
    for i in inside:
        need[program(i)] = need.get(program(i), 0) + 1

    def spare(i: int) -> int:
        return sum(not spans_nodes(t, rpn) for t in known.get(program(i), ())) - need[program(i)]

    for i in sorted(inside, key=lambda i: (-groups[i][0], spare(i), i)):
        d, p, _, a = groups[i]
        hit = next((t for t in known.get((d, p, a), ()) if not spans_nodes(t, rpn)
                    and places.get(t[0] // rpn, {}).get(d, 0) > 0 and free_at[t[0] // rpn].issuperset(t)), None)
        if hit is None:
            todo.append(i)
            continue
        places[hit[0] // rpn][d] -= 1
        free_at[hit[0] // rpn].difference_update(hit)
        out[i] = hit
    for i in todo:
        d, p, _, a = groups[i]
        have, off = runs(d, p, a), anchor(d, p, a, rpn)
        options = [slot(free_at[n], n, d, off) for n in sorted(places) if places[n].get(d, 0) > 0]
        t = min(options, key=lambda jt: (len(cache.processes(jt[1]) & have), jt[0], jt[1][0]))[1]
        places[t[0] // rpn][d] -= 1
        free_at[t[0] // rpn].difference_update(t)
        out[i] = t
    return out


def _match(mine: dict[int, list[int]], theirs: dict[int, list[int]], pi: dict[int, int],
           size: dict[int, int]) -> dict[int, int] | None:
    """A map of `mine`'s nodes onto `theirs`' with the same part sizes and node sizes, consistent
    with the permutation `pi` so far; None if there is none (greedy: parts by size)."""
    used = set(pi.values())
    m: dict[int, int] = {}
    left = dict(theirs)
    for n in sorted(mine, key=lambda n: (n not in pi, -len(mine[n]), n)):
        if n in pi:
            x = pi[n]
            if x not in left or len(left[x]) != len(mine[n]):
                return None
        else:
            x = next((x for x in sorted(left) if len(left[x]) == len(mine[n]) and x not in used
                      and size.get(x) == size.get(n)), None)
            if x is None:
                return None
        m[n] = x
        del left[x]
    return m


def anchor(degree: int, padded_tokens: int, attention: str, ranks_per_node: int) -> int:
    """A program's canonical first rank within a node (the same on every process and run)."""
    return zlib.crc32(f"{degree},{padded_tokens},{attention}".encode()) % int(ranks_per_node)
