"""Qwen2.5-VL (arXiv:2502.13923) as transformers' `Qwen2_5_VLForConditionalGeneration` defines it.

Vision encoder (`model.visual`), per image or video, over flattened patches x[N, C*T*P*P]:
- patch_embed: a Conv3d without bias = x @ kernel;
- `depth` blocks: x += proj(attn(RMSNorm1(x))); x += down(silu(gate(y)) * up(y)), y = RMSNorm2(x)
  (eps 1e-6; q/k/v fused in `qkv`, all vision Linears with bias); 2-D rotary over (row, column);
  attention within a window of merged tokens (`window_segments`), except in the
  `fullatt_block_indexes` blocks, which attend within a frame;
- merger: RMSNorm(x) per patch, each merge**2 consecutive patches concatenated, then
  mlp.2(GELU(mlp.0(.))) (exact GELU) -> one LLM token.
LLM (`model.language_model`): Qwen2 blocks (q/k/v biases) with 3-D M-RoPE in sections
(`RopeSpec.mrope_sections`); vision features replace the embeddings of the image / video
placeholder tokens; video frames are `tokens_per_second * second_per_grid_ts` apart in time.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from dhp_jax.model.hf.config import HFConfig
from dhp_jax.models.qwen_common.hf_vision import VISION_EPS
from dhp_jax.model.attention import AttnIds
from dhp_jax.model.hf.layers import (AttentionFn, BlockStream, Params, causal_ids, gated, linear,
                                     qwen_vision_block, rms_norm, rotary, row_linear, segment_ids)
from dhp_jax.model.hf.scan import block_rows
from dhp_jax.model.hf.text import text_forward
from dhp_jax.model.tensor_parallel import TensorHooks




def encode(cfg: HFConfig, p: Params, enc: Mapping[str, Any], attn_fn: AttentionFn,
           tp: TensorHooks | None = None) -> jax.Array:
    """LLM-token features [N / merge**2, d] of one modality's patches (subtree `model.visual`).
    `enc["live"]` (optional, bool per patch): the patches a feature is read from; with it, the
    blocks skip the chunks of the others (`layers.BlockStream`, `cfg.linear_chunk`). `tp`:
    tensor parallelism, the blocks' params one device's share (`layers.qwen_vision_block`), summed
    over the rank after the row-split proj and down_proj; with `tp.sequence` the blocks run
    sequence-parallel (arXiv 2205.05198): the scan carries this device's rows of the patch stream
    (`layers.BlockStream.enter`), the rotary tables and each block's window or frame ids whole in
    the blocks' order, and the merger reads the whole stream joined again (`BlockStream.leave`)."""
    v = cfg.vision
    x = jnp.asarray(enc["pixels"]).astype(p["patch_embed"]["proj"]["kernel"].dtype) @ p["patch_embed"]["proj"]["kernel"]
    stream = BlockStream(cfg.remat, cfg.linear_chunk, enc.get("live"), tp=tp)
    rot = rotary(stream.rows(v.rope.angles(jnp.asarray(enc["patch_positions"]))))
    frames, windows = (stream.rows(segment_ids(enc[k])) for k in ("frames", "windows"))

    def norm(y: jax.Array, q: Params) -> jax.Array:
        return rms_norm(y, q, VISION_EPS)

    def mlp(m: Params, y: jax.Array, reduce: Callable[[jax.Array], jax.Array] | None) -> jax.Array:
        return row_linear(m["down_proj"], gated(v.act, linear(m["gate_proj"], y), linear(m["up_proj"], y)), reduce)

    def block(b, h, blk, rt):
        return qwen_vision_block(b, h, rt, AttnIds(*blk), v.num_heads, norm, mlp, attn_fn, stream.chunk, stream.live,
                                 None if tp is None else tp.psum, stream.sequence)

    # each block's ids, scanned: a frame's in the full-attention blocks, a window's in the others
    full = jnp.asarray([i in v.full_attention_blocks for i in range(v.depth)])[:, None]
    ids = tuple(jnp.where(full, f[None], w[None]) for f, w in zip(frames, windows))
    x = stream.leave(stream.scan(block, block_rows(p["blocks"], v.depth), stream.enter(x), ids, rot), x.shape[0])
    m = p["merger"]
    y = rms_norm(x, m["ln_q"], VISION_EPS).reshape(-1, v.hidden_size * v.merge ** 2)
    return linear(m["mlp"]["2"], jax.nn.gelu(linear(m["mlp"]["0"], y), approximate=False))


def hidden(cfg: HFConfig, params: Params, batch: Mapping[str, Any], attn_fn: AttentionFn) -> jax.Array:
    """Final LLM hidden states [L, d] of one prepared sample."""
    lm = params["model"]["language_model"]
    x = lm["embed_tokens"]["embedding"][jnp.asarray(batch["input_ids"])]
    for kind in ("image", "video"):
        if kind in batch:
            feats = encode(cfg, params["model"]["visual"], batch[kind], attn_fn)
            x = x.at[jnp.asarray(batch[kind]["scatter"])].set(feats.astype(x.dtype))
    return text_forward(cfg.text, lm, x, jnp.asarray(batch["positions"]), causal_ids(batch["keep"]), attn_fn)


def encode_stream(cfg: HFConfig, params: Params, vi: Mapping[str, jax.Array], pixels: jax.Array,
                  tap_weights: jax.Array, attn_fn: AttentionFn, tp: TensorHooks | None, s: int,
                  live: jax.Array) -> tuple[jax.Array, list]:
    """`packed_forward`'s encoder on a packed vision stream (`model.hf.packed`): (merged features, [])."""
    enc = {"pixels": pixels, "patch_positions": jnp.stack([vi["row"], vi["col"]], axis=1),
           "frames": vi["frame"], "windows": vi["window"], "live": live}
    return encode(cfg, params["model"]["visual"], enc, attn_fn, tp), []
