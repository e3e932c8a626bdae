"""The LLM half of every family: its config (from a `text_config` dict of config.json) and its
forward pass from input embeddings to final hidden states, on per-token rotary positions and
the engine's pluggable attention.

Which text models are covered: Qwen2 (InternVL3's LLM; q/k/v biases), the Qwen2.5-VL text model
(q/k/v biases, 3-D M-RoPE), Qwen3 and the Qwen3-VL text model (per-head QK RMSNorm, optional
biases, interleaved M-RoPE), Llama (no biases). All are causal over the whole sample.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from dhp_jax.model.attention import AttnIds
from dhp_jax.model.hf.layers import AttentionFn, DecoderShape, Params, RopeSpec, decoder_block, rms_norm

# model_type -> (q/k/v bias, QK-norm, rotary kind); a bias given by config["attention_bias"] wins
TEXT_MODELS: dict[str, tuple[bool, bool, str]] = {
    "qwen2": (True, False, "plain"),
    "qwen2_5_vl_text": (True, False, "mrope_sections"),
    "qwen2_vl_text": (True, False, "mrope_sections"),
    "qwen3": (False, True, "plain"),
    "qwen3_vl_text": (False, True, "mrope_interleaved"),
    "llama": (False, False, "plain"),
}


def rope_parameters(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The rotary parameters of a config dict in transformers 5's form ({"rope_type", "rope_theta",
    "mrope_section"?}), also from the older `rope_scaling` / `rope_theta` fields."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = "default" if kind == "mrope" else kind
    return params


@dataclasses.dataclass(frozen=True, eq=False)
class TextConfig:
    """The shape of a family's LLM, read from its `text_config`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    shape: DecoderShape
    rope: RopeSpec
    bias: bool

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> "TextConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in TEXT_MODELS:
            raise ValueError(f"text_config.model_type {model_type!r} is not supported (known: {sorted(TEXT_MODELS)})")
        if cfg.get("use_sliding_window"):
            raise ValueError(f"text_config: sliding-window attention (use_sliding_window) is not supported")
        bias, qk_norm, rope_kind = TEXT_MODELS[model_type]
        bias = bool(cfg.get("attention_bias", bias))
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        rp = rope_parameters(cfg)
        if rp["rope_type"] != "default":
            raise ValueError(f"text_config: rope_type {rp['rope_type']!r} is not supported (only 'default')")
        theta = float(rp["rope_theta"])
        if rope_kind == "plain":
            rope = RopeSpec.plain(theta, head_dim)
        else:
            sections = tuple(int(s) for s in rp["mrope_section"])
            rope = getattr(RopeSpec, rope_kind)(theta, head_dim, sections)
        shape = DecoderShape(heads, int(cfg.get("num_key_value_heads") or heads), head_dim,
                             float(cfg.get("rms_norm_eps", 1e-6)), qk_norm, cfg.get("hidden_act", "silu"))
        return cls(model_type, int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]),
                   shape, rope, bias)


# A hook run after decoder layer i: (i, x) -> x (DeepStack adds vision features there).
LayerHook = Callable[[int, jax.Array], jax.Array]


def text_forward(cfg: TextConfig, p: Params, x: jax.Array, positions: jax.Array, ids: AttnIds,
                 attn_fn: AttentionFn, after_layer: LayerHook | None = None) -> jax.Array:
    """Final hidden states [S, d] of the decoder layers (subtree `language_model`) run on input
    embeddings x[S, d] at rotary positions[S, n_axes] with decoder ids `ids`."""
    angles = cfg.rope.angles(positions)
    layers = p["layers"]
    for i in range(cfg.num_layers):
        x = decoder_block(layers[str(i)], x, angles, ids, cfg.shape, attn_fn)
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
