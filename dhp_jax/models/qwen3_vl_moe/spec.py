"""Qwen3-VL-MoE's `FamilySpec` (transformers' `Qwen3VLMoeConfig`: Qwen3-VL-30B-A3B,
Qwen3-VL-235B-A22B): Qwen3-VL's vision encoder, processors, chat and example files unchanged
(`dhp_jax.models.qwen3_vl.spec`), its LLM `Qwen3VLMoeTextConfig`: Qwen3-VL's text blocks with a
sparse mixture-of-experts block in the layers the config makes sparse (`MoeSpec`)."""

from __future__ import annotations

from typing import Any, Mapping

from dhp_jax.models import ConfigRules, FamilySpec, register
from dhp_jax.models.qwen3_vl import spec as dense
from dhp_jax.models.qwen_common.tiny import qwen_tiny

NAME = "qwen3_vl_moe"
WIDTH_OVER_HEADS = "=hidden_size//num_attention_heads"     # head_dim absent or null
TEXT, VISION = "qwen3_vl_moe_text", "qwen3_vl_moe_vision"

FIELDS = {
    TEXT: dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
               num_attention_heads=16, num_key_value_heads=16, head_dim=WIDTH_OVER_HEADS, hidden_act="silu",
               rms_norm_eps=1e-6, max_position_embeddings=128000, attention_bias=False,
               rope_theta=500000.0, mrope_section=[24, 20, 20],
               num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408, decoder_sparse_step=1,
               mlp_only_layers=[], router_aux_loss_coef=0.001),
    VISION: dict(dense.FIELDS[dense.VISION]),
    NAME: dict(dense.FIELDS[dense.NAME]),
}
CONFIG = ConfigRules(FIELDS, (TEXT,), VISION, {NAME: VISION},
                     text_kinds={TEXT: (False, True, "mrope_interleaved")})   # QK-norm, interleaved M-RoPE

# the tiny MoE LLM: 8 experts, top 2, layer 0 dense (mlp_only_layers), layers 1 and 2 sparse
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                mlp_only_layers=[0], num_hidden_layers=3)


def tiny_config(token_ids: Mapping[str, int], vocab_size: int, text: dict) -> dict[str, Any]:
    """Qwen3-VL's tiny config (`dhp_jax.models.qwen3_vl.spec.tiny_config`) with a MoE LLM (`TINY_MOE`)."""
    raw = dense.tiny_config(token_ids, vocab_size, text)
    vision = {k: v for k, v in raw["vision_config"].items() if k != "model_type"}
    return qwen_tiny(NAME, "Qwen3VLMoeForConditionalGeneration", {**raw["text_config"], **TINY_MOE},
                     {"model_type": TEXT}, vision, token_ids)


SPEC = register(FamilySpec(
    name=NAME, model_types=(NAME,), name_prefixes=("qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b", "qwen3_vl_moe"), router_aux_loss=True,
    config=CONFIG, facts=dense.facts, processor=dense.Processor(),
    processor_names=(NAME,), chat=dense.Chat(), example=dense.EXAMPLE, vision_rule="qwen3-vl",
    published_model="qwen3-vl-8b", memory=dense.MEMORY, tiny_config=tiny_config, demo=dense.Demo(),
    hf_module="dhp_jax.models.qwen3_vl_moe.hf_config", jax_module="dhp_jax.models.qwen3_vl.jax_model",
    torch_module="dhp_jax.models.qwen3_vl_moe.torch_model"))
