"""Tensor parallelism as the model sees it: the collectives it is handed, and the vocab-parallel ops.

The model never names a mesh. A rank of t devices (Megatron-LM, arXiv 1909.08053, section 3) runs
the model with a `TensorHooks` the executor builds (`dhp_jax.sharding.tensor_parallel.hooks`): the device's
place among the t, and sums / maxima over them. Which parameter is split how, and the slicing of
each device's share, live in `dhp_jax.sharding.tensor_parallel`; the model reads its head counts and widths
off the (local) kernels it is given, so a block's math is the same code at t = 1 and t > 1, with
`TensorHooks.psum` after each row-split output projection (`mllm.block_apply`).

Autodiff: every collective's transpose is its own (a psum's is a psum), so differentiating the
sum over devices of each device's output gives each device the gradient of its own copy of the
params; the executor counts a rank's loss once (on its first device) and the reduction over all
devices sums the copies (`dhp_jax.sharding.tensor_parallel`).

Vocab-parallel (arXiv 1909.08053, section 3): device i owns the ids [i Vl, (i+1) Vl) (the last
share ends at V), Vl = ceil(V / t), and holds the Vl embedding rows and LM-head columns from
`vocab_share(...)[0]` = min(i Vl, V - Vl): the last device's window is moved back to end at V
(no padded copy of the tables), and the ids it holds twice are not its own (masked):
- `vocab_embed`: each device looks up the ids it owns (zero elsewhere); the psum is the lookup.
- `vocab_loss_sum`: cross entropy from the local logits of the ids it owns: the max over devices
  (no gradient), the psum of the local sums of exp, and the target's logit from its owner.

Copies: a parameter every device of a rank holds (a norm, the patch embedding, the projector) or a
kv head several devices share is one parameter with a copy per device. Its gradient is the sum
of the copies' (in fp32): `copy_sum` over the rank, `group_sum` over the devices sharing the head,
the one definition of both sums. `tied_copy` / `tied_group_copy` pass one leaf's copy through
unchanged and apply them in the backward pass (`tied`); a family's block stack applies them to the
columns of its stacked rows that hold copies (`dhp_jax.sharding.tensor_parallel.tie_rows`). So every copy
receives the gradient of the one parameter and the copies stay equal under the optimizer.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class TensorHooks:
    """The tensor-parallel collectives of one rank of `size` devices, bound by the executor:
    `index()` this device's place (0 .. size-1), `psum(x)` / `pmax(x)` over the rank's devices;
    with `sequence`, the block stacks run sequence-parallel (`dhp_jax.model.mllm.block_apply`)."""

    size: int
    index: Callable[[], jax.Array]
    psum: Callable[[jax.Array], jax.Array]
    pmax: Callable[[jax.Array], jax.Array]
    # sequence parallelism (arXiv 2205.05198): between the split matrices each device holds 1/size
    # of the rank's rows; `gather(x)` joins the devices' rows [r, ...] -> [size r, ...] (in device
    # order), `scatter(x)` sums [size r, ...] over the devices and keeps this device's r rows
    sequence: bool = False
    gather: Callable[[jax.Array], jax.Array] | None = None
    scatter: Callable[[jax.Array], jax.Array] | None = None


def vocab_share(vocab: int, t: int, index: Any) -> tuple[Any, Any, int]:
    """(first id held, first id owned, Vl) of device `index` of t: it holds the Vl = ceil(V / t)
    ids from min(index Vl, V - Vl) and owns those from index Vl (up to (index+1) Vl or V). The one
    rule of the windows: a traced `index` (the model, `tp.index()`) gives traced ids, a static one
    (the state's layout, `dhp_jax.sharding.tensor_parallel`) Python ints."""
    vl = -(-vocab // t)
    if isinstance(index, jax.Array):
        own = index * vl
        return jnp.minimum(own, vocab - vl), own, vl
    own = operator.index(index) * vl
    return min(own, vocab - vl), own, vl


def vocab_embed(table: jax.Array, ids: jax.Array, vocab: int, tp: TensorHooks) -> jax.Array:
    """`table_full[ids]` from this device's rows table[Vl, d] of the vocab-split embedding."""
    start, own, vl = vocab_share(vocab, tp.size, tp.index())
    assert table.shape[0] == vl, (table.shape, vl)
    ok = (ids >= own) & (ids < own + vl)
    rows = jnp.take(table, jnp.clip(ids - start, 0, vl - 1), axis=0)
    return tp.psum(jnp.where(ok[:, None], rows, jnp.zeros((), rows.dtype)))


def vocab_loss_sum(logits: jax.Array, targets: jax.Array, weights: jax.Array, vocab: int,
                   tp: TensorHooks) -> jax.Array:
    """`mllm.token_loss_sum` of the full logits from this device's columns logits[S, Vl]
    (`vocab_share`: the columns it holds but does not own are excluded), in fp32."""
    logits = logits.astype(jnp.float32)
    start, own, vl = vocab_share(vocab, tp.size, tp.index())
    assert logits.shape[-1] == vl, (logits.shape, vl)
    cols = start + jnp.arange(vl)
    owned = cols[None, :] >= own
    logits = jnp.where(owned, logits, -jnp.inf)
    m = lax.stop_gradient(tp.pmax(lax.stop_gradient(jnp.max(logits, axis=-1))))
    lse = m + jnp.log(tp.psum(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1)))
    # the target's logit from its owner only (a held, not owned, column is -inf here)
    hit = owned & (cols[None, :] == targets[:, None].astype(jnp.int32))
    picked = tp.psum(jnp.sum(jnp.where(hit, logits, 0.0), axis=-1))
    return jnp.sum((lse - picked) * weights)


def copy_sum(g: jax.Array, tp: TensorHooks) -> jax.Array:
    """The gradient `g` of this device's copy of a parameter every device of the rank holds, summed
    over the rank's copies (in fp32, returned in g's dtype): the gradient of the one parameter."""
    return tp.psum(g.astype(jnp.float32)).astype(g.dtype)


def group_sum(g: jax.Array, tp: TensorHooks, groups: int) -> jax.Array:
    """The gradient `g` of this device's copy of a kv head shared by the `tp.size // groups`
    consecutive devices that read it, summed over those devices' copies (in fp32, returned in g's
    dtype): one psum over the rank of a [groups, ...] array holding each device's copy at its
    head's slot (zero elsewhere), read back at this device's slot."""
    if tp.size % groups:
        raise ValueError(f"{groups} kv head groups do not divide the rank's {tp.size} devices")
    me = tp.index() // (tp.size // groups)
    slots = jnp.zeros((groups,) + g.shape, jnp.float32).at[me].set(g.astype(jnp.float32))
    return tp.psum(slots)[me].astype(g.dtype)


def tied(x: jax.Array, backward: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """`x` unchanged, its cotangent mapped by `backward` in the backward pass (`copy_sum`,
    `group_sum` or a stack's per-column mix of them, `dhp_jax.sharding.tensor_parallel.tie_rows`)."""

    @jax.custom_vjp
    def copy(v):
        return v

    copy.defvjp(lambda v: (v, None), lambda _, g: (backward(g),))
    return copy(x)


def tied_copy(x: jax.Array, tp: TensorHooks) -> jax.Array:
    """`x` (this device's copy of a parameter every device of the rank holds) unchanged; its
    gradient is the sum of every copy's (`copy_sum`)."""
    return tied(x, lambda g: copy_sum(g, tp))


def tied_group_copy(x: jax.Array, tp: TensorHooks, groups: int) -> jax.Array:
    """`x` (this device's copy of a kv head shared by the `tp.size // groups` consecutive devices
    that read it) unchanged; its gradient is the sum over those devices' copies (`group_sum`)."""
    return tied(x, lambda g: group_sum(g, tp, groups))
