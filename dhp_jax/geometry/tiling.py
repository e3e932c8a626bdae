"""Tiles of an attention block and the test that skips a (query tile, key tile) pair: pure NumPy.

One home for the rule that the JAX ring kernel (`dhp_jax.sharding.tiles`), the torch ring
(`npu_backend.ring`) and the benches share, so a count made here is what the kernels compute.
Functions taking `xp` run on NumPy or on `jax.numpy` alike.

Tiling (`TileSpec`): a block of S tokens made of `chunks` contiguous chunks (the two zigzag chunks
of a ring device) is cut chunk by chunk into n tiles of t = ceil(c / n) tokens, where c = S / chunks
and n = ceil(c / tile); a chunk's last tile holds c - (n-1) t real tokens (the JAX kernel pads it
with segment-0 tokens, the torch kernel slices it shorter), and no tile straddles two chunks. A
block of at most `tile` tokens is one tile, whatever its chunks.

Skipping: every tile gets a summary from its ids (`summarize`, six int32 per tile): its lowest and
highest segment, the first position of its lowest segment, the last position of its highest
segment, and its lowest and highest bidirectional span, all over real tokens (segment > 0).
`tile_pairs_allowed` is true unless the summaries prove that no pair may attend under the mask
rule of `dhp_jax.model.attention` (same segment > 0, and causal by position or the same span > 0):
disjoint segment ranges; or no span in common and the key tile's first (segment, position) after
the query tile's last (the causal future); or either tile all padding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

DEFAULT_TILE = 512
_BIG = 2 ** 30


@dataclasses.dataclass(frozen=True)
class TileSpec:
    """How a block of `length` tokens in `chunks` contiguous chunks is cut into tiles of `size`."""

    length: int
    chunks: int
    per_chunk: int       # tiles per chunk (n)
    size: int            # tokens per tile (t)

    @classmethod
    def make(cls, length: int, tile: int = DEFAULT_TILE, chunks: int = 1) -> "TileSpec":
        if tile < 1 or chunks < 1 or length < 1 or length % chunks:
            raise ValueError(f"cannot tile a block of {length} tokens in {chunks} chunks with tile {tile}")
        if length <= tile:             # a block that fits one tile is one tile (no loop to run)
            return cls(length, 1, 1, length)
        c = length // chunks
        n = -(-c // tile)
        return cls(length, chunks, n, -(-c // n))

    @property
    def num_tiles(self) -> int:
        return self.chunks * self.per_chunk

    @property
    def chunk(self) -> int:
        return self.length // self.chunks


def to_tiles(x: Any, spec: TileSpec, xp: Any = np) -> Any:
    """x[S, ...] -> x[num_tiles, t, ...], each chunk padded at its end with zeros (segment 0)."""
    c, pad = spec.chunk, spec.per_chunk * spec.size - spec.chunk
    x = x.reshape((spec.chunks, c) + x.shape[1:])
    if pad:
        x = xp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape((spec.num_tiles, spec.size) + x.shape[2:])


def from_tiles(x: Any, spec: TileSpec) -> Any:
    """Inverse of `to_tiles`: x[num_tiles, t, ...] -> x[S, ...] (the padding dropped)."""
    x = x.reshape((spec.chunks, spec.per_chunk * spec.size) + x.shape[2:])
    return x[:, :spec.chunk].reshape((spec.length,) + x.shape[2:])


def summarize(seg: Any, pos: Any, span: Any, xp: Any = np) -> Any:
    """int32[n, 6] per-tile summaries of tiled ids [n, t] (see the module docstring)."""
    real = seg > 0
    seg_lo = xp.min(xp.where(real, seg, _BIG), axis=1)
    seg_hi = xp.max(xp.where(real, seg, -1), axis=1)
    first = xp.min(xp.where(real & (seg == seg_lo[:, None]), pos, _BIG), axis=1)
    last = xp.max(xp.where(real & (seg == seg_hi[:, None]), pos, -1), axis=1)
    spanned = real & (span > 0)
    span_lo = xp.min(xp.where(spanned, span, _BIG), axis=1)
    span_hi = xp.max(xp.where(spanned, span, -1), axis=1)
    return xp.stack([seg_lo, seg_hi, first, last, span_lo, span_hi], axis=1).astype(xp.int32)


def tile_pairs_allowed(qs: Any, ks: Any, xp: Any = np) -> Any:
    """bool[nq, nk]: False only where no query of the q tile may attend any key of the k tile."""
    q = [qs[:, i, None] for i in range(6)]
    k = [ks[None, :, i] for i in range(6)]
    seg = (xp.maximum(q[0], k[0]) <= xp.minimum(q[1], k[1]))           # also false on empty tiles
    causal = (k[0] < q[1]) | ((k[0] == q[1]) & (k[2] <= q[3]))
    spans = xp.maximum(q[4], k[4]) <= xp.minimum(q[5], k[5])
    return seg & (causal | spans)


def tile_ranges(spec: TileSpec) -> list[tuple[int, int]]:
    """[start, stop) of every tile's real tokens in the block (the unpadded view of `to_tiles`)."""
    c, t = spec.chunk, spec.size
    return [(ch * c + j * t, ch * c + min((j + 1) * t, c)) for ch in range(spec.chunks) for j in range(spec.per_chunk)]


def count_ring_tiles(segment: np.ndarray, position: np.ndarray, span: np.ndarray, degree: int,
                     tile: int = DEFAULT_TILE, chunks: int = 2) -> tuple[int, int]:
    """(computed, total) tile pairs of a ring over a stream already in device order (NumPy).

    Device i holds `array[i*S/d:(i+1)*S/d]` in `chunks` chunks; over the ring every device meets
    every block. Uses the kernel's own `summarize` / `tile_pairs_allowed`.
    """
    ids = [np.asarray(a).reshape(degree, -1) for a in (segment, position, span)]
    spec = TileSpec.make(ids[0].shape[1], tile, chunks)
    sums = [summarize(*(to_tiles(a[i], spec, np) for a in ids), xp=np) for i in range(degree)]
    computed = sum(int(tile_pairs_allowed(qs, ks, np).sum()) for qs in sums for ks in sums)
    return computed, degree * degree * spec.num_tiles ** 2
