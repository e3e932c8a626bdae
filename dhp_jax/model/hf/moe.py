"""The sparse mixture-of-experts block of the MoE LLMs (transformers' `Qwen3MoeSparseMoeBlock`,
`Qwen3VLMoeTextSparseMoeBlock`; `MoeSpec` in `dhp_jax.model.hf.spec`), its load-balancing loss
and the experts' published checkpoint layouts.

Routing: logits = z @ gate [S, E]; probabilities = softmax(logits) in fp32; each token goes to
its `top_k` experts of highest probability with weights those probabilities (divided by their sum
when `norm_topk_prob`). Dropless: every token reaches all k of its experts (no capacity factor).

Experts: the S * k (token, expert) pairs are sorted by expert (a stable sort, static shape
[S * k]) and each expert's rows are one group of a grouped GEMM: rows x @ gate_up[e] ->
act(gate) * up -> @ down[e], scaled by the routing weight and summed back onto their tokens.
Expert parallelism inside a rank: a device holds experts [r E/t, (r+1) E/t) (the leading axis of
`experts.*` split over the rank's t devices, `dhp_jax.sharding.tensor_parallel`); the pairs routed
to other devices' experts are sorted after its own and fall outside every group, so the device's
output is the sum over its experts only and the rank's sum over its devices (the row-split
collective of the dense MLP: a psum, or the reduce-scatter under sequence parallelism) is the
whole block's output.

The grouped GEMM has two formulations, equal in value and gradient, chosen when the block is
traced (`grouped_gemm_kind`):
- "ragged": `jax.lax.ragged_dot` over the S * k sorted rows. jax registers a lowering of its
  primitive to XLA's `chlo.ragged_dot` instruction for the "tpu" and "gpu" platforms only
  (`jax/_src/lax/lax.py`, the `register_lowering` calls of `ragged_dot_general_p`); on every other
  platform, XLA:CPU included, it lowers through `_ragged_dot_general_impl`, which masks the rows
  into a dense [groups, rows, width] copy per GEMM (and per cotangent in the backward pass): a
  program holding E_l x S x k rows where the routed rows are S x k.
- "blocks" (`block_dot`): each expert's sorted rows start at a multiple of a block of B rows
  (`block_layout`), a static count of blocks covers any routing, and a `lax.scan` over the blocks
  multiplies each block by its expert's weights (taken by dynamic index); its backward pass is a
  scan too, accumulating each block's weight gradient into its expert's slice. The program holds
  the padded rows only: at most S * k (1 + 1 / BLOCKS_PER_EXPERT) (`padded_rows`).
The rule: a run executes "ragged" on every platform; the memory measurements of XLA:CPU programs
(`dhp_jax.sharding.family_memory.memory_analysis`, `dhp bench memory --families`,
`experiments/moe_fit_check.py`) compile "blocks" (`grouped_gemm("blocks")`), which holds what an
accelerator's native grouped GEMM holds (the routed rows), where XLA:CPU's "ragged" would hold the
dense copies. Runs on CPU devices do not execute "blocks": XLA:CPU's thunk runtime can run a
collective inside a conditional (the pad-skipping chunks under sequence parallelism) concurrently
with another collective of the same program, and with the blocks' scans in the program the two
devices of a rank were seen to enter them in different orders and wait on each other. The
environment variable `DHP_GROUPED_GEMM` ("ragged" or "blocks") overrides both (the tests compare
the two forms on CPU devices).

Parameters of a sparse layer (transformers' `state_dict()`): `mlp.gate.weight` [E, d] (the tree's
`gate.kernel` [d, E]), `mlp.experts.gate_up_proj` [E, 2 I, d] (gate rows, then up rows) and
`mlp.experts.down_proj` [E, d, I], kept in the tree as stored.

Router statistics (`stats` [2, E] fp32 per layer): the number of the live tokens' (token,
expert) pairs routed to each expert, and each expert's summed router probability over the live
tokens: what transformers' `load_balancing_loss_func` accumulates over the layers
(`aux_loss`), and the per-step tokens-per-expert figures of the metrics.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from dhp_jax.model.hf import expert_layouts as xl
from dhp_jax.model.hf.spec import MoeSpec, default_router_aux_loss_coef

Params = Mapping[str, Any]


def route(gate: Params, z: jax.Array, moe: MoeSpec) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(probabilities [S, E] fp32, top-k expert ids [S, k], their weights [S, k] in z's dtype)."""
    logits = z @ gate["kernel"]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(probs, moe.top_k)
    if moe.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return probs, ids, top.astype(logits.dtype)


def grouped_experts(experts: Params, z: jax.Array, ids: jax.Array, weights: jax.Array, act: Callable,
                    first: Any = 0) -> jax.Array:
    """sum over each token's k experts held here of weight * expert(z) [S, d]. `experts` holds
    the E_l experts first .. first + E_l - 1 (`gate_up_proj` [E_l, 2 I, d], `down_proj` [E_l, d,
    I]); pairs routed elsewhere contribute nothing. Static shapes: S * k rows, sorted by expert,
    multiplied by `grouped_gemm_kind`'s grouped GEMM."""
    gate_up, down = experts["gate_up_proj"], experts["down_proj"]
    local, inter = gate_up.shape[0], down.shape[-1]
    s, k = ids.shape
    e = ids.reshape(-1) - first
    key = jnp.where((e >= 0) & (e < local), e, local)          # other devices' experts sort last
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=local + 1)[:local].astype(jnp.int32)
    if grouped_gemm_kind() == "ragged":
        token = order // k
        rows = jnp.take(z, token, axis=0)                       # [S k, d]
        h = jax.lax.ragged_dot(rows, jnp.swapaxes(gate_up, 1, 2), sizes)
        y = jax.lax.ragged_dot(act(h[:, :inter], h[:, inter:]), jnp.swapaxes(down, 1, 2), sizes)
        w = jnp.take(weights.reshape(-1), order)
        return jnp.zeros_like(z).at[token].add(y * w[:, None].astype(y.dtype))
    source, group = block_layout(sizes, s * k)
    live = source >= 0
    pair = jnp.take(order, jnp.maximum(source, 0))              # the (token, expert) pair of each slot
    token = jnp.where(live, pair // k, s)                       # a padding slot: past the rows, so it
    rows = jnp.take(z, token, axis=0, mode="fill", fill_value=0)  # reads zeros [P, d] (no mask kept)
    h = block_dot(rows, gate_up, group)
    y = block_dot(act(h[:, :inter], h[:, inter:]), down, group)
    w = jnp.where(live, jnp.take(weights.reshape(-1), pair), jnp.zeros((), weights.dtype))
    return jnp.zeros_like(z).at[token].add(y * w[:, None].astype(y.dtype), mode="drop")   # and adds nothing


# --- the grouped GEMM ("ragged" or "blocks", `grouped_gemm_kind`) -----------------------------

GROUPED_GEMM_ENV = "DHP_GROUPED_GEMM"
GROUPED_GEMMS = ("ragged", "blocks")
BLOCKS_PER_EXPERT = 16                  # the block size keeps a group's padding under rows / this / groups


_FORCED: list[str] = []


@contextlib.contextmanager
def grouped_gemm(kind: str) -> Iterator[None]:
    """Within the block, MoE blocks traced use the grouped GEMM `kind` ("ragged" or "blocks")
    unless `DHP_GROUPED_GEMM` is set."""
    if kind not in GROUPED_GEMMS:
        raise ValueError(f"grouped GEMM {kind!r} is not one of {GROUPED_GEMMS}")
    _FORCED.append(kind)
    try:
        yield
    finally:
        _FORCED.pop()


def grouped_gemm_kind() -> str:
    """The grouped GEMM a trace uses: `DHP_GROUPED_GEMM` ("ragged" or "blocks") when set, else the
    innermost `grouped_gemm` block's, else "ragged" (the module docstring's rule)."""
    kind = os.environ.get(GROUPED_GEMM_ENV, "")
    if kind and kind not in GROUPED_GEMMS:
        raise ValueError(f"environment variable {GROUPED_GEMM_ENV}={kind!r} is not one of {GROUPED_GEMMS}")
    return kind or (_FORCED[-1] if _FORCED else "ragged")


def block_rows(rows: int, groups: int) -> int:
    """The block size B of `block_layout` for `rows` sorted rows over `groups` groups: the largest
    B with groups x B <= rows / BLOCKS_PER_EXPERT, at least 1 (B = 1: no padding at all)."""
    return max(1, rows // (BLOCKS_PER_EXPERT * max(1, groups)))


def padded_rows(rows: int, groups: int) -> int:
    """Static row count P of `block_layout`: the whole blocks that any split of `rows` rows over
    `groups` groups fills, each group's rows rounded up to a whole block (P < rows + groups x B <=
    rows (1 + 1 / BLOCKS_PER_EXPERT))."""
    b = block_rows(rows, groups)
    return (rows + groups * (b - 1)) // b * b


def block_layout(sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """(source [P] int: the sorted row each padded slot holds, -1 for a padding slot; group [P / B]
    int: the group of each block of B = `block_rows` slots) of `rows` rows sorted by group, `sizes`
    [G] the rows of each group (their sum at most `rows`; the rows after them are in no group and
    in no slot). Group g's rows fill whole blocks from its first; blocks past the last group's
    are padding of group G - 1."""
    groups = sizes.shape[0]
    b = block_rows(rows, groups)
    slots = padded_rows(rows, groups)
    blocks = (sizes + b - 1) // b                              # blocks of each group
    block_end = jnp.cumsum(blocks)
    group = jnp.minimum(jnp.searchsorted(block_end, jnp.arange(slots // b), side="right"), groups - 1)
    slot = jnp.arange(slots)
    g = jnp.repeat(group, b)                                   # group of each slot
    offset = slot - (block_end - blocks)[g] * b                # slot's row within its group
    first_row = jnp.cumsum(sizes) - sizes
    live = (offset < sizes[g]) & (slot < block_end[-1] * b)
    return jnp.where(live, first_row[g] + offset, -1).astype(jnp.int32), group.astype(jnp.int32)


def _blocks(x: jax.Array, group: jax.Array) -> jax.Array:
    return x.reshape(group.shape[0], x.shape[0] // group.shape[0], x.shape[1])


@jax.custom_vjp
def block_dot(x: jax.Array, w: jax.Array, group: jax.Array) -> jax.Array:
    """[P, out]: each block n of B = P / N rows of x [P, in] times w[group[n]] transposed (w [G,
    out, in], the experts' stored layout; group [N] int), one block at a time (`lax.scan`), so that
    nothing but the rows and one expert's weights is live."""
    def step(_, block):
        xb, g = block
        wg = jax.lax.dynamic_index_in_dim(w, g, 0, keepdims=False)
        return None, jax.lax.dot_general(xb, wg, (((1,), (1,)), ((), ())))
    _, out = jax.lax.scan(step, None, (_blocks(x, group), group))
    return out.reshape(x.shape[0], w.shape[1])


def _block_dot_fwd(x, w, group):
    return block_dot(x, w, group), (x, w, group)


def _block_dot_bwd(res, dy):
    """x's cotangent block by block (dy_n @ w[g_n]) and w's accumulated in its group's slice
    (sum over the group's blocks of dy_n^T @ x_n), in one scan over the blocks."""
    x, w, group = res

    def step(dw, block):
        xb, dyb, g = block
        wg = jax.lax.dynamic_index_in_dim(w, g, 0, keepdims=False)
        dx = jax.lax.dot_general(dyb, wg, (((1,), (0,)), ((), ())))
        dwg = jax.lax.dot_general(dyb, xb, (((0,), (0,)), ((), ())))
        now = jax.lax.dynamic_index_in_dim(dw, g, 0, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(dw, (now + dwg).astype(dw.dtype), g, 0), dx.astype(x.dtype)
    dw, dx = jax.lax.scan(step, jnp.zeros_like(w), (_blocks(x, group), _blocks(dy, group), group))
    return dx.reshape(x.shape), dw, None


block_dot.defvjp(_block_dot_fwd, _block_dot_bwd)


def router_stats(probs: jax.Array, ids: jax.Array, live: jax.Array, num_experts: int) -> jax.Array:
    """[2, E] fp32: (pairs routed to each expert, summed probability of each expert) over the live
    rows (`live` bool [S])."""
    m = live.astype(jnp.float32)
    counts = jnp.zeros((num_experts,), jnp.float32).at[ids.reshape(-1)].add(jnp.repeat(m, ids.shape[1]))
    return jnp.stack([jax.lax.stop_gradient(counts), jnp.sum(probs * m[:, None], axis=0)])


def sparse_mlp(p: Params, z: jax.Array, moe: MoeSpec, act: Callable, live: jax.Array,
               first: Any = 0) -> tuple[jax.Array, jax.Array]:
    """(this device's share of the block's output [S, d], router stats [2, E]) of the normed rows
    z [S, d] (`p` a layer's `mlp` subtree; `first` the first expert it holds)."""
    probs, ids, weights = route(p["gate"], z, moe)
    return grouped_experts(p["experts"], z, ids, weights, act, first), router_stats(probs, ids, live, moe.num_experts)


def aux_loss(stats: jax.Array, rows: jax.Array, num_experts: int) -> jax.Array:
    """transformers' `load_balancing_loss_func` of the stats [2, E] summed over the sparse layers:
    E * sum_e (pairs_e / R) (prob_e / R), R = `rows`, the live rows summed over the layers."""
    rows = jnp.asarray(rows, jnp.float32)
    return num_experts * jnp.sum((stats[0] / rows) * (stats[1] / rows))


def aux_loss_coef(config: Any, coef: float | None = None) -> float:
    """The load-balancing loss's weight in a step of the family model `config` (an `HFConfig`; 0:
    off). `coef` None: as transformers decides (`spec.default_router_aux_loss_coef`); a number
    >= 0: that weight, whatever config.json says (0: off). ValueError for a negative weight, or a
    weight > 0 for a model without sparse layers."""
    spec = getattr(getattr(config, "text", None), "moe", None)
    name = f"model {getattr(config, 'family', type(config).__name__)!r}"
    if coef is None:
        return default_router_aux_loss_coef(config)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not np.isfinite(coef) or coef < 0:
        raise ValueError(f"router_aux_loss_coef must be a number >= 0 (the load-balancing loss's weight), got {coef!r}")
    if coef > 0 and (spec is None or not any(spec.sparse)):
        raise ValueError(f"router_aux_loss_coef {coef:g}: {name} has no mixture-of-experts layer (no router to balance)")
    return float(coef)


def aux_weights(counts: Any, rows: float) -> np.ndarray:
    """[E] float32: the per-expert weights w_e = E * count_e / R^2 of the batch's router counts
    (pairs routed to each expert, summed over every live token of the batch and every sparse
    layer; no gradient) and R = `rows` (live tokens x sparse layers), so that the load-balancing
    loss E sum_e (count_e / R)(prob_e / R) is sum_e w_e prob_e: linear in the probability sums, each
    token's share sum_e w_e p_e(token) (0 weights for an empty batch)."""
    counts = np.asarray(counts, np.float64)
    if rows <= 0:
        return np.zeros(counts.shape, np.float32)
    return (counts.size * counts / (float(rows) * float(rows))).astype(np.float32)


# --- collecting the router statistics of a forward pass ---------------------------------------

_COLLECTORS: list[list] = []


@contextlib.contextmanager
def collect() -> Iterator[list]:
    """Within the block, every MoE forward pass traced (`text.text_forward`) appends its (stats
    [2, E] summed over its sparse layers, live rows summed over them) to the list yielded: read
    them in the same traced function (e.g. the loss under `jax.grad`)."""
    out: list = []
    _COLLECTORS.append(out)
    try:
        yield out
    finally:
        _COLLECTORS.remove(out)


def report(stats: jax.Array, rows: jax.Array) -> None:
    """Hand a forward pass's router statistics to the innermost `collect` (if any)."""
    if _COLLECTORS:
        _COLLECTORS[-1].append((stats, rows))


# --- published checkpoint layouts of the experts (`expert_layouts`, shared with the torch side) ----

EXPERT_LAYOUTS, layout_of = xl.EXPERT_LAYOUTS, xl.layout_of


def load_experts(named: Iterable[tuple[str, Any]], layout: str,
                 shapes: Mapping[str, tuple[int, ...]] | None = None) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, weight) pairs with the experts in transformers' fused layout
    (`expert_layouts`): "fused" as is; "fused_transposed" transposed; "per_expert" stacked, as
    transformers' conversion mapping does on load (a fused weight already of the shape `shapes`
    gives, transformers' own, is kept as is, as its `Transpose(check_dims=True)` does). A layer's
    experts must be complete (0 .. E-1, all three)."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert layout {layout!r} is not one of {EXPERT_LAYOUTS}")
    pending: dict[str, dict[tuple[int, str], np.ndarray]] = {}
    for name, w in named:
        if layout == "fused_transposed" and xl.is_fused(name):
            keep = shapes is not None and tuple(shapes.get(name, ())) == tuple(w.shape)
            yield name, (w if keep else np.swapaxes(np.asarray(w), 1, 2))
            continue
        key = xl.per_expert_name(name) if layout == "per_expert" else None
        if key is not None:
            pending.setdefault(key[0], {})[key[1], key[2]] = np.asarray(w)
            continue
        yield name, w
    for prefix, mats in pending.items():
        yield from xl.fuse(prefix, mats, 1 + max(e for e, _ in mats))
