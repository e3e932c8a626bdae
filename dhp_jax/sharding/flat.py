"""`FlatLayout`: the params tree as one flat vector, padded so that it splits evenly over N ranks.

The train state lives as flat vectors `x[P_pad]` sharded `P("dp")` over the full mesh: rank r owns
elements [r P_pad/N, (r+1) P_pad/N). Leaves are laid end to end in the natural order of their
paths (`layers_2` before `layers_10`), so the blocks of a stack ("layers_0", "layers_1", ...) are
rows of one [count, block size] matrix (`rows`): the group program scans over them without a
copy. The group program differentiates with respect to the flat vector cut into pieces at the
stacks' bounds (`cuts`, `split`): the stacks' gradients come out stacked and are joined with the
others by one concatenation. The tail (P_pad - P < N elements) is zero; its gradient is zero, so AdamW keeps it at zero. The
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

    def record(self) -> dict:
        """The layout as JSON (what a checkpoint stores, so that a run on another number of shards,
        or a reader without jax, can lay the flat vector out again): the leaves in flat-vector
        order as [path, shape, dtype], P, P_pad and the number of shards."""
        return {"num_shards": self.num_shards, "size": self.size, "padded": self.padded,
                "leaves": [[self.paths[i], list(self.shapes[i]), self.dtypes[i]] for i in self.order]}

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

    def stack(self, prefix: str, count: int, first: int = 0) -> tuple[int, int, Any]:
        """The blocks `prefix0` .. `prefix{count-1}` (from `prefix{first}` when `first` is given: a
        run of a stack whose blocks differ, a MoE LLM's sparse or dense layers) as rows of one
        [count, n] matrix at offset `start` of the flat vector: (start, n, a function from one row
        to that block's params subtree)."""
        start, n, local = self.block_leaves(prefix, count, first)

        def tree(row: jax.Array) -> dict:
            out: dict = {}
            for keys, o, shape in local:
                d = out
                for k in keys[:-1]:
                    d = d.setdefault(k, {})
                d[keys[-1]] = row[o:o + int(np.prod(shape))].reshape(shape)
            return out

        return start, n, tree

    def block_leaves(self, prefix: str, count: int, first: int = 0) -> tuple[int, int, tuple]:
        """(start, n, leaves) of the stack `prefix{first}` .. `prefix{first+count-1}` (`stack`):
        each leaf of a block as (keys inside the block, offset in its row, shape), in row order."""
        offsets = self._offsets()
        members = [[i for i in self.order if self.paths[i].startswith(f"{prefix}{first + b}/")] for b in range(count)]
        if not members[0]:
            raise ValueError(f"no params under {prefix}{first}/")
        n = sum(self.sizes[i] for i in members[0])
        start = offsets[members[0][0]]
        for b, ids in enumerate(members):
            rel = [offsets[i] - start - b * n for i in ids]
            if [self.shapes[i] for i in ids] != [self.shapes[i] for i in members[0]] or \
                    rel != [offsets[i] - start for i in members[0]]:
                raise ValueError(f"{prefix}{first + b} is not laid out like {prefix}{first} at row {b}")
        return start, n, tuple((tuple(self.paths[i][len(f"{prefix}{first}/"):].split("/")), offsets[i] - start,
                                self.shapes[i]) for i in members[0])

    def rows(self, flat: jax.Array, prefix: str, count: int) -> tuple[jax.Array, Any]:
        """The blocks `prefix0` .. `prefix{count-1}` of `flat` as rows[count, n] (a slice and a
        reshape, no copy), and a function from one row to that block's params subtree."""
        start, n, tree = self.stack(prefix, count)
        return flat[start:start + count * n].reshape(count, n), tree

    def cuts(self, stacks: Any, leaves: bool = False) -> tuple[int, ...]:
        """The offsets where `split` cuts the flat vector: 0, then each stack's start and end
        (`stacks`: (prefix, count) or (prefix, count, first)), in order; with `leaves`, also every leaf's start
        outside the stacks (one piece per leaf there, as `leaf_cuts`)."""
        bounds, spans = set(), []
        for prefix, count, *first in stacks:
            start, n, _ = self.block_leaves(prefix, count, *first)
            bounds |= {start, start + count * n}
            spans.append((start, start + count * n))
        if leaves:
            bounds |= {o for o in self._offsets().values() if not any(a < o < b for a, b in spans)}
        return tuple(sorted(bounds | {0}))

    def leaf_cuts(self) -> tuple[int, ...]:
        """`cuts` at every leaf's start: `split` then gives one piece per leaf (and the pad tail)."""
        return tuple(sorted(set(self._offsets().values()) | {0}))

    def split(self, flat: jax.Array, cuts: tuple[int, ...]) -> tuple[jax.Array, ...]:
        """`flat[P_pad]` cut at `cuts` (`FlatLayout.cuts`) into pieces; `jnp.concatenate` joins
        them again. Differentiating with respect to the pieces gives each its own gradient, joined
        by a concatenation (no arithmetic) instead of a sum of zero-padded parts."""
        ends = (*cuts[1:], self.padded)
        return tuple(flat[a:b] for a, b in zip(cuts, ends) if b > a)

    def unravel_pieces(self, pieces: Any, cuts: tuple[int, ...]) -> Any:
        """`unravel` of the flat vector `split` into `pieces` at `cuts`, reading every leaf from the
        piece that holds it (a leaf across a cut is an error)."""
        ends = (*cuts[1:], self.padded)
        spans = [(a, b) for a, b in zip(cuts, ends) if b > a]
        offsets, leaves = self._offsets(), []
        for i, (n, sh) in enumerate(zip(self.sizes, self.shapes)):
            o = offsets[i]
            j = next(j for j, (a, b) in enumerate(spans) if a <= o < b or (n == 0 and a <= o <= b))
            a, b = spans[j]
            if o + n > b:
                raise ValueError(f"leaf {self.paths[i]} crosses the cut at {b}")
            leaves.append(pieces[j][o - a:o - a + n].reshape(sh))
        return jax.tree.unflatten(self.treedef, leaves)

    def piece_rows(self, pieces: Any, cuts: tuple[int, ...], prefix: str, count: int,
                   first: int = 0) -> tuple[jax.Array, Any]:
        """`rows` of the flat vector `split` into `pieces` at `cuts` (a stack is one piece)."""
        start, n, tree = self.stack(prefix, count, first)
        if start not in cuts or (start + count * n < self.padded and start + count * n not in cuts):
            raise ValueError(f"the stack {prefix}* is not a piece of the split at {cuts}")
        j = [c for c, e in zip(cuts, (*cuts[1:], self.padded)) if e > c].index(start)
        return pieces[j].reshape(count, n), tree


def _natural(path: str) -> tuple:
    """Sort key that orders digit runs as numbers ("layers_2" < "layers_10")."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path))
