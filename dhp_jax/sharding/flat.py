"""`FlatLayout`: the params tree as one flat vector, padded so that it splits evenly over N ranks.

The train state lives as flat vectors `x[P_pad]` sharded `P("dp")` over the full mesh: rank r owns
elements [r P_pad/N, (r+1) P_pad/N). Leaves are laid end to end in `jax.tree.flatten` order and
the tail (P_pad - P < N elements) is zero; its gradient is zero, so AdamW keeps it at zero. The
executor gathers the flat vector (in the compute dtype) once per step and reduce-scatters the
groups' flat gradients back into these shards.
"""

from __future__ import annotations

import dataclasses
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

    @classmethod
    def of(cls, params: Any, num_shards: int) -> "FlatLayout":
        """The layout of `params` (arrays or `jax.ShapeDtypeStruct`s) split over `num_shards` ranks."""
        if int(num_shards) < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        leaves, treedef = jax.tree.flatten(params)
        return cls(treedef, tuple(tuple(int(s) for s in x.shape) for x in leaves),
                   tuple(str(x.dtype) for x in leaves), int(num_shards))

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
        parts = [jnp.ravel(x).astype(dtype) for x in jax.tree.leaves(params)]
        parts.append(jnp.zeros((self.padded - self.size,), dtype))
        return jnp.concatenate(parts)

    def unravel(self, flat: jax.Array) -> Any:
        """The tree from `flat[P_pad]` (traceable); leaves keep the dtype of `flat`."""
        offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int)
        return jax.tree.unflatten(self.treedef, [flat[int(o):int(o) + n].reshape(sh)
                                                 for o, n, sh in zip(offsets, self.sizes, self.shapes)])
