"""The one source of model shapes: published Hugging Face `config.json` fields, read into `ModelFacts`.

Each named model is one directory `dhp_jax/data/models/<name>/` laid out as a checkpoint directory
without weights: `config.json`, the published file of the release (its layout and fields), and
`source.json` with its Hub repository id (`hub_id`), the file's address (`source`) and notes on what
was checked or assumed. A new model is one such directory. Every config is read by the one reader
`dhp_jax.data.hf_config` (as transformers reads it), so a preset and a checkpoint directory
(`--model DIR`, `model.pretrained=DIR`) are read alike, in every layout a registered family reads
(`dhp_jax.models`); the vision encoder's facts are the family's (`FamilySpec.facts`).

Mixture-of-experts LLMs (`qwen3_vl_moe`, and InternVL with a `qwen3_moe` LLM) are read by their
families alike; their sparse blocks are read from the resolved LLM section (`moe_facts`).

`ModelFacts` is what the planner prices (`dhp_jax.planner.cost.presets.ModelShape.from_facts`), what
`dhp_jax.model.MLLMConfig.from_hf` sizes, and what picks the vision-token rule: every consumer
reads the same fields. Pure Python (the planner imports it and must not import jax).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Mapping

from dhp_jax import models
from dhp_jax.data import hf_config

MODELS_DIR = Path(__file__).with_name("models")


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """The shape of one published model, as its config.json gives it (field names are the planner's).

    LLM: `layers` decoder blocks of width `hidden`, `heads` query / `kv_heads` key-value heads of
    `head_dim`, SwiGLU width `intermediate`, `vocab` tokens, `tied` LM head.
    Vision encoder: `vision_layers` blocks of width `vision_hidden`, `vision_heads` x
    `vision_head_dim`, MLP width `vision_intermediate` with `vision_mlp` matrices (2: GELU
    fc1/fc2, InternViT and Qwen3-VL; 3: SwiGLU gate/up/down, Qwen2.5-VL); `patch_size` px patches
    over `temporal_patch` frames, `merge` x `merge` of them merged after the encoder into one LLM
    token (`patches_per_token`). Attention: full over `frame_patches` patches, except
    `window_layers` layers that attend within windows of `window_patches` (Qwen2.5-VL).
    `deepstack`: vision layers whose features a merger of their own adds to the first LLM layers
    (Qwen3-VL). `projector_hidden`: the middle width of the projector / patch merger.
    `params`: the exact parameter count of transformers' model built from this config.
    `vision_rule`: the name of the token rule of `dhp_jax.data.vision`.
    Mixture of experts (all 0 / empty for a dense LLM): `experts` experts of SwiGLU width
    `expert_intermediate` in each layer of `sparse_layers` (the others are dense, of width
    `intermediate`), `experts_per_token` (top-k) of them per token, their gates renormalised over
    the k when `norm_topk`; `router_aux_loss_coef` weighs the load-balancing loss.
    `active_params`: the parameters one token's forward pass uses (all but the experts it is not
    routed to; `params` for a dense model).
    """

    family: str
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    intermediate: int
    head_dim: int
    vocab: int
    tied: bool
    rope_theta: float
    rms_eps: float
    vision_layers: int
    vision_hidden: int
    vision_intermediate: int
    vision_heads: int
    vision_head_dim: int
    vision_mlp: int
    patch_size: int
    temporal_patch: int
    channels: int
    merge: int
    frame_patches: int
    window_patches: int
    window_layers: int
    deepstack: int
    projector_hidden: int
    params: int
    vision_rule: str
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    sparse_layers: tuple[int, ...] = ()
    norm_topk: bool = False
    router_aux_loss_coef: float = 0.0
    active_params: int = 0

    @property
    def moe(self) -> bool:
        """Whether any LLM layer is a sparse mixture-of-experts block."""
        return bool(self.sparse_layers)

    @property
    def patches_per_token(self) -> int:
        """Encoder patches per LLM vision token (the merge after the encoder)."""
        return self.merge * self.merge

    @property
    def patch_dim(self) -> int:
        """Input features per LLM vision token: `patches_per_token` patches of C x T x P x P pixels."""
        return self.patches_per_token * self.channels * self.temporal_patch * self.patch_size ** 2


@functools.lru_cache(maxsize=None)
def model_names() -> tuple[str, ...]:
    """The stored models, by family and then by size (the order DHP, arXiv 2602.21788, lists them)."""
    names = [p.parent.name for p in MODELS_DIR.glob("*/config.json")]
    if not names:
        raise FileNotFoundError(f"no model config files under {MODELS_DIR} (is the package installed with its data?)")
    facts = {n: model_facts(n) for n in names}
    return tuple(sorted(names, key=lambda n: (facts[n].family, facts[n].params)))


def is_stored(name: str) -> bool:
    """Whether `name` is a stored model (a directory `dhp_jax/data/models/<name>/` with config.json)."""
    return (MODELS_DIR / str(name).lower() / "config.json").is_file()


def model_dir(name: str) -> Path:
    """The directory of stored model `name` (config.json, source.json, processor configs)."""
    if not is_stored(name):
        known = sorted(p.parent.name for p in MODELS_DIR.glob("*/config.json"))
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(known)}")
    return MODELS_DIR / str(name).lower()


def model_record(name: str) -> dict[str, Any]:
    """Stored model `name`: its source.json ({"name", "hub_id", "source", "notes", ...}) with
    "config", its config.json."""
    path = model_dir(name)
    with open(path / "source.json") as f:
        record = json.load(f)
    if not record.get("hub_id"):
        raise ValueError(f"{path / 'source.json'}: a model's source.json needs 'hub_id'")
    record["config"] = read_config(path)
    return record


def model_config(name: str) -> dict[str, Any]:
    """The published config.json fields of model `name`."""
    return model_record(name)["config"]


@functools.lru_cache(maxsize=None)
def model_facts(name: str) -> ModelFacts:
    """`ModelFacts` of stored model `name` (read once)."""
    return facts_from_config(model_config(name), where=f"model {name!r}")


read_config = hf_config.read_config


def hf_layout(config: Mapping[str, Any]) -> dict[str, Any]:
    """The nested transformers layout of a config (`dhp_jax.data.hf_config.nested`): a flat
    Qwen2.5-VL file nested, InternVL's chat layout as the `-hf` one; others as they are."""
    return hf_config.nested(config)


# ------------------------------------------------------------------ mixture-of-experts LLMs
MOE_INTS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")


def moe_facts(text: Mapping[str, Any], where: str = "text_config.") -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelFacts` of a resolved LLM section (`hf_config.resolve`,
    the family's defaults filled in; {} for a dense LLM), as transformers builds the decoder: layer i
    is sparse unless it is in `mlp_only_layers`, when there are experts and (i + 1) is a multiple of
    `decoder_sparse_step`. A router whose config class has no `norm_topk_prob` (Qwen3-VL-MoE's)
    always renormalises its top-k gates. `where`: the section's prefix in errors."""
    if text.get("num_experts") is None:
        return {}
    for k in MOE_INTS:
        v, low = text[k], (0 if k == "num_experts" else 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{where}{k}: {v!r} is not a {'non-negative' if low == 0 else 'positive'} integer")
    experts, k, step = int(text["num_experts"]), int(text["num_experts_per_tok"]), int(text["decoder_sparse_step"])
    if experts and k > experts:
        raise ValueError(f"{where}num_experts_per_tok {k} is more than num_experts {experts}")
    layers, dense = int(text["num_hidden_layers"]), list(text.get("mlp_only_layers") or [])
    bad = [i for i in dense if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers]
    if bad:
        raise ValueError(f"{where}mlp_only_layers: {bad} are not layer indices 0..{layers - 1}")
    sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    norm = text.get("norm_topk_prob")
    return dict(experts=experts if sparse else 0, experts_per_token=k if sparse else 0,
                expert_intermediate=int(text["moe_intermediate_size"]) if sparse else 0, sparse_layers=sparse,
                norm_topk=(True if norm is None else bool(norm)) and bool(sparse),
                router_aux_loss_coef=float(text["router_aux_loss_coef"]))


def _moe_params(f: Mapping[str, Any], moe: Mapping[str, Any]) -> tuple[int, int]:
    """(parameters the sparse blocks add over dense MLPs of width `intermediate` in their layers,
    parameters of the experts one token is not routed to) of the LLM: per sparse layer the router
    (hidden x experts) and each expert's fused gate/up and down matrices (3 x hidden x width), less
    the dense MLP it replaces."""
    if not moe.get("sparse_layers"):
        return 0, 0
    d, n = f["hidden"], len(moe["sparse_layers"])
    expert = 3 * d * moe["expert_intermediate"]
    extra = n * (d * moe["experts"] + moe["experts"] * expert - 3 * d * f["intermediate"])
    return extra, n * (moe["experts"] - moe["experts_per_token"]) * expert


def _text(t: Mapping[str, Any]) -> dict[str, Any]:
    """The planner's LLM fields of a resolved text_config."""
    return dict(layers=int(t["num_hidden_layers"]), heads=int(t["num_attention_heads"]),
                kv_heads=int(t["num_key_value_heads"]), hidden=int(t["hidden_size"]),
                intermediate=int(t["intermediate_size"]), head_dim=int(t["head_dim"]), vocab=int(t["vocab_size"]),
                rope_theta=float(t["rope_parameters"]["rope_theta"]), rms_eps=float(t["rms_norm_eps"]))


def _text_params(t: Mapping[str, Any], f: dict[str, Any], tied: bool) -> int:
    """Parameters of the decoder, embedding and LM head, as transformers builds them."""
    d, hd = f["hidden"], f["head_dim"]
    q, kv = f["heads"] * hd, f["kv_heads"] * hd
    # q/k/v biases: Qwen2's attention always has them; the others' config says (attention_bias)
    bias = bool(t["attention_bias"]) if "attention_bias" in hf_config.FIELDS[t["model_type"]] else True
    qk_norm = models.text_kinds()[t["model_type"]][1]            # the family's `ConfigRules.text_kinds`
    layer = d * (q + 2 * kv) + q * d + 3 * d * f["intermediate"] + 2 * d
    layer += (q + 2 * kv) * bias + 2 * hd * qk_norm
    return f["layers"] * layer + d + f["vocab"] * d * (1 if tied else 2)


def facts_from_config(config: Mapping[str, Any], where: str = "config") -> ModelFacts:
    """`ModelFacts` of a published config dict (any of its published layouts), read as transformers
    reads it (`dhp_jax.data.hf_config.resolve`; a MoE LLM's sparse blocks by `moe_facts`)."""
    raw = hf_config.resolve(config, where)
    family = raw["model_type"]
    t = raw["text_config"]
    moe = moe_facts(t, f"{where}: {models.spec(family).config.text_section(config)}")
    text = _text(t)
    d = text["hidden"]
    tied = bool(raw["tie_word_embeddings"])          # transformers' rule (hf_config.tied)
    f = models.spec(family).facts(raw, d, where)
    vh, vi, vn, depth, patch = f["vh"], f["vi"], f["vn"], f["depth"], f["patch"]
    vision, projector = f["vision"], f["projector"]
    if vh % vn:
        raise ValueError(f"{where}: vision hidden_size {vh} is not a multiple of its {vn} heads")
    extra, idle = _moe_params(text, moe)
    params = _text_params(t, text, tied) + vision + projector + extra
    return ModelFacts(family=family, **text, tied=tied, vision_layers=depth, vision_hidden=vh, vision_intermediate=vi,
                      vision_heads=vn, vision_head_dim=vh // vn, vision_mlp=f["mlp"], patch_size=patch,
                      temporal_patch=f["temporal"], channels=f["channels"], merge=f["merge"],
                      frame_patches=f["frame"], window_patches=f["window"], window_layers=f["window_layers"],
                      deepstack=f["deepstack"], projector_hidden=f["proj_hidden"], params=params,
                      vision_rule=f["rule"], **moe, active_params=params - idle)
