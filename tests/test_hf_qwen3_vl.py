"""Qwen3-VL in JAX vs transformers' Qwen3VLForConditionalGeneration on a tiny random config:
logits with text, image and video inputs (fp32, relative error <= 1e-5; QK-norm, interleaved
M-RoPE, interpolated position table, DeepStack), tied embeddings, checkpoint names, and
save_pretrained / from_pretrained both ways."""

import numpy as np
import pytest

import hf_cases as hc
from hf_cases import transformers

from dhp_jax.model import hf

IMAGE, VIDEO, START, END = 120, 121, 122, 123


def make_config(tied: bool):
    return transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                          "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        # a 4 x 4 position table resampled to 8 x 8 and 4 x 8 patch grids; DeepStack from blocks 0 and 1
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=tied)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = hc.model_dir(tmp_path_factory, "qwen3_vl")
    model = hc.build(transformers.Qwen3VLForConditionalGeneration, make_config(False), path)
    cfg, params = hf.load_pretrained(path)
    return model, cfg, params


def image_inputs(g):
    ids = [5, 6, START] + [IMAGE] * 16 + [END, 8, 9]
    types = [0] * 3 + [1] * 16 + [0] * 3
    return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "mm_token_type_ids": np.array([types]), "pixel_values": g.standard_normal((64, 96)).astype(np.float32),
            "image_grid_thw": np.array([[1, 8, 8]])}


def video_inputs(g):
    # a 2-frame 4 x 8-patch video, a timestamp token before each frame, then a 4 x 4 image
    frame = [START] + [VIDEO] * 8 + [END]
    ids = [5, 30] + frame + [31] + frame + [6, START] + [IMAGE] * 4 + [END, 7]
    types = [0, 0, 0] + [2] * 8 + [0, 0, 0] + [2] * 8 + [0, 0, 0] + [1] * 4 + [0, 0]
    return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "mm_token_type_ids": np.array([types]),
            "pixel_values": g.standard_normal((16, 96)).astype(np.float32), "image_grid_thw": np.array([[1, 4, 4]]),
            "pixel_values_videos": g.standard_normal((64, 96)).astype(np.float32),
            "video_grid_thw": np.array([[2, 4, 8]])}


@pytest.mark.parametrize("kind", ["text", "image", "video"])
def test_logits_match_transformers(case, kind):
    model, cfg, params = case
    g = hc.rng(1)
    inputs = {"text": hc.qwen_text_inputs, "image": lambda: image_inputs(g), "video": lambda: video_inputs(g)}[kind]()
    hc.check_logits(model, cfg, params, inputs, f"qwen3_vl {kind}")


def test_tied_embeddings(tmp_path):
    """Qwen3-VL-2B/4B tie the LM head to the embedding: no lm_head in the tree or the checkpoint."""
    model = hc.build(transformers.Qwen3VLForConditionalGeneration, make_config(True), str(tmp_path / "tf"), seed=3)
    cfg, params = hf.load_pretrained(str(tmp_path / "tf"))
    assert cfg.tied and "lm_head" not in params
    inputs = image_inputs(hc.rng(4))
    hc.check_logits(model, cfg, params, inputs, "qwen3_vl tied image")
    hc.check_state_dict(model, cfg, params)
    hc.check_save_roundtrip(model, cfg, params, inputs, str(tmp_path / "ours"))


def test_state_dict_names_and_shapes(case):
    hc.check_state_dict(*case)


def test_save_pretrained_loads_in_transformers(case, tmp_path):
    model, cfg, params = case
    hc.check_save_roundtrip(model, cfg, params, video_inputs(hc.rng(2)), str(tmp_path))


def test_sample_from_inputs(case):
    """A video's frames are separate runs (timestamps between them): one segment per frame."""
    _, cfg, params = case
    sample = hc.check_sample_roundtrip(cfg, params, video_inputs(hc.rng(5)), "qwen3_vl video")
    assert [s.modality for s in sample.segments] == ["text", "video", "text", "video", "text", "image", "text"]
    assert sample.segments[1].meta["grid_thw"] == (1, 4, 8) and sample.segments[1].pixels.shape == (8, 4 * 96)
