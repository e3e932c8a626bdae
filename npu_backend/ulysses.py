"""Ulysses (all-to-all) and hybrid Ulysses x ring attention over point-to-point sends on the world group.

The torch twin of `dhp_jax.sharding.ulysses`. A group of degree d = u r (global ranks in rank
order) is r Ulysses sub-groups of u consecutive ranks; rank (i, j) is the j-th rank of sub-group
i. The all-to-all inside a sub-group is u - 1 pairwise exchanges posted as one
`dist.batch_isend_irecv` (no process group per sub-group: plans that change every step create no
communicators); the ring of a hybrid runs over the j-th ranks of the r sub-groups with
`npu_backend.ring` (its own custom backward). Per rank:

    q[S_l, H, D], k, v[S_l, KVH, D], meta[S_l, M]     sequence shard
      -- all-to-all (split heads, concat sequence) -->  q[u S_l, H'/u, D], k, v[u S_l, KVH'/u, D]
      -- ring attention over the r sub-groups (r = 1: the local attention) -->
      -- all-to-all back -->  o[S_l, H, D]

meta (segment, position, span) is sent to every peer of the sub-group once per call. Heads follow
`dhp_jax.planner.contract.kinds.head_plan`: KV heads repeated up to lcm(KVH, u), or zero heads padding an
encoder whose heads u does not split.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from dhp_jax.planner.contract.kinds import head_plan
from npu_backend.ring import MaskFn, RingComm, ring_attention


class UlyssesComm:
    """One rank's view of a (Ulysses u) x (ring r) group: its sub-group peers and its ring.

    `ranks` are the group's global ranks in order; counts tensors sent (all-to-all and ring).
    """

    def __init__(self, ranks: Sequence[int], rank: int, ulysses: int):
        ranks = [int(x) for x in ranks]
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not in the CP group {ranks}")
        if ulysses < 1 or len(ranks) % ulysses:
            raise ValueError(f"CP group {ranks} does not split into Ulysses sub-groups of {ulysses}")
        self.rank, self.ulysses = rank, int(ulysses)
        self.ring_degree = len(ranks) // self.ulysses
        i, j = divmod(ranks.index(rank), self.ulysses)
        self.peers = ranks[i * self.ulysses:(i + 1) * self.ulysses]     # the sub-group, in order
        self.index = j
        self.ring = RingComm(ranks[j::self.ulysses], rank) if self.ring_degree > 1 else None
        self._sent = 0

    @property
    def tensors_sent(self) -> int:
        return self._sent + (self.ring.tensors_sent if self.ring is not None else 0)

    def exchange(self, chunks: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """chunks[p] goes to peer p; returns what each peer sent here (own chunks kept locally)."""
        out: list[list[torch.Tensor]] = []
        ops, sent = [], []
        for p, peer in enumerate(self.peers):
            if peer == self.rank:
                out.append(list(chunks[p]))
                continue
            send = [t.contiguous() for t in chunks[p]]
            recv = [torch.empty_like(t) for t in send]
            # Same order on every rank: the k-th send to a peer meets that peer's k-th receive.
            ops += [dist.P2POp(dist.isend, t, peer) for t in send]
            ops += [dist.P2POp(dist.irecv, t, peer) for t in recv]
            sent += send
            out.append(recv)
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        self._sent += len(sent)
        return out


def _all_to_all(xs: Sequence[torch.Tensor], comm: UlyssesComm, split: int, cat: int) -> list[torch.Tensor]:
    """Split each x into u chunks along `split`, chunk p to peer p; concat what arrives along `cat`."""
    chunks = list(zip(*[x.chunk(comm.ulysses, dim=split) for x in xs]))
    got = comm.exchange(chunks)
    return [torch.cat([got[p][t] for p in range(comm.ulysses)], dim=cat) for t in range(len(xs))]


class _AllToAll(torch.autograd.Function):
    """The all-to-all of q, k, v (or o); its backward is the reverse all-to-all of the gradients."""

    @staticmethod
    def forward(ctx, comm, split, cat, *xs):  # type: ignore[override]
        ctx.comm, ctx.split, ctx.cat = comm, split, cat
        return tuple(_all_to_all(xs, comm, split, cat))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, None, None, *_all_to_all(grads, ctx.comm, ctx.cat, ctx.split))


def _pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    if x.shape[1] == heads:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], heads - x.shape[1], x.shape[2])], dim=1)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor,
                      mask_fn: MaskFn, comm: UlyssesComm, scale: float | None = None) -> torch.Tensor:
    """Attention of the local queries over the whole group's keys; returns o[S_l, H, D]."""
    s_l, h, d = q.shape
    kvh = k.shape[1]
    hq, hkv = head_plan(h, kvh, comm.ulysses)
    if hq == h:
        k, v = k.repeat_interleave(hkv // kvh, dim=1), v.repeat_interleave(hkv // kvh, dim=1)
    else:
        k, v = (_pad_heads(x.repeat_interleave(h // kvh, dim=1), hq) for x in (k, v))
        q = _pad_heads(q, hq)
    qh, kh, vh = _AllToAll.apply(comm, 1, 0, q, k, v)                  # [u S_l, H'/u, D]
    got = comm.exchange([[meta]] * comm.ulysses)
    meta_all = torch.cat([got[p][0] for p in range(comm.ulysses)], dim=0)
    oh = ring_attention(qh, kh, vh, meta_all, mask_fn, comm.ring, scale)
    (o,) = _AllToAll.apply(comm, 0, 1, oh)                            # o[S_l, H', D]
    return o[:, :h]
