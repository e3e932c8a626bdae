"""The torch twin equals the flax model (logits, loss, gradients) and the weight mapping is exact."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from npu_backend.model import TorchMLLM, token_loss_sum
from npu_backend.weights import (WeightsError, export_flax_params, flatten_tree, grads_as_flax,
                                 load_flax_params, load_npz, save_npz)

TOL = 1e-5  # fp32, whole model


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


LENGTHS = [37, 12, 25, 9, 44, 18, 6, 30]


@functools.lru_cache(maxsize=1)
def reference_case():
    """Tiny config, flax params, a mixed batch, and JAX's `reference_loss` with its gradients.

    Cached so that this module and test_npu_executor.py pay for one jax compile only.
    """
    import jax

    from dhp_jax.data.synthetic import random_samples
    from dhp_jax.model import MLLMConfig, init_params, reference_loss

    config = MLLMConfig()
    params = jax.device_get(init_params(config, jax.random.PRNGKey(7)))
    samples = random_samples(config, LENGTHS, seed=11)
    loss, grads = jax.value_and_grad(lambda p: reference_loss(config, p, samples))(params)
    return config, params, samples, float(loss), flatten_tree(jax.device_get(grads))


@pytest.fixture(scope="module")
def flax_setup():
    config, params, samples, _, _ = reference_case()
    return config, params, samples


def test_torch_model_matches_flax_loss_and_grads():
    from dhp_jax.model.reference import reference_stream

    config, params, samples, ref_loss, ref_grads = reference_case()
    stream = reference_stream(config, samples)
    assert stream["vision_mask"].any() and (stream["span_ids"] > 0).any()
    assert len(np.unique(stream["frame_ids"])) > 3  # several frames: video and images
    model = TorchMLLM(config)
    load_flax_params(model, params)
    batch = {k: torch.from_numpy(np.asarray(v)) for k, v in stream.items()}
    logits = model(batch)
    count = float(stream["loss_weights"].sum())
    loss = token_loss_sum(logits, batch["targets"], batch["loss_weights"]) / count
    loss.backward()
    assert abs(float(loss.detach()) - ref_loss) <= TOL * abs(ref_loss)
    got = flatten_tree(grads_as_flax(model))
    assert set(got) == set(ref_grads)
    bad = {k: _rel(got[k], v) for k, v in ref_grads.items() if _rel(got[k], v) > TOL}
    assert not bad, bad


def test_weight_mapping_round_trips_exactly(flax_setup, tmp_path):
    config, params, _ = flax_setup
    model = TorchMLLM(config)
    load_flax_params(model, params)
    back = flatten_tree(export_flax_params(model))
    orig = flatten_tree(params)
    assert set(back) == set(orig)
    for k in orig:
        assert back[k].shape == orig[k].shape and np.array_equal(back[k], orig[k]), k
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    save_npz(str(tmp_path / "w.npz"), params)
    again = TorchMLLM(config)
    load_flax_params(again, load_npz(str(tmp_path / "w.npz")))
    for (n, a), b in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(a, b), n


def test_mismatched_weights_name_every_problem(flax_setup):
    config, params, _ = flax_setup
    flat = flatten_tree(params)
    flat.pop("layers_1/mlp/up/kernel")
    flat["layers_0/attn/q/kernel"] = np.zeros((config.d_model, 3), np.float32)
    flat["layers_9/attn/q/kernel"] = np.zeros((2, 2), np.float32)
    model = TorchMLLM(config)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(WeightsError) as e:
        load_flax_params(model, {"params": _unflat(flat)})
    msg = str(e.value)
    assert "missing weight 'layers_1/mlp/up/kernel'" in msg
    assert f"'layers_0/attn/q/kernel' has shape ({config.d_model}, 3)" in msg
    assert "unexpected weight 'layers_9/attn/q/kernel'" in msg
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "partial load"


def _unflat(flat):
    from npu_backend.weights import unflatten_tree

    return unflatten_tree(flat)
