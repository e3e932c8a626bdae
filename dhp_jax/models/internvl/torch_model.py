"""InternVL in torch (the torch backend only): InternViT and the projector over the packed vision
stream, the twin of `jax_model.encode_stream`, and its tensor-parallel split."""

from __future__ import annotations

import torch

from dhp_jax.models.internvl.hf_config import PROJECTOR_EPS, QK_NORM_EPS
from npu_backend.hf import TorchFamilyModel, activation, segment_ids


def encode(m: TorchFamilyModel, vi, pixels, tap_weights, attn):
    v, p = m.config.vision, "model.vision_tower"
    emb = p + ".embeddings"
    x = m.linear(emb + ".patch_embeddings.projection", pixels)
    d = x.shape[-1]
    x = torch.where(vi["cls"][:, None] > 0, m.w(emb + ".cls_token").reshape(1, d).to(x.dtype), x)
    if emb + ".position_embeddings" in m.params:
        x = x + m.w(emb + ".position_embeddings").reshape(-1, d)[vi["table"]].to(x.dtype)
    ids = segment_ids(vi["frame"])
    norm = m.layer_norm if v.norm == "layer_norm" else m.rms_norm
    act, heads = activation(v.act), v.num_heads
    local = m.local_heads(heads)          # this process's heads under tensor parallelism
    s = x.shape[0]
    x = m.split_rows(x)                   # sequence parallelism: the blocks run on this process's rows
    for i in range(v.num_layers):
        b = f"{p}.encoder.layer.{i}"
        a = b + ".attention"
        q, k, val = m.column(norm(b + ".layernorm_before", x, v.eps), [a + ".q_proj", a + ".k_proj", a + ".v_proj"], s)
        if v.qk_norm:          # over all heads: a sum over the rank when they are split
            q, k = m.split_rms_norm(a + ".q_norm", q, QK_NORM_EPS), m.split_rms_norm(a + ".k_norm", k, QK_NORM_EPS)
        shape = (s, local, d // heads)
        o = attn(q.reshape(shape), k.reshape(shape), val.reshape(shape), ids)
        x = x + m.w(b + ".lambda_1") * m.row_linear(a + ".projection_layer", o.reshape(s, -1))
        y = m.column(norm(b + ".layernorm_after", x, v.eps), [b + ".mlp.fc1"], s)[0]
        x = x + m.w(b + ".lambda_2") * m.row_linear(b + ".mlp.fc2", act(y))
    x = m.join_rows(x, s)
    if v.final_norm:
        x = m.layer_norm(p + ".layernorm", x, v.eps)
    kk = v.shuffle ** 2
    x = x.reshape(-1, kk + 1, d)[:, :kk].reshape(-1, kk * d)       # drop the CLS row: pixel-shuffled rows
    pr = "model.multi_modal_projector"
    y = m.linear(pr + ".linear_1", m.layer_norm(pr + ".layer_norm", x, PROJECTOR_EPS))
    return m.linear(pr + ".linear_2", activation(v.projector_act)(y)), []


# ----------------------------------------------------------------- tensor parallelism (`npu_backend.tensor_parallel`)
VISION_MLP_FIRST = "model.vision_tower.encoder.layer.0.mlp.fc1.weight"


def vision_split(c, params: dict, j: int, t: int, put, out: dict) -> None:
    """The slices tp index j of t holds of each InternViT layer: q/k/v (and the QK-norm scales over
    the whole width) by heads, projection_layer by columns, fc1 by rows, fc2 by columns."""
    v = c.vision
    pre = "model.vision_tower.encoder.layer"
    hq, d = v.num_heads // t, v.hidden_size // v.num_heads
    for i in range(v.num_layers):
        a, m = f"{pre}.{i}.attention", f"{pre}.{i}.mlp"
        heads_rows = (0, j * hq * d, (j + 1) * hq * d)
        for k in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"):
            put(f"{a}.{k}", heads_rows)
        out[f"{a}.projection_layer.weight"] = (1, *heads_rows[1:])
        ff = params[f"{m}.fc1.weight"].shape[0] // t
        put(f"{m}.fc1", (0, j * ff, (j + 1) * ff))
        out[f"{m}.fc2.weight"] = (1, j * ff, (j + 1) * ff)


def sequence_locals(c) -> tuple[list, list]:
    """(block, modules) sequence parallelism applies to local rows (the norms, the row-split
    matrices' biases), and the layer scales, whole parameters whose gradient sums over the rank."""
    pre = "model.vision_tower.encoder.layer"
    n = c.vision.num_layers
    return ([(f"{pre}.{i}", ("layernorm_before", "layernorm_after", "attention.projection_layer", "mlp.fc2"))
             for i in range(n)], [f"{pre}.{i}.{lam}" for i in range(n) for lam in ("lambda_1", "lambda_2")])
