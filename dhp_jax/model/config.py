"""`MLLMConfig`: the shape of the multimodal model (vision encoder + projector + decoder LLM).

"tiny" is the model the tests and the CPU demo instantiate. The six named presets carry the public
shapes of the six models DHP evaluates (arXiv 2602.21788; docs/DESIGN.md, Sources); they feed cost-model presets and are never instantiated here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dhp_jax.checks import positive_int


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
    def preset(cls, name: str, **overrides: Any) -> "MLLMConfig":
        """A named shape ("tiny" or one of the six models DHP evaluates), with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


# Public shapes (decoder layers/heads/kv/hidden and vision hidden as DHP, arXiv 2602.21788, lists its
# models; the head size, MLP widths, vocabularies and vision depths from the models' published
# config.json on the Hugging Face Hub: OpenGVLab/InternVL3-2B, OpenGVLab/InternVL2_5-4B,
# OpenGVLab/InternVL3-8B, Qwen/Qwen3-VL-{2B,4B,8B}-Instruct).
# InternViT merges 2x2 patches of 14x14x3 (patch_dim 2352); Qwen3-VL merges 2x2 patches of
# 16x16x3 over 2 frames (patch_dim 6144).
_INTERNVIT = dict(patch_dim=2352, vision_dim=1024, vision_layers=24, vision_heads=16,
                  vision_head_dim=64, vision_ff=4096)
_QWEN3_VIT = dict(patch_dim=6144, vision_dim=1024, vision_layers=24, vision_heads=16,
                  vision_head_dim=64, vision_ff=4096)
PRESETS: dict[str, MLLMConfig] = {
    "tiny": MLLMConfig(),
    "internvl3-2b": MLLMConfig("internvl3-2b", 151674, 1536, 28, 12, 2, 128, 8960, **_INTERNVIT,
                               rope_base=1e6),
    "internvl2.5-4b": MLLMConfig("internvl2.5-4b", 151674, 2048, 36, 16, 8, 128, 11008, **_INTERNVIT,
                                 rope_base=1e6),
    "internvl3-8b": MLLMConfig("internvl3-8b", 151674, 3584, 28, 28, 4, 128, 18944, **_INTERNVIT,
                               rope_base=1e6),
    "qwen3-vl-2b": MLLMConfig("qwen3-vl-2b", 151936, 2048, 28, 16, 8, 128, 6144, **_QWEN3_VIT,
                              rope_base=5e6),
    "qwen3-vl-4b": MLLMConfig("qwen3-vl-4b", 151936, 2560, 36, 32, 8, 128, 9728, **_QWEN3_VIT,
                              rope_base=5e6),
    "qwen3-vl-8b": MLLMConfig("qwen3-vl-8b", 151936, 4096, 36, 32, 8, 128, 12288,
                              patch_dim=6144, vision_dim=1152, vision_layers=27, vision_heads=16,
                              vision_head_dim=72, vision_ff=4304, rope_base=5e6),
}
