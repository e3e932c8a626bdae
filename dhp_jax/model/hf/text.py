"""The LLM half of every family: its forward pass from input embeddings to final hidden states, on
per-token rotary positions and the engine's pluggable attention (its config, `TextConfig` from a
`text_config` dict of config.json, is in `dhp_jax.model.hf.spec`).

Which text models are covered: Qwen2 (InternVL3's LLM; q/k/v biases), the Qwen2.5-VL text model
(q/k/v biases, 3-D M-RoPE), Qwen3 and the Qwen3-VL text model (per-head QK RMSNorm, optional
biases, interleaved M-RoPE), Llama (no biases). All are causal over the whole sample.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from dhp_jax.model.attention import AttnIds
from dhp_jax.model.hf.layers import AttentionFn, BlockStream, Params, decoder_block, rms_norm
from dhp_jax.model.hf.spec import TEXT_MODELS, TextConfig, rope_parameters  # noqa: F401 (re-exported)

# A hook run after decoder layer i: (i, x) -> x (DeepStack adds vision features there).
LayerHook = Callable[[int, jax.Array], jax.Array]


def text_forward(cfg: TextConfig, p: Params, x: jax.Array, positions: jax.Array, ids: AttnIds,
                 attn_fn: AttentionFn, after_layer: LayerHook | None = None, remat: str = "none",
                 chunk: int = 0) -> jax.Array:
    """Final hidden states [S, d] of the decoder layers (subtree `language_model`) run on input
    embeddings x[S, d] at rotary positions[S, n_axes] with decoder ids `ids`; each layer under
    `remat` (`layers.remat_block`), its token-local work in chunks of `chunk` rows with the chunks
    of padding (segment 0: a prefix of real tokens per shard) skipped (`layers.BlockStream`)."""
    angles = cfg.rope.angles(positions)
    layers = p["layers"]
    stream = BlockStream(remat, chunk, ids.segment > 0, reorder=False)
    block = stream.block(lambda b, h: decoder_block(b, h, angles, ids, cfg.shape, attn_fn, stream.chunk, stream.live))
    for i in range(cfg.num_layers):
        x = block(layers[str(i)], x)
        if after_layer is not None:
            x = after_layer(i, x)
    return rms_norm(x, p["norm"], cfg.shape.eps)


def lm_head(params: Params, x: jax.Array, tied: bool) -> jax.Array:
    """logits = x @ lm_head (or @ embed_tokens.T when the embeddings are tied), in fp32."""
    if tied:
        w = params["model"]["language_model"]["embed_tokens"]["embedding"].T
    else:
        w = params["lm_head"]["kernel"]
    return (x @ w).astype(jnp.float32)
