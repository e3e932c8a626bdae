"""The train state and its update: optax AdamW with warm-up + cosine and clipping, created sharded.

The state (params, optimizer state, step, PRNG key) is created directly with the sharding it lives
in and the update is one jit over the full mesh that donates the old state, so a step holds one
copy of it. The trainer's state is sharded over the full mesh: params are the fp32 master vector
`PlanExecutor.layout` lays out, and AdamW's moments follow it, so each rank holds 1/N of
params + moments and the update runs on the shards (`PlanExecutor.state_sharding`). `sharding`
arguments below are one `Sharding` for every leaf or a function leaf -> `Sharding`.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import flax.struct
import jax
import jax.numpy as jnp
import optax

from dhp_jax.train.train_config import OptimConfig


ShardingSpec = Union[jax.sharding.Sharding, Callable[[Any], jax.sharding.Sharding]]


def _per_leaf(sharding: ShardingSpec, tree: Any) -> Any:
    """The sharding of every leaf of `tree` (a state or its abstract shapes)."""
    fn = sharding if callable(sharding) and not isinstance(sharding, jax.sharding.Sharding) else (lambda _: sharding)
    return jax.tree.map(fn, tree)


@flax.struct.dataclass
class TrainState:
    step: jax.Array          # int32[], steps taken
    params: Any
    opt_state: Any
    rng: jax.Array           # key of the run; a step's randomness is fold_in(rng, step)


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up to the peak, then cosine decay to peak * end_lr_ratio at `total_steps`."""
    warmup = max(0, min(cfg.warmup_steps, total_steps))
    decay = max(1, total_steps - warmup)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.learning_rate, peak_value=cfg.learning_rate,
        warmup_steps=warmup, decay_steps=warmup + decay, end_value=cfg.learning_rate * cfg.end_lr_ratio)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm` that takes the norm as `grad_norm=` when its caller knows it
    (a tensor-parallel state holds copies of some parameters: `make_update` counts each once);
    otherwise the norm of all the updates. Its state is optax's `EmptyState`, like optax's."""

    def update(updates, state, params=None, *, grad_norm=None, **extra):
        del params, extra
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        ok = norm < max_norm
        return jax.tree.map(lambda u: jnp.where(ok, u, (u / norm.astype(u.dtype)) * max_norm), updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    return optax.chain(
        clip_by_global_norm(cfg.clip_norm),
        optax.adamw(make_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


def make_init(init_params: Callable[[jax.Array], Any], optimizer: optax.GradientTransformation,
              sharding: ShardingSpec) -> Callable[[jax.Array], TrainState]:
    """`init(key) -> TrainState`, jitted with every leaf's output sharding fixed by `sharding`.

    The key is split once into named streams: "params" for initialisation, "train" kept in the
    state for anything random during training.
    """

    def init(key: jax.Array) -> TrainState:
        k_params, k_train = jax.random.split(key)
        params = init_params(k_params)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                          rng=k_train)

    abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
    return jax.jit(init, out_shardings=_per_leaf(sharding, abstract))


def create_state(init_params: Callable[[jax.Array], Any], optimizer: optax.GradientTransformation,
                 seed: int, sharding: ShardingSpec) -> TrainState:
    """Initialise the state already placed with `sharding` (no host copy, no later re-shard)."""
    return make_init(init_params, optimizer, sharding)(jax.random.PRNGKey(seed))


def state_shardings(state: TrainState, sharding: ShardingSpec) -> TrainState:
    return _per_leaf(sharding, state)


def make_update(optimizer: optax.GradientTransformation, sharding: ShardingSpec,
                state_like: TrainState, count_once: jax.Array | None = None
                ) -> Callable[[TrainState, Any], tuple[TrainState, jax.Array]]:
    """`update(state, grads) -> (new_state, grad_norm)`, jitted over the full mesh, state donated;
    grads are sharded like the params (on the shards, AdamW is elementwise and the global norm
    for clipping is one small all-reduce). `count_once` (a bool vector shaped and sharded like
    the params, `PlanExecutor.norm_weights`): the params hold copies of some parameters, and the
    global norm (reported and clipped to) sums the squares where it is True only."""

    def update(state: TrainState, grads: Any, once: Any = None) -> tuple[TrainState, jax.Array]:
        if once is None:
            grad_norm = optax.tree.norm(grads)
        else:
            grad_norm = jnp.sqrt(jnp.sum(jnp.where(once, jnp.square(grads), 0.0)))
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params, grad_norm=grad_norm)
        params = optax.apply_updates(state.params, updates)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), grad_norm

    shardings = state_shardings(state_like, sharding)
    if count_once is None:          # the jitted function itself (`dhp bench memory --step` lowers it)
        return jax.jit(update, in_shardings=(shardings, shardings.params), out_shardings=(shardings, None),
                       donate_argnums=(0,))
    step = jax.jit(update, in_shardings=(shardings, shardings.params, shardings.params),
                   out_shardings=(shardings, None), donate_argnums=(0,))
    return lambda state, grads: step(state, grads, count_once)
