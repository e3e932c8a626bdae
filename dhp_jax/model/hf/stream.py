"""A checkpoint read piece by piece: any range of any leaf of the parameter tree, in float32, straight
from the memory-mapped safetensors bytes, without ever building the tree.

`checkpoint_sources(path)` reads config.json and the safetensors headers only and gives the
parameter tree with a `TensorSource` at every leaf (the tree `load_pretrained` would build, same
paths, same leaf shapes). `TensorSource.read(a, b, out)` writes elements [a, b) of its leaf,
raveled in C order, into `out` as float32. A leaf kept as stored (embeddings, norms, biases) is a
contiguous byte range of its file; a Linear or conv kernel is weight.reshape(out, -1).T, so a range
of its elements is a band of kernel rows, i.e. of weight columns, gathered from all weight rows.
Either way the file is mapped `block_bytes` at a time and each mapping is dropped once copied, so
what a read holds is `out`, one mapped block and (for a kernel) the band of whole kernel rows it
cuts from; the bytes stay in the OS page cache, not in the process.
`dhp_jax.sharding.stream_load` fills the executor's sharded master vector this way.
"""

from __future__ import annotations

import dataclasses
import mmap
from typing import Any

import jax
import numpy as np

from dhp_jax.model.hf import safetensors_io
from dhp_jax.model.hf.api import LM_HEAD, check_params, load_config
from dhp_jax.model.hf.families import hf_module
from dhp_jax.model.hf.checkpoint import leaf_rule, leaf_shape, tree_from_weights
from dhp_jax.model.hf.config import HFConfig

BLOCK_BYTES = 16 * 2**20     # the most file bytes one read maps at a time
PAGE = mmap.ALLOCATIONGRANULARITY


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """One checkpoint tensor as a leaf of the tree: `file`, byte `offset` of its data, stored
    `dtype` and `stored` shape; `transposed`: the leaf is stored.reshape(rows, -1).T."""

    name: str
    file: str
    offset: int
    dtype: np.dtype
    stored: tuple[int, ...]
    transposed: bool

    @property
    def rows(self) -> int:
        """Rows of the stored tensor seen as a matrix [rows, cols] (1 for a scalar)."""
        return self.stored[0] if self.stored else 1

    @property
    def cols(self) -> int:
        return int(np.prod(self.stored[1:], dtype=np.int64)) if self.stored else 1

    @property
    def shape(self) -> tuple[int, ...]:
        """The leaf's shape in the tree (the checkpoint's leaf rule)."""
        return leaf_shape(self.name, self.stored)[1]

    @property
    def size(self) -> int:
        return self.rows * self.cols

    def _copy(self, first: int, count: int, block_bytes: int, sink) -> None:
        """sink(element offset, view) over stored elements [first, first + count), each view a
        fresh read-only mapping of at most about `block_bytes`, unmapped once `sink` returns."""
        item = self.dtype.itemsize
        step = max(1, block_bytes // item)
        with open(self.file, "rb") as f:
            for at in range(first, first + count, step):
                n = min(step, first + count - at)
                start = self.offset + at * item
                base = start - start % PAGE
                m = mmap.mmap(f.fileno(), start + n * item - base, access=mmap.ACCESS_READ, offset=base)
                view = np.frombuffer(m, dtype=self.dtype, count=n, offset=start - base)
                sink(at, view)
                del view
                m.close()

    def read(self, a: int, b: int, out: np.ndarray, block_bytes: int = BLOCK_BYTES) -> None:
        """out[:] = float32 elements [a, b) of the leaf raveled in C order."""
        if not 0 <= a <= b <= self.size or out.shape != (b - a,):
            raise ValueError(f"{self.name}: range [{a}, {b}) of {self.size} elements into {out.shape}")
        if a == b:
            return
        if not self.transposed:
            def put(at, view):
                out[at - a:at - a + view.size] = view
            self._copy(a, b - a, block_bytes, put)
            return
        # leaf[i, o] = stored[o, i]: elements [a, b) lie in leaf rows i0 .. i1 - 1 (stored columns)
        rows, cols = self.rows, self.cols
        i0, i1 = a // rows, (b - 1) // rows + 1
        band = np.empty((i1 - i0, rows), np.float32)

        def put_rows(at, view):
            o0 = at // cols
            band[:, o0:o0 + view.size // cols] = view.reshape(-1, cols)[:, i0:i1].T

        # whole stored rows per mapping, so that every view is [rows, cols]
        per = max(1, block_bytes // (cols * self.dtype.itemsize))
        self._copy(0, rows * cols, per * cols * self.dtype.itemsize, put_rows)
        out[:] = band.reshape(-1)[a - i0 * rows:b - i0 * rows]


@dataclasses.dataclass(frozen=True)
class ExpertSource:
    """A MoE layer's fused expert leaf (`mlp.experts.gate_up_proj` [E, 2 I, d], `down_proj`
    [E, d, I], transformers' layout) read from a checkpoint that stores the experts otherwise
    (`dhp_jax.model.hf.moe.load_experts`): `pieces[e]` the stored tensors (file, dtype, shape,
    offset) that make expert e, joined along axis 0 and transposed when `transpose`. A read maps
    the experts its range covers, one at a time."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[tuple[tuple[str, Any, tuple[int, ...], int], ...], ...]
    transpose: bool

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def expert(self, e: int) -> np.ndarray:
        parts = [np.memmap(file, dtype=dtype, mode="r", offset=offset, shape=shape)
                 for file, dtype, shape, offset in self.pieces[e]]
        w = np.concatenate([np.asarray(p, np.float32) for p in parts], axis=0) if len(parts) > 1 \
            else np.asarray(parts[0], np.float32)
        return w.T if self.transpose else w

    def read(self, a: int, b: int, out: np.ndarray, block_bytes: int = BLOCK_BYTES) -> None:
        """out[:] = float32 elements [a, b) of the leaf raveled in C order."""
        if not 0 <= a <= b <= self.size or out.shape != (b - a,):
            raise ValueError(f"{self.name}: range [{a}, {b}) of {self.size} elements into {out.shape}")
        per = self.size // self.shape[0]
        at = a
        while at < b:
            e = at // per
            end = min(b, (e + 1) * per)
            out[at - a:end - a] = self.expert(e).reshape(-1)[at - e * per:end - e * per]
            at = end


def _expert_sources(named: Any, config: HFConfig) -> Any:
    """`named` ((name, (file, dtype, shape, offset)) of the checkpoint's tensors) with a MoE
    model's experts as `ExpertSource`s of transformers' fused leaves (the family's published
    layout, `expert_layouts.layout_of`)."""
    from dhp_jax.model.hf import expert_layouts as xl
    from dhp_jax.model.hf.api import init_shapes

    layout, want = xl.layout_of(hf_module(config.family)), init_shapes(config)
    pending: dict[str, dict[tuple[int, str], Any]] = {}
    for name, info in named:
        shape = tuple(info[2])
        if layout != "per_expert" and xl.is_fused(name):
            swap = layout == "fused_transposed" and tuple(want.get(name, ())) != shape
            file, dtype, _, offset = info
            per = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize
            leaf = (shape[0], shape[2], shape[1]) if swap else shape
            yield name, ExpertSource(name, leaf, tuple(((file, dtype, shape[1:], offset + e * per),)
                                                       for e in range(shape[0])), swap)
            continue
        key = xl.per_expert_name(name) if layout == "per_expert" else None
        if key is not None:
            pending.setdefault(key[0], {})[key[1], key[2]] = info
            continue
        yield name, info
    for prefix, mats in pending.items():
        n = 1 + max(e for e, _ in mats)
        xl.check_complete(prefix, lambda e, m: (e, m) in mats, n, "checkpoint")
        inter, d = tuple(mats[0, "gate_proj"][2])
        yield f"{prefix}.gate_up_proj", ExpertSource(f"{prefix}.gate_up_proj", (n, 2 * inter, d), tuple(
            (mats[e, "gate_proj"], mats[e, "up_proj"]) for e in range(n)), False)
        yield f"{prefix}.down_proj", ExpertSource(f"{prefix}.down_proj", (n, d, inter), tuple(
            (mats[e, "down_proj"],) for e in range(n)), False)


def checkpoint_sources(path: str) -> tuple[HFConfig, dict]:
    """(config, the parameter tree with a `TensorSource` at each leaf) of a checkpoint directory,
    from config.json and the safetensors headers alone (legacy names renamed, a tied lm_head
    left out, as `load_pretrained` does; a MoE model's experts in transformers' fused layout,
    `ExpertSource`)."""
    config = load_config(path)
    renames = hf_module(config.family).LEGACY_RENAMES

    def named():
        for file in safetensors_io.checkpoint_files(path):
            for name, dtype, shape, offset in safetensors_io.tensor_infos(file):
                yield name, (file, dtype, shape, offset)

    def leaf(name: str, info: Any) -> tuple[list[str], Any]:
        if isinstance(info, ExpertSource):
            return name.split("."), info
        file, dtype, shape, offset = info
        tree_path, transposed = leaf_rule(name, len(shape))
        return tree_path, TensorSource(name, file, offset, dtype, shape, transposed)

    infos = named() if config.text.moe is None else _expert_sources(named(), config)
    tree = tree_from_weights(infos, renames, skip=(LM_HEAD,) if config.tied else (), leaf=leaf)
    check_params(config, tree)
    return config, tree


def abstract_params(sources: Any) -> Any:
    """The float32 parameter tree of `checkpoint_sources` as `jax.ShapeDtypeStruct`s."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.float32), sources)
