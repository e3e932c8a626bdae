"""`MLLMConfig`: the shape of the multimodal model (vision encoder + projector + decoder LLM).

"tiny" is the model the tests and the CPU demo instantiate. The other presets are the six models DHP
evaluates (arXiv 2602.21788), built by `MLLMConfig.from_hf` from their published config.json
fields, stored once in `dhp_jax/data/models/` (the planner's cost presets read the same files). The
engine's model is a stand-in architecture (one SwiGLU block stack over merged patches) at those
widths and depths; the real families are `dhp_jax.model.hf`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from dhp_jax.checks import positive_int
from dhp_jax.data import model_configs


# MLLMConfig fields that change how a step runs, never the params: a checkpoint's config may differ
# in them (a run resumes, the torch backend starts, with another value)
RUN_ONLY_MODEL_FIELDS = ("remat", "linear_chunk")


def run_model_section(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The `model` section of the run config that a checkpoint's meta stores ({} when there is none):
    `pretrained` names the Hugging Face checkpoint a fine-tuning run started from, `preset` the model
    of any other run."""
    model = (meta.get("run_config") or {}).get("model")
    return model if isinstance(model, dict) else {}


@dataclasses.dataclass(frozen=True)
class MLLMConfig:
    """Hyper-parameters of the model; frozen (hashable) so it can be a static jit argument.

    Decoder: `num_layers` blocks of width `d_model`, `num_heads` query heads and `num_kv_heads`
    key/value heads of size `head_dim`, SwiGLU width `d_ff`, vocabulary `vocab_size`.
    Vision encoder: `patch_dim` input features per merged patch (one per LLM vision token),
    `vision_layers` blocks of width `vision_dim` with `vision_heads` heads of `vision_head_dim`,
    SwiGLU width `vision_ff`. Shared: RMSNorm `rms_eps`, rotary base `rope_base`.
    `remat`: recompute policy of every block in the backward pass ("none": keep everything;
    "layer": keep only each block's input; "selective": keep the block's GEMM outputs). It changes
    memory and time, never params or values, so checkpoints ignore it.
    `linear_chunk`: tokens per chunk of every block's token-local work (norms, projections, MLP);
    a chunk with no real token (padding) is skipped (`dhp_jax.model.mllm.block_apply`); in the
    vision encoder, whose rows run vision rows first, a chunk with no vision token; 0: one
    pass over the whole stream. Like `remat` it changes time, never values.
    """

    name: str = "tiny"
    vocab_size: int = 256
    d_model: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    d_ff: int = 64
    patch_dim: int = 12
    vision_dim: int = 16
    vision_layers: int = 1
    vision_heads: int = 2
    vision_head_dim: int = 8
    vision_ff: int = 32
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    remat: str = "none"      # "none" | "layer" | "selective": jax.checkpoint around every block
    linear_chunk: int = 0    # tokens per skippable chunk of the blocks' linear work (0: no chunks)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("name", "rope_base", "rms_eps", "remat", "linear_chunk"):
                continue
            positive_int(v, f"MLLMConfig.{f.name}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"MLLMConfig: num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (GQA groups must be equal)")
        if self.head_dim % 2 or self.vision_head_dim % 2:
            raise ValueError("MLLMConfig: head_dim and vision_head_dim must be even (rotary halves)")
        if self.remat not in ("none", "layer", "selective"):
            raise ValueError(f"MLLMConfig.remat must be 'none', 'layer' or 'selective', got {self.remat!r}")
        if isinstance(self.linear_chunk, bool) or not isinstance(self.linear_chunk, int) or self.linear_chunk < 0:
            raise ValueError(f"MLLMConfig.linear_chunk must be an integer >= 0 (0: no chunks), got {self.linear_chunk!r}")
        if not self.rms_eps > 0 or not self.rope_base > 1:
            raise ValueError("MLLMConfig: rms_eps must be > 0 and rope_base > 1")

    @property
    def kv_group(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        """Parameter count of the tree `init_params` builds (exact)."""
        d, v = self.d_model, self.vision_dim
        attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        dec = self.num_layers * (attn + 3 * d * self.d_ff + 2 * d)
        vattn = 4 * v * self.vision_heads * self.vision_head_dim
        vis = self.vision_layers * (vattn + 3 * v * self.vision_ff + 2 * v)
        return (self.vocab_size * d + self.patch_dim * v + v + vis + v
                + v * d + d + d * d + d + dec + d + d * self.vocab_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf(cls, config: "Mapping[str, Any] | str | os.PathLike", **overrides: Any) -> "MLLMConfig":
        """The engine's config at the widths and depths of a published model: `config` is its
        config.json (a dict, a checkpoint directory or the file; `internvl`, `internvl_chat`,
        `qwen2_5_vl` or `qwen3_vl`). The LLM is the config's; the stand-in encoder gets the real
        encoder's depth, width, heads and MLP width, and `patch_dim` = the pixels of the patches
        one LLM token merges (2x2 x C x T x P x P). `overrides` replace fields (e.g. `name`,
        `remat`). The planner prices the real family from the same fields
        (`dhp_jax.planner.cost.presets.ModelShape.from_config`)."""
        raw = model_configs.read_config(config)
        f = model_configs.facts_from_config(raw, where=str(overrides.get("name") or "config"))
        fields = dict(name=str(raw.get("model_type", "hf")), vocab_size=f.vocab, d_model=f.hidden,
                      num_layers=f.layers, num_heads=f.heads, num_kv_heads=f.kv_heads, head_dim=f.head_dim,
                      d_ff=f.intermediate, patch_dim=f.patch_dim, vision_dim=f.vision_hidden,
                      vision_layers=f.vision_layers, vision_heads=f.vision_heads,
                      vision_head_dim=f.vision_head_dim, vision_ff=f.vision_intermediate,
                      rope_base=f.rope_theta, rms_eps=f.rms_eps)
        return cls(**{**fields, **overrides})

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "MLLMConfig":
        """A named shape ("tiny" or a stored dense model, `dhp_jax/data/models`), with optional field
        overrides. A stored mixture-of-experts model is refused: the stand-in has no experts."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
        if name in MOE_PRESETS:
            raise ValueError(f"model preset {name!r} is a mixture of experts, which the stand-in MLLMConfig cannot "
                             f"build; train its family model from a checkpoint (model.pretrained=DIR, dhp_jax.model.hf)")
        return dataclasses.replace(PRESETS[name], **overrides)


def split_shape(config: MLLMConfig) -> Any:
    """The fields tensor parallelism splits, as `dhp_jax.planner.cost.tensor_parallel.unsplittable` reads a
    model shape (heads, kv_heads, intermediate, vision_heads, vision_intermediate), named as
    `MLLMConfig` fields in its errors. No jax: the train config validates with it."""
    import types

    return types.SimpleNamespace(
        heads=config.num_heads, kv_heads=config.num_kv_heads, intermediate=config.d_ff,
        vision_heads=config.vision_heads, vision_intermediate=config.vision_ff,
        FIELD_NAMES={"heads": "MLLMConfig.num_heads", "kv_heads": "MLLMConfig.num_kv_heads",
                     "intermediate": "MLLMConfig.d_ff", "vision_heads": "MLLMConfig.vision_heads",
                     "vision_intermediate": "MLLMConfig.vision_ff"})


PRESETS: dict[str, MLLMConfig] = {"tiny": MLLMConfig()}
PRESETS.update({name: MLLMConfig.from_hf(model_configs.model_config(name), name=name)
                for name in model_configs.model_names()})
MOE_PRESETS = frozenset(name for name in model_configs.model_names() if model_configs.model_facts(name).moe)
