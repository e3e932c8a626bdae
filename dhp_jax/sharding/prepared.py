"""`PreparedStep`: a plan made ready to run on an executor's devices, once per step.

`PlanExecutor.prepare(samples, plan)` checks the plan against the devices and the samples, resolves
each group's attention kind and lays out every group's samples (`pack_group` or the family's two
streams) before any device work, so bad input fails fast, naming the group or the sample. What it
returns is everything a step's consumers need: the planner thread makes it next to the plan
(`dhp_jax.train.trainer`), the compile-ahead worker builds its `keys`, the step runs its `work`,
and the plan log reads its `id_keys`; nobody packs the plan again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from dhp_jax.planner.contract.kinds import GroupAttention
from dhp_jax.planner.contract.plan import Plan


@dataclasses.dataclass(frozen=True)
class GroupWork:
    """One group of one micro-batch, ready to dispatch: its devices (rank order), its layout and
    its attention (`attention`: the kind's text, `shape`: the resolved `GroupAttention`)."""

    micro_batch: int
    index: int
    devices: tuple[Any, ...]
    layout: Any
    shape: GroupAttention

    @property
    def attention(self) -> str:
        return self.shape.text

    @property
    def key(self) -> tuple[int, int, tuple[Any, ...], str]:
        """Its executable's key (degree, bucket, devices, attention)."""
        return self.layout.degree, self.layout.bucket, self.devices, self.attention


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """A plan checked and packed for one executor: `work` (every group, plan order) and `local` (the
    groups this process takes part in). Iterating it gives `work`."""

    plan: Plan
    samples: tuple[Any, ...]
    work: tuple[GroupWork, ...]
    local: tuple[GroupWork, ...]

    def __iter__(self) -> Iterator[GroupWork]:
        return iter(self.work)

    def __len__(self) -> int:
        return len(self.work)

    def __getitem__(self, i: int) -> GroupWork:
        return self.work[i]

    @property
    def keys(self) -> list[tuple[int, int, tuple[Any, ...], str]]:
        """The executable keys this process builds and launches (its local groups, plan order)."""
        return [w.key for w in self.local]

    @property
    def id_keys(self) -> list[tuple[int, int, tuple[int, ...], str]]:
        """(degree, bucket, device ids, attention) of every group, plan order (`plan_keys`)."""
        return [(d, b, tuple(x.id for x in devs), a) for d, b, devs, a in (w.key for w in self.work)]

    def micro_batches(self) -> list[list[GroupWork]]:
        """The local groups of each micro-batch, in order (empty where this process has none: it
        still takes part in that micro-batch's reduction)."""
        order = sorted({w.micro_batch for w in self.work})
        return [[w for w in self.local if w.micro_batch == m] for m in order]
