"""Tensor parallelism inside a rank, engine side: which parameter is split how over the t devices.

With `PlanExecutor(..., tensor_parallel=t)` a rank is t consecutive devices (`RankLayout`), each
group's sub-mesh has a last `tp` axis (`mesh.TP_AXIS`) and every device of a rank runs the same
stream shard (replicated over `tp`) on its share of the params, Megatron-style (Megatron-LM,
arXiv 1909.08053, section 3; the "psum form": the activations between blocks are whole on every
device; with `sequence_parallel` the block stacks carry 1/t of the rows instead, arXiv 2205.05198,
`dhp_jax.model.mllm.sequence_block`).

The split rule is `BLOCK_SPLIT` (every block of the vision encoder and of the decoder: q/k/v,
gate and up by column, o and down by row, the norms replicated; kv heads split when t divides
KVH, else each device takes the one kv head its query heads read, replicated) and `TOP_SPLIT` (the
embedding by rows and the LM head by columns, vocab-parallel over ceil(V / t) ids per device
(`dhp_jax.model.tensor.vocab_share`: the last window moved back to end at V, no padded copy); the
patch embedding, the vision and final norms and the projector
replicated). docs/executor.md ("Tensor parallelism inside a rank") states it as the table both
engines follow. A head count that no layout allows (H, vision heads, F or the vision MLP width not
divisible by t; kv heads neither a multiple of t nor a divisor of it) is refused by `check`
naming the model and t (`dhp_jax.planner.cost.tensor.unsplittable`, the rule the planner prices).

The state (`TensorLayout`): each device receives only its share of the params and returns only
its share's gradient. A device's share (its slices of the split leaves, its copies of the
replicated ones) is one local flat vector `row`[L_pad] (`TensorLayout.local`, the same layout on
every device of a rank); the fp32 master vector is the t rows, each sharded over the R = N / t
devices of its tp index: device r t + i holds elements [r L_pad / R, (r+1) L_pad / R) of row i.
So the step's gather is an all-gather over the R devices of each tp index, the reduction a
reduce-scatter over them, and a device holds L_pad (about P / t) params and gradient, not P.

Copies: a leaf every device of a rank holds (norms, patch embedding, projector) is stored t
times, a kv head shared by g devices g times; the group program sums the copies' gradients over
the devices that hold them (`dhp_jax.model.tensor.tied_copy`, `tied_group_copy`), so the copies
get equal gradients and stay equal under AdamW; `TensorLayout.count_once` marks one copy of each
for the gradient's global norm. The vocab windows overlap on the last device (its ids held
twice are masked, so their gradient there is zero); `unravel` reads every id from its owner.
Each device differentiates the group's loss (counted once per rank, on its device tp = 0)
with respect to its own share: the collectives' transposes bring each device its share's
gradient (`dhp_jax.model.tensor`).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dhp_jax.model.config import MLLMConfig, split_shape
from dhp_jax.model.tensor import TensorHooks, tied_copy, tied_group_copy, vocab_share
from dhp_jax.planner.cost.tensor import check_tensor_parallel
from dhp_jax.sharding.flat import FlatLayout
from dhp_jax.sharding.mesh import TP_AXIS

# leaf path inside a block -> (axis split, the unit its columns or rows count)
BLOCK_SPLIT = {"attn/q/kernel": (1, "heads"), "attn/k/kernel": (1, "kv_heads"), "attn/v/kernel": (1, "kv_heads"),
               "attn/o/kernel": (0, "heads"), "mlp/gate/kernel": (1, "mlp"), "mlp/up/kernel": (1, "mlp"),
               "mlp/down/kernel": (0, "mlp")}
# leaf path outside the blocks -> (axis split, unit); every other leaf is replicated
TOP_SPLIT = {"embed/embedding": (0, "vocab"), "lm_head/kernel": (1, "vocab")}


def check(config: MLLMConfig, t: int) -> None:
    """ValueError naming the model, the field and t unless every split of the table is even."""
    check_tensor_parallel(split_shape(config), t, f"model {config.name!r}")


def hooks(t: int, sequence: bool = False) -> TensorHooks:
    """The model's tensor-parallel collectives over the `tp` axis of a group's sub-mesh
    (`sequence`: the block stacks sequence-parallel, with the all-gather and reduce-scatter of rows)."""
    return TensorHooks(t, lambda: lax.axis_index(TP_AXIS), functools.partial(lax.psum, axis_name=TP_AXIS),
                       functools.partial(lax.pmax, axis_name=TP_AXIS), sequence,
                       functools.partial(lax.all_gather, axis_name=TP_AXIS, axis=0, tiled=True),
                       functools.partial(lax.psum_scatter, axis_name=TP_AXIS, scatter_dimension=0, tiled=True))


def _units(config: MLLMConfig, vision: bool, t: int) -> dict[str, tuple[int, Any]]:
    """unit -> (elements per device along the split axis, device index -> its first element)."""
    c = config
    h, kvh, hd, f = ((c.vision_heads, c.vision_heads, c.vision_head_dim, c.vision_ff) if vision
                     else (c.num_heads, c.num_kv_heads, c.head_dim, c.d_ff))
    kv = ((kvh // t * hd, lambda i: i * (kvh // t) * hd) if kvh % t == 0
          else (hd, lambda i: i // (t // kvh) * hd))
    vl = -(-c.vocab_size // t)
    return {"heads": (h // t * hd, lambda i: i * (h // t) * hd), "kv_heads": kv,
            "mlp": (f // t, lambda i: i * (f // t)), "vocab": (vl, lambda i: vocab_share(c.vocab_size, t, i)[0])}


def _share(tree: dict, rule: dict, units: dict, index: jax.Array, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out[k] = _share(v, rule, units, index, path + "/")
        elif path in rule:
            axis, unit = rule[path]
            size, start = units[unit]
            out[k] = lax.dynamic_slice_in_dim(v, start(index), size, axis)
        else:
            out[k] = v
    return out


def block_share(params: dict, config: MLLMConfig, vision: bool, t: int, index: jax.Array) -> dict:
    """Device `index`'s share of one block's params (a `layers_i` / `vision_layers_i` subtree)."""
    return _share(params, BLOCK_SPLIT, _units(config, vision, t), index)


def top_share(params: dict, config: MLLMConfig, t: int, index: jax.Array) -> dict:
    """Device `index`'s share of the params outside the blocks (blocks are left as they are)."""
    return _share(params, TOP_SPLIT, _units(config, False, t), index)


# ------------------------------------------------------------------ the tp-sharded state
REPLICATED, SPLIT, SHARED, VOCAB = "replicated", "split", "shared", "vocab"
_BLOCK = re.compile(r"^(vision_)?layers_\d+/(.+)$")


def leaf_split(path: str, config: MLLMConfig, t: int) -> tuple[str, int | None, int]:
    """(kind, axis, kv groups) of the params leaf at `path` ("layers_3/attn/k/kernel"): REPLICATED
    (every device holds it), SPLIT (each its own slice along `axis`), SHARED (kv heads fewer than t:
    `groups` = KVH heads, each held by t / KVH consecutive devices) or VOCAB (the vocab windows)."""
    m = _BLOCK.match(path)
    if m is None:
        rule = TOP_SPLIT.get(path)
        return (VOCAB, rule[0], 0) if rule else (REPLICATED, None, 0)
    rule = BLOCK_SPLIT.get(m.group(2))
    if rule is None:
        return REPLICATED, None, 0
    axis, unit = rule
    kvh = config.vision_heads if m.group(1) else config.num_kv_heads
    if unit == "kv_heads" and kvh % t:
        return SHARED, axis, kvh
    return SPLIT, axis, 0


def share_tree(params: dict, config: MLLMConfig, t: int, index: Any) -> dict:
    """Device `index`'s share of a whole params tree (its blocks' and the top leaves' shares)."""
    out = {k: (block_share(v, config, k.startswith("vision_"), t, index) if _BLOCK.match(f"{k}/x") else v)
           for k, v in params.items()}
    return top_share(out, config, t, index)


def _tie(tree: dict, config: MLLMConfig, tp: TensorHooks, prefix: str, skip_blocks: bool) -> dict:
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out[k] = v if skip_blocks and _BLOCK.match(f"{path}/x") else _tie(v, config, tp, path + "/", skip_blocks)
            continue
        kind, _, groups = leaf_split(path, config, tp.size)
        out[k] = (tied_copy(v, tp) if kind == REPLICATED else tied_group_copy(v, tp, groups) if kind == SHARED
                  else v)
    return out


def tie_block(params: dict, config: MLLMConfig, vision: bool, tp: TensorHooks) -> dict:
    """A block's local params with its copies tied (their gradients summed over their holders)."""
    return _tie(params, config, tp, "vision_layers_0/" if vision else "layers_0/", False)


def tie_top(params: dict, config: MLLMConfig, tp: TensorHooks) -> dict:
    """The local params outside the blocks with their copies tied (blocks left as they are)."""
    return _tie(params, config, tp, "", True)


class TensorLayout:
    """The master vector of a run with `t` devices per rank over `num_ranks` ranks (module
    docstring): the same surface as `FlatLayout` for whole params trees (`ravel`, `unravel`,
    `matches`, `record`, `padded` = the master's length, `shard_size` = one device's part) plus
    `local` (the layout of one device's share, what the group program reads) and `count_once`."""

    def __init__(self, config: MLLMConfig, abstract: Any, t: int, num_ranks: int) -> None:
        self.config, self.tensor_parallel, self.num_ranks = config, int(t), int(num_ranks)
        self.whole = FlatLayout.of(abstract, self.tensor_parallel * self.num_ranks)
        self.local = FlatLayout.of(jax.eval_shape(lambda p: share_tree(p, config, t, 0), abstract), self.num_ranks)
        self.treedef, self.shapes, self.dtypes, self.paths = (self.whole.treedef, self.whole.shapes,
                                                              self.whole.dtypes, self.whole.paths)
        self.kinds = tuple(leaf_split(p, config, self.tensor_parallel) for p in self.paths)

    num_shards = property(lambda self: self.tensor_parallel * self.num_ranks)
    size = property(lambda self: self.whole.size)                       # P: the model's parameters
    row = property(lambda self: self.local.padded)                      # L_pad: one device's share
    padded = property(lambda self: self.tensor_parallel * self.local.padded)
    shard_size = property(lambda self: self.local.shard_size)

    def matches(self, params: Any) -> bool:
        return self.whole.matches(params)

    def record(self) -> dict:
        """`FlatLayout.record` of the whole tree, with t and the local layout (a checkpoint of a
        tensor-parallel run restores only with the same t and rank count)."""
        return {**self.whole.record(), "padded": self.padded, "tensor_parallel": self.tensor_parallel,
                "local": self.local.record()}

    def _interleave(self, rows: jax.Array) -> jax.Array:
        """rows[t, L_pad] -> the master vector (device r t + i's part is row i's r-th)."""
        t, r = self.tensor_parallel, self.num_ranks
        return rows.reshape(t, r, self.shard_size).transpose(1, 0, 2).reshape(-1)

    def rows(self, flat: jax.Array) -> jax.Array:
        """The master vector as rows[t, L_pad] (row i: the share of the devices of tp index i)."""
        t, r = self.tensor_parallel, self.num_ranks
        return flat.reshape(r, t, self.shard_size).transpose(1, 0, 2).reshape(t, self.row)

    def ravel(self, params: Any, dtype: Any = jnp.float32) -> jax.Array:
        """A whole params tree as the master vector (traceable)."""
        return self._interleave(jnp.stack([self.local.ravel(share_tree(params, self.config, self.tensor_parallel, i),
                                                            dtype) for i in range(self.tensor_parallel)]))

    def unravel(self, flat: jax.Array) -> Any:
        """The whole params tree of a master vector (traceable): split leaves joined from their
        shares, shared kv heads from one holder each, vocab ids from their owners, replicated
        leaves from tp index 0."""
        t, rows = self.tensor_parallel, self.rows(flat)
        shares = [jax.tree.leaves(self.local.unravel(rows[i])) for i in range(t)]
        vocab = self.config.vocab_size
        vl = -(-vocab // t)
        leaves = []
        for j, (kind, axis, groups) in enumerate(self.kinds):
            if kind == REPLICATED:
                leaves.append(shares[0][j])
            elif kind == SPLIT:
                leaves.append(jnp.concatenate([s[j] for s in shares], axis=axis))
            elif kind == SHARED:
                leaves.append(jnp.concatenate([shares[h * (t // groups)][j] for h in range(groups)], axis=axis))
            else:
                parts = []
                for i in range(t):
                    own, start = i * vl, min(i * vl, vocab - vl)
                    if own < vocab:
                        parts.append(lax.slice_in_dim(shares[i][j], own - start, own - start + min(vl, vocab - own),
                                                      axis=axis))
                leaves.append(jnp.concatenate(parts, axis=axis))
        return jax.tree.unflatten(self.treedef, leaves)

    def count_once(self) -> jax.Array:
        """bool master vector, True on one copy of every parameter (tp index 0's copy of a
        replicated leaf, the first holder's of a shared kv head, the owner's of a vocab id; every
        element of a split leaf) and False on the other copies and the padding: the gradient's
        global norm sums the squares where it is True (traceable)."""
        t, vocab = self.tensor_parallel, self.config.vocab_size
        vl = -(-vocab // t)
        local_leaves = jax.tree.leaves(jax.eval_shape(lambda: self.local.unravel(jnp.zeros((self.row,)))))
        rows = []
        for i in range(t):
            marks = []
            for (kind, axis, groups), leaf in zip(self.kinds, local_leaves):
                if kind == VOCAB:
                    own, start = i * vl, min(i * vl, vocab - vl)
                    ids = start + np.arange(vl)
                    keep = np.expand_dims(ids >= own, 1 - axis)
                    marks.append(jnp.broadcast_to(jnp.asarray(keep), leaf.shape))
                else:
                    keep = (kind == SPLIT or (kind == REPLICATED and i == 0)
                            or (kind == SHARED and i % (t // groups) == 0))
                    marks.append(jnp.full(leaf.shape, keep))
            rows.append(self.local.ravel(jax.tree.unflatten(self.treedef, marks), jnp.bool_))
        return self._interleave(jnp.stack(rows))
