"""`FlatLayout`: the params tree as one flat vector, padded so that it splits evenly over N ranks.

The train state lives as flat vectors `x[P_pad]` sharded `P("dp")` over the full mesh: rank r owns
elements [r P_pad/N, (r+1) P_pad/N). Leaves are laid end to end in the natural order of their
paths (`layers_2` before `layers_10`), so the blocks of a stack ("layers_0", "layers_1", ...) are
rows of one [count, block size] matrix (`rows`): the group program scans over them without a
copy. The tail (P_pad - P < N elements) is zero; its gradient is zero, so AdamW keeps it at zero. The
executor gathers the flat vector (in the compute dtype) once per step and reduce-scatters the
groups' flat gradients back into these shards.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Leaf order, shapes and offsets of a params tree inside a flat vector of `padded` elements."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    num_shards: int
    paths: tuple[str, ...] = ()        # "a/b/c" of each leaf, in `jax.tree.flatten` order
    order: tuple[int, ...] = ()        # leaf indices in flat-vector order

    @classmethod
    def of(cls, params: Any, num_shards: int) -> "FlatLayout":
        """The layout of `params` (arrays or `jax.ShapeDtypeStruct`s) split over `num_shards` ranks."""
        if int(num_shards) < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
        leaves = [x for _, x in with_path]
        paths = tuple("/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p) for p, _ in with_path)
        order = tuple(sorted(range(len(paths)), key=lambda i: _natural(paths[i])))
        return cls(treedef, tuple(tuple(int(s) for s in x.shape) for x in leaves),
                   tuple(str(x.dtype) for x in leaves), int(num_shards), paths, order)

    def _offsets(self) -> dict[int, int]:
        """Flat offset of every leaf (by leaf index)."""
        out, at = {}, 0
        for i in self.order:
            out[i] = at
            at += self.sizes[i]
        return out

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(s)) for s in self.shapes)

    @property
    def size(self) -> int:
        """P: the number of parameters."""
        return int(sum(self.sizes))

    @property
    def padded(self) -> int:
        """P_pad: P rounded up to a multiple of the number of shards."""
        return -(-self.size // self.num_shards) * self.num_shards

    @property
    def shard_size(self) -> int:
        return self.padded // self.num_shards

    def matches(self, params: Any) -> bool:
        """Whether `params` has this tree structure, these shapes and these dtypes."""
        leaves, treedef = jax.tree.flatten(params)
        return (treedef == self.treedef and tuple(tuple(x.shape) for x in leaves) == self.shapes
                and tuple(str(x.dtype) for x in leaves) == self.dtypes)

    def ravel(self, params: Any, dtype: Any = jnp.float32) -> jax.Array:
        """The tree as `flat[P_pad]` (traceable), zero-padded."""
        leaves = jax.tree.leaves(params)
        parts = [jnp.ravel(leaves[i]).astype(dtype) for i in self.order]
        parts.append(jnp.zeros((self.padded - self.size,), dtype))
        return jnp.concatenate(parts)

    def unravel(self, flat: jax.Array) -> Any:
        """The tree from `flat[P_pad]` (traceable); leaves keep the dtype of `flat`."""
        offsets = self._offsets()
        return jax.tree.unflatten(self.treedef, [flat[offsets[i]:offsets[i] + n].reshape(sh)
                                                 for i, (n, sh) in enumerate(zip(self.sizes, self.shapes))])

    def rows(self, flat: jax.Array, prefix: str, count: int) -> tuple[jax.Array, Any]:
        """The blocks `prefix0` .. `prefix{count-1}` of `flat` as rows[count, n] (a slice and a
        reshape, no copy), and a function from one row to that block's params subtree."""
        offsets = self._offsets()
        members = [[i for i in self.order if self.paths[i].startswith(f"{prefix}{b}/")] for b in range(count)]
        if not members[0]:
            raise ValueError(f"no params under {prefix}0/")
        n = sum(self.sizes[i] for i in members[0])
        start = offsets[members[0][0]]
        for b, ids in enumerate(members):
            rel = [offsets[i] - start - b * n for i in ids]
            if [self.shapes[i] for i in ids] != [self.shapes[i] for i in members[0]] or \
                    rel != [offsets[i] - start for i in members[0]]:
                raise ValueError(f"{prefix}{b} is not laid out like {prefix}0 at row {b}")
        local = [(self.paths[i][len(f"{prefix}0/"):].split("/"), offsets[i] - start, self.sizes[i], self.shapes[i])
                 for i in members[0]]

        def tree(row: jax.Array) -> dict:
            out: dict = {}
            for keys, o, size, shape in local:
                d = out
                for k in keys[:-1]:
                    d = d.setdefault(k, {})
                d[keys[-1]] = row[o:o + size].reshape(shape)
            return out

        return flat[start:start + count * n].reshape(count, n), tree


def _natural(path: str) -> tuple:
    """Sort key that orders digit runs as numbers ("layers_2" < "layers_10")."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path))
