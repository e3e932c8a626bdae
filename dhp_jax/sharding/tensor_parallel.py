"""Tensor parallelism inside a rank, engine side: which parameter is split how over the t devices.

With `PlanExecutor(..., tensor_parallel=t)` a rank is t consecutive devices (`RankLayout`), each
group's sub-mesh has a last `tp` axis (`mesh.TP_AXIS`) and every device of a rank runs the same
stream shard (replicated over `tp`) on its share of the params, Megatron-style (Megatron-LM,
arXiv 1909.08053, section 3; the "psum form": the activations between blocks are whole on every
device; with `sequence_parallel` the block stacks carry 1/t of the rows instead, arXiv 2205.05198,
`dhp_jax.model.mllm.split_block`).

The split rule is `BLOCK_SPLIT` (every block of the vision encoder and of the decoder: q/k/v,
gate and up by column, o and down by row, the norms replicated; kv heads split when t divides
KVH, else each device takes the one kv head its query heads read, replicated) and `TOP_SPLIT` (the
embedding by rows and the LM head by columns, vocab-parallel over ceil(V / t) ids per device
(`dhp_jax.model.tensor_parallel.vocab_share`: the last window moved back to end at V, no padded copy); the
patch embedding, the vision and final norms and the projector
replicated). docs/executor.md ("Tensor parallelism inside a rank") states it as the table both
engines follow. That is the stand-in's table; each model gives its own (`split_table`, a
`SplitTable` of `Stack`s): the Hugging Face families' LLM layers by the same rule under
transformers' names (`FAMILY_BLOCK_SPLIT`, `FAMILY_TOP_SPLIT`), the Qwen encoders' blocks with the
fused qkv split by heads inside each of q, k and v (`QWEN_VISION_SPLIT`), InternViT's layers
with their QK-norm over the whole width (`INTERNVIT_SPLIT`).
A head count that no layout allows (H, vision heads, F or the vision MLP width not divisible by
t; kv heads neither a multiple of t nor a divisor of it) is refused by `check` naming the model
and t (`dhp_jax.planner.cost.tensor_parallel.unsplittable`, the rule the planner prices).

The state (`TensorLayout`): each device receives only its share of the params and returns only
its share's gradient. A device's share (its slices of the split leaves, its copies of the
replicated ones) is one local flat vector `row`[L_pad] (`TensorLayout.local`, the same layout on
every device of a rank); the fp32 master vector is the t rows, each sharded over the R = N / t
devices of its tp index: device r t + i holds elements [r L_pad / R, (r+1) L_pad / R) of row i.
So the step's gather is an all-gather over the R devices of each tp index, the reduction a
reduce-scatter over them, and a device holds L_pad (about P / t) params and gradient, not P.

Copies: a leaf every device of a rank holds (norms, patch embedding, projector) is stored t
times, a kv head shared by g devices g times; the group program sums the copies' gradients over
the devices that hold them (`dhp_jax.model.tensor_parallel.copy_sum`, `group_sum`: per leaf with
`tie_block` / `tie_top`, on the copies' columns of a family's stacked block rows with `tie_rows`,
the split columns untouched), so the copies get equal gradients and stay equal under AdamW;
`TensorLayout.count_once` marks one copy of each for the gradient's global norm. The vocab windows overlap on the last device (its ids held
twice are masked, so their gradient there is zero); `unravel` reads every id from its owner
(the windows of `vocab_share`, the model's rule, at static indices).
Each device differentiates the group's loss (counted once per rank, on its device tp = 0)
with respect to its own share: the collectives' transposes bring each device its share's
gradient (`dhp_jax.model.tensor_parallel`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dhp_jax.model.mllm_config import MLLMConfig, split_shape
from dhp_jax.model.tensor_parallel import TensorHooks, copy_sum, group_sum, tied, tied_copy, tied_group_copy, vocab_share
from dhp_jax.planner.cost.tensor_parallel import check_tensor_parallel
from dhp_jax.sharding.flat import FlatLayout
from dhp_jax.sharding.mesh import TP_AXIS

# leaf path inside a block -> (axis split, the unit its columns or rows count)
BLOCK_SPLIT = {"attn/q/kernel": (1, "heads"), "attn/k/kernel": (1, "kv_heads"), "attn/v/kernel": (1, "kv_heads"),
               "attn/o/kernel": (0, "heads"), "mlp/gate/kernel": (1, "mlp"), "mlp/up/kernel": (1, "mlp"),
               "mlp/down/kernel": (0, "mlp")}
# leaf path outside the blocks -> (axis split, unit); every other leaf is replicated
TOP_SPLIT = {"embed/embedding": (0, "vocab"), "lm_head/kernel": (1, "vocab")}

# The Hugging Face families' LLM layers (`dhp_jax.model.hf`, transformers' names): q/k/v and their
# biases by heads, o_proj by row (a bias of it, if any, replicated: added once after the sum), the
# MLP's gate/up by column and down by row; the norms (with Qwen3's per-head q/k norms) replicated.
# The vision encoders' blocks split by each family's `VISION_TP_SPLIT` (its `hf_config` module,
# `dhp_jax.models.<family>`); the projector replicated.
FAMILY_BLOCK_SPLIT = {"self_attn/q_proj/kernel": (1, "heads"), "self_attn/q_proj/bias": (0, "heads"),
                      "self_attn/k_proj/kernel": (1, "kv_heads"), "self_attn/k_proj/bias": (0, "kv_heads"),
                      "self_attn/v_proj/kernel": (1, "kv_heads"), "self_attn/v_proj/bias": (0, "kv_heads"),
                      "self_attn/o_proj/kernel": (0, "heads"), "mlp/gate_proj/kernel": (1, "mlp"),
                      "mlp/up_proj/kernel": (1, "mlp"), "mlp/down_proj/kernel": (0, "mlp")}
FAMILY_TOP_SPLIT = {"model/language_model/embed_tokens/embedding": (0, "vocab"), "lm_head/kernel": (1, "vocab")}
FAMILY_LLM_LAYERS = "model/language_model/layers/"
# A MoE LLM's sparse layers (`dhp_jax.model.hf.moe`): expert parallelism inside the rank, each
# device E / t whole experts (the leading axis of the fused expert weights), the router replicated
MOE_EXPERT_SPLIT = {"mlp/experts/gate_up_proj": (0, "experts"), "mlp/experts/down_proj": (0, "experts")}


@dataclasses.dataclass(frozen=True)
class Stack:
    """A model's stack of identical blocks `prefix0/`, `prefix1/`, ...: which leaf inside a block
    (its path after `prefix<i>/`) is split how (`rules`: path -> (axis, unit)), and the units
    (`units`: unit -> (count, width): the columns or rows of a split axis are `count` units of
    `width` elements; "kv_heads" may be fewer than t, then shared; a third entry `parts`: the axis is
    that many equal parts, each split so, a device taking its slice of every part: a fused qkv)."""

    prefix: str
    rules: Mapping[str, tuple[int, str]]
    units: Mapping[str, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class SplitTable:
    """Which parameter of one model is split how over a rank's t devices: its block stacks
    (`Stack`; a stack with no rules is replicated whole), the leaves outside them (`top`: path ->
    (axis, "vocab"); every other leaf replicated) and the vocabulary size. The stand-in's is
    `BLOCK_SPLIT` / `TOP_SPLIT`, the families' `FAMILY_BLOCK_SPLIT` / `FAMILY_TOP_SPLIT`
    (`split_table`)."""

    name: str
    vocab: int
    stacks: tuple[Stack, ...]
    top: Mapping[str, tuple[int, str]]

    def stack_of(self, path: str) -> tuple[Stack, str] | None:
        """(the stack, the path inside the block) of a leaf path in a block, else None."""
        for s in self.stacks:
            if path.startswith(s.prefix):
                m = re.match(r"^(\d+)/(.+)$", path[len(s.prefix):])
                if m:
                    return s, m.group(2)
        return None

    def in_block(self, subtree_path: str) -> bool:
        """Whether the subtree at `subtree_path` is one block of a stack (or inside one)."""
        return self.stack_of(f"{subtree_path}/x") is not None

    def rule(self, path: str, t: int) -> tuple[str, int | None, int, int, Callable[[Any], Any]]:
        """(kind, axis, groups, elements per device along the axis, device index -> its first
        element) of the leaf at `path`: kind REPLICATED (every device holds it; axis None), SPLIT
        (each its own slice), FUSED (`groups` parts, each device its slice of every part), SHARED
        (kv heads fewer than t: `groups` = KVH heads, each held by t / KVH consecutive devices) or
        VOCAB (the vocab windows, `vocab_share`)."""
        found = self.stack_of(path)
        if found is None:
            rule = self.top.get(path)
            if rule is None:
                return REPLICATED, None, 0, 0, lambda i: 0
            return VOCAB, rule[0], 0, vocab_share(self.vocab, t, 0)[2], lambda i: vocab_share(self.vocab, t, i)[0]
        stack, inner = found
        rule = stack.rules.get(inner)
        if rule is None:
            return REPLICATED, None, 0, 0, lambda i: 0
        axis, unit = rule
        n, width, *parts = stack.units[unit]
        if parts and parts[0] > 1:
            assert n % t == 0, (path, n, t)
            return FUSED, axis, parts[0], n // t * width, lambda i: i * (n // t) * width
        if n % t == 0:
            return SPLIT, axis, 0, n // t * width, lambda i: i * (n // t) * width
        assert unit == "kv_heads" and t % n == 0, (path, n, t)
        return SHARED, axis, n, width, lambda i: i // (t // n) * width


def _stand_in_table(config: MLLMConfig) -> SplitTable:
    c = config
    llm = {"heads": (c.num_heads, c.head_dim), "kv_heads": (c.num_kv_heads, c.head_dim), "mlp": (c.d_ff, 1)}
    vis = {"heads": (c.vision_heads, c.vision_head_dim), "kv_heads": (c.vision_heads, c.vision_head_dim),
           "mlp": (c.vision_ff, 1)}
    return SplitTable(c.name, c.vocab_size,
                      (Stack("vision_layers_", BLOCK_SPLIT, vis), Stack("layers_", BLOCK_SPLIT, llm)), TOP_SPLIT)


def _family_table(config: Any) -> SplitTable:
    from dhp_jax.model.hf.scan import block_stacks
    s = config.text.shape
    units = {"heads": (s.num_heads, s.head_dim), "kv_heads": (s.num_kv_heads, s.head_dim),
             "mlp": (_family_intermediate(config), 1)}
    vision = block_stacks(config)[0][0]
    v = config.vision
    hd = v.hidden_size // v.num_heads
    vunits = {"heads": (v.num_heads, hd), "qkv": (v.num_heads, hd, 3), "mlp": (_vision_intermediate(config), 1)}
    from dhp_jax.model.hf.families import hf_module
    encoder = Stack("/".join(vision) + "/", hf_module(config.family).VISION_TP_SPLIT, vunits)
    rules = FAMILY_BLOCK_SPLIT
    if config.text.moe is not None:     # a MoE LLM's sparse layers: experts split, router replicated
        rules = {**rules, **MOE_EXPERT_SPLIT}
        units["experts"] = (config.text.moe.num_experts, 1)
    return SplitTable(config.name, config.vocab_size, (encoder, Stack(FAMILY_LLM_LAYERS, rules, units)),
                      FAMILY_TOP_SPLIT)


def _family_intermediate(config: Any) -> int:
    return int(config.fields["text_config"]["intermediate_size"])


def _vision_intermediate(config: Any) -> int:
    return int(config.fields["vision_config"]["intermediate_size"])


def split_table(config: Any) -> SplitTable:
    """The split table of a model: the stand-in's (`MLLMConfig`) or a Hugging Face family's."""
    if isinstance(config, MLLMConfig):
        return _stand_in_table(config)
    if hasattr(config, "family"):
        return _family_table(config)
    raise TypeError(f"no tensor-parallel split table for a {type(config).__name__}")


def check(config: Any, t: int) -> None:
    """ValueError naming the model, the field and t unless every split of the table is even (a
    family: its LLM's heads, kv heads and MLP width, its encoder's heads and MLP width)."""
    if isinstance(config, MLLMConfig):
        check_tensor_parallel(split_shape(config), t, f"model {config.name!r}")
        return
    s = config.text.shape
    shape = types.SimpleNamespace(heads=s.num_heads, kv_heads=s.num_kv_heads,
                                  intermediate=_family_intermediate(config), vision_heads=config.vision.num_heads,
                                  vision_intermediate=_vision_intermediate(config))
    check_tensor_parallel(shape, t, f"model {config.name!r} ({config.family} family)")
    moe = config.text.moe
    if moe is not None and any(moe.sparse) and moe.num_experts % t:
        raise ValueError(f"model {config.name!r} ({config.family} family): tensor_parallel {t} cannot split "
                         f"text_config.num_experts = {moe.num_experts} (each device holds num_experts / t experts)")


def hooks(t: int, sequence: bool = False) -> TensorHooks:
    """The model's tensor-parallel collectives over the `tp` axis of a group's sub-mesh
    (`sequence`: the block stacks sequence-parallel, with the all-gather and reduce-scatter of rows)."""
    return TensorHooks(t, lambda: lax.axis_index(TP_AXIS), functools.partial(lax.psum, axis_name=TP_AXIS),
                       functools.partial(lax.pmax, axis_name=TP_AXIS), sequence,
                       functools.partial(lax.all_gather, axis_name=TP_AXIS, axis=0, tiled=True),
                       functools.partial(lax.psum_scatter, axis_name=TP_AXIS, scatter_dimension=0, tiled=True))


def _share(tree: dict, table: SplitTable, t: int, index: Any, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out[k] = _share(v, table, t, index, path + "/")
            continue
        kind, axis, parts, size, start = table.rule(path, t)
        out[k] = v if kind == REPLICATED else _take(v, axis, start(index), size, parts if kind == FUSED else 1)
    return out


def _take(v: jax.Array, axis: int, start: Any, size: int, parts: int = 1) -> jax.Array:
    """v's elements [start, start + size) along `axis`, or of each of its `parts` equal parts."""
    if parts == 1:
        return lax.dynamic_slice_in_dim(v, start, size, axis)
    sh = v.shape
    w = lax.dynamic_slice_in_dim(v.reshape(sh[:axis] + (parts, sh[axis] // parts) + sh[axis + 1:]), start, size,
                                 axis + 1)
    return w.reshape(sh[:axis] + (parts * size,) + sh[axis + 1:])


# ------------------------------------------------------------------ the tp-sharded state
REPLICATED, SPLIT, SHARED, VOCAB, FUSED = "replicated", "split", "shared", "vocab", "fused"


def share_tree(params: dict, config: Any, t: int, index: Any) -> dict:
    """Device `index`'s share of a whole params tree (its blocks' and the top leaves' shares)."""
    return _share(params, split_table(config), t, index)


def table_of(model: Any) -> SplitTable:
    """`model` itself if it is a `SplitTable` (`TensorLayout.table`: built once per layout), else
    its `split_table`."""
    return model if isinstance(model, SplitTable) else split_table(model)


def _tie(tree: dict, table: SplitTable, tp: TensorHooks, prefix: str, skip_blocks: bool) -> dict:
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out[k] = v if skip_blocks and table.in_block(path) else _tie(v, table, tp, path + "/", skip_blocks)
            continue
        kind, _, groups = table.rule(path, tp.size)[:3]
        out[k] = (tied_copy(v, tp) if kind == REPLICATED else tied_group_copy(v, tp, groups) if kind == SHARED
                  else v)
    return out


def tie_block(params: dict, model: Any, vision: bool, tp: TensorHooks) -> dict:
    """A block's local params with its copies tied (their gradients summed over their holders);
    `model`: the model's `SplitTable` (`TensorLayout.table`) or its config."""
    return _tie(params, table_of(model), tp, "vision_layers_0/" if vision else "layers_0/", False)


def tie_top(params: dict, model: Any, tp: TensorHooks) -> dict:
    """The local params outside the blocks with their copies tied (blocks left as they are);
    `model`: the model's `SplitTable` (`TensorLayout.table`) or its config."""
    return _tie(params, table_of(model), tp, "", True)


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Column spans (start, end) with the adjacent ones merged, in order."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _sum_columns(g: jax.Array, spans: list[tuple[int, int]], total: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """g[count, n] with its columns `spans` replaced by `total` of them (taken together, one
    collective), the other columns left as they are (no copy of them in another dtype). A 2-byte
    g is sliced and updated as its unsigned-integer bits: XLA:CPU widens a bf16 slice or update of
    the whole array to fp32 first."""
    bits = jnp.dtype(g.dtype).itemsize == 2
    view = lax.bitcast_convert_type(g, jnp.uint16) if bits else g
    cols = [view[:, a:b] for a, b in spans]
    segs = jnp.concatenate(cols, axis=1) if len(cols) > 1 else cols[0]
    summed = total(lax.bitcast_convert_type(segs, g.dtype) if bits else segs)
    summed = lax.bitcast_convert_type(summed, jnp.uint16) if bits else summed
    pos = 0
    for a, b in spans:
        view = lax.dynamic_update_slice_in_dim(view, summed[:, pos:pos + b - a], a, axis=1)
        pos += b - a
    return lax.bitcast_convert_type(view, g.dtype) if bits else view


def tie_rows(rows: jax.Array, model: Any, prefix: str, leaves: Sequence[tuple[tuple[str, ...], int, Any]],
             tp: TensorHooks) -> jax.Array:
    """A block stack's local rows[count, n] (`FlatLayout.block_leaves` `leaves`: keys inside the
    block, offset in the row, shape) unchanged, with its copies tied in the backward pass as
    `tie_block` ties a block's leaves (`model`: the `SplitTable` or the config): the gradient
    columns of the replicated leaves summed over the rank (`copy_sum`, one psum of those columns),
    of the shared kv heads over their holders (`group_sum`), the split leaves' columns left as they
    are (a stack the table does not split at all is summed whole, one psum)."""
    table = table_of(model)
    copies: list[tuple[int, int]] = []
    shared: dict[int, list[tuple[int, int]]] = {}
    for keys, off, shape in leaves:
        kind, _, groups = table.rule(f"{prefix}0/{'/'.join(keys)}", tp.size)[:3]
        span = (off, off + int(np.prod(shape)))
        if kind == REPLICATED:
            copies.append(span)
        elif kind == SHARED:
            shared.setdefault(groups, []).append(span)
    if not copies and not shared:
        return rows
    if not shared and _runs(copies) == [(0, rows.shape[1])]:
        return tied(rows, lambda g: copy_sum(g, tp))

    def backward(g):
        if copies:
            g = _sum_columns(g, _runs(copies), lambda x: copy_sum(x, tp))
        for groups, spans in sorted(shared.items()):
            g = _sum_columns(g, _runs(spans), lambda x, k=groups: group_sum(x, tp, k))
        return g

    return tied(rows, backward)


class TensorLayout:
    """The master vector of a run with `t` devices per rank over `num_ranks` ranks (module
    docstring): the same surface as `FlatLayout` for whole params trees (`ravel`, `unravel`,
    `matches`, `record`, `padded` = the master's length, `shard_size` = one device's part) plus
    `local` (the layout of one device's share, what the group program reads) and `count_once`."""

    def __init__(self, config: MLLMConfig, abstract: Any, t: int, num_ranks: int) -> None:
        self.config, self.tensor_parallel, self.num_ranks = config, int(t), int(num_ranks)
        self.table = split_table(config)
        self.whole = FlatLayout.of(abstract, self.tensor_parallel * self.num_ranks)
        self.local = FlatLayout.of(jax.eval_shape(lambda p: share_tree(p, config, t, 0), abstract), self.num_ranks)
        self.treedef, self.shapes, self.dtypes, self.paths = (self.whole.treedef, self.whole.shapes,
                                                              self.whole.dtypes, self.whole.paths)
        self.kinds = tuple(self.table.rule(p, self.tensor_parallel)[:3] for p in self.paths)

    num_shards = property(lambda self: self.tensor_parallel * self.num_ranks)
    size = property(lambda self: self.whole.size)                       # P: the model's parameters
    row = property(lambda self: self.local.padded)                      # L_pad: one device's share
    padded = property(lambda self: self.tensor_parallel * self.local.padded)
    shard_size = property(lambda self: self.local.shard_size)

    def matches(self, params: Any) -> bool:
        return self.whole.matches(params)

    def record(self) -> dict:
        """`FlatLayout.record` of the whole tree, with t, the local layout and how each leaf is
        split (`split`: [path, kind, axis, groups] in the whole tree's flat order; `vocab`: V), so
        that a reader without the model config (`npu_backend.relayout.unravel_record`, the
        torch backend) joins the whole tree again. A checkpoint restores at any t and device count
        (`dhp_jax.train.checkpoint`)."""
        split = [[self.paths[i], *self.kinds[i]] for i in self.whole.order]
        return {**self.whole.record(), "padded": self.padded, "tensor_parallel": self.tensor_parallel,
                "local": self.local.record(), "split": split, "vocab": self.table.vocab}

    def read_copy(self, kind: str, groups: int, i: int) -> int:
        """The tp index whose copy of a leaf stands for tp index i's: index 0's for a replicated
        leaf, the first holder's of i's kv heads for a shared one (t / groups devices hold each),
        i's own for split and fused leaves. The one rule behind `unravel` (which copy it reads),
        `count_once` (which copy the norm counts) and `copy_spread` (which copies must equal it);
        vocab windows follow their owners (`vocab_share`)."""
        if kind == REPLICATED:
            return 0
        if kind == SHARED:
            return i - i % (self.tensor_parallel // groups)
        return i

    def copy_spread(self, flat: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(spread, scale), float32[leaves] in `jax.tree.leaves` order, of a master-shaped vector
        (params or an AdamW moment; traceable): `spread` the largest difference between a copy of a
        replicated leaf or shared kv head and the copy `unravel` reads (0 for split leaves and the
        vocab windows, whose overlapping ids on the last device are masked and drift apart),
        `scale` the largest magnitude of the leaf. Copies get summed gradients, so they stay equal
        under AdamW; a checkpoint converted to another t is checked with this."""
        t, rows = self.tensor_parallel, self.rows(flat)
        shares = [jax.tree.leaves(self.local.unravel(rows[i])) for i in range(t)]
        spread, scale = [], []
        for j, (kind, _, groups) in enumerate(self.kinds):
            held = [jnp.max(jnp.abs(s[j]), initial=0.0) for s in shares]
            scale.append(functools.reduce(jnp.maximum, held))
            if kind not in (REPLICATED, SHARED):
                spread.append(jnp.zeros((), flat.dtype))
                continue
            diffs = [jnp.max(jnp.abs(shares[i][j] - shares[self.read_copy(kind, groups, i)][j]), initial=0.0)
                     for i in range(t)]
            spread.append(functools.reduce(jnp.maximum, diffs))
        return jnp.stack(spread), jnp.stack(scale)

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
        vocab = self.table.vocab
        leaves = []
        for j, (kind, axis, groups) in enumerate(self.kinds):
            if kind == REPLICATED:
                leaves.append(shares[self.read_copy(kind, groups, 0)][j])
            elif kind == SPLIT:
                leaves.append(jnp.concatenate([s[j] for s in shares], axis=axis))
            elif kind == SHARED:          # one holder per kv head group, in head order
                holders = sorted({self.read_copy(kind, groups, i) for i in range(t)})
                leaves.append(jnp.concatenate([shares[h][j] for h in holders], axis=axis))
            elif kind == FUSED:
                sh = shares[0][j].shape
                parts = [s[j].reshape(sh[:axis] + (groups, sh[axis] // groups) + sh[axis + 1:]) for s in shares]
                whole = jnp.concatenate(parts, axis=axis + 1)
                leaves.append(whole.reshape(sh[:axis] + (t * sh[axis],) + sh[axis + 1:]))
            else:
                parts = []
                for i in range(t):
                    start, own, vl = vocab_share(vocab, t, i)
                    if own < vocab:         # its owned ids: [own, min(own + Vl, V)) of the window from start
                        parts.append(lax.slice_in_dim(shares[i][j], own - start, min(own + vl, vocab) - start,
                                                      axis=axis))
                leaves.append(jnp.concatenate(parts, axis=axis))
        return jax.tree.unflatten(self.treedef, leaves)

    def count_once(self) -> jax.Array:
        """bool master vector, True on one copy of every parameter (tp index 0's copy of a
        replicated leaf, the first holder's of a shared kv head, the owner's of a vocab id; every
        element of a split leaf) and False on the other copies and the padding: the gradient's
        global norm sums the squares where it is True (traceable)."""
        t, vocab = self.tensor_parallel, self.table.vocab
        local_leaves = jax.tree.leaves(jax.eval_shape(lambda: self.local.unravel(jnp.zeros((self.row,)))))
        rows = []
        for i in range(t):
            marks = []
            for (kind, axis, groups), leaf in zip(self.kinds, local_leaves):
                if kind == VOCAB:
                    start, own, vl = vocab_share(vocab, t, i)
                    ids = start + np.arange(vl)
                    keep = np.expand_dims(ids >= own, 1 - axis)
                    marks.append(jnp.broadcast_to(jnp.asarray(keep), leaf.shape))
                else:
                    keep = self.read_copy(kind, groups, i) == i
                    marks.append(jnp.full(leaf.shape, keep))
            rows.append(self.local.ravel(jax.tree.unflatten(self.treedef, marks), jnp.bool_))
        return self._interleave(jnp.stack(rows))


def layout_for_record(model: Any, layout: Any, t_now: int, record: Mapping[str, Any]) -> Any:
    """The layout of `model` (an executor's model adapter, whose bound `layout` runs at t = `t_now`)
    for a layout record's t and device count (`record["tensor_parallel"]`, 1 if absent, and
    `record["num_shards"]` devices): `layout` itself when they are its, else the layout a run there
    has (`PlanExecutor.layout_for`)."""
    t, n = int(record.get("tensor_parallel", 1)), int(record["num_shards"])
    if (t, n) == (t_now, layout.num_shards):
        return layout
    if t < 1 or n % t:
        raise ValueError(f"a layout record of tensor_parallel={t} on {n} devices (not a multiple of t)")
    abstract = jax.tree.unflatten(layout.treedef, [jax.ShapeDtypeStruct(s, d) for s, d in
                                                   zip(layout.shapes, layout.dtypes)])
    if t == 1:
        return FlatLayout.of(abstract, n)
    model.check_tensor_parallel(t)
    return TensorLayout(model.config, abstract, t, n // t)
