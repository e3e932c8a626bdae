"""Rank -> device layout and the sub-mesh cache: the one place that owns the parallel layout.

A rank is one model replica: `devices_per_rank` = t consecutive devices (t > 1: Megatron-style
tensor parallelism inside the rank, `dhp_jax.sharding.tensor_parallel`). A plan's ranks are devices / t and
its groups stay in rank units. A group's sub-mesh is (cp) for a ring, (cp, sp) for Ulysses and
hybrid, and gains a last `tp` axis of size t when t > 1: (cp, tp), (cp, sp, tp), built from the
group's devices in rank order (rank i of the group is row i). Sub-meshes are built once per device
tuple and reused.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from dhp_jax.planner.contract.plan import Plan, PlanValidationError

CP_AXIS = "cp"      # the ring axis of a group's sub-mesh
SP_AXIS = "sp"      # the Ulysses (all-to-all) axis of a Ulysses or hybrid group's 2-D sub-mesh
TP_AXIS = "tp"      # the tensor-parallel axis: the t devices of one rank (only when t > 1)
DP_AXIS = "dp"      # the full mesh: one entry per device, for the cross-group reduction


class RankLayout:
    """Validated map rank -> devices over a fixed device list."""

    def __init__(self, devices: Sequence[jax.Device], devices_per_rank: int = 1) -> None:
        devices = list(devices)
        if not devices:
            raise ValueError("RankLayout needs at least one device")
        if len({(d.platform, d.id) for d in devices}) != len(devices):
            raise ValueError("RankLayout: a device is listed twice")
        if isinstance(devices_per_rank, bool) or not isinstance(devices_per_rank, int) or devices_per_rank < 1:
            raise ValueError(f"devices_per_rank must be a positive integer, got {devices_per_rank!r}")
        if len(devices) % devices_per_rank:
            raise ValueError(f"{len(devices)} devices do not split into ranks of {devices_per_rank}")
        self.devices = tuple(devices)
        self.devices_per_rank = devices_per_rank
        self.num_ranks = len(devices) // devices_per_rank
        self.full_mesh = Mesh(np.array(self.devices), (DP_AXIS,))
        self._submeshes: dict[tuple[tuple[jax.Device, ...], int], Mesh] = {}

    def rank_devices(self, rank: int) -> tuple[jax.Device, ...]:
        if not 0 <= rank < self.num_ranks:
            raise PlanValidationError(f"rank {rank} is beyond the {self.num_ranks} ranks of this layout")
        k = self.devices_per_rank
        return self.devices[rank * k:(rank + 1) * k]

    def group_devices(self, ranks: Sequence[int]) -> tuple[jax.Device, ...]:
        """Devices of a group, in ring order (the order of `ranks`)."""
        return tuple(d for r in ranks for d in self.rank_devices(int(r)))

    def submesh(self, devices: tuple[jax.Device, ...], shape: tuple[int, ...] | None = None) -> Mesh:
        """The group's mesh over `devices` (its ranks' devices in rank order), built once per
        (device tuple, shape in ranks; its attention kind's `GroupAttention.mesh_shape`): (r,) is
        the 1-D `cp` ring mesh (the default: every rank on it), (r, u) the 2-D (cp: r, sp: u) view,
        row-major in rank order, so each Ulysses sub-group is u consecutive ranks; with t =
        `devices_per_rank` > 1 a last `tp` axis of size t holds each rank's devices."""
        t = self.devices_per_rank
        ranks = len(devices) // t
        shape = (ranks,) if shape is None else tuple(int(n) for n in shape)
        key = (devices, shape)
        mesh = self._submeshes.get(key)
        if mesh is None:
            if len(devices) % t or ranks != int(np.prod(shape)) or len(shape) not in (1, 2):
                raise ValueError(f"{len(devices)} devices ({t} per rank) do not form a group mesh of {shape} ranks")
            names = (CP_AXIS, SP_AXIS)[:len(shape)]
            if t > 1:
                shape, names = shape + (t,), names + (TP_AXIS,)
            mesh = self._submeshes[key] = Mesh(np.array(devices).reshape(shape), names)
        return mesh

    @staticmethod
    def stream_spec(mesh: Mesh) -> P:
        """How a group's stream is sharded on its mesh: over `cp`, or over (cp, sp) in rank order
        (replicated over `tp`)."""
        axes = tuple(n for n in mesh.axis_names if n != TP_AXIS)
        return P(axes[0]) if len(axes) == 1 else P(axes)

    @property
    def num_submeshes(self) -> int:
        return len(self._submeshes)

    def check_plan(self, plan: Plan, num_samples: int) -> None:
        """Reject a plan that does not fit these ranks or these samples, naming the group."""
        if not isinstance(plan, Plan):
            raise TypeError(f"expected a Plan, got {type(plan).__name__}")
        for m, mb in enumerate(plan.micro_batches):
            for gi, g in enumerate(mb.groups):
                where = f"micro-batch {m} group {gi} (ranks {list(g.ranks)})"
                bad = [r for r in g.ranks if not 0 <= int(r) < self.num_ranks]
                if bad:
                    raise PlanValidationError(f"{where}: ranks {bad} are beyond the {self.num_ranks} "
                                              f"ranks ({len(self.devices)} devices) of the executor")
                if g.degree != len(g.ranks):
                    raise PlanValidationError(f"{where}: degree {g.degree} != number of ranks {len(g.ranks)}")
                missing = [s for s in g.samples if not 0 <= int(s) < num_samples]
                if missing:
                    raise PlanValidationError(f"{where}: samples {missing} do not exist "
                                              f"(the batch has {num_samples})")
        plan.validate(num_samples=num_samples, num_devices=self.num_ranks)
