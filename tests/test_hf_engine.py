"""The Hugging Face families in PlanExecutor on 8 fake CPU devices: one DHP step of an irregular
plan (degrees 3 and 5, ring / Ulysses / hybrid groups) gives transformers' loss and autograd
gradients (by transformers parameter name, `hf.to_state_dict`) at fp32, relative error <= 1e-5.

The reference: each sample through `*ForConditionalGeneration(**inputs, labels=labels)` (the loss
is the mean over the sample's shifted labels); the batch loss is the token-weighted mean,
sum_i loss_i * n_i / sum_i n_i, n_i the sample's counted labels, and its gradient by autograd."""

import numpy as np
import pytest

import hf_cases as hc
from hf_cases import torch, transformers

from dhp_jax.model import hf
from dhp_jax.planner.plan import Group, MicroBatch, Plan
from dhp_jax.sharding import PlanExecutor

IMAGE, VIDEO, START, END = 120, 121, 122, 123


def qwen2_5_vl_config():
    # 4 query heads, 2 KV heads (Ulysses 4 repeats KV heads); 2 vision heads (padded under Ulysses 4)
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         bos_token_id=1, eos_token_id=2),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1], tokens_per_second=2),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


def qwen_image(g, h, w, before, after):
    """text, an h x w-patch image, text (Qwen processor layout)."""
    n = h * w // 4
    ids = list(g.integers(3, 100, before)) + [START] + [IMAGE] * n + [END] + list(g.integers(3, 100, after))
    types = [0] * (before + 1) + [1] * n + [0] * (after + 1)
    return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "mm_token_type_ids": np.array([types]),
            "pixel_values": g.standard_normal((h * w, 96)).astype(np.float32),
            "image_grid_thw": np.array([[1, h, w]])}


def qwen_video(g):
    """a 2-frame 4 x 8-patch video 1.5 s per grid step, then a 4 x 4 image."""
    ids = [5, START] + [VIDEO] * 16 + [END, 6, START] + [IMAGE] * 4 + [END, 7, 8]
    types = [0] * 2 + [2] * 16 + [0] * 3 + [1] * 4 + [0] * 3
    return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "mm_token_type_ids": np.array([types]),
            "pixel_values": g.standard_normal((16, 96)).astype(np.float32), "image_grid_thw": np.array([[1, 4, 4]]),
            "pixel_values_videos": g.standard_normal((64, 96)).astype(np.float32),
            "video_grid_thw": np.array([[2, 4, 8]]), "second_per_grid_ts": np.array([1.5], np.float32)}


def labels_of(g, inputs):
    """The input ids as labels, -100 on the vision tokens and on a random quarter of the rest."""
    ids = inputs["input_ids"][0]
    drop = (ids == IMAGE) | (ids == VIDEO) | (g.random(ids.shape) < 0.25)
    return np.where(drop, -100, ids)[None]


def qwen2_5_vl_batch(g):
    return [qwen_image(g, 8, 8, 3, 4), hc.qwen_text_inputs(), qwen_video(g), qwen_image(g, 4, 8, 5, 2),
            qwen_image(g, 8, 4, 1, 6)]


def reference(model, batch, labels):
    """(token-weighted batch loss, {name: grad}) by transformers' own loss and autograd."""
    model.zero_grad()
    total, count = 0.0, 0
    for inputs, lab in zip(batch, labels):
        n = int((lab[0, 1:] != -100).sum())
        out = model(**hc.torch_inputs(inputs), labels=torch.as_tensor(lab))
        total = total + out.loss * n
        count += n
    loss = total / count
    loss.backward()
    return float(loss.detach()), {k: p.grad.numpy().copy() for k, p in model.named_parameters() if p.grad is not None}


def plan(*groups):
    """One micro-batch of (ranks, samples, attention kind) groups on 8 ranks."""
    return Plan(8, (MicroBatch(tuple(Group(tuple(r), len(r), tuple(s), kind) for r, s, kind in groups)),))


# degrees 3 and 5 on 8 devices (4 query heads: ring only); a group's samples are not in batch order
IRREGULAR = plan(((0, 1, 2), (0, 3), "ring"), ((3, 4, 5, 6, 7), (2, 1, 4), "ring"))
# Ulysses over 4 (2 KV heads repeated, 2 vision heads padded to 4) and Ulysses 2 x ring 2
ALL_TO_ALL = plan(((0, 1, 2, 3), (0, 3), "ulysses"), ((7, 5, 6, 4), (2, 1, 4), "hybrid:2x2"))
PLANS = {"ring-3+5": IRREGULAR, "ulysses-4+hybrid-2x2": ALL_TO_ALL}


def relative_errors(ours, theirs):
    """(worst per-tensor max |ours - theirs| / max |theirs| over the named grads, its name)."""
    assert sorted(ours) == sorted(theirs), set(ours) ^ set(theirs)
    errs = {k: float(np.max(np.abs(np.asarray(ours[k], np.float64) - theirs[k])) / max(np.max(np.abs(theirs[k])), 1e-30))
            for k in theirs}
    worst = max(errs, key=errs.get)
    return errs[worst], worst


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    path = hc.model_dir(tmp_path_factory, "engine_qwen2_5_vl")
    model = hc.build(transformers.Qwen2_5_VLForConditionalGeneration, qwen2_5_vl_config(), path)
    cfg, params = hf.load_pretrained(path)
    g = hc.rng(3)
    batch = qwen2_5_vl_batch(g)
    labels = [labels_of(g, x) for x in batch]
    samples = [hf.sample_from_inputs(cfg, x, lab, sample_id=i) for i, (x, lab) in enumerate(zip(batch, labels))]
    ref = reference(model, batch, labels)
    return cfg, params, samples, ref, PlanExecutor(cfg)


@pytest.mark.parametrize("name", list(PLANS))
def test_qwen2_5_vl_step_matches_transformers(qwen2_5_vl, name):
    cfg, params, samples, (ref_loss, ref_grads), ex = qwen2_5_vl
    loss, grads = ex.loss_and_grads(params, samples, PLANS[name])
    loss_err = abs(float(loss) - ref_loss) / abs(ref_loss)
    grad_err, worst = relative_errors(hf.to_state_dict(cfg, grads), ref_grads)
    print(f"qwen2_5_vl {name}: loss {float(loss):.6f} vs {ref_loss:.6f} (rel {loss_err:.1e}), "
          f"grads max rel {grad_err:.1e} ({worst})")
    assert loss_err <= hc.TOL and grad_err <= hc.TOL, (loss_err, grad_err, worst)
