"""The shapes of the families' blocks, read from config.json: rotary (`RopeSpec`), the LLM block
(`DecoderShape`) and the LLM (`TextConfig`). Plain Python and NumPy (no jax): the torch backend
(`npu_backend.hf`) reads the very same fields.

Rotary: every rotary kind of these families is rotate-half with per-token angles
`angles[s, j] = positions[s, axis[j]] * inv_freq[j]`, j < D/2; positions are int arrays
[S, n_axes] that travel with their tokens (1 axis for 1-D RoPE, (t, h, w) for M-RoPE, (h, w) for
the vision encoders' 2-D RoPE).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from dhp_jax import models
from dhp_jax.data import hf_config


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Which position axis and which inverse frequency drive each of the D/2 rotary angles."""

    axis: tuple[int, ...]
    inv_freq: tuple[float, ...]

    @staticmethod
    def inverse_frequencies(theta: float, dim: int) -> np.ndarray:
        """1 / theta ** (arange(0, dim, 2) / dim), computed in fp32 like transformers."""
        exps = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        return (np.float32(1.0) / np.power(np.float32(theta), exps, dtype=np.float32)).astype(np.float32)

    @classmethod
    def plain(cls, theta: float, head_dim: int) -> "RopeSpec":
        """1-D RoPE over the whole head (one position axis)."""
        inv = cls.inverse_frequencies(theta, head_dim)
        return cls((0,) * len(inv), tuple(float(f) for f in inv))

    @classmethod
    def mrope_sections(cls, theta: float, head_dim: int, sections: tuple[int, ...]) -> "RopeSpec":
        """Qwen2-VL / Qwen2.5-VL M-RoPE: the D/2 frequencies cut in consecutive sections
        (t, h, w), section i rotated by position axis i % 3."""
        inv = cls.inverse_frequencies(theta, head_dim)
        if sum(sections) != len(inv):
            raise ValueError(f"mrope_section {sections} must sum to head_dim/2 = {len(inv)}")
        axis = [i % 3 for i, n in enumerate(sections) for _ in range(n)]
        return cls(tuple(axis), tuple(float(f) for f in inv))

    @classmethod
    def mrope_interleaved(cls, theta: float, head_dim: int, sections: tuple[int, ...]) -> "RopeSpec":
        """Qwen3-VL interleaved M-RoPE: frequency j uses h when j % 3 == 1 and j < 3 * sections[1],
        w when j % 3 == 2 and j < 3 * sections[2], t otherwise."""
        inv = cls.inverse_frequencies(theta, head_dim)
        axis = []
        for j in range(len(inv)):
            if j % 3 == 1 and j < 3 * sections[1]:
                axis.append(1)
            elif j % 3 == 2 and j < 3 * sections[2]:
                axis.append(2)
            else:
                axis.append(0)
        return cls(tuple(axis), tuple(float(f) for f in inv))

    @classmethod
    def vision_2d(cls, theta: float, head_dim: int) -> "RopeSpec":
        """The Qwen vision encoders' axial 2-D RoPE: D/4 frequencies for h, the same D/4 for w."""
        inv = cls.inverse_frequencies(theta, head_dim // 2)
        return cls((0,) * len(inv) + (1,) * len(inv), tuple(float(f) for f in np.concatenate([inv, inv])))

    def angles(self, positions: Any) -> Any:
        """angles[S, D/2] (fp32) of integer positions[S, n_axes]."""
        pos = positions.astype(np.float32)[:, np.asarray(self.axis)]     # numpy or jax alike
        return pos * np.asarray(self.inv_freq, np.float32)[None, :]


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """What distinguishes the LLM blocks of the families: head counts, norm eps, whether the
    attention has a per-head RMSNorm on q and k (Qwen3), the activation. Biases are read off the
    parameter tree (Qwen2 / Qwen2.5 have q/k/v biases)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    qk_norm: bool = False
    act: str = "silu"


# Text config fields of a mixture-of-experts LLM (transformers' Qwen3MoeConfig, Qwen3VLMoeTextConfig)
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
              "router_aux_loss_coef")


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """The sparse blocks of a mixture-of-experts LLM (transformers' `Qwen3MoeSparseMoeBlock`,
    `Qwen3VLMoeTextSparseMoeBlock`): `num_experts` SwiGLU experts of width `intermediate_size`
    (`moe_intermediate_size`), each token sent to the `top_k` experts of highest softmax router
    probability, their outputs summed weighted by those probabilities, renormalised to sum 1 when
    `norm_topk_prob`. `sparse[i]`: layer i has the sparse block (else the dense MLP of
    `intermediate_size` of the config), by transformers' rule: i not in `mlp_only_layers`,
    num_experts > 0 and (i + 1) % `decoder_sparse_step` == 0. `router_aux_loss_coef`: the
    load-balancing loss's weight in config.json (the loss is added only when asked for).

    Parameters of a sparse layer i (transformers' `state_dict()` names under
    `model.language_model.layers.{i}.mlp`, torch shapes): `gate.weight` [E, d] (the router),
    `experts.gate_up_proj` [E, 2 * I, d] (gate rows first, then up) and `experts.down_proj`
    [E, d, I]."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse: tuple[bool, ...]
    router_aux_loss_coef: float

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], norm_topk_prob: bool) -> "MoeSpec":
        """Of a resolved text_config with the MoE fields (`MOE_FIELDS`); `norm_topk_prob` the
        router's rule (a field of Qwen3MoeConfig; Qwen3-VL-MoE's router always renormalises)."""
        n, e, k = int(cfg["num_hidden_layers"]), int(cfg["num_experts"]), int(cfg["num_experts_per_tok"])
        step = int(cfg["decoder_sparse_step"])
        dense = {int(i) for i in (cfg["mlp_only_layers"] or [])}
        sparse = tuple(i not in dense and e > 0 and step > 0 and (i + 1) % step == 0 for i in range(n))
        if any(sparse) and not 0 < k <= e:
            raise ValueError(f"text_config.num_experts_per_tok {k} must be in 1..num_experts ({e})")
        return cls(e, k, int(cfg["moe_intermediate_size"]), bool(norm_topk_prob), sparse,
                   float(cfg["router_aux_loss_coef"]))

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.sparse) if s)


def default_router_aux_loss_coef(config: Any) -> float:
    """The load-balancing loss's weight when the run sets none, as transformers decides: the text
    config's `router_aux_loss_coef` when config.json sets `output_router_logits` (in `text_config`
    or at the top) and the family's transformers model adds the loss to its loss
    (`FamilySpec.router_aux_loss`; InternVL's does not), else 0 (off). One rule for both engines
    (`dhp_jax.model.hf.moe.aux_loss_coef`, `npu_backend.moe.aux_loss_coef`)."""
    moe = getattr(getattr(config, "text", None), "moe", None)
    if moe is None or not any(moe.sparse):
        return 0.0
    if not models.spec(config.family).router_aux_loss:
        return 0.0
    raw = getattr(config, "raw", None) or {}
    on = (raw.get("text_config") or {}).get("output_router_logits", raw.get("output_router_logits", False))
    return float(moe.router_aux_loss_coef) if on else 0.0


def __getattr__(name: str):
    # model_type -> (q/k/v bias, QK-norm, rotary kind) of the registered families' LLMs (each family's
    # `ConfigRules.text_kinds`); where the config class has an `attention_bias` field
    # (`dhp_jax.data.hf_config.FIELDS`) it decides the bias, else the module's fixed bias does
    if name == "TEXT_MODELS":
        return models.text_kinds()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class TextConfig:
    """The shape of a family's LLM, read from its `text_config` as `dhp_jax.data.hf_config.resolve`
    gives it (every field present). `exact_positions`: positions at or past it would get a rotary
    that transformers rescales (a `dynamic` rope_type past max_position_embeddings); None: no bound."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    shape: DecoderShape
    rope: RopeSpec
    bias: bool
    exact_positions: int | None = None
    moe: MoeSpec | None = None

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> "TextConfig":
        """From a resolved `text_config` (`dhp_jax.data.hf_config.resolve(raw)["text_config"]`)."""
        model_type = cfg["model_type"]
        kinds = models.text_kinds()
        if model_type not in kinds:
            raise ValueError(f"text_config.model_type {model_type!r} is not supported (known: {sorted(kinds)})")
        bias, qk_norm, rope_kind = kinds[model_type]
        if "attention_bias" in hf_config.FIELDS[model_type]:
            bias = bool(cfg["attention_bias"])
        heads, head_dim = int(cfg["num_attention_heads"]), int(cfg["head_dim"])
        rp = cfg["rope_parameters"]
        theta = float(rp["rope_theta"])
        if rope_kind == "plain":
            rope = RopeSpec.plain(theta, head_dim)
        else:
            rope = getattr(RopeSpec, rope_kind)(theta, head_dim, tuple(int(s) for s in rp["mrope_section"]))
        if rp["rope_type"] == "linear":       # transformers divides the inverse frequencies by the factor
            rope = RopeSpec(rope.axis, tuple(float(f) for f in (np.asarray(rope.inv_freq, np.float32)
                                                                 / np.float32(rp["factor"])).astype(np.float32)))
        shape = DecoderShape(heads, int(cfg["num_key_value_heads"]), head_dim, float(cfg["rms_norm_eps"]), qk_norm,
                             cfg["hidden_act"])
        moe = None
        if "num_experts" in hf_config.FIELDS[model_type]:
            # Qwen3MoeConfig has the field; Qwen3VLMoeTextTopKRouter always renormalises
            norm = bool(cfg["norm_topk_prob"]) if "norm_topk_prob" in hf_config.FIELDS[model_type] else True
            moe = MoeSpec.from_dict(cfg, norm)
        return cls(model_type, int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]),
                   shape, rope, bias, hf_config.rope_exact_positions(cfg), moe)

    def check_positions(self, positions: Any, where: str = "sample") -> None:
        """Refuse positions past the bound where transformers' rotary would differ (`exact_positions`)."""
        positions = np.asarray(positions)
        if self.exact_positions is not None and positions.size and int(positions.max()) >= self.exact_positions:
            raise ValueError(f"{where}: position {int(positions.max())} is past text_config.max_position_embeddings "
                             f"{self.exact_positions}, where the 'dynamic' rope_scaling of config.json rescales the "
                             f"rotary (not supported: shorten the sample)")
