"""Qwen3-VL (tied embeddings, DeepStack from two vision blocks, per-frame video spans) in
PlanExecutor on 8 fake CPU devices: one two-micro-batch DHP step (ring degrees 3 and 5, then
Ulysses over 4 and a hybrid 2 x 2) gives transformers' loss and autograd gradients at fp32,
relative error <= 1e-5 (`hf_engine_cases`)."""

import numpy as np
import pytest

import hf_cases as hc
from hf_cases import transformers

import hf_engine_cases as ec

IMAGE, VIDEO, START, END = 120, 121, 122, 123


def config():
    return transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                          "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=True)


def image(g, h, w, before, after):
    n = h * w // 4
    ids = list(g.integers(3, 100, before)) + [START] + [IMAGE] * n + [END] + list(g.integers(3, 100, after))
    types = [0] * (before + 1) + [1] * n + [0] * (after + 1)
    return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "mm_token_type_ids": np.array([types]), "pixel_values": g.standard_normal((h * w, 96)).astype(np.float32),
            "image_grid_thw": np.array([[1, h, w]])}


def video(g):
    """a 2-frame 4 x 8-patch video, a timestamp token before each frame, then a 4 x 4 image."""
    frame = [START] + [VIDEO] * 8 + [END]
    ids = [5, 30] + frame + [31] + frame + [6, START] + [IMAGE] * 4 + [END, 7]
    types = [0, 0, 0] + [2] * 8 + [0, 0, 0] + [2] * 8 + [0, 0, 0] + [1] * 4 + [0, 0]
    return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "mm_token_type_ids": np.array([types]),
            "pixel_values": g.standard_normal((16, 96)).astype(np.float32), "image_grid_thw": np.array([[1, 4, 4]]),
            "pixel_values_videos": g.standard_normal((64, 96)).astype(np.float32),
            "video_grid_thw": np.array([[2, 4, 8]])}


def batch(g):
    return [image(g, 8, 8, 3, 4), hc.qwen_text_inputs(), video(g), image(g, 4, 8, 5, 2), image(g, 8, 4, 1, 6),
            image(g, 4, 4, 2, 3)]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return ec.build_case(tmp_path_factory, "engine_qwen3_vl", transformers.Qwen3VLForConditionalGeneration,
                         config(), batch, (IMAGE, VIDEO))


def test_qwen3_vl_step_matches_transformers(case):
    assert case[0].tied and case[0].vision.deepstack_blocks == (0, 1)
    ec.check_step(case, ec.MIXED, "qwen3_vl ring-3+5 / ulysses-4+hybrid-2x2")


def test_qwen3_vl_bf16_step(case):
    """compute_dtype="bfloat16" (params cast once per step; fp32 norms statistics, softmax and
    loss): one hybrid 2 x 4 group of all samples stays close to transformers' fp32 step."""
    from dhp_jax.model import hf
    from dhp_jax.sharding import PlanExecutor
    cfg, params, samples, (ref_loss, ref_grads), _ = case
    ex = PlanExecutor(cfg, compute_dtype="bfloat16")
    loss, grads = ex.loss_and_grads(params, samples, ec.plan([(tuple(range(8)), tuple(range(6)), "hybrid:2x4")]))
    ours = hf.to_state_dict(cfg, grads)
    a = np.concatenate([np.asarray(ours[k], np.float64).ravel() for k in ref_grads])
    b = np.concatenate([ref_grads[k].astype(np.float64).ravel() for k in ref_grads])
    cos = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    loss_err = abs(float(loss) - ref_loss) / ref_loss
    print(f"qwen3_vl bf16 hybrid 2x4: loss rel {loss_err:.1e}, gradient cosine {cos:.6f}")
    assert np.isfinite(a).all() and loss_err <= 1e-3 and cos >= 0.9995, (loss_err, cos)
