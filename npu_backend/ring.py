"""Ring attention for a CP group of any degree, over point-to-point sends on the world group.

A group is a list of global ranks; K/V blocks (with the per-token metadata the mask needs and the
per-tile summaries) travel around it with `dist.batch_isend_irecv`, so no process group is ever
created per plan group (communicator memory is what hurts HCCL/NCCL users when plans change every
step). The algorithm is the JAX ring's (`dhp_jax.sharding.ring`): inside each block a loop over
(query tile, key tile) pairs with an online softmax, skipping the pairs that
`dhp_jax.geometry.tiling.tile_pairs_allowed` rules out (other samples, the causal future, padding), so
temporaries are one score tile; the custom autograd function saves only q, k, v, meta, the output
and the log-sum-exp, and runs the backward as a second ring in which dK/dV accumulators travel
one hop behind their K/V block and come home after `degree` hops. The next block is always
posted before the current one is computed.

Layouts (local shard of one packed stream): `q[S, H, D]`, `k, v[S, Hkv, D]` with H % Hkv == 0
(grouped-query attention), `meta[S, M]` int64. The mask is any `mask_fn(q_meta, k_meta) ->
bool[Sq, Sk]`, so token order inside the stream (zigzag or not) does not matter.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from dhp_jax.geometry.tiling import DEFAULT_TILE, TileSpec, summarize, tile_pairs_allowed, tile_ranges, to_tiles

MaskFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class RingComm:
    """The ring of one CP group as seen from one rank: who to send to, who to receive from.

    `ranks` are global ranks of the world group, in ring order. Counts the tensors it sends so
    tests can assert the communication, not only the values.
    """

    def __init__(self, ranks: Sequence[int], rank: int):
        ranks = [int(r) for r in ranks]
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not in the CP group {ranks}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"CP group {ranks} lists a rank twice")
        self.ranks = ranks
        self.rank = rank
        self.degree = len(ranks)
        self.index = ranks.index(rank)
        self.next = ranks[(self.index + 1) % self.degree]
        self.prev = ranks[(self.index - 1) % self.degree]
        self.tensors_sent = 0
        self.tiles_computed = 0

    def shift_start(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Post sends of `tensors` to the next rank and receives of same-shaped ones from the previous."""
        sent = [t.contiguous() for t in tensors]
        recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in sent]
        # Same order on every rank: the k-th send to a peer meets that peer's k-th receive.
        ops = [dist.P2POp(dist.isend, t, self.next) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev) for r in recv]
        reqs = dist.batch_isend_irecv(ops)
        self.tensors_sent += len(tensors)
        return recv, [*reqs, _KeepAlive(sent)]

    def shift(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        recv, reqs = self.shift_start(tensors)
        for r in reqs:
            r.wait()
        return recv


class _KeepAlive:
    """Holds the send buffers until the round is waited on (a `wait()` that does nothing)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors

    def wait(self) -> None:
        self.tensors = []


def _wait(reqs: list) -> None:
    for r in reqs:
        r.wait()


def _scores(q4: torch.Tensor, k: torch.Tensor, qm: torch.Tensor, km: torch.Tensor,
            mask_fn: MaskFn, scale: float) -> torch.Tensor:
    """Masked logits s[Hkv, G, Sq, Sk] (-inf where masked) for q4[Hkv, G, Sq, D], k[Sk, Hkv, D]."""
    s = torch.einsum("hgqd,khd->hgqk", q4, k) * scale
    return s.masked_fill(~mask_fn(qm, km), float("-inf"))


def _split_heads(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """q[S, H, D] -> q4[Hkv, G, S, D] (query head h uses kv head h // G)."""
    s, h, d = q.shape
    return q.reshape(s, hkv, h // hkv, d).permute(1, 2, 0, 3)


def _merge_heads(x4: torch.Tensor) -> torch.Tensor:
    hkv, g, s, d = x4.shape
    return x4.permute(2, 0, 1, 3).reshape(s, hkv * g, d)


def _summary(meta: torch.Tensor, spec: TileSpec) -> np.ndarray:
    """Per-tile summaries int32[n, 6] of meta[S, 3] = (segment, position, span) (`dhp_jax.geometry.tiling`)."""
    ids = meta[:, :3].detach().cpu().numpy()
    return summarize(*(to_tiles(ids[:, c], spec, np) for c in range(3)), xp=np)


def _pairs(qsum: np.ndarray, ksum: torch.Tensor) -> list[tuple[int, int]]:
    """The (query tile, key tile) pairs that may hold an allowed pair, in row-major order."""
    ok = tile_pairs_allowed(qsum, ksum.cpu().numpy(), np)
    return [(int(i), int(j)) for i, j in zip(*np.nonzero(ok))]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, meta, comm, mask_fn, scale, tile):  # type: ignore[override]
        hkv = k.shape[1]
        spec = TileSpec.make(q.shape[0], tile, 2 if q.shape[0] % 2 == 0 else 1)
        ranges = tile_ranges(spec)
        qsum = _summary(meta, spec)
        q4 = _split_heads(q, hkv)
        m = torch.full(q4.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q4)
        blk = [k, v, meta, torch.from_numpy(qsum).to(meta.device)]   # the summary travels with its block
        degree = 1 if comm is None else comm.degree
        for step in range(degree):
            if step < degree - 1:  # prefetch the next block while this one is computed
                nxt, reqs = comm.shift_start(blk)
            kc, vc, mc, ksum = blk
            for i, j in _pairs(qsum, ksum):
                (qa, qb), (ka, kb) = ranges[i], ranges[j]
                s = _scores(q4[:, :, qa:qb], kc[ka:kb], meta[qa:qb], mc[ka:kb], mask_fn, scale)
                m_old = m[:, :, qa:qb]
                m_new = torch.maximum(m_old, s.amax(dim=-1))
                m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(m_old - m_safe)
                l[:, :, qa:qb] = l[:, :, qa:qb] * alpha + p.sum(dim=-1)
                acc[:, :, qa:qb] = acc[:, :, qa:qb] * alpha[..., None] + torch.einsum("hgqk,khd->hgqd", p, vc[ka:kb])
                m[:, :, qa:qb] = m_new
                if comm is not None:
                    comm.tiles_computed += 1
            if step < degree - 1:
                _wait(reqs)
                blk = nxt
        empty = l == 0  # rows that may attend to nothing (padding): output 0, lse -inf
        out4 = torch.where(empty[..., None], torch.zeros_like(acc), acc / torch.where(empty, 1.0, l)[..., None])
        lse = torch.where(empty, torch.full_like(l, float("-inf")),
                          torch.where(torch.isfinite(m), m, 0.0) + torch.log(torch.where(empty, 1.0, l)))
        out = _merge_heads(out4)
        ctx.save_for_backward(q, k, v, meta, out, lse)       # inputs, output and lse only
        ctx.comm, ctx.mask_fn, ctx.scale, ctx.spec = comm, mask_fn, scale, spec
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, meta, out, lse = ctx.saved_tensors
        comm, mask_fn, scale, spec = ctx.comm, ctx.mask_fn, ctx.scale, ctx.spec
        ranges = tile_ranges(spec)
        qsum = _summary(meta, spec)
        hkv = k.shape[1]
        q4, do4 = _split_heads(q, hkv), _split_heads(dout.contiguous(), hkv)
        delta = (do4 * _split_heads(out, hkv)).sum(dim=-1)  # [Hkv, G, Sq]
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        dq4 = torch.zeros_like(q4)
        blk = [k, v, meta, torch.from_numpy(qsum).to(meta.device)]
        dk = dv = None  # gradient accumulators of the block held now; they travel with it
        degree = 1 if comm is None else comm.degree
        for step in range(degree):
            # One round per step: prefetch the next K/V block and pass the previous block's
            # accumulators on; what arrives from the previous rank belongs to the block held now.
            out_t = (blk if step < degree - 1 else []) + ([dk, dv] if step > 0 else [])
            if out_t:
                nxt, reqs = comm.shift_start(out_t)
            kc, vc, mc, ksum = blk
            dk_blk, dv_blk = torch.zeros_like(kc), torch.zeros_like(vc)
            for i, j in _pairs(qsum, ksum):
                (qa, qb), (ka, kb) = ranges[i], ranges[j]
                s = _scores(q4[:, :, qa:qb], kc[ka:kb], meta[qa:qb], mc[ka:kb], mask_fn, scale)
                p = torch.exp(s - lse_safe[:, :, qa:qb, None])  # masked entries are exp(-inf) = 0
                do_t = do4[:, :, qa:qb]
                dv_blk[ka:kb] += torch.einsum("hgqk,hgqd->khd", p, do_t)
                ds = p * (torch.einsum("hgqd,khd->hgqk", do_t, vc[ka:kb]) - delta[:, :, qa:qb, None])
                dq4[:, :, qa:qb] += torch.einsum("hgqk,khd->hgqd", ds, kc[ka:kb]) * scale
                dk_blk[ka:kb] += torch.einsum("hgqk,hgqd->khd", ds, q4[:, :, qa:qb]) * scale
            if out_t:
                _wait(reqs)
            if step > 0:
                dk, dv = nxt[-2] + dk_blk, nxt[-1] + dv_blk
            else:
                dk, dv = dk_blk, dv_blk
            if step < degree - 1:
                blk = nxt[:4]
        if degree > 1:
            # After `degree` blocks the accumulators held are those of the next rank's block.
            dk, dv = comm.shift([dk, dv])
        return _merge_heads(dq4), dk, dv, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor,
                   mask_fn: MaskFn, comm: RingComm | None = None, scale: float | None = None,
                   tile: int = DEFAULT_TILE) -> torch.Tensor:
    """Attention of the local queries over the whole group's keys; returns `out[S, H, D]`.

    `comm=None` (or degree 1) is plain single-rank attention with the same numerics. Rows whose
    mask is empty everywhere (padding) give zeros and zero gradients. `tile` is the largest tile;
    tile pairs are skipped by the (segment, position, span) rule of meta's first three columns,
    so `mask_fn` must allow no pair that rule forbids.
    """
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape:
        raise ValueError(f"expected q[S, H, D] and k, v[S, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2] or q.shape[0] != k.shape[0]:
        raise ValueError(f"q{tuple(q.shape)} and k{tuple(k.shape)}: heads must divide, head dims and "
                         f"local lengths match")
    if meta.shape[0] != q.shape[0]:
        raise ValueError(f"meta has {meta.shape[0]} rows for {q.shape[0]} local tokens")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if meta.ndim != 2 or meta.shape[1] < 3:
        raise ValueError(f"meta must be [S, 3+] = (segment, position, span, ...), got {tuple(meta.shape)}")
    return _RingAttention.apply(q, k, v, meta, comm, mask_fn, scale, int(tile))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """Plain masked softmax attention on one rank (the reference the ring is tested against)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    s = s.masked_fill(~mask, float("-inf"))
    any_ = mask.any(dim=-1)
    p = torch.softmax(torch.where(any_[None, :, None], s, torch.zeros_like(s)), dim=-1) * any_[None, :, None]
    return torch.einsum("hqk,khd->qhd", p, vv)
