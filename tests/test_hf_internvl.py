"""InternVL (transformers-native -hf layout) in JAX vs transformers' InternVLForConditionalGeneration
on tiny random configs: logits with text and image inputs (fp32, relative error <= 1e-5), tied
embeddings (InternVL's default), checkpoint names, and save_pretrained / from_pretrained both ways."""

import numpy as np
import pytest

import hf_cases as hc
from hf_cases import transformers

from dhp_jax.model import hf

IMAGE = 120


def make_config(**vision):
    # 16 x 16 tiles of 4 x 4 patches: 16 patches + CLS per tile, 4 LLM tokens after the pixel shuffle
    return transformers.InternVLConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                           image_size=16, patch_size=4, attention_bias=True, **vision),
        text_config=dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        image_token_id=IMAGE, image_seq_length=4)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = hc.model_dir(tmp_path_factory, "internvl")
    model = hc.build(transformers.InternVLForConditionalGeneration, make_config(), path)
    cfg, params = hf.load_pretrained(path)
    return model, cfg, params


def image_inputs(g, tiles=2):
    ids = [5, 6, 121] + [IMAGE] * (4 * tiles) + [122, 8, 9]
    return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "pixel_values": g.standard_normal((tiles, 3, 16, 16)).astype(np.float32)}


@pytest.mark.parametrize("kind", ["text", "image"])
def test_logits_match_transformers(case, kind):
    model, cfg, params = case
    inputs = hc.text_inputs([5, 6, 7, 8, 9, 10, 11]) if kind == "text" else image_inputs(hc.rng(1))
    hc.check_logits(model, cfg, params, inputs, f"internvl {kind}")
    assert cfg.tied and "lm_head" not in params


def test_rms_norm_qk_norm_variant(tmp_path):
    """The InternViT-6B options: RMSNorm, QK-norm, a final LayerNorm (no mean pooling); an LM head
    of its own, as the released InternVL3 models have: saved as transformers saves it
    (`language_model.lm_head.weight`)."""
    config = make_config(norm_type="rms_norm", use_qk_norm=True, use_mean_pooling=False)
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = False
    model = hc.build(transformers.InternVLForConditionalGeneration, config, str(tmp_path / "tf"), seed=5)
    cfg, params = hf.load_pretrained(str(tmp_path / "tf"))
    assert not cfg.tied and "lm_head" in params
    inputs = image_inputs(hc.rng(6), tiles=1)
    hc.check_logits(model, cfg, params, inputs, "internvl rms/qk-norm image")
    hc.check_save_roundtrip(model, cfg, params, inputs, str(tmp_path / "ours"))
    assert "language_model.lm_head.weight" in hc.saved_shapes(str(tmp_path / "ours"))


def test_state_dict_names_and_shapes(case):
    hc.check_state_dict(*case)


def test_save_pretrained_loads_in_transformers(case, tmp_path):
    model, cfg, params = case
    hc.check_save_roundtrip(model, cfg, params, image_inputs(hc.rng(2)), str(tmp_path))


def test_sample_from_inputs(case):
    _, cfg, params = case
    sample = hc.check_sample_roundtrip(cfg, params, image_inputs(hc.rng(5), tiles=2), "internvl image")
    image = sample.segments[1]
    assert image.modality == "image" and image.pixels.shape == (8, 4 * 48) and image.tokens_per_frame == 4
    np.testing.assert_array_equal(hf.inputs_from_sample(cfg, sample)["pixel_values"],
                                  image_inputs(hc.rng(5), tiles=2)["pixel_values"])
