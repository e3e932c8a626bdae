"""Blocks shared by the Hugging Face model families: norms, linears, rotary, the decoder block and
the vision-encoder block, as pure functions over parameter subtrees.

Parameter subtrees follow the transformers module path (`dhp_jax.model.hf.checkpoint` maps the
names): a Linear is {kernel [in, out], bias [out]?} (torch weight = kernel.T), a norm
{scale [d], bias [d]?}, an Embedding {embedding [V, d]}.

Attention is pluggable, with the engine's signature (`dhp_jax.model.attention`):
`attn_fn(q[S, H, D], k[S, KVH, D], v[S, KVH, D], q_ids, k_ids) -> o[S, H, D]`, where the mask comes
from per-token `AttnIds` only. The decoder is causal over the whole sample (vision spans too):
ids (segment = 1 on real tokens, position = offset in the sample, span = 0). The vision encoders are
bidirectional inside a segment (a frame, a window, a tile): ids (segment = span = segment id).

Rotary: every rotary kind of these families is `rope(x, angles)` with per-token angles
`angles[s, j] = positions[s, axis[j]] * inv_freq[j]`, j < D/2 (`RopeSpec`). Positions are int
arrays [S, n_axes] that travel with their tokens: 1 axis for plain 1-D RoPE, (t, h, w) for
M-RoPE, (h, w) for the vision encoders' 2-D RoPE.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from dhp_jax.model.attention import AttnIds
from dhp_jax.model.mllm import live_chunks, remat_policy, sequence_rows, sequence_stream, split_block, vision_first
from dhp_jax.model.hf.scan import run_blocks
from dhp_jax.model.hf.spec import DecoderShape, RopeSpec  # noqa: F401 (the blocks' shapes)
from dhp_jax.model.tensor_parallel import TensorHooks

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, AttnIds, AttnIds], jax.Array]
Params = Mapping[str, Any]


def linear(p: Params, x: jax.Array) -> jax.Array:
    """x @ kernel (+ bias when the subtree has one)."""
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def fused(fn: Callable) -> Callable:
    """`fn` (token-local elementwise work: a norm, an activation, rotary) under `jax.checkpoint`
    saving nothing: its VJP keeps its inputs only and recomputes the rest, as a compiler fuses it.
    A block stack's scan stores each block's residuals explicitly, so without this every
    intermediate of a norm or a GELU would be kept per block. Values unchanged."""
    return jax.checkpoint(fn, prevent_cse=False)


def rms_norm(x: jax.Array, p: Params, eps: float) -> jax.Array:
    """RMSNorm over the last axis; statistics in fp32 (as transformers' RMSNorm)."""
    def norm(x, scale):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return scale * y.astype(x.dtype)

    return fused(norm)(x, p["scale"])


def split_rms_norm(x: jax.Array, p: Params, eps: float, reduce: Callable[[jax.Array], jax.Array],
                   width: int) -> jax.Array:
    """`rms_norm` over a width split across a rank's devices: x[..., w] and p["scale"][w] are this
    device's columns of the `width`-wide whole; the mean square is the sum of squares summed by
    `reduce` over the devices, / `width` (fp32)."""
    def norm(x, scale):
        xf = x.astype(jnp.float32)
        ms = reduce(jnp.sum(xf * xf, axis=-1, keepdims=True)) / width
        return scale * (xf * jax.lax.rsqrt(ms + eps)).astype(x.dtype)

    return fused(norm)(x, p["scale"])


def layer_norm(x: jax.Array, p: Params, eps: float) -> jax.Array:
    """LayerNorm over the last axis with affine scale and bias (biased variance, as torch)."""
    def norm(x, scale, bias):
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = ((xf - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)
        return y * scale + bias

    return fused(norm)(x, p["scale"], p["bias"])


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The transformers activation `name` (`hidden_act` of a config)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (known: {sorted(ACTIVATIONS)})")
    return fused(ACTIVATIONS[name])


def gated(name: str, gate: jax.Array, up: jax.Array) -> jax.Array:
    """act(gate) * up (SwiGLU's middle, `name` the activation), `fused`."""
    return fused(lambda g, u: ACTIVATIONS[name](g) * u)(gate, up)


def rotary(angles: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [S, 1, D] fp32 tables of angles[S, D/2], what `rope` multiplies by: computed
    once per stream, outside a block stack's scan, so no block keeps its own copy."""
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :]
    return cos, sin


def rope(x: jax.Array, angles: Any) -> jax.Array:
    """Rotate-half rotary embedding of x[S, H, D] by angles[S, D/2] or their `rotary` tables (cos/sin in fp32)."""
    def rotate(x, cos, sin):
        xf = x.astype(jnp.float32)
        half = x.shape[-1] // 2
        rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
        return (xf * cos + rotated * sin).astype(x.dtype)

    return fused(rotate)(x, *(angles if isinstance(angles, tuple) else rotary(angles)))


def row_linear(p: Params, x: jax.Array, reduce: Callable[[jax.Array], jax.Array] | None) -> jax.Array:
    """`linear` of a row-split Linear under tensor parallelism: reduce(x @ kernel) (+ bias, added
    once, after the sum); `reduce` None: `linear` itself."""
    if reduce is None:
        return linear(p, x)
    y = reduce(x @ p["kernel"])
    return y + p["bias"] if "bias" in p else y


def block_collectives(reduce: Callable[[jax.Array], jax.Array] | None, sequence: TensorHooks | None
                      ) -> tuple[Callable[[jax.Array], jax.Array], Callable[[jax.Array], jax.Array] | None, int]:
    """(widen, reduce, t) of a block's split matrices: without `sequence`, the identity before the
    column-split GEMMs and `reduce` (the sum over the rank, or None without tensor parallelism)
    after the row-split ones, t = 1; with `sequence` (the rank's `TensorHooks`, Megatron SP, arXiv
    2205.05198) the all-gather of this device's rows before them and the reduce-scatter back to its
    rows after them, t = the rank's size (`mllm.split_block`'s argument). The one rule of every
    family block (`decoder_block`, `qwen_vision_block`, InternViT's layers)."""
    if sequence is None:
        return (lambda y: y), reduce, 1
    return sequence.gather, sequence.scatter, sequence.size


def decoder_block(p: Params, x: jax.Array, angles: jax.Array, ids: AttnIds, shape: DecoderShape,
                  attn_fn: AttentionFn, chunk: int = 0, live: jax.Array | None = None,
                  reduce: Callable[[jax.Array], jax.Array] | None = None,
                  sequence: TensorHooks | None = None, mlp: bool = True) -> jax.Array:
    """One pre-norm LLM block (transformers' `*DecoderLayer`) on `p`, a `layers.i` subtree:
    h = x + o_proj(attn(rope(q), rope(k), v)) over input_layernorm(x); out = h + SwiGLU(post_norm(h)).
    `live` (bool per chunk of `chunk` rows, `mllm.live_chunks`): the token-local work runs in
    chunks and the dead ones are skipped (`mllm.split_block`); None: one pass.
    Tensor parallelism (`dhp_jax.sharding.tensor_parallel`): `p` is one device's share (its query and kv
    heads, its MLP columns; the head counts are read off the kernels) and `reduce` the sum over
    the rank's devices after the row-split o_proj and down_proj. `sequence` (the rank's
    `TensorHooks` with `sequence` set): sequence-parallel (Megatron SP, arXiv 2205.05198;
    `mllm.split_block`): x is this device's rows of the stream (`mllm.sequence_rows`, `live` from
    `mllm.live_chunks(..., t)`), `angles` and `ids` whole; the normed rows are all-gathered before
    q/k/v and gate/up, and the outputs of o_proj and down_proj reduce-scattered back (instead of
    summed by `reduce`), their biases added to this device's rows. `mlp` False: the attention half
    only, h (a sparse layer's MLP runs after it on the whole rows, `moe_decoder_block`)."""
    hd = shape.head_dim
    widen, reduce, t = block_collectives(reduce, sequence)
    heads = p["self_attn"]["q_proj"]["kernel"].shape[-1] // hd
    kv = p["self_attn"]["k_proj"]["kernel"].shape[-1] // hd

    def project(pp, xc, ang):
        a = pp["self_attn"]
        y = widen(rms_norm(xc, pp["input_layernorm"], shape.eps))
        q = linear(a["q_proj"], y).reshape(-1, heads, hd)
        k = linear(a["k_proj"], y).reshape(-1, kv, hd)
        v = linear(a["v_proj"], y).reshape(-1, kv, hd)
        if shape.qk_norm:
            q, k = rms_norm(q, a["q_norm"], shape.eps), rms_norm(k, a["k_norm"], shape.eps)
        return rope(q, ang), rope(k, ang), v

    def finish(pp, xc, oc):
        h = xc + row_linear(pp["self_attn"]["o_proj"], oc.reshape(-1, heads * hd), reduce)
        if not mlp:
            return h
        m = pp["mlp"]
        z = widen(rms_norm(h, pp["post_attention_layernorm"], shape.eps))
        return h + row_linear(m["down_proj"], gated(shape.act, linear(m["gate_proj"], z), linear(m["up_proj"], z)),
                              reduce)

    return split_block(p, x, angles, live, project, finish, lambda q, k, v: attn_fn(q, k, v, ids, ids), chunk,
                       t, ids.segment.shape[0])


def moe_decoder_block(p: Params, x: jax.Array, angles: jax.Array, ids: AttnIds, shape: DecoderShape,
                      moe_spec: Any, attn_fn: AttentionFn, chunk: int = 0, live: jax.Array | None = None,
                      reduce: Callable[[jax.Array], jax.Array] | None = None,
                      sequence: TensorHooks | None = None, first_expert: Any = 0,
                      keep: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """A sparse LLM layer (`dhp_jax.model.hf.moe`): the attention half of `decoder_block`, then
    h + experts(post_attention_layernorm(h)) on the whole rows at once (the router and the grouped
    GEMM want every token). Returns (x, router stats [2, E] of the live rows: `keep`, bool per row
    of x, or segment > 0 of `ids` when x is the whole stream).
    Tensor parallelism: `p["mlp"]["experts"]` holds this device's experts, from `first_expert`,
    the router is whole; the normed rows are joined over the rank under sequence parallelism (as
    the dense MLP's) and the experts' sum is `reduce`d (the psum, or the reduce-scatter back to this
    device's rows)."""
    from dhp_jax.model.hf import moe

    h = decoder_block(p, x, angles, ids, shape, attn_fn, chunk, live, reduce, sequence, mlp=False)
    widen, reduce, _ = block_collectives(reduce, sequence)
    z = widen(rms_norm(h, p["post_attention_layernorm"], shape.eps))
    keep = ids.segment > 0 if keep is None else widen(keep)
    y, stats = moe.sparse_mlp(p["mlp"], z, moe_spec, lambda g, u: gated(shape.act, g, u), keep, first_expert)
    return h + (y if reduce is None else reduce(y))[:h.shape[0]], stats


def qwen_vision_block(p: Params, x: jax.Array, angles: jax.Array, ids: AttnIds, num_heads: int,
                      norm: Callable[[jax.Array, Params], jax.Array], mlp: Callable[..., jax.Array],
                      attn_fn: AttentionFn, chunk: int = 0, live: jax.Array | None = None,
                      reduce: Callable[[jax.Array], jax.Array] | None = None,
                      sequence: TensorHooks | None = None) -> jax.Array:
    """One Qwen vision block on `p` (a `blocks.i` subtree): x += proj(attn(norm1(x))) with the fused
    qkv Linear (head-minor columns: [3, H, D]) and 2-D rotary, attention within a segment of `ids`;
    x += mlp(p["mlp"], norm2(x), reduce): the family's MLP, `reduce` the collective after its
    row-split last matrix (`block_collectives`; None without tensor parallelism). `norm(x, p)` is
    the family's norm; `chunk`, `live` as in `decoder_block`. Tensor parallelism: `p` one
    device's share (its heads of each of q, k, v: the local head count read off the qkv kernel),
    `reduce` the sum after the row-split proj and the MLP's last matrix; `sequence`:
    sequence-parallel as `decoder_block` (x this device's rows, `angles` and `ids` whole; the
    normed rows all-gathered before qkv and the MLP, the outputs of proj and the MLP
    reduce-scattered back, their biases added to this device's rows)."""
    d = x.shape[-1]
    hd = d // num_heads
    heads = p["attn"]["qkv"]["kernel"].shape[-1] // (3 * hd)
    widen, reduce, t = block_collectives(reduce, sequence)

    def project(pp, xc, ang):
        qkv = linear(pp["attn"]["qkv"], widen(norm(xc, pp["norm1"]))).reshape(-1, 3, heads, hd)
        return rope(qkv[:, 0], ang), rope(qkv[:, 1], ang), qkv[:, 2]

    def finish(pp, xc, oc):
        xc = xc + row_linear(pp["attn"]["proj"], oc.reshape(-1, heads * hd), reduce)
        return xc + mlp(pp["mlp"], widen(norm(xc, pp["norm2"])), reduce)

    return split_block(p, x, angles, live, project, finish, lambda q, k, v: attn_fn(q, k, v, ids, ids), chunk,
                       t, ids.segment.shape[0])


def remat_block(fn: Callable, remat: str) -> Callable:
    """`fn(p, x) -> x` (one block, `p` its params) as a stream runs it under `remat`: "none": `fn`
    itself; "selective": `jax.checkpoint` with `mllm.remat_policy` (the block's weight GEMMs'
    outputs kept); "layer": a custom VJP that keeps the block input (with `p` and what `fn` closes
    over) only and, in the backward pass, runs `fn` again under `jax.vjp`. The values are `fn`'s, bit for bit; the
    gradients are `jax.vjp(fn)`'s. A plain fn -> fn wrapper: call it per block, in a Python loop or
    in a scan body.

    Why not `jax.checkpoint` for "layer": in a whole group program XLA:CPU kept every block's
    intermediates anyway (tiny Qwen3-VL, degree 2, 4096 tokens: 128 MB compiled with
    `jax.checkpoint`, 124.5 MB without remat). Its recompute was merged with the forward pass (the
    same ops on the same block input: an optimization barrier on the recompute's inputs did not
    stop it)
    and the scheduler deferred every block's weight-gradient GEMMs to the end of the program,
    holding their operands. Two data dependencies that change no value fix both: the recompute
    reads the saved `p` and `x` plus `0 * g[0]` (so it is a different computation from the forward
    pass, and cannot start before the block's output gradient `g` exists), and the input gradient
    is returned plus `0 * sum(max(dp_leaf))` (so the next block's backward cannot start before this
    block's weight gradients exist; a max, since XLA rewrites a sum of a GEMM's output into GEMMs
    of sums, which frees the weight-gradient GEMM again). tests/test_family_memory.py fails
    without either dependency. `0 * v` is 0 for finite v; a non-finite gradient is
    non-finite either way."""
    if remat != "layer":
        return fn if remat == "none" else jax.checkpoint(fn, policy=remat_policy(remat))

    def run(p: Any, x: jax.Array) -> jax.Array:
        # what `fn` closes over (rotary angles, ids; in a scan body, per-step values) becomes
        # arguments: a custom VJP may not close over tracers
        pure, consts = jax.closure_convert(fn, p, x)
        return _recompute(pure, p, x, *consts)

    return run


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _recompute(fn: Callable, p: Any, x: jax.Array, *consts: Any) -> jax.Array:
    """`fn(p, x, *consts)`, recomputed in its backward pass (`remat_block` "layer")."""
    return fn(p, x, *consts)


def _recompute_forward(fn: Callable, p: Any, x: jax.Array, *consts: Any) -> tuple[jax.Array, tuple]:
    return fn(p, x, *consts), (p, x, consts)


def _recompute_backward(fn: Callable, saved: tuple, g: jax.Array) -> tuple:
    zero = 0 * g.reshape(-1)[0]
    p, x, consts = jax.tree.map(lambda t: t + zero.astype(t.dtype) if jnp.issubdtype(t.dtype, jnp.inexact) else t,
                                saved)
    grads = jax.vjp(fn, p, x, *consts)[1](g)
    done = sum(jnp.max(t).astype(grads[1].dtype) for t in jax.tree.leaves(grads[0])
               if jnp.issubdtype(t.dtype, jnp.inexact))  # integer inputs (a scan's per-block ids) get float0
    return (grads[0], grads[1] + 0 * done, *grads[2:])


_recompute.defvjp(_recompute_forward, _recompute_backward)


class BlockStream:
    """How a stream's blocks run (`HFConfig.remat`, `HFConfig.linear_chunk`): each block under
    `remat_block`; with `live` (bool per row: the rows a later result reads) and 0 < `chunk` <
    rows, in chunks with the dead ones skipped, on the rows reordered live rows first unless they
    are already a prefix (`reorder` False: the LLM stream, whose shards hold their real tokens
    first; `mllm.vision_first`: a shard's live rows fill whole chunks; masks read ids, never the
    order).
    `rows(a)` puts per-row arrays in the blocks' order, `back(x)` restores the stream's; `chunk`
    and `live` are the blocks' arguments (0, None: one pass). `tp` with `tp.sequence` (a rank of
    t > 1 devices): the blocks run sequence-parallel (Megatron SP, arXiv 2205.05198;
    `mllm.split_block`, the chunks `mllm.sequence_chunks`): `enter(x)` is this device's rows of the
    whole stream x in the blocks' order (`mllm.sequence_rows`), `leave(y, s)` the whole stream of s
    rows again, in the stream's order (`mllm.sequence_stream`, an all-gather over the rank);
    `sequence` is the hooks the blocks take (`block_collectives`), None otherwise. Per-row inputs
    the blocks read whole (ids, rotary tables) stay whole, in the blocks' order (`rows`). The one
    way in and out of sequence parallelism for every family stack: the LLM layers
    (`dhp_jax.model.hf.text.text_forward`) and the encoders."""

    def __init__(self, remat: str, chunk: int, live: jax.Array | None = None, reorder: bool = True,
                 tp: TensorHooks | None = None) -> None:
        self.remat = remat
        self.sequence = tp if tp is not None and tp.sequence and tp.size > 1 else None
        t = 1 if self.sequence is None else self.sequence.size
        n = 0 if live is None else live.shape[0]
        self.chunk = chunk if live is not None and 0 < chunk < n else 0
        self.order, self._back = vision_first(live, self.chunk) if self.chunk and reorder else (None, None)
        self.live = live_chunks(self.rows(live).astype(jnp.int32), self.chunk, t) if self.chunk else None

    def rows(self, a: Any) -> Any:
        """Per-row arrays (a pytree, e.g. `AttnIds`) in the blocks' order."""
        return a if self.order is None else jax.tree.map(lambda t: t[self.order], a)

    def back(self, x: jax.Array) -> jax.Array:
        """Rows in the blocks' order back in the stream's."""
        return x if self._back is None else x[self._back]

    def enter(self, x: jax.Array) -> jax.Array:
        """The rows the blocks carry of a whole stream x[S, ...] (in the stream's order): all of
        them in the blocks' order, or this device's under sequence parallelism."""
        x = self.rows(x)
        return x if self.sequence is None else sequence_rows(x, self.chunk, self.sequence)

    def leave(self, y: jax.Array, s: int) -> jax.Array:
        """The whole stream [s, ...] in the stream's order from the rows the blocks carried (`enter`)."""
        return self.back(y if self.sequence is None else sequence_stream(y, s, self.chunk, self.sequence))

    def block(self, fn: Callable) -> Callable:
        """`fn` (x -> x, one block) as this stream runs it (`remat_block`)."""
        return remat_block(fn, self.remat)

    def scan(self, fn: Callable, stack: Any, x: jax.Array, per_block: Any = (), consts: Any = (), **kw) -> Any:
        """The blocks of `stack` (`scan.BlockRows`) run on x (the rows `enter` gives) as one
        scan (`scan.run_blocks`, `feed` and `taps` in `kw`): block i is `fn(p_i, x, per_block[i],
        consts)` under `block`."""
        body = self.block(lambda args, h: fn(args[0], h, args[1], args[2]))
        return run_blocks(lambda p, h, blk, cs: body((p, blk, cs), h), stack, x, per_block, consts, **kw)


def per_block(count: int, tree: Any) -> Any:
    """`tree`'s arrays with a leading axis of `count` copies: inputs every block of a scan reads,
    scanned rather than loop constants (as the stand-in's `mllm.block_stack` passes its ids)."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (count,) + a.shape), tree)


def causal_ids(keep: Any) -> AttnIds:
    """Decoder ids of one sample: segment 1 on tokens the attention mask keeps (0: padding),
    position = offset in the sample, no bidirectional span (the three families are causal over
    vision too). Works on host arrays and on traced ones."""
    seg = jnp.asarray(keep).reshape(-1).astype(jnp.int32)
    return AttnIds(seg, jnp.arange(seg.shape[0], dtype=jnp.int32), jnp.zeros_like(seg))


def segment_ids(segments: Any) -> AttnIds:
    """Vision ids: full (bidirectional) attention among tokens of the same segment id (> 0)."""
    seg = jnp.asarray(segments).astype(jnp.int32)
    return AttnIds(seg, jnp.zeros_like(seg), seg)
