"""Qwen3-VL (arXiv:2511.21631) as transformers' `Qwen3VLForConditionalGeneration` defines it.

Vision encoder (`model.visual`), per image or video, over flattened patches x[N, C*T*P*P]:
- patch_embed: a Conv3d with bias = x @ kernel + bias, plus a learned position embedding: the
  square table `pos_embed` [side**2, d] resampled to the image's (h, w) patch grid by bilinear
  interpolation with aligned corners (4 taps per patch, `interpolation_taps`);
- `depth` blocks: x += proj(attn(LayerNorm1(x))); x += fc2(act(fc1(LayerNorm2(x)))) (eps 1e-6,
  `hidden_act`, gelu-tanh in the released configs); 2-D rotary over (row, column); attention
  within a frame;
- merger: LayerNorm per patch, merge**2 consecutive patches concatenated, fc2(GELU(fc1(.)));
- DeepStack (arXiv:2406.04334): after block `deepstack_visual_indexes[k]`, merger k (LayerNorm
  over the concatenated merge**2 patches instead) makes features that are added to the hidden
  states of the vision tokens after LLM layer k.
LLM (`model.language_model`): Qwen3 blocks (QK RMSNorm per head, no biases by default) with
interleaved M-RoPE (`RopeSpec.mrope_interleaved`); a video's frames are separate spans (the
processor puts a timestamp between them), each at temporal position = its start.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from dhp_jax.model.hf.config import HFConfig
from dhp_jax.models.qwen_common.hf_vision import VISION_EPS
from dhp_jax.model.attention import AttnIds
from dhp_jax.model.hf.layers import (AttentionFn, BlockStream, Params, activation, causal_ids, layer_norm, linear,
                                     per_block, qwen_vision_block, rotary, row_linear, segment_ids)
from dhp_jax.model.hf.scan import block_rows
from dhp_jax.model.hf.text import text_forward
from dhp_jax.model.tensor_parallel import TensorHooks




def merge_patches(cfg: HFConfig, p: Params, x: jax.Array, norm_after_merge: bool) -> jax.Array:
    """A patch merger: LayerNorm (per patch, or over the merged row), fc2(GELU(fc1(.)))."""
    width = cfg.vision.hidden_size * cfg.vision.merge ** 2
    if norm_after_merge:
        y = layer_norm(x.reshape(-1, width), p["norm"], VISION_EPS)
    else:
        y = layer_norm(x, p["norm"], VISION_EPS).reshape(-1, width)
    return linear(p["linear_fc2"], jax.nn.gelu(linear(p["linear_fc1"], y), approximate=False))


def encode(cfg: HFConfig, p: Params, enc: Mapping[str, Any], attn_fn: AttentionFn,
           tp: TensorHooks | None = None) -> tuple[jax.Array, list]:
    """(LLM-token features [N / merge**2, d], DeepStack features [levels] of the same shape).
    `enc["live"]`, `tp`: as in `qwen2_5_vl.encode` (the interpolated position embedding added to
    the whole stream before the blocks); under sequence parallelism each DeepStack tap, the hidden
    state after its block, is this device's rows and is joined into the whole stream for its merger
    (`layers.BlockStream.leave`), as the last block's output is for the merger."""
    v = cfg.vision
    kernel = p["patch_embed"]["proj"]["kernel"]
    x = linear(p["patch_embed"]["proj"], jnp.asarray(enc["pixels"]).astype(kernel.dtype))
    table = p["pos_embed"]["embedding"]
    x = x + jnp.sum(table[jnp.asarray(enc["taps"])] * jnp.asarray(enc["tap_weights"])[:, :, None], axis=1).astype(x.dtype)
    stream = BlockStream(cfg.remat, cfg.linear_chunk, enc.get("live"), tp=tp)
    rot = rotary(stream.rows(v.rope.angles(jnp.asarray(enc["patch_positions"]))))
    ids = stream.rows(segment_ids(enc["frames"]))
    act = activation(v.act)

    def norm(y: jax.Array, q: Params) -> jax.Array:
        return layer_norm(y, q, VISION_EPS)

    def mlp(m: Params, y: jax.Array, reduce: Callable[[jax.Array], jax.Array] | None) -> jax.Array:
        return row_linear(m["linear_fc2"], act(linear(m["linear_fc1"], y)), reduce)

    def block(b, h, blk, rt):
        return qwen_vision_block(b, h, rt, AttnIds(*blk), v.num_heads, norm, mlp, attn_fn, stream.chunk, stream.live,
                                 None if tp is None else tp.psum, stream.sequence)

    s = x.shape[0]
    stack = block_rows(p["blocks"], v.depth)
    taps = tuple(v.deepstack_blocks)
    out = stream.scan(block, stack, stream.enter(x), per_block(v.depth, tuple(ids)), rot, taps=taps)
    x, tapped = out if taps else (out, ())
    deep = [merge_patches(cfg, p["deepstack_merger_list"][str(k)], stream.leave(tapped[k], s), norm_after_merge=True)
            for k in range(len(taps))]
    return merge_patches(cfg, p["merger"], stream.leave(x, s), norm_after_merge=False), deep


def hidden(cfg: HFConfig, params: Params, batch: Mapping[str, Any], attn_fn: AttentionFn) -> jax.Array:
    """Final LLM hidden states [L, d] of one prepared sample. DeepStack features are per-token
    rows [levels, L, d] (zero off the vision tokens) added after the first LLM layers."""
    lm = params["model"]["language_model"]
    x = lm["embed_tokens"]["embedding"][jnp.asarray(batch["input_ids"])]
    deep = None
    for kind in ("image", "video"):
        if kind in batch:
            feats, levels = encode(cfg, params["model"]["visual"], batch[kind], attn_fn)
            where = jnp.asarray(batch[kind]["scatter"])
            x = x.at[where].set(feats.astype(x.dtype))
            if levels:
                rows = jnp.stack(levels).astype(x.dtype)
                deep = (jnp.zeros((len(levels),) + x.shape, x.dtype) if deep is None else deep).at[:, where].set(rows)
    return text_forward(cfg.text, lm, x, jnp.asarray(batch["positions"]), causal_ids(batch["keep"]), attn_fn,
                        deepstack=deep)


def encode_stream(cfg: HFConfig, params: Params, vi: Mapping[str, jax.Array], pixels: jax.Array,
                  tap_weights: jax.Array, attn_fn: AttentionFn, tp: TensorHooks | None, s: int,
                  live: jax.Array) -> tuple[jax.Array, list]:
    """`packed_forward`'s encoder on a packed vision stream (`model.hf.packed`): (merged features,
    DeepStack features)."""
    taps = tap_weights.shape[1]
    enc = {"pixels": pixels, "patch_positions": jnp.stack([vi["row"], vi["col"]], axis=1),
           "frames": vi["frame"], "taps": jnp.stack([vi[f"tap{i}"] for i in range(taps)], axis=1),
           "tap_weights": tap_weights, "live": live}
    return encode(cfg, params["model"]["visual"], enc, attn_fn, tp)
