"""The LLM half of every family: its forward pass from input embeddings to final hidden states, on
per-token rotary positions and the engine's pluggable attention (its config, `TextConfig` from a
`text_config` dict of config.json, is in `dhp_jax.model.hf.spec`).

Which text models are covered: Qwen2 (InternVL3's LLM; q/k/v biases), the Qwen2.5-VL text model
(q/k/v biases, 3-D M-RoPE), Qwen3 and the Qwen3-VL text model (per-head QK RMSNorm, optional
biases, interleaved M-RoPE), Llama (no biases). All are causal over the whole sample.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dhp_jax.model.attention import AttnIds
from dhp_jax.model.hf.layers import AttentionFn, BlockStream, Params, decoder_block, per_block, rms_norm, rotary
from dhp_jax.model.hf.scan import block_rows
from dhp_jax.model.tensor_parallel import TensorHooks
from dhp_jax.model.hf.spec import TextConfig  # noqa: F401 (re-exported)


def text_forward(cfg: TextConfig, p: Params, x: jax.Array, positions: jax.Array, ids: AttnIds,
                 attn_fn: AttentionFn, deepstack: jax.Array | None = None, remat: str = "none",
                 chunk: int = 0, tp: TensorHooks | None = None) -> jax.Array:
    """Final hidden states [S, d] of the decoder layers (subtree `language_model`; its `layers` a
    per-layer tree or `scan.BlockRows`) run on input embeddings x[S, d] at rotary positions[S,
    n_axes] with decoder ids `ids`, as one scan (`scan.run_blocks`); `deepstack` [levels, S, d]
    (DeepStack) is added after layers 0 .. levels-1. Each layer under `remat`
    (`layers.remat_block`), its token-local work in chunks of `chunk` rows with the chunks of
    padding (segment 0: a prefix of real tokens per shard) skipped (`layers.BlockStream`). `tp`:
    tensor parallelism, the layers' params one device's shares (`layers.decoder_block`); with
    `tp.sequence` the layers run sequence-parallel (Megatron SP, arXiv 2205.05198): the scan
    carries this device's rows of the stream (`layers.BlockStream.enter`), the DeepStack features are
    cut into the same rows (each is added to the hidden state of its own token), the rotary
    tables (from the M-RoPE positions) and the ids stay whole (a layer's q and k are computed on a
    chunk's rows joined over the rank), and the final hidden states are joined again
    (`layers.BlockStream.leave`) for the vocab-parallel head."""
    stack = block_rows(p["layers"], cfg.num_layers)
    stream = BlockStream(remat, chunk, ids.segment > 0, reorder=False, tp=tp)

    def block(b, h, blk, rot):
        return decoder_block(b, h, rot, AttnIds(*blk), cfg.shape, attn_fn, stream.chunk, stream.live,
                             None if tp is None else tp.psum, stream.sequence)

    s = x.shape[0]
    if deepstack is not None:       # [levels, S, d] -> [levels, rows, d]: the rows the scan carries
        deepstack = jnp.moveaxis(stream.enter(jnp.moveaxis(deepstack, 0, 1)), 1, 0)
    x = stream.scan(block, stack, stream.enter(x), per_block(cfg.num_layers, tuple(ids)),
                    rotary(cfg.rope.angles(positions)), feed=deepstack)
    return rms_norm(stream.leave(x, s), p["norm"], cfg.shape.eps)


def lm_head(params: Params, x: jax.Array, tied: bool) -> jax.Array:
    """logits = x @ lm_head (or @ embed_tokens.T when the embeddings are tied), in fp32."""
    if tied:
        w = params["model"]["language_model"]["embed_tokens"]["embedding"].T
    else:
        w = params["lm_head"]["kernel"]
    return (x @ w).astype(jnp.float32)
