"""The flax multimodal model: vision encoder + projector + decoder LLM over one packed token stream.

Exact math (fp32 throughout; a torch twin must match op for op). The model computes in the dtype
of the params it is given: with bf16 params (the executor's bf16 mode) the GEMMs run in bf16 while
RMSNorm statistics, rotary angles, softmax statistics and the loss stay fp32; with fp32 params every
cast is a no-op and the math below is exact. `MLLMConfig.remat` wraps every vision and decoder
block in `jax.checkpoint` (`remat_policy`); it changes memory and recompute, never values.

Inputs (one packed stream of S tokens, see `dhp_jax.geometry.layout`): `token_ids` int32[S],
`pixels` float32[S, patch_dim] (zeros on text tokens), `vision_mask` bool[S], decoder ids
`segment_ids`, `positions`, `span_ids` int32[S], vision-encoder ids `frame_ids`,
`frame_positions` int32[S]. Masks come from ids only (`dhp_jax.model.attention`).

- RMSNorm(x) = x * rsqrt(mean(x**2, -1) + rms_eps) * scale          (rms_eps = 1e-6, no bias)
- Dense: y = x @ kernel (+ bias); kernel is [in, out] (torch Linear weight = kernel.T).
- Rotary (rotate-half, whole head): inv_freq[i] = rope_base ** (-2i / D), i = 0..D/2-1;
  ang = pos * inv_freq; cos = concat(cos(ang), cos(ang)), sin likewise;
  rope(x) = x * cos + rotate_half(x) * sin,  rotate_half([x1, x2]) = [-x2, x1] (halves of D).
- Attention block (pre-norm): q = (x @ q.kernel).reshape(S, H, D) (head-major columns),
  k, v = (x @ k/v.kernel).reshape(S, KVH, D); q, k = rope(q, pos), rope(k, pos);
  GQA: query head h uses kv head h // (H / KVH) (repeat-interleave);
  softmax(q k^T / sqrt(D) + mask) v; rows with no allowed key give 0; out = concat_heads @ o.kernel.
- SwiGLU MLP: down(silu(gate(x)) * up(x)), no biases.
- Block: h = x + attn(attn_norm(x)); out = h + mlp(mlp_norm(h)). With `MLLMConfig.linear_chunk`
  > 0 everything but attention runs over chunks of the stream, and a chunk with no live token
  (segment 0: padding; in the vision encoder, no vision token) is skipped (`block_apply`); live
  rows are unchanged, and no result reads a dead row (masks exclude it, the loss weights it 0, the
  decoder input takes vision rows only from vision tokens). The vision encoder's blocks then run
  on the stream's rows reordered vision rows first (`vision_first`), so its live chunks are the
  vision rows rounded up to whole chunks.
- Vision encoder (per frame, bidirectional): v = pixels @ patch_embed.kernel + patch_embed.bias;
  `vision_layers` blocks (H = KVH = vision_heads) with ids (segment = frame_id,
  position = frame_position, span = frame_id), i.e. full attention inside a frame and rotary
  over the position inside the frame; v = vision_norm(v).
- Projector: proj_fc2(gelu_exact(proj_fc1(v))) with biases (gelu_exact = x * Phi(x), erf form).
- Decoder input: x = where(vision_mask, projector(v), embed.embedding[token_ids]).
- Decoder: `num_layers` blocks with ids (segment_ids, positions, span_ids): text is causal over
  the position within the sample, a vision segment is one bidirectional span; vision tokens take
  the same sequential positions as text (position = offset inside the sample).
- logits = final_norm(x) @ lm_head.kernel (untied, no bias).
- Loss: cross entropy (logsumexp(logits) - logits[target]) summed over tokens with
  loss_weight 1 (a text token whose next token is text of the same sample; the target is that
  next token), divided by the number of such tokens in the whole batch.

Parameter tree (`init_params` returns it without flax's "params" wrapper):
  embed/embedding [V, d]; patch_embed/{kernel [P, dv], bias [dv]};
  vision_layers_i/{attn_norm/scale, attn/{q,k,v,o}/kernel, mlp_norm/scale, mlp/{gate,up,down}/kernel};
  vision_norm/scale; proj_fc1/{kernel [dv, d], bias}; proj_fc2/{kernel [d, d], bias};
  layers_i/{same names as vision layers}; final_norm/scale; lm_head/kernel [d, V].
Initialisation: flax defaults (lecun-normal kernels, zero biases, unit norm scales, nn.Embed's
default variance-scaling normal embedding). Tests compare implementations on the same tree, so
the initialiser is not part of the contract.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dhp_jax.geometry.layout import chunk_size
from dhp_jax.model.attention import AttnIds, dense_attention
from dhp_jax.model.mllm_config import MLLMConfig
from dhp_jax.model.executed import tick
from dhp_jax.model.tensor_parallel import TensorHooks, vocab_embed, vocab_loss_sum

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, AttnIds, AttnIds], jax.Array]
Params = Mapping[str, Any]



def rope(x: jax.Array, pos: jax.Array, base: float) -> jax.Array:
    """Rotate-half rotary embedding of x[S, H, D] at integer positions pos[S]."""
    d = x.shape[-1]
    inv_freq = base ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    ang = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]          # ang[S, D/2], fp32
    cos = jnp.concatenate([jnp.cos(ang), jnp.cos(ang)], axis=-1)[:, None, :].astype(x.dtype)
    sin = jnp.concatenate([jnp.sin(ang), jnp.sin(ang)], axis=-1)[:, None, :].astype(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of x[..., d] (statistics in fp32 whatever the compute dtype)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype) * scale


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32), self.eps)


class Attention(nn.Module):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_base: float
    attn_fn: AttentionFn

    @nn.compact
    def __call__(self, x: jax.Array, ids: AttnIds) -> jax.Array:
        s, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = nn.Dense(h * d, use_bias=False, name="q")(x).reshape(s, h, d)
        k = nn.Dense(kvh * d, use_bias=False, name="k")(x).reshape(s, kvh, d)
        v = nn.Dense(kvh * d, use_bias=False, name="v")(x).reshape(s, kvh, d)
        q, k = rope(q, ids.position, self.rope_base), rope(k, ids.position, self.rope_base)
        o = self.attn_fn(q, k, v, ids, ids)                               # o[S, H, D]
        return nn.Dense(x.shape[-1], use_bias=False, name="o")(o.reshape(s, h * d))


class SwiGLU(nn.Module):
    d_ff: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        g = nn.Dense(self.d_ff, use_bias=False, name="gate")(x)
        u = nn.Dense(self.d_ff, use_bias=False, name="up")(x)
        return nn.Dense(x.shape[-1], use_bias=False, name="down")(jax.nn.silu(g) * u)


class Block(nn.Module):
    """h = x + attn(attn_norm(x)); out = h + mlp(mlp_norm(h)) (the module docstring's math).

    `chunk` > 0: the token-local work (norms, q/k/v projections and rotary, o projection, MLP)
    runs over chunks of `chunk` tokens (`block_apply`), and a chunk with no live token
    (`ids.segment > 0`: a real token in the decoder, a vision token in the vision encoder) is
    skipped under `lax.cond`. Values of live rows are unchanged; dead rows are never read."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_ff: int
    rope_base: float
    eps: float
    attn_fn: AttentionFn
    chunk: int = 0
    tp: TensorHooks | None = None   # tensor parallelism: the params are this device's shares (`block_apply`)

    @nn.compact
    def __call__(self, x: jax.Array, ids: AttnIds) -> jax.Array:
        if self.is_initializing():       # declares the parameter tree of the module docstring
            h = x + Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.rope_base,
                              self.attn_fn, name="attn")(RMSNorm(self.eps, name="attn_norm")(x), ids)
            return h + SwiGLU(self.d_ff, name="mlp")(RMSNorm(self.eps, name="mlp_norm")(h))
        return block_apply(self.variables["params"], x, ids, self, self.chunk)


def _merge(x: jax.Array, length: int) -> jax.Array:
    return x.reshape((-1,) + x.shape[2:])[:length]


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    """x[S, ...] with zero rows appended up to `rows` (x itself when S == rows)."""
    pad = rows - x.shape[0]
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x


def live_chunks(segment: jax.Array, chunk: int, t: int = 1) -> jax.Array:
    """bool[n]: which of the n chunks of a stream (`sequence_chunks(S, chunk, t)`: `chunk_size(S,
    chunk)` rows, rounded up to a multiple of t under sequence parallelism) hold a live token
    (segment > 0)."""
    n, c = sequence_chunks(segment.shape[0], chunk, t)
    return jnp.any(_pad_rows(segment > 0, n * c).reshape(n, c), axis=1)


def _skippable(live_fn: Callable, dead_fn: Callable) -> Callable:
    """(params, ok, *xs) -> `live_fn(params, *xs)` if `ok` else `dead_fn(params, *xs)` (`lax.cond`),
    with a VJP whose residuals are its inputs; the backward pass is the `lax.cond` of the two
    pullbacks. Autodiff of a bare `lax.cond` keeps what the cond forwards (here every weight) as a
    residual computed inside the loop over chunks, so that loop stacked each block's weights once per
    chunk (XLA:CPU: 29 GB more for internvl3-8b at 64k tokens); a residual that is an input stays a
    loop constant. The backward pass recomputes the chunk's forward work that its pullback reads
    (what no pullback reads, e.g. the projections' outputs, is left to dead-code elimination)."""

    @jax.custom_vjp
    def run(params, ok, *xs):
        return lax.cond(ok, live_fn, dead_fn, params, *xs)

    def fwd(params, ok, *xs):
        return run(params, ok, *xs), (params, ok, xs)

    def bwd(res, ct):
        params, ok, xs = res

        def pull(fn):
            return lambda c: jax.vjp(fn, params, *xs)[1](c)

        grads = lax.cond(ok, pull(live_fn), pull(dead_fn), ct)
        return (grads[0], None, *grads[1:])

    run.defvjp(fwd, bwd)
    return run


def block_apply(p: Params, x: jax.Array, ids: AttnIds, shape: Any, chunk: int = 0) -> jax.Array:
    """One block on params `p` (a `layers_i` subtree): `Block`'s math with its token-local work in
    chunks of at most `chunk` tokens (`split_block`: dead chunks skipped, zero q/k/v, the residual
    passed through); chunk 0 (or >= S): one pass over the whole stream. `shape` has the `Block`
    fields num_heads, num_kv_heads, head_dim, rope_base, eps and attn_fn, and optionally `tp`
    (`dhp_jax.model.tensor_parallel.TensorHooks`): the params are then one device's column shares of q/k/v,
    gate and up and row shares of o and down (`dhp_jax.sharding.tensor_parallel`), and the outputs of o and
    down are summed over the rank's devices. The head counts are read off the kernels given."""
    hd = shape.head_dim
    h, kvh = p["attn"]["q"]["kernel"].shape[-1] // hd, p["attn"]["k"]["kernel"].shape[-1] // hd
    tp = getattr(shape, "tp", None)
    sp = tp is not None and tp.sequence
    reduce = (lambda y: y) if tp is None else tp.scatter if sp else tp.psum
    widen = tp.gather if sp else (lambda y: y)      # sequence-parallel: a norm's rows joined before the split GEMMs

    def project(pp, xc, pos):
        a = pp["attn"]
        y = widen(rms_norm(xc, pp["attn_norm"]["scale"], shape.eps))
        q = (y @ a["q"]["kernel"]).reshape(-1, h, hd)
        k = (y @ a["k"]["kernel"]).reshape(-1, kvh, hd)
        v = (y @ a["v"]["kernel"]).reshape(-1, kvh, hd)
        return rope(q, pos, shape.rope_base), rope(k, pos, shape.rope_base), v

    def finish(pp, xc, oc):
        a, m = pp["attn"], pp["mlp"]
        y = xc + reduce(oc.reshape(-1, h * hd) @ a["o"]["kernel"])
        z = widen(rms_norm(y, pp["mlp_norm"]["scale"], shape.eps))
        return y + reduce((jax.nn.silu(z @ m["gate"]["kernel"]) * (z @ m["up"]["kernel"])) @ m["down"]["kernel"])

    attend = lambda q, k, v: shape.attn_fn(q, k, v, ids, ids)  # noqa: E731
    # sequence-parallel: x is this device's rows of the stream (`sequence_rows`), the ids whole
    s, t = ids.position.shape[0], tp.size if sp else 1
    live = live_chunks(ids.segment, chunk, t) if 0 < chunk < s else None
    return split_block(p, x, ids.position, live, project, finish, attend, chunk, t, s)


def sequence_chunks(s: int, chunk: int, t: int) -> tuple[int, int]:
    """(n, c): a sequence-parallel stream of `s` rows runs as n chunks of c rows, c `chunk_size`
    rounded up to a multiple of t (one chunk of s rounded up to t without chunks), each of the t
    devices holding c / t consecutive rows of every chunk (`sequence_rows`)."""
    c = chunk_size(s, chunk) if 0 < chunk < s else s
    c = -(-c // t) * t
    return -(-s // c), c


def sequence_rows(x: jax.Array, chunk: int, tp: TensorHooks) -> jax.Array:
    """This device's rows of a stream x[S, ...] under sequence parallelism: rows [i c/t, (i+1) c/t)
    of each of the n chunks of c rows (`sequence_chunks`; zero rows pad the last), [n c/t, ...]."""
    s, t = x.shape[0], tp.size
    n, c = sequence_chunks(s, chunk, t)
    x = jnp.pad(x, [(0, n * c - s)] + [(0, 0)] * (x.ndim - 1)).reshape((n, c) + x.shape[1:])
    return lax.dynamic_slice_in_dim(x, tp.index() * (c // t), c // t, axis=1).reshape((n * (c // t),) + x.shape[2:])


def sequence_stream(rows: jax.Array, s: int, chunk: int, tp: TensorHooks) -> jax.Array:
    """The stream x[S, ...] from every device's `sequence_rows` (an all-gather over the rank)."""
    n, c = sequence_chunks(s, chunk, tp.size)
    part = jnp.moveaxis(rows.reshape((n, c // tp.size) + rows.shape[1:]), 1, 0)   # [c/t, n, ...]
    return jnp.moveaxis(tp.gather(part), 0, 1).reshape((n * c,) + rows.shape[1:])[:s]


def split_block(p: Params, x: jax.Array, rows: Any, live: jax.Array | None, project: Callable, finish: Callable,
                attend: Callable, chunk: int, t: int = 1, length: int | None = None) -> jax.Array:
    """A block cut at its attention, x[S, d] -> x[S, d]: `project(p, x, rows)` (the token-local
    work before it: a tuple of per-token arrays, q, k, v), `attend(*those)` (over the whole
    stream: o[S, ...]), `finish(p, x, o)` (the token-local work after it, with the residuals).
    `rows` is a pytree of per-token arrays `project` reads (positions, rotary angles).

    `live` None (or `chunk` 0 or >= S): one pass over the stream. Else `live` bool[n] says which of
    the n chunks of `chunk_size(S, chunk)` rows (`live_chunks`) hold a live row: `project` and
    `finish` run chunk by chunk (`lax.map`) and a dead chunk is skipped (`_skippable`: zero
    projections, the residual passed through), so live rows are unchanged and no result may read
    a dead row. A chunk that runs calls `executed.tick("linear_chunks")` (counted in debug mode).

    Sequence-parallel (`t` > 1, Megatron SP, arXiv 2205.05198): x is this device's rows [n c/t, d]
    of a stream of `length` rows (`sequence_rows`; n chunks of c rows, `sequence_chunks`; `live`
    from `live_chunks(segment, chunk, t)`), `rows` whole; `project` joins a chunk's rows over the
    rank before its column-split GEMMs (its q, k, v have c rows) and `finish` reduce-scatters its
    row-split outputs back to this device's c/t rows, so the residual stream, the norms and what a
    block keeps for its backward pass are 1/t of the rows; attention runs on the whole stream's
    q, k, v (heads split). Every device of the rank skips the same chunks (the ids are whole on
    each). One loop serves the stand-in (`block_apply`) and the families' blocks
    (`dhp_jax.model.hf.layers`)."""
    s = x.shape[0] if length is None else int(length)
    if t == 1 and s != x.shape[0]:
        raise ValueError(f"a block on {x.shape[0]} rows of a stream of {s}: only sequence parallelism (t > 1) "
                         f"holds part of the rows")
    n, c = sequence_chunks(s, chunk if live is not None else 0, t)
    cut = lambda a: _pad_rows(a, n * c).reshape((n, c) + a.shape[1:])  # noqa: E731
    xs, rs = _pad_rows(x, n * (c // t)).reshape((n, c // t) + x.shape[1:]), jax.tree.map(cut, rows)
    if n == 1:
        qkv = project(p, xs[0], jax.tree.map(lambda a: a[0], rs))
        return finish(p, xs[0], _pad_rows(attend(*(a[:s] for a in qkv)), c))[:x.shape[0]]
    shapes = jax.eval_shape(project, p, xs[0], jax.tree.map(lambda a: a[0], rs))

    def run_project(pp, xc, rc):
        tick("linear_chunks", xc)       # a live chunk's work ran (`executed`: counted only in debug mode)
        return project(pp, xc, rc)

    def run_finish(pp, xc, oc):
        tick("linear_chunks", xc)
        return finish(pp, xc, oc)

    project_chunk = _skippable(run_project, lambda pp, xc, rc: jax.tree.map(
        lambda a: jnp.zeros(a.shape, a.dtype), shapes))
    finish_chunk = _skippable(run_finish, lambda pp, xc, oc: xc)
    qkv = lax.map(lambda a: project_chunk(p, a[2], a[0], a[1]), (xs, rs, live))
    o = cut(attend(*(_merge(a, s) for a in qkv)))
    return _merge(lax.map(lambda a: finish_chunk(p, a[2], a[0], a[1]), (xs, o, live)), x.shape[0])


def vision_first(vision_mask: jax.Array, chunk: int) -> tuple[jax.Array | None, jax.Array | None]:
    """(order, back): `x[order]` puts the vision rows of a stream (or of one rank's shard) first, in
    their order, then the others; `y[back]` undoes it. The vision encoder's blocks run on that
    order, so that, in chunks (`block_apply`), a rank computes its vision rows rounded up to whole
    chunks and no chunk of text or padding (rows in the order of the stream would put text rows in
    every chunk that a vision span starts or ends in). The masks read ids, never the order, so
    values are unchanged. (None, None) when the blocks run in one pass (`chunk` 0 or >= S)."""
    s = vision_mask.shape[0]
    if chunk <= 0 or chunk >= s:
        return None, None
    vis = vision_mask.astype(jnp.int32)
    back = jnp.where(vision_mask, jnp.cumsum(vis) - 1, jnp.sum(vis) + jnp.cumsum(1 - vis) - 1)
    order = jnp.zeros(s, jnp.int32).at[back].set(jnp.arange(s, dtype=jnp.int32))
    return order, back


REMAT_POLICIES = ("none", "layer", "selective")


def remat_policy(name: str) -> Any:
    """The `jax.checkpoint` policy of a remat name ("layer": save nothing inside a block, recompute
    it whole; "selective": keep the outputs of the block's weight GEMMs, recompute the rest)."""
    if name == "layer":
        return jax.checkpoint_policies.nothing_saveable
    if name == "selective":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    raise ValueError(f"no checkpoint policy for remat={name!r}; known: {REMAT_POLICIES}")


def block_class(remat: str) -> type:
    """`Block`, or `Block` under `jax.checkpoint` with the policy `remat` names."""
    if remat == "none":
        return Block
    return nn.remat(Block, policy=remat_policy(remat))


class MLLM(nn.Module):
    """Vision encoder + projector + decoder over one packed stream; returns logits[S, V]."""

    config: MLLMConfig
    attn_fn: AttentionFn = dense_attention
    head: bool = True      # False: return final_norm(x)[S, d], the LM head's input (chunked loss)
    # (vision, decoder) block stacks run outside the module, (x, ids) -> x (`block_stack`); None:
    # the module's own `vision_layers_i` / `layers_i` blocks
    stacks: tuple[Callable[[jax.Array, AttnIds], jax.Array], Callable[[jax.Array, AttnIds], jax.Array]] | None = None
    # tensor parallelism: the params are one device's shares (`dhp_jax.sharding.tensor_parallel`): the
    # embedding vocab-split (`vocab_embed`), the blocks Megatron-split; patch embedding, norms and
    # projector replicated
    tp: TensorHooks | None = None

    @nn.compact
    def __call__(self, batch: Mapping[str, jax.Array]) -> jax.Array:
        c = self.config
        block = block_class(c.remat)
        vis_ids = AttnIds(batch["frame_ids"], batch["frame_positions"], batch["frame_ids"])
        v = nn.Dense(c.vision_dim, name="patch_embed")(batch["pixels"])
        order, back = vision_first(batch["vision_mask"], c.linear_chunk)
        if order is not None:       # the vision rows as a prefix: chunks of vision rows only
            v, vis_ids = v[order], AttnIds(*(i[order] for i in vis_ids))
        if self.stacks is not None:
            v = self.stacks[0](v, vis_ids)
        for i in range(0 if self.stacks is not None else c.vision_layers):
            v = block(c.vision_heads, c.vision_heads, c.vision_head_dim, c.vision_ff, c.rope_base,
                      c.rms_eps, self.attn_fn, c.linear_chunk, self.tp, name=f"vision_layers_{i}")(v, vis_ids)
        if back is not None:
            v = v[back]
        v = RMSNorm(c.rms_eps, name="vision_norm")(v)
        v = nn.Dense(c.d_model, name="proj_fc1")(v)
        v = nn.Dense(c.d_model, name="proj_fc2")(jax.nn.gelu(v, approximate=False))
        if self.tp is None or self.is_initializing():
            t = nn.Embed(c.vocab_size, c.d_model, name="embed")(batch["token_ids"])
        else:
            t = vocab_embed(self.variables["params"]["embed"]["embedding"], batch["token_ids"], c.vocab_size, self.tp)
        x = jnp.where(batch["vision_mask"][:, None], v, t)
        ids = AttnIds(batch["segment_ids"], batch["positions"], batch["span_ids"])
        if self.stacks is not None:
            x = self.stacks[1](x, ids)
        for i in range(0 if self.stacks is not None else c.num_layers):
            x = block(c.num_heads, c.num_kv_heads, c.head_dim, c.d_ff, c.rope_base, c.rms_eps,
                      self.attn_fn, c.linear_chunk, self.tp, name=f"layers_{i}")(x, ids)
        x = RMSNorm(c.rms_eps, name="final_norm")(x)
        if not self.head:
            return x
        return nn.Dense(c.vocab_size, use_bias=False, name="lm_head")(x)


def block_stack(config: MLLMConfig, rows: jax.Array, row_params: Callable[[jax.Array], Params], vision: bool,
                attn_fn: AttentionFn = dense_attention, tp: TensorHooks | None = None
                ) -> Callable[[jax.Array, AttnIds], jax.Array]:
    """The decoder (or vision) blocks as one `lax.scan` over their params, rows[count, n] (one row
    per block, `row_params` makes its params subtree): (x, ids) -> x, the same math as the
    module's `layers_i` loop, with its own VJP (`_scan_vjp`):

    - forward: a scan over the blocks that keeps, per block, the residuals of `jax.vjp` of the
      block under `config.remat` ("layer": `jax.checkpoint` saving nothing, so the block input
      only; "selective": the block input and the outputs of its weight GEMMs; "none": every
      intermediate the block's backward pass reads), never the block's params (they are `rows`);
    - backward: a reverse scan that rebuilds one block's pullback from its residuals and its row
      of `rows` (recomputing what the policy did not keep) and emits that block's param gradient
      as a scan output: the gradient of `rows` comes out stacked, [count, n], in the dtype of
      `rows` (the compute dtype).

    So a block's working set is live for one block, whatever the scheduler. Saved residuals and
    stacked gradients in a 2-byte float dtype are stored bit-cast to uint16 inside the loops and
    bit-cast back outside: bit-identical values, but a compiler that has no bf16 arithmetic
    (XLA:CPU) cannot widen the loop state to fp32. In fp32 nothing is bit-cast. `tp`: tensor
    parallelism (`row_params` then gives this device's shares of a block, `block_apply`)."""
    c = config
    shape = ((c.vision_heads, c.vision_heads, c.vision_head_dim, c.vision_ff) if vision
             else (c.num_heads, c.num_kv_heads, c.head_dim, c.d_ff))
    block = Block(*shape, c.rope_base, c.rms_eps, attn_fn, c.linear_chunk, tp)

    def body(x, row, ids):
        return block.apply({"params": row_params(row)}, x, AttnIds(*ids))

    if c.remat != "none":
        body = jax.checkpoint(body, policy=remat_policy(c.remat))
    stack = _scan_vjp(body)

    def run(x: jax.Array, ids: AttnIds) -> jax.Array:
        # ids go in as one copy per block (scanned, not loop constants): from loop constants,
        # autodiff of the scan hoists everything computed from them alone out of the loop and
        # keeps it (every tile pair's attention mask, [tiles, tiles, heads, t, t])
        per_block = tuple(jnp.broadcast_to(i, (rows.shape[0],) + i.shape) for i in ids)
        if tp is not None and tp.sequence:      # the scan carries this device's rows only
            s = x.shape[0]
            out = stack(sequence_rows(x, c.linear_chunk, tp), rows, per_block)
            return sequence_stream(out, s, c.linear_chunk, tp)
        return stack(x, rows, per_block)

    return run


def _store(x: jax.Array) -> jax.Array:
    """A loop-state value as stored inside a scan: 2-byte floats bit-cast to uint16."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype in (jnp.bfloat16, jnp.float16) else x


def _load(x: jax.Array, dtype: Any) -> jax.Array:
    """Inverse of `_store` for a value of `dtype`."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _scan_vjp(body: Callable[[jax.Array, jax.Array, tuple], jax.Array]):
    """(x, rows[count, n], ids (arrays with a leading count axis)) -> x after `body` ran once per
    row, as a `jax.custom_vjp` (see `block_stack`): the forward scan keeps each block's pullback
    residuals minus its params row and ids; the backward scan restores them, runs the pullback
    and emits the row's gradient."""
    meta: dict[str, Any] = {}

    def pullback(h, row, ids):
        y, pull = jax.vjp(lambda h_, r_: body(h_, r_, ids), h, row)
        leaves, tree = jax.tree.flatten(pull)
        given = [row, *ids]             # restored in the backward scan: not saved per block
        slots = tuple(next((j for j, g in enumerate(given) if leaf is g), None) for leaf in leaves)
        kept = [leaf for leaf, s in zip(leaves, slots) if s is None]
        meta.update(tree=tree, slots=slots, dtypes=tuple(leaf.dtype for leaf in kept))
        return y, kept

    def forward(x, rows, ids):
        def step(h, xs):
            row, blk_ids = xs
            y, kept = pullback(h, _load(row, rows.dtype), blk_ids)
            return y, [_store(k) for k in kept]

        return jax.lax.scan(step, x, (_store(rows), ids))

    @jax.custom_vjp
    def stack(x, rows, ids):
        def step(h, xs):
            return body(h, _load(xs[0], rows.dtype), xs[1]), None

        return jax.lax.scan(step, x, (_store(rows), ids))[0]

    def fwd(x, rows, ids):
        y, saved = forward(x, rows, ids)
        return y, (saved, rows, ids)

    def bwd(res, dy):
        saved, rows, ids = res

        def step(dh, xs):
            kept, row, blk_ids = xs
            given = [_load(row, rows.dtype), *blk_ids]
            kept = iter(_load(k, d) for k, d in zip(kept, meta["dtypes"]))
            leaves = [next(kept) if s is None else given[s] for s in meta["slots"]]
            dh, drow = jax.tree.unflatten(meta["tree"], leaves)(dh)
            return dh, _store(drow)

        dx, drows = jax.lax.scan(step, dy, (saved, _store(rows), ids), reverse=True)
        return dx, _load(drows, rows.dtype), None

    stack.defvjp(fwd, bwd)
    return stack


def dummy_batch(config: MLLMConfig, length: int = 2) -> dict[str, np.ndarray]:
    """A minimal input stream of `length` tokens (shapes/dtypes the model consumes)."""
    z = np.zeros(length, np.int32)
    return {"token_ids": z, "pixels": np.zeros((length, config.patch_dim), np.float32),
            "vision_mask": np.zeros(length, bool), "segment_ids": z + 1,
            "positions": np.arange(length, dtype=np.int32), "span_ids": z, "frame_ids": z,
            "frame_positions": z}


def init_params(config: MLLMConfig, key: jax.Array) -> dict[str, Any]:
    """Initial parameter tree (fp32) of the model; see the module docstring for its layout."""
    variables = jax.jit(lambda k: MLLM(config).init(k, dummy_batch(config)))(key)
    return jax.tree.map(lambda x: x, dict(variables["params"]))


def apply_model(config: MLLMConfig, params: Params, batch: Mapping[str, jax.Array],
                attn_fn: AttentionFn = dense_attention) -> jax.Array:
    """logits[S, V] of a packed stream, with the attention the caller hands in; computes in the
    dtype of `params` (pixels are cast to it; logits come back in it)."""
    dtype = params["patch_embed"]["kernel"].dtype
    batch = {**batch, "pixels": jnp.asarray(batch["pixels"]).astype(dtype)}
    return MLLM(config, attn_fn).apply({"params": params}, batch)


def token_loss_sum(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """Sum over tokens of weight * cross entropy(logits, target) (a scalar), in fp32."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return jnp.sum((lse - picked) * weights)


LOSS_CHUNK = 512      # tokens per LM-head chunk in `chunked_loss_sum`


def chunked_loss_sum(config: MLLMConfig, params: Params, batch: Mapping[str, jax.Array], targets: jax.Array,
                     weights: jax.Array, attn_fn: AttentionFn = dense_attention, chunk: int = LOSS_CHUNK,
                     stacks: tuple | None = None, tp: TensorHooks | None = None) -> jax.Array:
    """`token_loss_sum(apply_model(...), targets, weights)` without the [S, V] logits: the LM head
    and the cross entropy run over chunks of `chunk` tokens under `jax.checkpoint`, so forward and
    backward hold one chunk's logits (fp32) at a time instead of all S x V of them. `stacks`:
    (vision, decoder) `block_stack`s that replace the module's block loops. `tp`: tensor
    parallelism, `params` one device's shares (`MLLM.tp`; the LM head vocab-split)."""
    dtype = params["patch_embed"]["kernel"].dtype
    batch = {**batch, "pixels": jnp.asarray(batch["pixels"]).astype(dtype)}
    x = MLLM(config, attn_fn, head=False, stacks=stacks, tp=tp).apply({"params": params}, batch)   # x[S, d]
    return head_loss_sum(x, params["lm_head"]["kernel"], targets, weights, chunk, tp, config.vocab_size)


def head_loss_sum(x: jax.Array, kernel: jax.Array, targets: jax.Array, weights: jax.Array,
                  chunk: int = LOSS_CHUNK, tp: TensorHooks | None = None, vocab: int | None = None) -> jax.Array:
    """`token_loss_sum(x @ kernel, targets, weights)` over chunks of `chunk` tokens under
    `jax.checkpoint` (one chunk's fp32 logits live at a time, forward and backward): the LM head
    and loss of every model the executors run, x[S, d] the final hidden states, kernel [d, V].
    `tp`: kernel [d, Vl] is this device's columns of a vocab of `vocab` (`tensor.vocab_loss_sum`)."""
    s = x.shape[0]
    n = -(-s // chunk)
    pad = n * chunk - s
    xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(n, chunk, x.shape[1])
    ts = jnp.pad(targets, (0, pad)).reshape(n, chunk)
    ws = jnp.pad(weights, (0, pad)).reshape(n, chunk)

    @jax.checkpoint
    def one(xc, tc, wc):
        if tp is not None:
            return vocab_loss_sum(xc @ kernel, tc, wc, vocab, tp)
        return token_loss_sum(xc @ kernel, tc, wc)

    def step(total, inputs):
        return total + one(*inputs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (xs, ts, ws))
    return total
