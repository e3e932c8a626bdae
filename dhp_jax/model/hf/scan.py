"""The families' block stacks (LLM layers, encoder blocks) as one `lax.scan` each, with their own
VJP, so a group program's op count and compile time do not grow with depth.

The checkpoint tree stays per layer, as transformers names it (`layers.0`, `layers.1`, ...); the
scan runs over a stacked view, `BlockRows`: rows[count, n], one row per block, each block's leaves
end to end in the natural order of their paths inside the block (the order `FlatLayout` lays the
train state out in, so the executor's view is a slice and a reshape of its flat params, no copy;
`BlockRows.of` stacks a per-layer tree, a copy, for the single-sample paths).

`run_blocks` is the stand-in's `mllm.block_stack` VJP for a params subtree per block:

- forward: a scan that keeps, per block, the residuals of `jax.vjp` of the block (under the
  stream's remat, `layers.BlockStream.block`) minus what the backward scan can restore: the
  block's params (sliced again from its row), its per-block inputs and the stack's constants
  (rotary tables: computed once outside, never kept per block);
- backward: a reverse scan that rebuilds each block's pullback and emits its row's gradient, so the
  gradient of the rows comes out stacked [count, n].

Per-block differences are scanned inputs (`per_block`: e.g. Qwen2.5-VL's window or frame ids of
each block). DeepStack is two optional per-block index maps: `feed` [m, S, d] is added to the
hidden states after blocks 0 .. m-1 (Qwen3-VL's LLM), and `taps` (block indexes) returns the
hidden states after those blocks (Qwen3-VL's encoder), both differentiable.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from dhp_jax.model.mllm import _load, _store

Leaf = tuple[tuple[str, ...], int, tuple[int, ...]]     # (keys inside the block, offset in the row, shape)


def _natural(path: str) -> tuple:
    """Sort key that orders digit runs as numbers (as `FlatLayout` lays leaves out)."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class BlockRows:
    """A stack of identical blocks as rows[count, n] and where each leaf of a block sits in its row."""

    rows: jax.Array
    leaves: tuple[Leaf, ...]

    def tree_flatten(self):
        return (self.rows,), self.leaves

    @classmethod
    def tree_unflatten(cls, leaves, children):
        return cls(children[0], leaves)

    @classmethod
    def of(cls, blocks: Sequence[Any]) -> "BlockRows":
        """The per-block trees `blocks` (same structure, shapes and dtype) stacked: a copy."""
        rows = [cls.leaves_of(b) for b in blocks]
        if not rows:
            raise ValueError("a block stack needs at least one block")
        layout = tuple((keys, off, tuple(x.shape)) for keys, off, x in rows[0])
        for i, r in enumerate(rows):
            if tuple((keys, off, tuple(x.shape)) for keys, off, x in r) != layout:
                raise ValueError(f"block {i} does not have block 0's params (names and shapes)")
        return cls(jnp.stack([jnp.concatenate([jnp.ravel(x) for _, _, x in r]) for r in rows]), layout)

    @staticmethod
    def leaves_of(block: Any) -> list[tuple[tuple[str, ...], int, Any]]:
        """(keys, offset, leaf) of one block's tree, in row order."""
        with_path = jax.tree_util.tree_flatten_with_path(block)[0]
        named = sorted(((tuple(str(getattr(k, "key", k)) for k in p), x) for p, x in with_path),
                       key=lambda kx: _natural("/".join(kx[0])))
        out, at = [], 0
        for keys, x in named:
            out.append((keys, at, x))
            at += int(x.size)
        return out

    def tree(self, row: jax.Array) -> dict:
        """One block's params subtree from its row (slices and reshapes)."""
        out: dict = {}
        for keys, off, shape in self.leaves:
            d = out
            for k in keys[:-1]:
                d = d.setdefault(k, {})
            size = 1
            for s in shape:
                size *= s
            d[keys[-1]] = row[off:off + size].reshape(shape)
        return out

    def ravel(self, tree: Any) -> jax.Array:
        """The row of a block's subtree (its gradient, say): the inverse of `tree`."""
        parts = []
        for keys, _, _ in self.leaves:
            x = tree
            for k in keys:
                x = x[k]
            parts.append(jnp.ravel(x))
        return jnp.concatenate(parts)


def block_rows(stack: Any, count: int) -> BlockRows:
    """`stack` as `BlockRows`: itself, or a per-layer tree {"0": block, "1": ...} stacked."""
    if isinstance(stack, BlockRows):
        if stack.rows.shape[0] != count:
            raise ValueError(f"a stack of {stack.rows.shape[0]} blocks where the config has {count}")
        return stack
    return BlockRows.of([stack[str(i)] for i in range(count)])


def _read(table: jax.Array, at: jax.Array) -> jax.Array:
    """table[at], or zeros where `at` is -1 (a block with no entry)."""
    row = table[jnp.maximum(at, 0)]
    return jnp.where(at >= 0, row, jnp.zeros_like(row))


def _write(table: jax.Array, at: jax.Array, value: jax.Array) -> jax.Array:
    """table with row `at` set to value (unchanged where `at` is -1)."""
    i = jnp.maximum(at, 0)
    return table.at[i].set(jnp.where(at >= 0, value, table[i]))


Block = Callable[[Any, jax.Array, Any, Any], jax.Array]    # (params subtree, x, per-block inputs, consts) -> x


def run_blocks(block: Block, stack: BlockRows, x: jax.Array, per_block: Any = (), consts: Any = (),
               feed: jax.Array | None = None, taps: Sequence[int] = ()) -> Any:
    """x after `block(p_i, x, per_block[i], consts)` for every block i of `stack`, as one scan
    (see the module docstring). `per_block`: arrays with a leading block axis (not differentiated);
    `consts`: arrays every block reads (not differentiated; kept once, not per block); `feed`
    [m, ...x.shape], m <= count: added after blocks 0 .. m-1. Returns x, or (x, tapped[len(taps),
    ...x.shape]) when `taps` is given (the hidden states after each of those blocks)."""
    count = stack.rows.shape[0]
    taps = tuple(int(t) for t in taps)
    if feed is not None and not 0 < feed.shape[0] <= count:
        raise ValueError(f"{feed.shape[0]} feed levels for a stack of {count} blocks")
    if any(not 0 <= t < count for t in taps):
        raise ValueError(f"taps {taps} outside a stack of {count} blocks")
    m = 0 if feed is None else feed.shape[0]
    # per block: (index into feed or -1, index into the taps or -1)
    where = jnp.asarray([[i if i < m else -1, taps.index(i) if i in taps else -1] for i in range(count)], jnp.int32)
    dtype = stack.rows.dtype
    meta: dict[str, Any] = {}

    def pullback(h, row, blk, cs):
        p = stack.tree(_load(row, dtype))
        y, pull = jax.vjp(lambda h_, p_: block(p_, h_, blk, cs), h, p)
        leaves, tree = jax.tree.flatten(pull)
        given = [*jax.tree.leaves(p), *jax.tree.leaves(blk), *jax.tree.leaves(cs)]
        slots = tuple(next((j for j, g in enumerate(given) if leaf is g), None) for leaf in leaves)
        kept = [leaf for leaf, s in zip(leaves, slots) if s is None]
        meta.update(tree=tree, slots=slots, dtypes=tuple(leaf.dtype for leaf in kept))
        return y, kept

    def after(h, buf, at, fd):
        """The feed added after a block, its output recorded in the taps' buffer."""
        if fd is not None:
            h = h + _read(fd, at[0])
        if buf is not None:
            buf = _write(buf, at[1], h)
        return h, buf

    def new_buf(x):
        return jnp.zeros((len(taps),) + x.shape, x.dtype) if taps else None

    def forward(x, rows, fd, keep):
        def step(carry, xs):
            h, buf, cs = carry
            row, blk, at = xs
            if keep:
                h, kept = pullback(h, row, blk, cs)
            else:
                h, kept = block(stack.tree(_load(row, dtype)), h, blk, cs), None
            h, buf = after(h, buf, at, fd)
            return (h, buf, cs), None if kept is None else [_store(k) for k in kept]

        (h, buf, _), saved = jax.lax.scan(step, (x, new_buf(x), consts), (_store(rows), per_block, where))
        return (h, buf) if taps else h, saved

    @jax.custom_vjp
    def run(x, rows, fd):
        return forward(x, rows, fd, keep=False)[0]

    def fwd(x, rows, fd):
        out, saved = forward(x, rows, fd, keep=True)
        return out, (saved, rows, fd)

    def bwd(res, ct):
        saved, rows, fd = res
        dy, dtaps = ct if taps else (ct, None)

        def step(carry, xs):
            dh, dfd = carry
            kept, row, blk, at = xs
            if dtaps is not None:
                dh = dh + _read(dtaps, at[1])
            if dfd is not None:
                dfd = _write(dfd, at[0], dh)
            p = stack.tree(_load(row, dtype))
            given = [*jax.tree.leaves(p), *jax.tree.leaves(blk), *jax.tree.leaves(consts)]
            kept = iter(_load(k, d) for k, d in zip(kept, meta["dtypes"]))
            leaves = [next(kept) if s is None else given[s] for s in meta["slots"]]
            dh, dp = jax.tree.unflatten(meta["tree"], leaves)(dh)
            return (dh, dfd), _store(stack.ravel(dp))

        dfd0 = None if fd is None else jnp.zeros_like(fd)
        (dx, dfd), drows = jax.lax.scan(step, (dy, dfd0), (saved, _store(rows), per_block, where), reverse=True)
        return dx, _load(drows, dtype), dfd

    run.defvjp(fwd, bwd)
    return run(x, stack.rows, feed)


def layer_runs(kinds: Sequence[Any]) -> list[tuple[int, int, Any]]:
    """(first layer, count, kind) of each run of consecutive layers of one kind (a MoE LLM's
    sparse and dense layers, `MoeSpec.sparse`): each run is one scan of identical blocks."""
    runs: list[tuple[int, int, Any]] = []
    for i, k in enumerate(kinds):
        if runs and runs[-1][2] == k:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, k)
        else:
            runs.append((i, 1, k))
    return runs


LLM_LAYERS = ("model", "language_model", "layers")


def block_stacks(config: Any) -> tuple[tuple[tuple[str, ...], int, int], ...]:
    """(params path, block count, first block) of a family's scanned stacks (`HFConfig`): its
    encoder's blocks (the family's `encoder_stack`) and its LLM's layers; a MoE LLM's layers as
    one stack per run of dense or sparse layers (`layer_runs`), which the LLM's forward pass
    reads as {str(first): `BlockRows`} at the layers' path (`text.moe_text_forward`)."""
    from dhp_jax.model.hf.families import hf_module

    path, count = hf_module(config.family).encoder_stack(config)
    moe = config.text.moe
    if moe is None:
        return (path, count, 0), (LLM_LAYERS, config.text.num_layers, 0)
    return ((path, count, 0),) + tuple((LLM_LAYERS, n, first) for first, n, _ in layer_runs(moe.sparse))


def with_stacks(params: Any, stacks: dict) -> Any:
    """`params` with the subtree at each path of `stacks` ({path: `BlockRows`}) replaced (the
    other subtrees shared, nothing copied)."""
    def put(tree: Any, path: tuple[str, ...], value: Any) -> Any:
        return value if not path else {**tree, path[0]: put(tree[path[0]], path[1:], value)}

    for path, rows in stacks.items():
        params = put(params, path, rows)
    return params


def stack_rows(found: Any) -> dict:
    """{params path: what the forward pass reads there} of the stacks' `BlockRows`, `found`:
    ((path, first), rows) pairs (`block_stacks`): a stack of its own, its `BlockRows`; the runs of
    a MoE LLM's layers (several stacks at one path), {str(first): `BlockRows`}."""
    by_path: dict = {}
    for (path, first), rows in found:
        by_path.setdefault(path, []).append((first, rows))
    return {path: runs[0][1] if len(runs) == 1 and runs[0][0] == 0 else {str(f): r for f, r in runs}
            for path, runs in by_path.items()}
