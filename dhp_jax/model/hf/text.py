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
from dhp_jax.model.hf import moe
from dhp_jax.model.hf.layers import (AttentionFn, BlockStream, Params, decoder_block, moe_decoder_block, per_block,
                                     rms_norm, rotary)
from dhp_jax.model.hf.scan import BlockRows, block_rows, layer_runs, run_blocks
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
    if cfg.moe is not None:
        return moe_text_forward(cfg, p, x, positions, ids, attn_fn, deepstack, remat, chunk, tp)
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


def moe_text_forward(cfg: TextConfig, p: Params, x: jax.Array, positions: jax.Array, ids: AttnIds,
                     attn_fn: AttentionFn, deepstack: jax.Array | None = None, remat: str = "none",
                     chunk: int = 0, tp: TensorHooks | None = None) -> jax.Array:
    """`text_forward` of a mixture-of-experts LLM (`cfg.moe`): the layers in runs of consecutive
    layers of one kind (`scan.layer_runs`: dense or sparse), each run one scan; a dense run is
    `scan.run_blocks` as every dense stack, a sparse run a scan that also sums the layers' router
    statistics (`layers.moe_decoder_block`), each layer under `remat` (`jax.checkpoint`). The
    statistics summed over the sparse layers go to `moe.collect` (the load-balancing loss, the
    metrics). `p["layers"]`: the per-layer tree, or {run's first layer: `BlockRows` of the run}."""
    spec = cfg.moe
    stream = BlockStream(remat, chunk, ids.segment > 0, reorder=False, tp=tp)
    reduce = None if tp is None else tp.psum
    first = 0
    if tp is not None:
        local = spec.num_experts // tp.size
        first = tp.index() * local
    s = x.shape[0]
    if deepstack is not None:
        deepstack = jnp.moveaxis(stream.enter(jnp.moveaxis(deepstack, 0, 1)), 1, 0)
    levels = 0 if deepstack is None else deepstack.shape[0]
    rot = rotary(cfg.rope.angles(positions))
    h = stream.enter(x)
    keep = None if stream.sequence is None else stream.enter((ids.segment > 0).astype(jnp.int32)) > 0
    stats = jnp.zeros((2, spec.num_experts), jnp.float32)
    for start, count, sparse in layer_runs(spec.sparse):
        layers = p["layers"]                         # one run of every layer: the stack itself
        stack = layers if isinstance(layers, BlockRows) else layers.get(str(start))
        if not isinstance(stack, BlockRows):        # the per-layer tree (a checkpoint's): stacked here
            stack = BlockRows.of([p["layers"][str(i)] for i in range(start, start + count)])
        feed = None if start >= levels else deepstack[start:min(levels, start + count)]
        if not sparse:
            def block(b, hh, blk, r):
                return decoder_block(b, hh, r, AttnIds(*blk), cfg.shape, attn_fn, stream.chunk, stream.live,
                                     reduce, stream.sequence)
            h = stream.scan(block, stack, h, per_block(count, tuple(ids)), rot, feed=feed)
            continue

        def layer(row, hh, r):
            return moe_decoder_block(stack.tree(row), hh, r, ids, cfg.shape, spec, attn_fn, stream.chunk,
                                     stream.live, reduce, stream.sequence, first, keep)

        if remat != "none":
            layer = jax.checkpoint(layer, policy=None if remat == "layer" else jax.checkpoint_policies.
                                   dots_with_no_batch_dims_saveable)
        at = jnp.asarray([i if i < levels else -1 for i in range(start, start + count)], jnp.int32)

        def step(carry, xs, layer=layer, feed=feed):
            hh, acc = carry
            row, a = xs
            hh, st = layer(row, hh, rot)
            if feed is not None:
                hh = hh + jnp.where(a >= 0, feed[jnp.maximum(a - start, 0)], jnp.zeros_like(hh))
            return (hh, acc + st), None

        (h, stats), _ = jax.lax.scan(step, (h, stats), (stack.rows, at))
    rows = jnp.sum((ids.segment > 0).astype(jnp.float32)) * sum(spec.sparse)
    moe.report(stats, rows)
    return rms_norm(stream.leave(h, s), p["norm"], cfg.shape.eps)


def lm_head(params: Params, x: jax.Array, tied: bool) -> jax.Array:
    """logits = x @ lm_head (or @ embed_tokens.T when the embeddings are tied), in fp32."""
    if tied:
        w = params["model"]["language_model"]["embed_tokens"]["embedding"].T
    else:
        w = params["lm_head"]["kernel"]
    return (x @ w).astype(jnp.float32)
