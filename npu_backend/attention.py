"""The torch engine's attention builders, one per attention kind (`dhp_jax.planner.contract.kinds`).

A builder takes a group's `GroupAttention`, the processes of its ranks that hold this process's shard
(tensor parallelism: one per rank) and this process, and returns (attention callable, communicator):
the ring over the group's processes (point-to-point; none on one rank) for "ring", the all-to-all
over u consecutive processes times a ring over the sub-groups for "ulysses" and "hybrid:<u>x<r>".
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from dhp_jax.planner.contract.kinds import HYBRID_KIND, RING_KIND, ULYSSES_KIND, GroupAttention
from npu_backend.model import attention_mask
from npu_backend.ring import RingComm, ring_attention
from npu_backend.ulysses import UlyssesComm, ulysses_attention

ENGINE = "torch"


def _ring(attention: GroupAttention, procs: Sequence[int], me: int) -> tuple[Callable[..., Any], RingComm | None]:
    comm = RingComm(list(procs), me) if attention.degree > 1 else None

    def attn(q, k, v, ids):
        return ring_attention(q, k, v, ids, attention_mask, comm)

    return attn, comm


def _all_to_all(attention: GroupAttention, procs: Sequence[int], me: int) -> tuple[Callable[..., Any], UlyssesComm]:
    comm = UlyssesComm(list(procs), me, attention.ulysses)

    def attn(q, k, v, ids):
        return ulysses_attention(q, k, v, ids, attention_mask, comm)

    return attn, comm


RING_KIND.register(ENGINE, _ring)
ULYSSES_KIND.register(ENGINE, _all_to_all)
HYBRID_KIND.register(ENGINE, _all_to_all)


def group_attention(attention: GroupAttention, procs: Sequence[int], me: int) -> tuple[Callable[..., Any], Any]:
    """(attention callable, communicator or None) of a group, by its kind's torch builder."""
    return attention.kind.builder(ENGINE)(attention, procs, me)
