"""InternVL (tied embeddings; InternViT with CLS token, absolute position table, layer scale; pixel
shuffle) in PlanExecutor on 8 fake CPU devices: one two-micro-batch DHP step (ring degrees 3 and 5,
then a hybrid Ulysses 4 x ring 2) gives transformers' loss and autograd gradients at fp32,
relative error <= 1e-5 (`hf_engine_cases`)."""

import numpy as np
import pytest

import hf_cases as hc
from hf_cases import transformers

import hf_engine_cases as ec

IMAGE = 120


def config():
    # 16 x 16 tiles of 4 x 4 patches: 16 patches + CLS per tile, 4 LLM tokens after the pixel shuffle
    return transformers.InternVLConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                           image_size=16, patch_size=4, attention_bias=True,
                           initializer_range=0.2),   # scores far from uniform: q/k gradients not tiny
        text_config=dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        image_token_id=IMAGE, image_seq_length=4)


def image(g, tiles, before, after):
    ids = list(g.integers(3, 100, before)) + [121] + [IMAGE] * (4 * tiles) + [122] + list(g.integers(3, 100, after))
    return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "pixel_values": g.standard_normal((tiles, 3, 16, 16)).astype(np.float32)}


def batch(g):
    return [image(g, 2, 3, 4), hc.text_inputs([5, 6, 7, 8, 9, 10, 11]), image(g, 3, 1, 6), image(g, 1, 5, 2),
            image(g, 2, 2, 2), image(g, 1, 4, 3)]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return ec.build_case(tmp_path_factory, "engine_internvl", transformers.InternVLForConditionalGeneration,
                         config(), batch, (IMAGE,))


def test_internvl_step_matches_transformers(case):
    assert case[0].tied
    ec.check_step(case, ec.MIXED, "internvl ring-3+5 / hybrid-4x2")
