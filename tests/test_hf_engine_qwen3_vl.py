"""Qwen3-VL (the tied config and the video of test_hf_qwen3_vl: DeepStack from two vision blocks,
per-frame video spans) in PlanExecutor on 8 fake CPU devices: one two-micro-batch DHP step (ring degrees 3 and 5, then
Ulysses over 4 and a hybrid 2 x 2) gives transformers' loss and autograd gradients at fp32,
relative error <= 1e-5 (`hf_engine_cases`)."""

import numpy as np
import pytest

import hf_cases as hc
from hf_cases import transformers

import hf_engine_cases as ec
from test_hf_qwen3_vl import make_config, video_inputs

IMAGE, VIDEO = 120, 121


def batch(g):
    return [ec.qwen_image(g, 8, 8, 3, 4), hc.qwen_text_inputs(), video_inputs(g), ec.qwen_image(g, 4, 8, 5, 2),
            ec.qwen_image(g, 8, 4, 1, 6), ec.qwen_image(g, 4, 4, 2, 3)]


def config():
    """test_hf_qwen3_vl's tied config with 2 LLM layers and 2 vision blocks (both DeepStack): fewer
    layers to compile."""
    c = make_config(tied=True)
    c.text_config.num_hidden_layers = 2
    c.vision_config.depth = 2
    return c


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return ec.build_case(tmp_path_factory, "engine_qwen3_vl", transformers.Qwen3VLForConditionalGeneration,
                         config(), batch, (IMAGE, VIDEO))


def test_qwen3_vl_step_matches_transformers(case):
    assert case[0].tied and case[0].vision.deepstack_blocks == (0, 1) and case[0].text.num_layers == 2
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
