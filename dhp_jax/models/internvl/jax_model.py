"""InternVL (InternVL2.5 arXiv:2412.05271, InternVL3 arXiv:2504.10479) in the transformers-native
layout of the `-hf` releases, as transformers' `InternVLForConditionalGeneration` defines it.

Vision encoder, InternViT (`model.vision_tower`), per tile of pixel_values [tiles, C, H, W]:
- patch embedding: a Conv2d with bias over P x P patches (raster order), a CLS token in front,
  plus the absolute position table (1 + (H/P)(W/P) rows; the tile size must be the config's);
- layers: h = x + lambda_1 * proj(attn(norm_before(x))); out = h + lambda_2 * fc2(act(fc1(norm_after(h))))
  (norm: LayerNorm with bias or RMSNorm, `norm_type`; optional q/k biases and RMSNorm over
  the whole q and k, `use_qk_norm`); full bidirectional attention inside a tile, no rotary;
- a final LayerNorm unless `use_mean_pooling`.
Projector: drop the CLS token, pixel shuffle (each 2 x 2 patches -> one token of 4x width, for
`downsample_ratio` 0.5), LayerNorm (eps 1e-5), linear_2(act(linear_1(.))).
LLM (`model.language_model`): the `text_config` model (Qwen2 with q/k/v biases in InternVL2.5 /
InternVL3), 1-D RoPE over the token offset; image features replace the image placeholder tokens.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from dhp_jax.model.hf.config import HFConfig
from dhp_jax.models.internvl.hf_config import PROJECTOR_EPS, QK_NORM_EPS, pixel_shuffle
from dhp_jax.model.attention import AttnIds
from dhp_jax.model.hf.layers import (AttentionFn, BlockStream, Params, activation, block_collectives, causal_ids,
                                     layer_norm, linear, per_block, rms_norm, row_linear, segment_ids, split_rms_norm)
from dhp_jax.model.hf.scan import block_rows
from dhp_jax.model.mllm import split_block
from dhp_jax.model.hf.text import text_forward
from dhp_jax.model.tensor_parallel import TensorHooks



def encode(cfg: HFConfig, params: Params, enc: Mapping[str, Any], attn_fn: AttentionFn) -> jax.Array:
    """LLM-token features [tiles * (H/P)(W/P) / k**2, d] of the tiles (subtrees `model.vision_tower`
    and `model.multi_modal_projector`)."""
    v = cfg.vision
    p = params["model"]["vision_tower"]
    emb = p["embeddings"]
    proj = emb["patch_embeddings"]["projection"]
    x = linear(proj, jnp.asarray(enc["patches"]).astype(proj["kernel"].dtype))                # [n, hw, d]
    n, hw, d = x.shape
    x = jnp.concatenate([jnp.broadcast_to(emb["cls_token"].reshape(1, 1, d), (n, 1, d)), x], axis=1)
    if "position_embeddings" in emb:
        x = x + emb["position_embeddings"].reshape(1, hw + 1, d)
    x = x.reshape(n * (hw + 1), d)                                   # the tiles as one stream
    x = encoder_layers(cfg, p, x, segment_ids(np.repeat(np.arange(1, n + 1), hw + 1)), attn_fn)
    side = int(round(hw ** 0.5))
    x = pixel_shuffle(x.reshape(n, hw + 1, d)[:, 1:].reshape(n, side, side, d), v.shuffle)
    return project(cfg, params, x.reshape(-1, x.shape[-1]))


def encoder_layers(cfg: HFConfig, p: Params, x: jax.Array, ids: Any, attn_fn: AttentionFn,
                   live: jax.Array | None = None, tp: TensorHooks | None = None) -> jax.Array:
    """InternViT's layers and final norm over a stream of patch (and CLS) rows x[N, d] (subtree
    `model.vision_tower`), attending within the segments of `ids` (one per tile). `live` (bool per
    row, optional): the rows a result is read from; with it the layers skip the chunks of the
    others (`layers.BlockStream`, `cfg.linear_chunk`). `tp`: tensor parallelism, the layers'
    params one device's share (its heads of q/k/v and of the QK-norm scales, its MLP columns; the
    head count read off the q kernel), summed over the rank after the row-split projection_layer
    and fc2 (their biases added once) and in the QK-norm's sum of squares over the whole width.
    With `tp.sequence` the layers run sequence-parallel (arXiv 2205.05198,
    `layers.block_collectives`): the scan carries this device's rows (CLS rows included: a CLS
    token is a row like any other), the norms, the layer scales lambda_1 / lambda_2 and the
    residuals apply to them, the normed rows are all-gathered before q/k/v and fc1, the outputs of
    projection_layer and fc2 reduce-scattered back; the ids stay whole and the final norm reads the
    whole stream joined again (`BlockStream.leave`), as the pixel shuffle after it does."""
    v = cfg.vision
    d = x.shape[-1]
    norm = layer_norm if v.norm == "layer_norm" else rms_norm
    act, hd = activation(v.act), d // v.num_heads
    stream = BlockStream(cfg.remat, cfg.linear_chunk, live, tp=tp)
    widen, reduce, t = block_collectives(None if tp is None else tp.psum, stream.sequence)

    def qk_norm(y, q):     # y: the rows joined over the rank (sequence-parallel too), this device's heads
        return (rms_norm(y, q, QK_NORM_EPS) if tp is None
                else split_rms_norm(y, q, QK_NORM_EPS, tp.psum, d))

    ids = stream.rows(ids)

    def project(b, xc, _):
        a = b["attention"]
        y = widen(norm(xc, b["layernorm_before"], v.eps))
        q, k = linear(a["q_proj"], y), linear(a["k_proj"], y)
        if v.qk_norm:
            q, k = qk_norm(q, a["q_norm"]), qk_norm(k, a["k_norm"])
        shape = (-1, a["q_proj"]["kernel"].shape[-1] // hd, hd)
        return q.reshape(shape), k.reshape(shape), linear(a["v_proj"], y).reshape(shape)

    def finish(b, xc, oc):
        proj = b["attention"]["projection_layer"]
        xc = xc + b["lambda_1"] * row_linear(proj, oc.reshape(-1, proj["kernel"].shape[0]), reduce)
        m = b["mlp"]
        z = widen(norm(xc, b["layernorm_after"], v.eps))
        return xc + b["lambda_2"] * row_linear(m["fc2"], act(linear(m["fc1"], z)), reduce)

    def block(b, h, blk, _):
        ii = AttnIds(*blk)
        return split_block(b, h, (), stream.live, project, finish, lambda q, k, u: attn_fn(q, k, u, ii, ii),
                           stream.chunk, t, ii.segment.shape[0])

    stack = block_rows(p["encoder"]["layer"], v.num_layers)
    x = stream.leave(stream.scan(block, stack, stream.enter(x), per_block(v.num_layers, tuple(ids))), x.shape[0])
    if v.final_norm:
        x = layer_norm(x, p["layernorm"], v.eps)
    return x


def project(cfg: HFConfig, params: Params, x: jax.Array) -> jax.Array:
    """The projector (subtree `model.multi_modal_projector`) on pixel-shuffled rows [tokens, k*k*d]."""
    pr = params["model"]["multi_modal_projector"]
    y = linear(pr["linear_1"], layer_norm(x, pr["layer_norm"], PROJECTOR_EPS))
    return linear(pr["linear_2"], activation(cfg.vision.projector_act)(y))


def hidden(cfg: HFConfig, params: Params, batch: Mapping[str, Any], attn_fn: AttentionFn) -> jax.Array:
    """Final LLM hidden states [L, d] of one prepared sample."""
    lm = params["model"]["language_model"]
    x = lm["embed_tokens"]["embedding"][jnp.asarray(batch["input_ids"])]
    if "image" in batch:
        feats = encode(cfg, params, batch["image"], attn_fn)
        x = x.at[jnp.asarray(batch["image"]["scatter"])].set(feats.astype(x.dtype))
    return text_forward(cfg.text, lm, x, jnp.asarray(batch["positions"]), causal_ids(batch["keep"]), attn_fn)


def encode_stream(cfg: HFConfig, params: Params, vi: Mapping[str, jax.Array], pixels: jax.Array,
                  tap_weights: jax.Array, attn_fn: AttentionFn, tp: TensorHooks | None, s: int,
                  live: jax.Array) -> tuple[jax.Array, list]:
    """`packed_forward`'s encoder on a packed vision stream (`model.hf.packed`): the patch embedding,
    each tile's CLS row, the position table, InternViT's layers, then the CLS rows dropped and the
    pixel-shuffled rows projected: (features [s, d], [])."""
    p = params["model"]["vision_tower"]
    emb = p["embeddings"]
    proj = emb["patch_embeddings"]["projection"]
    x = linear(proj, pixels.astype(proj["kernel"].dtype))
    d = x.shape[-1]
    x = jnp.where(vi["cls"][:, None] > 0, emb["cls_token"].reshape(1, d).astype(x.dtype), x)
    if "position_embeddings" in emb:
        x = x + emb["position_embeddings"].reshape(-1, d)[vi["table"]].astype(x.dtype)
    x = encoder_layers(cfg, p, x, segment_ids(vi["frame"]), attn_fn, live, tp)
    kk = cfg.vision.shuffle ** 2
    x = x.reshape(s, kk + 1, d)[:, :kk].reshape(s, kk * d)      # drop the CLS row: pixel-shuffled rows
    return project(cfg, params, x), []
