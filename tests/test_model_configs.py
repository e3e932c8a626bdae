"""One source of model shapes: the published config.json files in dhp_jax/data/models, read by
dhp_jax.data.model_configs, are what the planner prices, what MLLMConfig.from_hf sizes and what
picks the vision-token rule; the parameter counts are transformers' own."""

import dataclasses
import json

import pytest

from dhp_jax.data import model_configs
from dhp_jax.data.vision import family_for_model, image_tokens, vision_rules
from dhp_jax.model import MLLMConfig
from dhp_jax.planner import CostModel
from dhp_jax.planner.cost import memory, presets
from dhp_jax.planner.cost.model import _encoder_flops

NAMES = ("internvl3-2b", "internvl2.5-4b", "internvl3-8b", "qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b")
# the 32B-class checkpoints of the three families (tensor parallelism's presets), listed by family then size
LARGE = ("internvl3-38b", "qwen2.5-vl-32b", "qwen3-vl-32b")
# the mixture-of-experts checkpoints (every LLM layer sparse: 128 experts, 8 per token)
MOE = ("internvl3.5-30b-a3b", "qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b")
ALL = ("internvl3-2b", "internvl2.5-4b", "internvl3-8b", "internvl3.5-30b-a3b", "internvl3-38b", "qwen2.5-vl-32b",
       "qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b", "qwen3-vl-30b-a3b", "qwen3-vl-32b", "qwen3-vl-235b-a22b")

# A Qwen2.5-VL-7B-shaped config (transformers' qwen2_5_vl layout): no stored model uses this family,
# so its window attention and SwiGLU encoder are checked on this one.
QWEN25_VL = {
    "model_type": "qwen2_5_vl", "tie_word_embeddings": False, "image_token_id": 151655, "video_token_id": 151656,
    "text_config": {"model_type": "qwen2_5_vl_text", "hidden_size": 3584, "intermediate_size": 18944,
                    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                    "vocab_size": 152064, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
    "vision_config": {"model_type": "qwen2_5_vl", "depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "hidden_act": "silu", "in_channels": 3, "out_hidden_size": 3584,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2},
}


def _transformers_params(raw: dict) -> int:
    """Parameters of transformers' own model built from `raw` (on the meta device: no memory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(**model_configs.hf_layout(raw))
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def test_the_models_are_stored_once_and_listed_by_family_and_size():
    # by family, then by size (a MoE family of its own sorts after its dense relative)
    names = model_configs.model_names()
    facts = {n: model_configs.model_facts(n) for n in ALL}
    assert set(names) == set(ALL) and names == tuple(sorted(ALL, key=lambda n: (facts[n].family, facts[n].params)))
    assert tuple(presets.MODELS) == names == CostModel.MODELS
    assert names[:3] == ALL[:3] and names.index("qwen3-vl-2b") < names.index("qwen3-vl-32b")
    for name in ALL:
        rec = model_configs.model_record(name)
        assert rec["source"] == f"https://huggingface.co/{rec['hub_id']}/blob/main/config.json"
        assert presets.MODELS[name] == presets.ModelShape.from_facts(model_configs.model_facts(name))
        if name in MOE:             # the stand-in has no experts: it refuses them (test_memory.py)
            with pytest.raises(ValueError, match="mixture of experts"):
                MLLMConfig.preset(name)
        else:
            assert MLLMConfig.preset(name) == MLLMConfig.from_hf(rec["config"], name=name)


@pytest.mark.parametrize("name", tuple(n for n in ALL if n not in MOE) + ("qwen2.5-vl-7b-shaped",))
def test_parameter_count_is_transformers_own(name):
    """(The MoE checkpoints' counts: test_moe_facts_are_transformers_own.)"""
    raw = QWEN25_VL if name == "qwen2.5-vl-7b-shaped" else model_configs.model_config(name)
    facts = model_configs.facts_from_config(raw)
    assert facts.params == _transformers_params(raw)
    if name in NAMES:
        assert memory.engine_params(presets.MODELS[name]) == facts.params == CostModel.preset(
            name, "h100").param_count
    elif name in LARGE:
        assert memory.engine_params(presets.MODELS[name]) == facts.params


# The checkpoints' sizes as the Hub lists them (billions of parameters, from their safetensors):
# an untied LM head in the three InternVL models, tied in Qwen3-VL-2B/4B.
HUB_SIZES_B = {"internvl3-2b": 2.09, "internvl2.5-4b": 3.71, "internvl3-8b": 7.94,
               "qwen3-vl-2b": 2.13, "qwen3-vl-4b": 4.44, "qwen3-vl-8b": 8.77}


# The 32B-class checkpoints, as their model cards list them (one decimal)
HUB_SIZES_LARGE_B = {"internvl3-38b": 38.4, "qwen2.5-vl-32b": 33.5, "qwen3-vl-32b": 33.4}


# The MoE checkpoints as their model cards list them: (total, active) billions, one decimal for the
# totals; the active counts (all but the 120 experts a token is not routed to, in every layer) as
# the names say (A3B, A22B), the vision encoder included
HUB_SIZES_MOE_B = {"internvl3.5-30b-a3b": (30.8, 3.7), "qwen3-vl-30b-a3b": (31.1, 3.9),
                   "qwen3-vl-235b-a22b": (235.7, 22.8)}


def _meta_model(raw: dict):
    """transformers' model built from `raw` on the meta device (no memory), and its config."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(**model_configs.hf_layout(raw))
    with torch.device("meta"):
        return transformers.AutoModelForImageTextToText.from_config(cfg), cfg


def _counts(model, cfg) -> tuple[int, int]:
    """(all parameters, those one token's forward pass uses: all less, in each sparse block, the
    experts' weights beyond the k a token is routed to) of transformers' model."""
    total = active = 0
    k = cfg.text_config.num_experts_per_tok
    for name, p in model.named_parameters():
        total += p.numel()
        active += p.numel() // p.shape[0] * k if ".mlp.experts." in name else p.numel()
    return total, active


@pytest.mark.parametrize("name", MOE)
def test_moe_facts_are_transformers_own(name):
    """The sparse blocks as transformers builds them: which layers hold experts, how many, their
    width and top-k; the active count is what a token runs through in transformers' model."""
    raw = model_configs.model_config(name)
    f = model_configs.facts_from_config(raw)
    model, cfg = _meta_model(raw)
    layers = model.model.language_model.layers
    sparse = tuple(i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts"))
    assert f.sparse_layers == sparse == tuple(range(f.layers)) and f.moe
    gate_up = layers[0].mlp.experts.gate_up_proj
    assert (f.experts, 2 * f.expert_intermediate, f.hidden) == tuple(gate_up.shape)
    assert f.experts_per_token == cfg.text_config.num_experts_per_tok == 8 and f.norm_topk
    assert (f.params, f.active_params) == _counts(model, cfg)
    assert memory.engine_params(presets.MODELS[name]) == f.params
    total, active = HUB_SIZES_MOE_B[name]
    assert (round(f.params / 1e9, 1), round(f.active_params / 1e9, 1)) == (total, active)
    m = presets.MODELS[name]
    assert (m.experts, m.experts_per_token, m.expert_intermediate, m.sparse_layers, m.active_param_count) == \
        (f.experts, f.experts_per_token, f.expert_intermediate, len(f.sparse_layers), f.active_params)


def test_moe_layers_and_defaults_as_transformers_reads_them():
    """decoder_sparse_step and mlp_only_layers pick the sparse layers as transformers' decoder does;
    a field absent from the file is its config class's default (Qwen3MoeConfig's norm_topk_prob
    False; Qwen3VLMoeTextConfig has none: its router always renormalises); the dense layers' MLP
    is counted at intermediate_size."""
    raw = model_configs.model_config("internvl3.5-30b-a3b")
    small = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    llm = {k: v for k, v in raw["llm_config"].items() if k not in ("norm_topk_prob", "router_aux_loss_coef")}
    cfg = {**raw, "llm_config": {**llm, **small}, "vision_config": {**raw["vision_config"], "num_hidden_layers": 1}}
    f = model_configs.facts_from_config(cfg)
    assert f.sparse_layers == (1, 5) and not f.norm_topk and f.router_aux_loss_coef == 0.001
    assert (f.params, f.active_params) == _counts(*_meta_model(cfg))
    q = model_configs.model_config("qwen3-vl-30b-a3b")
    text = {k: v for k, v in q["text_config"].items() if k not in ("norm_topk_prob", "head_dim")}
    qcfg = {**q, "text_config": {**text, **{k: v for k, v in small.items() if k != "head_dim"},
                                 "mlp_only_layers": [], "decoder_sparse_step": 3},
            "vision_config": {**q["vision_config"], "out_hidden_size": 64, "depth": 1, "deepstack_visual_indexes": []}}
    qf = model_configs.facts_from_config(qcfg)
    assert qf.sparse_layers == (2, 5) and qf.norm_topk and qf.head_dim == 64 // 4   # head_dim: hidden / heads
    assert (qf.params, qf.active_params) == _counts(*_meta_model(qcfg))
    # no experts: every layer dense, nothing sparse to price
    dense = model_configs.facts_from_config({**qcfg, "text_config": {**qcfg["text_config"], "num_experts": 0}})
    assert not dense.moe and dense.experts == 0 and dense.params == dense.active_params
    with pytest.raises(ValueError, match=r"llm_config.num_experts_per_tok 9 is more than num_experts 8"):
        model_configs.facts_from_config({**cfg, "llm_config": {**cfg["llm_config"], "num_experts_per_tok": 9}})
    with pytest.raises(ValueError, match=r"text_config.mlp_only_layers: \[7\] are not layer indices 0..5"):
        model_configs.facts_from_config({**qcfg, "text_config": {**qcfg["text_config"], "mlp_only_layers": [7]}})
    with pytest.raises(ValueError, match=r"text_config.moe_intermediate_size: 0 is not a positive integer"):
        model_configs.facts_from_config({**qcfg, "text_config": {**qcfg["text_config"], "moe_intermediate_size": 0}})


def test_parameter_counts_are_the_checkpoints_sizes():
    for name in NAMES:
        assert round(model_configs.model_facts(name).params / 1e9, 2) == HUB_SIZES_B[name], name
    for name in LARGE:
        assert round(model_configs.model_facts(name).params / 1e9, 1) == HUB_SIZES_LARGE_B[name], name
    assert [model_configs.model_facts(n).tied for n in NAMES] == [False] * 3 + [True, True, False]


def test_the_fixed_facts():
    # InternVL2.5-4B's LLM is Qwen2.5-3B: 16 query heads over 2 key/value heads
    assert (presets.MODELS["internvl2.5-4b"].heads, presets.MODELS["internvl2.5-4b"].kv_heads) == (16, 2)
    assert MLLMConfig.preset("internvl2.5-4b").num_kv_heads == 2
    for name in NAMES:
        m, f = presets.MODELS[name], model_configs.model_facts(name)
        # GELU MLPs of two matrices (InternViT, the Qwen3-VL ViT); the encoder runs before the 2x2 merge
        assert m.vision_mlp == 2 and m.patches_per_token == 4
        rules = vision_rules(name)   # the stored model's processor files agree with its config.json
        assert rules.family == family_for_model(name)
        if f.family == "qwen3_vl":
            c = rules.processor.image
            assert (c["patch_size"], c["merge_size"]) == (f.patch_size, f.merge) == (16, 2) and m.deepstack == 3
            assert image_tokens(640, 480, name) == 300
        else:
            assert rules.processor.image["size"] == {"height": 448, "width": 448}
            assert rules.family == "internvl" and m.frame_patches == (448 // 14) ** 2 + 1
    qwen25 = presets.ModelShape.from_config(QWEN25_VL)
    assert (qwen25.vision_mlp, qwen25.window_layers, qwen25.window_patches, qwen25.deepstack) == (3, 28, 64, 0)
    assert model_configs.facts_from_config(QWEN25_VL).vision_rule == "qwen-vl"


def test_encoder_flops_by_hand():
    """InternViT-300M per LLM vision token: 4 patches x 24 layers of GEMMs (q, k, v, o and two MLP
    matrices) and full attention over the 1025-token tile, plus the patch embedding."""
    m = presets.MODELS["internvl3-8b"]
    v, ff = 1024, 4096
    per_patch = 24 * (2 * (4 * v * v + 2 * v * ff) + 4 * v * 1025)
    assert _encoder_flops(m) == pytest.approx(4 * per_patch + 2 * 4 * 588 * v, rel=1e-12)
    # Qwen2.5-VL: 28 of its 32 layers attend within 8x8-patch windows
    q = presets.ModelShape.from_config(QWEN25_VL)
    full = presets.ModelShape.from_config({**QWEN25_VL, "vision_config": {
        **QWEN25_VL["vision_config"], "fullatt_block_indexes": list(range(32))}})
    assert _encoder_flops(full) - _encoder_flops(q) == pytest.approx(4 * 4 * 1280 * 28 * (1024 - 64), rel=1e-12)
    # DeepStack: Qwen3-VL prices four mergers (the main one and three DeepStack ones)
    c = CostModel.preset("qwen3-vl-8b", "h100")
    m8 = presets.MODELS["qwen3-vl-8b"]
    no_ds = CostModel.preset(presets.ModelShape(**{**m8.__dict__, "deepstack": 0}), "h100")
    assert c.a2_vision - no_ds.a2_vision == pytest.approx(
        4 * 3 * 2 * m8.projector_params / (989e12 * 0.45), rel=1e-9)


def test_from_hf_reads_a_checkpoint_directory(tmp_path):
    raw = model_configs.model_config("qwen3-vl-4b")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = MLLMConfig.from_hf(tmp_path, remat="layer")
    assert cfg == dataclasses.replace(MLLMConfig.preset("qwen3-vl-4b", remat="layer"), name="qwen3_vl")
    assert (cfg.patch_dim, cfg.vision_ff, cfg.rope_base) == (4 * 3 * 2 * 16 * 16, 4096, 5e6)
    assert presets.ModelShape.from_config(tmp_path) == presets.MODELS["qwen3-vl-4b"]
    with pytest.raises(FileNotFoundError, match="missing: does not exist"):      # not "no config.json"
        MLLMConfig.from_hf(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no config.json"):
        MLLMConfig.from_hf(tmp_path / "empty")


def test_the_hf_package_reads_the_same_shapes():
    """dhp_jax.model.hf parses the stored transformers-native configs into the same LLM shapes."""
    from dhp_jax.model.hf.families import hf_module

    for name in NAMES:
        raw = model_configs.hf_layout(model_configs.model_config(name))
        f = model_configs.model_facts(name)
        cfg = hf_module(f.family).parse(raw)
        t = cfg.text
        assert (t.num_layers, t.hidden_size, t.vocab_size, t.shape.num_heads, t.shape.num_kv_heads, t.shape.head_dim) == \
            (f.layers, f.hidden, f.vocab, f.heads, f.kv_heads, f.head_dim)
        depth = hf_module(f.family).encoder_stack(cfg)[1]
        assert cfg.tied == f.tied and depth == f.vision_layers


def test_bad_configs_name_the_problem():
    with pytest.raises(ValueError, match="unknown model 'llama-70b'; known models: internvl2.5-4b"):
        model_configs.model_record("llama-70b")
    with pytest.raises(ValueError, match="model_type 'llava' is not one of"):
        model_configs.facts_from_config({"model_type": "llava"})
    bad = {**QWEN25_VL, "vision_config": {**QWEN25_VL["vision_config"], "out_hidden_size": 1000}}
    with pytest.raises(ValueError, match="out_hidden_size 1000 is not the LLM's hidden_size 3584"):
        model_configs.facts_from_config(bad)
    with pytest.raises(ValueError, match="config: text_config is not an object"):
        model_configs.facts_from_config({"model_type": "qwen3_vl", "text_config": [], "vision_config": {}})
    # a config without text_config reads as transformers reads it: every field its default
    # (Qwen3VLTextConfig's widths, whose 4096 the default vision out_hidden_size 3584 does not match)
    with pytest.raises(ValueError, match="vision_config.out_hidden_size 3584 is not the LLM's hidden_size 4096"):
        model_configs.facts_from_config({"model_type": "qwen3_vl", "vision_config": {}})


def test_memory_counts_each_familys_encoder():
    """Per local token (every token priced as a vision token, as the family's program runs it): with
    remat "layer" each encoder layer keeps its input on every encoder row of the token (InternVL:
    the 4 patches it merges and its tile's CLS row); without remat, what the family's program keeps
    per encoder row (`memory.family_encoder_saved`) and the cotangents of the block whose backward
    pass is the peak; DeepStack's features, tapped states and mergers wait for the LLM."""
    rep = dataclasses.replace
    per_token = memory.activation_bytes_per_token
    m = presets.MODELS["internvl3-8b"]
    deeper = rep(m, vision_layers=m.vision_layers + 1)
    assert per_token(deeper, "layer", 2) - per_token(m, "layer", 2) == 2 * 5 * 1024
    # a middle width 8 wider than the published one, at which an encoder block's backward pass (the
    # peak) is in its MLP's phase, not its attention's (`memory._family_cotangents`)
    m = rep(m, vision_intermediate=m.vision_intermediate + 8)
    wider = rep(m, vision_intermediate=m.vision_intermediate + 1)
    # without remat a family is priced as its own program runs (memory.family_bytes_per_token):
    # InternViT's GELU MLP keeps 2 values as wide as its middle per row in each of its 24 layers, on
    # 5 rows per token (the 4 patches and the tile's CLS row), and an encoder block's backward pass
    # (the peak) holds 3 more (its `MemoryTerms.encoder_cotangents`); Qwen2.5-VL's SwiGLU keeps 3, on 4 rows
    # (its peak is an LLM layer's backward pass)
    assert per_token(wider, "none", 2) - per_token(m, "none", 2) == 2 * 5 * (24 * 2 + 3)
    q25 = presets.ModelShape.from_config(QWEN25_VL)
    assert per_token(rep(q25, vision_intermediate=q25.vision_intermediate + 1), "none", 2) \
        - per_token(q25, "none", 2) == 2 * 4 * q25.vision_layers * 3
    q = presets.MODELS["qwen3-vl-8b"]
    v4, d = 4 * 1152, 4096
    # per level: the feature added to the LLM (d) and its mask (a byte), the tapped encoder rows (4 x
    # 1152), the merger's LayerNorm input and output and exact GELU's four values (4 x 1152 wide)
    assert per_token(q, "layer", 2) - per_token(rep(q, deepstack=0), "layer", 2) == 2 * 3 * (d + v4 + 6 * v4) + 3 * d
