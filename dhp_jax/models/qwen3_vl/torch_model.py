"""Qwen3-VL in torch (the torch backend only): its encoder over the packed vision stream (with the
position-table taps and the DeepStack mergers), the twin of `jax_model.encode_stream`, and its
tensor-parallel split."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dhp_jax.models.qwen_common.torch_vision import qwen_sequence_locals, qwen_vision_split
from dhp_jax.models.qwen_common.hf_vision import VISION_EPS
from npu_backend.hf import TorchFamilyModel, activation, rope_angles, segment_ids


def merge(m: TorchFamilyModel, prefix: str, x: torch.Tensor, norm_after_merge: bool) -> torch.Tensor:
    width = m.config.vision.hidden_size * m.config.vision.merge ** 2
    if norm_after_merge:
        y = m.layer_norm(prefix + ".norm", x.reshape(-1, width), VISION_EPS)
    else:
        y = m.layer_norm(prefix + ".norm", x, VISION_EPS).reshape(-1, width)
    return m.linear(prefix + ".linear_fc2", F.gelu(m.linear(prefix + ".linear_fc1", y)))


def encode(m: TorchFamilyModel, vi, pixels, tap_weights, attn):
    v = m.config.vision
    x = m.linear("model.visual.patch_embed.proj", pixels)
    taps = torch.stack([vi[f"tap{i}"] for i in range(tap_weights.shape[1])], dim=1)
    table = m.w("model.visual.pos_embed.weight")
    x = x + torch.sum(table[taps] * tap_weights[:, :, None], dim=1).to(x.dtype)
    angles = rope_angles(v.rope, torch.stack([vi["row"], vi["col"]], dim=1))
    ids = segment_ids(vi["frame"])
    act, s = activation(v.act), x.shape[0]
    deep = []
    x = m.split_rows(x)              # sequence parallelism: the blocks run on this process's rows
    for i in range(v.depth):
        b = f"model.visual.blocks.{i}"
        x = x + m.vision_attention(b + ".attn", m.layer_norm(b + ".norm1", x, VISION_EPS), v.num_heads, angles, ids, attn)
        y = m.column(m.layer_norm(b + ".norm2", x, VISION_EPS), [b + ".mlp.linear_fc1"], s)[0]
        x = x + m.row_linear(b + ".mlp.linear_fc2", act(y))
        if i in v.deepstack_blocks:      # the merger reads the whole stream (all-gathered under sequence parallelism)
            k = v.deepstack_blocks.index(i)
            deep.append(merge(m, f"model.visual.deepstack_merger_list.{k}", m.join_rows(x, s), norm_after_merge=True))
    return merge(m, "model.visual.merger", m.join_rows(x, s), norm_after_merge=False), deep


# ----------------------------------------------------------------- tensor parallelism (`npu_backend.tensor_parallel`)
VISION_MLP_FIRST = "model.visual.blocks.0.mlp.linear_fc1.weight"


def vision_split(c, params: dict, j: int, t: int, put, out: dict) -> None:
    qwen_vision_split(c, params, j, t, put, out, ("linear_fc1",), "linear_fc2")


def sequence_locals(c) -> tuple[list, list]:
    return qwen_sequence_locals(c, "mlp." + "linear_fc2")
