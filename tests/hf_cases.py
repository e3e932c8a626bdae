"""Shared by the tests/test_hf_*.py modules: tiny random transformers models of the supported
families, hand-built processor-shaped inputs, and the comparisons (fp32, relative error <= 1e-5,
measured as max |ours - transformers| / max |transformers| over the logits)."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402

from dhp_jax.model import hf  # noqa: E402

TOL = 1e-5


QWEN_IMAGE, QWEN_VIDEO, QWEN_START, QWEN_END = 120, 121, 122, 123     # the tiny Qwen configs' placeholder ids


def qwen2_5_vl_config(depth: int):
    """The tiny Qwen2.5-VL of the tests, with `depth` vision blocks: 4 query heads, 2 KV heads, 2
    vision heads; window 16 px = 2 x 2 merged tokens (an 8 x 8 patch image has 4 windows), block 1
    attends the whole frame."""
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         bos_token_id=1, eos_token_id=2),
        vision_config=dict(depth=depth, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1], tokens_per_second=2),
        image_token_id=QWEN_IMAGE, video_token_id=QWEN_VIDEO, vision_start_token_id=QWEN_START,
        vision_end_token_id=QWEN_END)


def randomize(model, seed: int = 0) -> None:
    """Perturb every weight that its initialiser leaves constant (norm scales at 1, biases, layer
    scales, CLS token and position tables at 0), so that a dropped bias or norm shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.numel() > 1 and float(p.std()) > 0:
                continue
            p.add_(0.3 * torch.randn(p.shape, generator=gen))


def build(model_cls, config, directory: str, seed: int = 0):
    """A random model of `config`, perturbed by `randomize`, saved by transformers to `directory`."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize(model, seed)
    model.save_pretrained(directory)
    return model


def torch_inputs(inputs: dict) -> dict:
    return {k: torch.as_tensor(v) for k, v in inputs.items()}


def reference_logits(model, inputs: dict) -> np.ndarray:
    with torch.no_grad():
        return model(**torch_inputs(inputs)).logits[0].float().numpy()


def relative_error(ours, ref: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(ours, np.float64) - ref)) / np.max(np.abs(ref)))


def logits(config, params, inputs: dict) -> np.ndarray:
    """`hf.logits` of one sample as one compiled program (the sample's inputs its constants): run op
    by op, each of its hundreds of ops would compile a program of its own."""
    return np.asarray(jax.jit(lambda p: hf.logits(config, p, inputs))(params))


def check_logits(model, config, params, inputs: dict, label: str) -> float:
    """Our logits vs transformers' on one sample: shape, dtype and relative error <= TOL."""
    ref = reference_logits(model, inputs)
    ours = logits(config, params, inputs)
    assert ours.dtype == np.float32 and ours.shape == ref.shape, (ours.dtype, ours.shape, ref.shape)
    err = relative_error(ours, ref)
    print(f"{label}: max relative logits error {err:.2e}")
    assert err <= TOL, f"{label}: relative error {err:.2e} > {TOL}"
    return err


def check_state_dict(model, config, params) -> None:
    """to_state_dict(params) has transformers' names and shapes (a tied lm_head once) and values."""
    theirs = {k: v.numpy() for k, v in model.state_dict().items()}
    if config.tied:
        theirs.pop("lm_head.weight", None)
    ours = hf.to_state_dict(config, params)
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert ours[name].shape == value.shape, name
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


def saved_shapes(directory: str) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a checkpoint directory's tensors."""
    from dhp_jax.model.hf import safetensors_io
    return {k: tuple(v.shape) for k, v in safetensors_io.read_checkpoint(directory)}


def check_saved_like_transformers(config, ours: dict[str, tuple[int, ...]], theirs: dict[str, tuple[int, ...]]):
    """The names our savers wrote (`ours`, {name: shape}) are those transformers' own `save_pretrained`
    wrote for the same model (`theirs`), each of the same shape; the fused experts of a family whose
    releases store them transposed (`expert_layouts`, "fused_transposed"): that shape transposed."""
    from dhp_jax.model.hf import expert_layouts as xl
    from dhp_jax.model.hf.families import hf_module
    assert sorted(ours) == sorted(theirs), (sorted(set(ours) - set(theirs))[:4], sorted(set(theirs) - set(ours))[:4])
    transposed = xl.layout_of(hf_module(config.family)) == "fused_transposed"
    for name, shape in theirs.items():
        if transposed and xl.is_fused(name) and shape[1] != shape[2]:
            shape = (shape[0], shape[2], shape[1])
        assert ours[name] == shape, (name, ours[name], shape)


def check_save_roundtrip(model, config, params, inputs: dict, directory: str) -> None:
    """save_pretrained writes the names (and shapes) transformers' own `save_pretrained` writes;
    transformers' from_pretrained of it gives the very same logits, and our own load of it the
    same tree."""
    hf.save_pretrained(config, params, directory)
    model.save_pretrained(directory + "_transformers")
    check_saved_like_transformers(config, saved_shapes(directory), saved_shapes(directory + "_transformers"))
    reloaded = type(model).from_pretrained(directory).eval()
    np.testing.assert_array_equal(reference_logits(reloaded, inputs), reference_logits(model, inputs))
    config2, params2 = hf.load_pretrained(directory)
    a, b = hf.to_state_dict(config, params), hf.to_state_dict(config2, params2)
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def text_inputs(ids: list[int]) -> dict:
    ids_arr = np.array([ids], np.int64)
    return {"input_ids": ids_arr, "attention_mask": np.ones_like(ids_arr)}


def qwen_text_inputs() -> dict:
    """A text-only Qwen processor output (mm_token_type_ids all 0)."""
    inputs = text_inputs([5, 6, 7, 8, 9, 10, 11, 12, 13])
    inputs["mm_token_type_ids"] = np.zeros_like(inputs["input_ids"])
    return inputs


def model_dir(tmp_path_factory, name: str) -> str:
    return os.fspath(tmp_path_factory.mktemp(name))


def check_sample_roundtrip(config, params, inputs: dict, label: str):
    """sample_from_inputs: one segment per modality run, lengths and positions of the tokens,
    labels carried; inputs_from_sample of it gives the same logits."""
    n = inputs["input_ids"].shape[1]
    labels = np.where(np.arange(n) % 3 == 0, -100, inputs["input_ids"][0])[None]
    sample = hf.sample_from_inputs(config, inputs, labels, sample_id=label)
    assert sample.num_tokens == n and sample.source == config.family
    batch = hf.prepare(config, inputs)
    np.testing.assert_array_equal(np.concatenate([s.meta["positions"] for s in sample.segments]), batch["positions"])
    np.testing.assert_array_equal(np.concatenate([s.meta["labels"] for s in sample.segments]), labels[0])
    vision = [s for s in sample.segments if s.is_vision]
    assert vision and all(s.pixels.shape[0] == s.num_tokens and s.tokens_per_frame for s in vision)
    again = hf.inputs_from_sample(config, sample)
    np.testing.assert_array_equal(again["input_ids"], inputs["input_ids"])
    err = relative_error(logits(config, params, again), logits(config, params, inputs))
    assert err <= 1e-6, f"{label}: sample round trip changed the logits by {err:.2e}"
    return sample
