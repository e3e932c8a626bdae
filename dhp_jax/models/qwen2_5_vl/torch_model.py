"""Qwen2.5-VL in torch (the torch backend only): its encoder over the packed vision stream, the
twin of `jax_model.encode_stream`, and its tensor-parallel split."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dhp_jax.models.qwen_common.torch_vision import qwen_sequence_locals, qwen_vision_split
from dhp_jax.models.qwen_common.hf_vision import VISION_EPS
from npu_backend.hf import TorchFamilyModel, activation, rope_angles, segment_ids


def encode(m: TorchFamilyModel, vi, pixels, tap_weights, attn):
    v = m.config.vision
    x = m.linear("model.visual.patch_embed.proj", pixels)
    angles = rope_angles(v.rope, torch.stack([vi["row"], vi["col"]], dim=1))
    frames, windows = segment_ids(vi["frame"]), segment_ids(vi["window"])
    act, s = activation(v.act), x.shape[0]
    x = m.split_rows(x)              # sequence parallelism: the blocks run on this process's rows
    for i in range(v.depth):
        b = f"model.visual.blocks.{i}"
        ids = frames if i in v.full_attention_blocks else windows
        x = x + m.vision_attention(b + ".attn", m.rms_norm(b + ".norm1", x, VISION_EPS), v.num_heads, angles, ids, attn)
        gate, up = m.column(m.rms_norm(b + ".norm2", x, VISION_EPS), [b + ".mlp.gate_proj", b + ".mlp.up_proj"], s)
        x = x + m.row_linear(b + ".mlp.down_proj", act(gate) * up)
    x = m.join_rows(x, s)
    y = m.rms_norm("model.visual.merger.ln_q", x, VISION_EPS).reshape(-1, v.hidden_size * v.merge ** 2)
    return m.linear("model.visual.merger.mlp.2", F.gelu(m.linear("model.visual.merger.mlp.0", y))), []


# ----------------------------------------------------------------- tensor parallelism (`npu_backend.tensor_parallel`)
VISION_MLP_FIRST = "model.visual.blocks.0.mlp.gate_proj.weight"


def vision_split(c, params: dict, j: int, t: int, put, out: dict) -> None:
    qwen_vision_split(c, params, j, t, put, out, ("gate_proj", "up_proj"), "down_proj")


def sequence_locals(c) -> tuple[list, list]:
    return qwen_sequence_locals(c, "mlp." + "down_proj")
