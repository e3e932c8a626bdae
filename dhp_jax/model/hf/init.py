"""Random checkpoints of the families without transformers: every weight's transformers name and
shape from a parsed `HFConfig` (`weight_shapes`), a seeded random tree (`random_params`), and the
tiny configs `dhp example` writes (`tiny_config`).

Initialisation follows transformers' `_init_weights` in kind: Linear, convolution and embedding
weights N(0, 0.02), biases 0, norm scales 1, InternViT layer scales 0.1 (its config's
`layer_scale_init_value`). `hf.save_pretrained(config, random_params(config), dir)` writes a
directory that transformers' `from_pretrained` loads with no missing and no unexpected weight.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from dhp_jax import models
from dhp_jax.model.hf.checkpoint import tree_from_weights
from dhp_jax.model.hf.config import HFConfig
from dhp_jax.model.hf.families import hf_module

STD = 0.02
LAYER_SCALE = 0.1


def _linear(out: dict, name: str, n_out: int, n_in: int, bias: bool) -> None:
    out[f"{name}.weight"] = ("normal", (n_out, n_in))
    if bias:
        out[f"{name}.bias"] = ("zeros", (n_out,))


def _norm(out: dict, name: str, d: int, bias: bool) -> None:
    out[f"{name}.weight"] = ("ones", (d,))
    if bias:
        out[f"{name}.bias"] = ("zeros", (d,))


def _text_shapes(cfg: HFConfig, out: dict) -> None:
    t, s = cfg.text, cfg.text.shape
    d, pre = t.hidden_size, "model.language_model"
    inter = int(cfg.fields["text_config"]["intermediate_size"])
    out[f"{pre}.embed_tokens.weight"] = ("normal", (t.vocab_size, d))
    for i in range(t.num_layers):
        p = f"{pre}.layers.{i}"
        _linear(out, f"{p}.self_attn.q_proj", s.num_heads * s.head_dim, d, t.bias)
        _linear(out, f"{p}.self_attn.k_proj", s.num_kv_heads * s.head_dim, d, t.bias)
        _linear(out, f"{p}.self_attn.v_proj", s.num_kv_heads * s.head_dim, d, t.bias)
        _linear(out, f"{p}.self_attn.o_proj", d, s.num_heads * s.head_dim, False)
        if s.qk_norm:
            _norm(out, f"{p}.self_attn.q_norm", s.head_dim, False)
            _norm(out, f"{p}.self_attn.k_norm", s.head_dim, False)
        if t.moe is not None and t.moe.sparse[i]:       # `dhp_jax.model.hf.moe`
            e, mi = t.moe.num_experts, t.moe.intermediate_size
            _linear(out, f"{p}.mlp.gate", e, d, False)
            out[f"{p}.mlp.experts.gate_up_proj"] = ("normal", (e, 2 * mi, d))
            out[f"{p}.mlp.experts.down_proj"] = ("normal", (e, d, mi))
        else:
            _linear(out, f"{p}.mlp.gate_proj", inter, d, False)
            _linear(out, f"{p}.mlp.up_proj", inter, d, False)
            _linear(out, f"{p}.mlp.down_proj", d, inter, False)
        _norm(out, f"{p}.input_layernorm", d, False)
        _norm(out, f"{p}.post_attention_layernorm", d, False)
    _norm(out, f"{pre}.norm", d, False)
    if not cfg.tied:
        out["lm_head.weight"] = ("normal", (t.vocab_size, d))


def weight_shapes(cfg: HFConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{transformers weight name: (initialiser, torch shape)} of every weight of the model."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    _text_shapes(cfg, out)
    hf_module(cfg.family).vision_weight_shapes(cfg, out)      # the encoder's and projector's
    return out


def random_params(cfg: HFConfig, seed: int = 0) -> dict:
    """A float32 parameter tree of `cfg` (the tree `load_pretrained` returns), seeded."""
    rng = np.random.default_rng(seed)
    fills = {"normal": lambda s: rng.normal(0.0, STD, s), "zeros": np.zeros, "ones": np.ones,
             "scale": lambda s: np.full(s, LAYER_SCALE)}
    named = [(name, fills[kind](shape).astype(np.float32)) for name, (kind, shape) in weight_shapes(cfg).items()]
    return tree_from_weights(named)


def tiny_config(family: str, token_ids: Mapping[str, int], vocab_size: int) -> dict[str, Any]:
    """config.json of a tiny model of `family` whose vision settings fit the processor files of
    `dhp_jax.data.example` (the family's `FamilySpec.tiny_config`; Qwen2.5-VL 14-px and Qwen3-VL
    16-px patches, temporal 2, merge 2; InternVL 112-px tiles of 14-px patches, 16 tokens a tile)
    over the LLM settings below. `token_ids`: the tokenizer's ids of the placeholders the family's
    example names (`FamilySpec.example.token_names`), and of "bos" and "eos" (optional)."""
    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                bos_token_id=token_ids.get("bos"), eos_token_id=token_ids.get("eos"),
                pad_token_id=token_ids.get("bos"))
    return models.spec(family).tiny_config(token_ids, vocab_size, text)
