"""Qwen2.5-VL in JAX vs transformers' Qwen2_5_VLForConditionalGeneration on a tiny random config:
logits with text, image and video inputs (fp32, relative error <= 1e-5), checkpoint names, and
save_pretrained / from_pretrained both ways."""

import json

import numpy as np
import pytest

import hf_cases as hc
from hf_cases import torch, transformers

from dhp_jax.model import hf
from dhp_jax.model.hf import safetensors_io

IMAGE, VIDEO, START, END = hc.QWEN_IMAGE, hc.QWEN_VIDEO, hc.QWEN_START, hc.QWEN_END


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    config = hc.qwen2_5_vl_config(depth=3)
    path = hc.model_dir(tmp_path_factory, "qwen2_5_vl")
    model = hc.build(transformers.Qwen2_5_VLForConditionalGeneration, config, path)
    cfg, params = hf.load_pretrained(path)
    return model, cfg, params


def image_inputs(g):
    # text, an 8 x 8-patch image (16 LLM tokens, 2 x 2 windows), text
    ids = [5, 6, 7, START] + [IMAGE] * 16 + [END, 8, 9, 10]
    types = [0] * 4 + [1] * 16 + [0] * 4
    return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "mm_token_type_ids": np.array([types]), "pixel_values": g.standard_normal((64, 96)).astype(np.float32),
            "image_grid_thw": np.array([[1, 8, 8]])}


def video_inputs(g):
    # a 2-frame 4 x 8-patch video 1.5 s per grid step (temporal positions 0 and 3), then an image
    ids = [5, START] + [VIDEO] * 16 + [END, 6, START] + [IMAGE] * 4 + [END, 7, 8]
    types = [0] * 2 + [2] * 16 + [0] * 3 + [1] * 4 + [0] * 3
    return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "mm_token_type_ids": np.array([types]),
            "pixel_values": g.standard_normal((16, 96)).astype(np.float32), "image_grid_thw": np.array([[1, 4, 4]]),
            "pixel_values_videos": g.standard_normal((64, 96)).astype(np.float32),
            "video_grid_thw": np.array([[2, 4, 8]]), "second_per_grid_ts": np.array([1.5], np.float32)}


@pytest.mark.parametrize("kind", ["text", "image", "video"])
def test_logits_match_transformers(case, kind):
    model, cfg, params = case
    g = hc.rng(1)
    inputs = {"text": hc.qwen_text_inputs, "image": lambda: image_inputs(g), "video": lambda: video_inputs(g)}[kind]()
    hc.check_logits(model, cfg, params, inputs, f"qwen2_5_vl {kind}")


def test_positions_resume_after_vision(case):
    """M-RoPE ids: the text after an 8 x 8-patch image (4 x 4 merged) resumes at start + 4."""
    _, cfg, _ = case
    pos = hf.prepare(cfg, image_inputs(hc.rng(1)))["positions"]
    assert pos[4].tolist() == [4, 4, 4] and pos[19].tolist() == [4, 7, 7]
    assert pos[20].tolist() == [8, 8, 8]


def test_state_dict_names_and_shapes(case):
    hc.check_state_dict(*case)


def test_save_pretrained_loads_in_transformers(case, tmp_path):
    model, cfg, params = case
    hc.check_save_roundtrip(model, cfg, params, image_inputs(hc.rng(2)), str(tmp_path))


def test_legacy_checkpoint_names(case, tmp_path):
    """The original Qwen2.5-VL release names its weights visual.* / model.layers.*: same tree."""
    _, cfg, params = case
    legacy = {}
    for name, w in hf.to_state_dict(cfg, params).items():
        name = name.replace("model.visual.", "visual.").replace("model.language_model.", "model.")
        legacy[name] = w
    safetensors_io.write_checkpoint(str(tmp_path), legacy)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(dict(cfg.raw), f)
    _, params2 = hf.load_pretrained(str(tmp_path))
    a, b = hf.to_state_dict(cfg, params), hf.to_state_dict(cfg, params2)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_bf16_checkpoint_and_shards(case, tmp_path):
    """A bf16 checkpoint written by transformers reads back exactly (fp32 or bf16 leaves); our
    sharded save (index + shards) loads in transformers."""
    model, cfg, params = case
    model16 = hc.build(transformers.Qwen2_5_VLForConditionalGeneration, model.config, str(tmp_path / "bf16"))
    model16.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    _, p32 = hf.load_pretrained(str(tmp_path / "bf16"), dtype="float32")
    _, p16 = hf.load_pretrained(str(tmp_path / "bf16"), dtype="bfloat16")
    ours32, ours16 = hf.to_state_dict(cfg, p32), hf.to_state_dict(cfg, p16)
    for name, w in model16.state_dict().items():
        np.testing.assert_array_equal(ours32[name], w.float().numpy(), err_msg=name)
        assert ours16[name].dtype == np.dtype("bfloat16"), name
    hf.save_pretrained(cfg, params, str(tmp_path / "sharded"), max_shard_bytes=64 * 1024)
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    reloaded = type(model).from_pretrained(str(tmp_path / "sharded")).eval()
    inputs = image_inputs(hc.rng(3))
    np.testing.assert_array_equal(hc.reference_logits(reloaded, inputs), hc.reference_logits(model, inputs))


def test_sample_from_inputs(case):
    _, cfg, params = case
    sample = hc.check_sample_roundtrip(cfg, params, video_inputs(hc.rng(5)), "qwen2_5_vl video")
    assert [s.modality for s in sample.segments] == ["text", "video", "text", "image", "text"]
    video = sample.segments[1]
    assert video.pixels.shape == (16, 4 * 96) and video.tokens_per_frame == 8
    assert video.meta["grid_thw"] == (2, 4, 8) and video.meta["second_per_grid_ts"] == 1.5


def test_forward_traces_with_a_handed_in_attention(case):
    """The engine's contract: the prepared per-token arrays are jit arguments, and every attention
    call goes through the `attn_fn` handed in, with (q, k, v, q_ids, k_ids) and id-based masks."""
    import jax

    from dhp_jax.model.attention import dense_attention
    from dhp_jax.models.qwen2_5_vl import jax_model as qwen2_5_vl

    _, cfg, params = case
    inputs = image_inputs(hc.rng(1))
    batch = hf.prepare(cfg, inputs)
    calls = []

    def attn(q, k, v, q_ids, k_ids):
        calls.append(q.shape)
        return dense_attention(q, k, v, q_ids, k_ids)

    traced = jax.jit(lambda p, b: qwen2_5_vl.hidden(cfg, p, b, attn))(params, batch)
    assert len(calls) == 2        # traced once per block stack (a scan): the 3 vision blocks, the 2 LLM layers
    whole = jax.jit(lambda p: hf.hidden_states(cfg, p, inputs))(params)     # the inputs as constants
    assert hc.relative_error(traced, np.asarray(whole)) <= 1e-6
