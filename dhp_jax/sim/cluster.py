"""A described cluster: nodes x ranks per node, link bandwidths and the cost-model preset it runs.

The cluster is the simulator's unit of description; `cost_model()` turns it into the planner's
`CostModel` (the preset for the model and hardware, with the bandwidths overridden when given).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dhp_jax.checks import positive_int
# The vision-token counts of a model come from its processor files, through the data package's one rule.
from dhp_jax.data.vision import rules_for_model
from dhp_jax.planner import CostModel
from dhp_jax.planner.cli_args import preset_model


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`nodes` x `ranks_per_node` model replicas; ring-hop bandwidths in GB/s per rank
    (None: the preset's; they set the cost model's `bw_intra` / `bw_inter`).

    `tensor_parallel` = t: each rank is t devices of its node (`dhp_jax.planner.cost.tensor_parallel`), so a
    node has ranks_per_node x t devices and the cluster `devices` = num_ranks x t; the plans stay in
    rank units; `sequence_parallel` (t > 1): the block stacks sequence-parallel over a rank's t
    devices (`CostModel.preset(..., sequence_parallel=True)`). `state_shards`: devices the fp32
    state is sharded over (None: the preset's 64).
    `with_devices` builds one from device counts."""

    nodes: int
    ranks_per_node: int = 8
    model: str = "internvl3-8b"
    hardware: str = "ascend-910b"
    freeze_vision: bool = False
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    tensor_parallel: int = 1
    state_shards: int | None = None
    sequence_parallel: bool = False
    video_sampling: Any = "auto"   # the run's video sampling (dhp_jax.data.vision; "auto", {"fps": F}, ...)

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node", "tensor_parallel") + (("state_shards",) if self.state_shards else ()):
            v = getattr(self, name)
            positive_int(v, f"Cluster.{name}")
        for name in ("intra_node_gbps", "inter_node_gbps"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"Cluster.{name} must be a positive number of GB/s, got {v!r}")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError("Cluster.sequence_parallel needs tensor_parallel > 1 (it splits a rank's rows over "
                             "its devices)")

    @classmethod
    def with_ranks(cls, num_ranks: int, ranks_per_node: int = 8, **kw: Any) -> "Cluster":
        """The smallest cluster of whole nodes holding `num_ranks` (fewer than a node: one partial node)."""
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if num_ranks < ranks_per_node:
            return cls(nodes=1, ranks_per_node=num_ranks, **kw)
        if num_ranks % ranks_per_node:
            raise ValueError(f"{num_ranks} ranks is not a whole number of {ranks_per_node}-rank nodes")
        return cls(nodes=num_ranks // ranks_per_node, ranks_per_node=ranks_per_node, **kw)

    @classmethod
    def with_devices(cls, devices: int, devices_per_node: int = 8, tensor_parallel: int = 1, **kw: Any) -> "Cluster":
        """The cluster of `devices` devices, `devices_per_node` a node, in ranks of `tensor_parallel`
        devices (t must divide the node's devices; fewer devices than a node: one partial node)."""
        from dhp_jax.planner.cost.tensor_parallel import check_node

        positive_int(devices, "devices")
        check_node(min(devices, devices_per_node), tensor_parallel)
        t = tensor_parallel
        return cls.with_ranks(devices // t, max(1, devices_per_node // t), tensor_parallel=t, **kw)

    @property
    def num_ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def devices(self) -> int:
        return self.num_ranks * self.tensor_parallel

    @property
    def vision(self) -> Any:
        """The vision-token rules of the model: its processor files with the run's video sampling."""
        return rules_for_model(self.model, self.video_sampling)

    def cost_model(self) -> Any:
        """The planner's cost model for this cluster (bandwidth overrides applied)."""
        overrides: dict[str, Any] = {}
        if self.intra_node_gbps is not None:
            overrides["bw_intra"] = self.intra_node_gbps * 1e9
        if self.inter_node_gbps is not None:
            overrides["bw_inter"] = self.inter_node_gbps * 1e9
        if self.tensor_parallel > 1:
            overrides["tensor_parallel"] = self.tensor_parallel
        if self.sequence_parallel:
            overrides["sequence_parallel"] = True
        if self.state_shards:
            overrides["state_shards"] = self.state_shards
        return CostModel.preset(preset_model(self.model), self.hardware, ranks_per_node=self.ranks_per_node,
                                freeze_vision=self.freeze_vision, **overrides)

    def describe(self) -> str:
        bw = ""
        if self.intra_node_gbps or self.inter_node_gbps:
            bw = f", intra {self.intra_node_gbps or 'preset'} GB/s, inter {self.inter_node_gbps or 'preset'} GB/s"
        frozen = ", vision frozen" if self.freeze_vision else ""
        sp = ", sequence-parallel" if self.sequence_parallel else ""
        tp = f" of {self.tensor_parallel} devices{sp} ({self.devices} devices)" if self.tensor_parallel > 1 else ""
        return (f"{self.nodes} nodes x {self.ranks_per_node} ranks{tp}, {self.model} on {self.hardware} preset"
                f"{bw}{frozen}")

