"""Ring attention over batch_isend_irecv: values and gradients equal dense attention, any degree."""

from __future__ import annotations

import pytest
import torch

from npu_backend.launch import run_world
from npu_backend.model import attention_mask
from npu_backend.ring import RingComm, dense_attention, ring_attention

TOL = 1e-5  # fp32, complex op: ring and dense sum in different orders


_mask = attention_mask  # the decoder's rule: causal inside a sample, bidirectional inside a span


def _stream(length: int, h: int, hkv: int, d: int, seed: int):
    """A packed stream: three samples, a vision span in the second, trailing padding (segment 0)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, h, d, generator=g, dtype=torch.float32)
    k = torch.randn(length, hkv, d, generator=g, dtype=torch.float32)
    v = torch.randn(length, hkv, d, generator=g, dtype=torch.float32)
    w = torch.randn(length, h, d, generator=g, dtype=torch.float32)
    bounds = [0, length // 4, length // 4 + length // 2, length - 3]
    meta = torch.zeros((length, 3), dtype=torch.int64)
    for s in range(3):
        a, b = bounds[s], bounds[s + 1]
        meta[a:b, 0] = s + 1
        meta[a:b, 1] = torch.arange(b - a)
    a = bounds[1] + 2
    meta[a:a + length // 5, 2] = 7  # a bidirectional vision span inside sample 1
    return q, k, v, w, meta


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _dense_grads(q, k, v, w, meta):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = dense_attention(q, k, v, _mask(meta, meta))
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def test_single_rank_matches_dense_with_gqa_and_padding():
    q, k, v, w, meta = _stream(40, 4, 2, 8, seed=0)
    ref = _dense_grads(q, k, v, w, meta)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = ring_attention(qq, kk, vv, meta, _mask)
    (out * w).sum().backward()
    for a, b in zip((out.detach(), qq.grad, kk.grad, vv.grad), ref):
        assert _rel(a, b) < TOL
    assert torch.all(out[-3:] == 0) and torch.all(qq.grad[-3:] == 0)  # padding rows


def _saved_bytes(fn):
    """(result, bytes autograd saved for backward while running fn())."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def _ring_worker(rank: int, world: int, groups: list[list[int]], chunk: int, tile: int) -> dict:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from dhp_jax.geometry.tiling import count_ring_tiles

    pgs_before = c10d.get_pg_count()
    out = {}
    for gi, ranks in enumerate(groups):
        if rank not in ranks:
            continue
        deg = len(ranks)
        length = 2 * deg * chunk
        q, k, v, w, meta = _stream(length, 4, 2, 8, seed=10 + gi)
        ref = _dense_grads(q, k, v, w, meta)
        # Shard a random permutation of the stream: the mask reads metadata, not stream order.
        perm = torch.randperm(length, generator=torch.Generator().manual_seed(gi))
        mine = perm.view(deg, -1)[ranks.index(rank)]
        comm = RingComm(ranks, rank)
        qq, kk, vv = (t[mine].clone().requires_grad_(True) for t in (q, k, v))
        o, saved = _saved_bytes(lambda: ring_attention(qq, kk, vv, meta[mine], _mask, comm, tile=tile))
        sent_fwd = comm.tensors_sent
        (o * w[mine]).sum().backward()
        # The same local length on one rank (degree 1): what autograd keeps must not grow with d.
        q1, k1, v1 = (t[mine].clone().requires_grad_(True) for t in (q, k, v))
        _, saved_1 = _saved_bytes(lambda: ring_attention(q1, k1, v1, meta[mine], _mask, tile=tile))
        computed, total = count_ring_tiles(*(meta[perm, c].numpy() for c in range(3)), deg, tile)
        out = {"group": gi, "degree": deg, "sent_fwd": sent_fwd, "sent_total": comm.tensors_sent,
               "tiles": comm.tiles_computed, "tiles_expected": computed, "tiles_dense": total,
               "saved": saved, "saved_1": saved_1,
               "rel": [_rel(a, b[mine]) for a, b in zip((o.detach(), qq.grad, kk.grad, vv.grad), ref)]}
    dist.barrier()
    out["pgs_created"] = c10d.get_pg_count() - pgs_before
    return out


def test_ring_on_world_group_any_degree():
    """World 5 cut into rings of 3 (non-adjacent ranks) and 2: dense values and grads, counted sends."""
    groups = [[3, 0, 4], [1, 2]]
    res = run_world(_ring_worker, 5, (groups, 5, 3), timeout=180)   # tiles of 3 < a zigzag chunk of 5
    for gi in range(len(groups)):
        mine = [o for o in res if o["group"] == gi]
        assert sum(o["tiles"] for o in mine) == mine[0]["tiles_expected"] < mine[0]["tiles_dense"]
    for r, o in enumerate(res):
        assert o["pgs_created"] == 0, f"rank {r} created a process group"
        assert max(o["rel"]) < TOL, f"rank {r}: {o['rel']}"
        d = o["degree"]
        assert o["sent_fwd"] == 4 * (d - 1)  # k, v, meta, tile summaries per hop
        assert o["sent_total"] == 4 * (d - 1) + 4 * (d - 1) + 2 * d  # + backward: kv hops, dk/dv home
        assert o["saved"] == o["saved_1"], "saved-for-backward bytes grew with the degree"


def test_saved_for_backward_is_inputs_output_and_lse():
    """Single rank, tiles smaller than the stream: autograd keeps q, k, v, meta, out and lse only."""
    q, k, v, w, meta = _stream(60, 4, 2, 8, seed=1)
    ref = _dense_grads(q, k, v, w, meta)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, saved = _saved_bytes(lambda: ring_attention(qq, kk, vv, meta, _mask, tile=7))
    (out * w).sum().backward()
    for a, b in zip((out.detach(), qq.grad, kk.grad, vv.grad), ref):
        assert _rel(a, b) < TOL
    lse = 60 * 4 * 4
    assert saved == 4 * (2 * q.numel() + k.numel() + v.numel()) + 8 * meta.numel() + lse


def test_rank_outside_group_is_rejected():
    with pytest.raises(ValueError, match="rank 2 is not in the CP group"):
        RingComm([0, 1], 2)
    q, k, v, _, meta = _stream(12, 4, 2, 8, seed=0)
    with pytest.raises(ValueError, match="meta has"):
        ring_attention(q, k, v, meta[:5], _mask)
