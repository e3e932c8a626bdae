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

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from dhp_jax.model.attention import AttnIds
from dhp_jax.model.hf.spec import DecoderShape, RopeSpec  # noqa: F401 (the blocks' shapes)

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, AttnIds, AttnIds], jax.Array]
Params = Mapping[str, Any]


def linear(p: Params, x: jax.Array) -> jax.Array:
    """x @ kernel (+ bias when the subtree has one)."""
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def rms_norm(x: jax.Array, p: Params, eps: float) -> jax.Array:
    """RMSNorm over the last axis; statistics in fp32 (as transformers' RMSNorm)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return p["scale"] * y.astype(x.dtype)


def layer_norm(x: jax.Array, p: Params, eps: float) -> jax.Array:
    """LayerNorm over the last axis with affine scale and bias (biased variance, as torch)."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = ((xf - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return y * p["scale"] + p["bias"]


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
    return ACTIVATIONS[name]


def rope(x: jax.Array, angles: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding of x[S, H, D] by angles[S, D/2] (cos/sin in fp32)."""
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def decoder_block(p: Params, x: jax.Array, angles: jax.Array, ids: AttnIds, shape: DecoderShape,
                  attn_fn: AttentionFn) -> jax.Array:
    """One pre-norm LLM block (transformers' `*DecoderLayer`) on `p`, a `layers.i` subtree:
    h = x + o_proj(attn(rope(q), rope(k), v)) over input_layernorm(x); out = h + SwiGLU(post_norm(h))."""
    s, a = x.shape[0], p["self_attn"]
    y = rms_norm(x, p["input_layernorm"], shape.eps)
    q = linear(a["q_proj"], y).reshape(s, shape.num_heads, shape.head_dim)
    k = linear(a["k_proj"], y).reshape(s, shape.num_kv_heads, shape.head_dim)
    v = linear(a["v_proj"], y).reshape(s, shape.num_kv_heads, shape.head_dim)
    if shape.qk_norm:
        q, k = rms_norm(q, a["q_norm"], shape.eps), rms_norm(k, a["k_norm"], shape.eps)
    o = attn_fn(rope(q, angles), rope(k, angles), v, ids, ids)
    h = x + linear(a["o_proj"], o.reshape(s, shape.num_heads * shape.head_dim))
    m = p["mlp"]
    z = rms_norm(h, p["post_attention_layernorm"], shape.eps)
    act = activation(shape.act)
    return h + linear(m["down_proj"], act(linear(m["gate_proj"], z)) * linear(m["up_proj"], z))


def vision_qkv_attention(p: Params, x: jax.Array, num_heads: int, angles: jax.Array | None, ids: AttnIds,
                         attn_fn: AttentionFn) -> jax.Array:
    """The Qwen vision attention: fused qkv Linear (head-minor columns: [3, H, D]), 2-D rotary,
    attention within a segment, output Linear `proj`."""
    s, d = x.shape
    qkv = linear(p["qkv"], x).reshape(s, 3, num_heads, d // num_heads)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    if angles is not None:
        q, k = rope(q, angles), rope(k, angles)
    return linear(p["proj"], attn_fn(q, k, v, ids, ids).reshape(s, d))


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
