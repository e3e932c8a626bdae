"""Qwen3-VL (the tied config and the video of test_hf_qwen3_vl: DeepStack from two vision blocks,
per-frame video spans) in PlanExecutor on 8 fake CPU devices: one two-micro-batch DHP step (ring degrees 3 and 5, then
a hybrid Ulysses 4 x ring 2), and a hybrid 2 x 2 group under remat and pad skipping, give
transformers' loss and autograd gradients at fp32, relative error <= 1e-5 (`hf_engine_cases`); a
Ulysses group in bf16 stays close to them."""

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
    ec.check_step(case, ec.MIXED, "qwen3_vl ring-3+5 / hybrid-4x2")


def test_qwen3_vl_bf16_step(case):
    """compute_dtype="bfloat16" (params cast once per step; fp32 norms statistics, softmax and
    loss): one Ulysses group over 4 devices (out of order) of all samples stays close to
    transformers' fp32 step; devices 4-7 are idle (their zero rows join the bf16 groups' rows)."""
    from dhp_jax.model import hf
    from dhp_jax.sharding import PlanExecutor
    cfg, params, samples, (ref_loss, ref_grads), _ = case
    ex = PlanExecutor(cfg, compute_dtype="bfloat16")
    loss, grads = ex.loss_and_grads(params, samples, ec.plan([((2, 0, 3, 1), tuple(range(6)), "ulysses")]))
    ours = hf.to_state_dict(cfg, grads)
    a = np.concatenate([np.asarray(ours[k], np.float64).ravel() for k in ref_grads])
    b = np.concatenate([ref_grads[k].astype(np.float64).ravel() for k in ref_grads])
    cos = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    loss_err = abs(float(loss) - ref_loss) / ref_loss
    print(f"qwen3_vl bf16 ulysses 4: loss rel {loss_err:.1e}, gradient cosine {cos:.6f}")
    assert np.isfinite(a).all() and loss_err <= 1e-3 and cos >= 0.9995, (loss_err, cos)


def test_qwen3_vl_remat_and_pad_skipping(case):
    """`remat` "layer" (every LLM layer and vision block recomputed, `layers.remat_block`) with `linear_chunk`
    pad skipping, on a hybrid 2 x 2 group (Ulysses and ring hops) of every sample with a long
    padding tail: transformers'
    loss and gradients at fp32 1e-5, and the chunks counted as they run (`executed.counting`: a
    host callback in the work of a live chunk, on every device) are each rank's real tokens (LLM)
    and live vision rows (encoder, reordered live rows first) in whole chunks, each counted 6 times
    per block and step (q/k/v and the MLP, in the forward pass, in the remat's re-run of it and
    in the chunk's pullback); a chunk of padding or of dead
    vision rows never runs (computing every chunk and selecting would count them all)."""
    import dataclasses
    import math

    from dhp_jax.geometry.layout import bucket_length, chunk_size
    from dhp_jax.model.executed import counting
    from dhp_jax.model.hf.packed import unit
    from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan
    from dhp_jax.sharding import PlanExecutor

    cfg, params, samples, reference, _ = case
    chunk, d = 8, 4
    tokens = sum(s.num_tokens for s in samples)
    group = Group((0, 1, 2, 3), d, tuple(range(len(samples))), "hybrid:2x2", tokens=tokens,
                  padded_tokens=bucket_length(tokens, d) + 2 * d * 24)
    with counting() as counts:
        ex = PlanExecutor(dataclasses.replace(cfg, remat="layer"), linear_chunk=chunk)
        ec.check_step((cfg, params, samples, reference, ex), Plan(8, (MicroBatch((group,)),)), "qwen3_vl remat+chunks")
    (w,) = ex.prepare(samples, Plan(8, (MicroBatch((group,)),)))
    lay = w.layout
    shard, u = lay.bucket // d, unit(cfg)
    live_vision = (lay.vision_ints[:, 0] > 0).reshape(d, shard * u).sum(axis=1)
    real = (lay.llm_ints[:, 2] > 0).reshape(d, shard).sum(axis=1)
    llm = sum(math.ceil(r / chunk_size(shard, chunk)) for r in real)
    vision = sum(math.ceil(v / chunk_size(shard * u, chunk)) for v in live_vision)
    everything = d * (math.ceil(shard / chunk_size(shard, chunk)) + math.ceil(shard * u / chunk_size(shard * u, chunk)))
    assert 0 < llm + vision < everything
    want = 6 * (cfg.text.num_layers * llm + cfg.vision.depth * vision)
    assert counts["linear_chunks"] == want, (counts["linear_chunks"], want, llm, vision)
