"""Tensor parallelism inside a rank, engine side: which parameter is split how over the t devices.

With `PlanExecutor(..., tensor_parallel=t)` a rank is t consecutive devices (`RankLayout`), each
group's sub-mesh has a last `tp` axis (`mesh.TP_AXIS`) and every device of a rank runs the same
stream shard (replicated over `tp`) on its share of the params, Megatron-style (Megatron-LM,
arXiv 1909.08053, section 3; the "psum form": the activations between blocks are whole on every
device, sequence-parallel norms (arXiv 2205.05198) are not done here).

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

Gradients: each device differentiates the group's loss (counted once per rank, on its device
tp = 0) with respect to its copy of the whole flat params; its shares' gradients land at their
places (zeros elsewhere) and replicated leaves get its copy's part. The step's reduce-scatter
over all devices sums the copies: the exact gradient. Each device still receives the whole
gathered params and returns a whole gradient row, as at t = 1 (the state stays sharded over all
devices, 1/N each).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax

from dhp_jax.model.config import MLLMConfig, split_shape
from dhp_jax.model.tensor import TensorHooks, vocab_share
from dhp_jax.planner.cost.tensor import check_tensor_parallel
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


def hooks(t: int) -> TensorHooks:
    """The model's tensor-parallel collectives over the `tp` axis of a group's sub-mesh."""
    return TensorHooks(t, lambda: lax.axis_index(TP_AXIS), functools.partial(lax.psum, axis_name=TP_AXIS),
                       functools.partial(lax.pmax, axis_name=TP_AXIS))


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
