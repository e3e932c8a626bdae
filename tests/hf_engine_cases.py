"""Shared by tests/test_hf_engine*.py: one DHP step of Hugging Face family samples in PlanExecutor
vs transformers' own loss and autograd gradients.

The reference: each sample through `*ForConditionalGeneration(**inputs, labels=labels)` (its loss
is the mean over the sample's shifted labels); the batch loss is the token-weighted mean
sum_i loss_i * n_i / sum_i n_i (n_i: the sample's counted labels), its gradient by autograd.
Compared in fp32: |loss - ref| / |ref| and, per parameter (by transformers name through
`hf.to_state_dict`), max |grad - ref| / max |ref|, both <= 1e-5."""

from __future__ import annotations

import numpy as np

import hf_cases as hc
from hf_cases import torch

from dhp_jax.model import hf
from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan


def labels_of(g: np.random.Generator, inputs: dict, vision_ids: tuple[int, ...]) -> np.ndarray:
    """The input ids as labels, -100 on the vision placeholders and on a random quarter of the rest."""
    ids = inputs["input_ids"][0]
    drop = np.isin(ids, vision_ids) | (g.random(ids.shape) < 0.25)
    return np.where(drop, -100, ids)[None]


IMAGE, START, END = hc.QWEN_IMAGE, hc.QWEN_START, hc.QWEN_END


def qwen_image(g, h, w, before, after):
    """text, an h x w-patch image, text, as the Qwen processors emit it (ids of tests/test_hf_qwen*.py)."""
    n = h * w // 4
    ids = list(g.integers(3, 100, before)) + [START] + [IMAGE] * n + [END] + list(g.integers(3, 100, after))
    types = [0] * (before + 1) + [1] * n + [0] * (after + 1)
    return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "mm_token_type_ids": np.array([types]),
            "pixel_values": g.standard_normal((h * w, 96)).astype(np.float32),
            "image_grid_thw": np.array([[1, h, w]])}


def reference(model, batch: list[dict], labels: list[np.ndarray], **kw) -> tuple[float, dict[str, np.ndarray]]:
    """(token-weighted batch loss, {name: grad}) by transformers' loss and autograd (`kw` to the
    model's forward, e.g. output_router_logits=True: the MoE load-balancing loss added)."""
    model.zero_grad()
    total, count = 0.0, 0
    for inputs, lab in zip(batch, labels):
        n = int((lab[0, 1:] != -100).sum())
        out = model(**hc.torch_inputs(inputs), labels=torch.as_tensor(lab), **kw)
        total = total + out.loss * n
        count += n
    loss = total / count
    loss.backward()
    return float(loss.detach()), {k: p.grad.numpy().copy() for k, p in model.named_parameters() if p.grad is not None}


def plan(*micro_batches) -> Plan:
    """Micro-batches of (ranks, samples, attention kind) groups on 8 ranks."""
    return Plan(8, tuple(MicroBatch(tuple(Group(tuple(r), len(r), tuple(s), kind) for r, s, kind in mb))
                         for mb in micro_batches))


# Two micro-batches on 8 devices (4 query heads): ring groups of degrees 3 and 5, then one group of
# Ulysses 4 x ring 2 over every device, out of order (Ulysses over 4: the 2 KV heads repeated, the
# 2 vision heads padded to 4; and the ring's hops): three executables. A group's samples are not
# in batch order.
MIXED = plan([((0, 1, 2), (0,), "ring"), ((3, 4, 5, 6, 7), (2, 1), "ring")],
             [((7, 5, 6, 4, 0, 2, 1, 3), (3, 5, 4), "hybrid:4x2")])


ZERO = 1e-6      # a reference gradient below ZERO x the largest one is an exact zero up to rounding


def relative_errors(ours: dict, theirs: dict) -> tuple[float, str]:
    """(worst per-tensor max |ours - theirs| / max |theirs|, its name); the names must match.

    A tensor whose exact gradient is zero (the key bias of attention without rotary: softmax does
    not change when every score of a row moves by q . b) holds rounding noise on both sides, whose
    ratio means nothing: where max |theirs| <= ZERO * the largest reference gradient, the error is
    measured against the largest reference gradient instead."""
    assert sorted(ours) == sorted(theirs), set(ours) ^ set(theirs)
    largest = max(float(np.max(np.abs(v))) for v in theirs.values())
    errs = {}
    for k, ref in theirs.items():
        diff = float(np.max(np.abs(np.asarray(ours[k], np.float64) - ref)))
        scale = float(np.max(np.abs(ref)))
        errs[k] = diff / (scale if scale > ZERO * largest else largest)
    worst = max(errs, key=errs.get)
    return errs[worst], worst


def check_step(case, dhp_plan: Plan, label: str) -> tuple[float, float]:
    """One step of `dhp_plan` on the case's executor vs the reference: (loss error, grads error)."""
    cfg, params, samples, (ref_loss, ref_grads), ex = case
    loss, grads = ex.loss_and_grads(params, samples, dhp_plan)
    loss_err = abs(float(loss) - ref_loss) / abs(ref_loss)
    grad_err, worst = relative_errors(hf.to_state_dict(cfg, grads), ref_grads)
    print(f"{label}: loss {float(loss):.6f} vs {ref_loss:.6f} (rel {loss_err:.1e}), grads max rel {grad_err:.1e} "
          f"({worst})")
    assert loss_err <= hc.TOL and grad_err <= hc.TOL, (loss_err, grad_err, worst)
    return loss_err, grad_err


def build_case(tmp_path_factory, name: str, model_cls, config, batch_fn, vision_ids: tuple[int, ...]):
    """(config, params, samples, reference, executor) of a tiny random model and a batch."""
    from dhp_jax.sharding import PlanExecutor
    path = hc.model_dir(tmp_path_factory, name)
    model = hc.build(model_cls, config, path)
    cfg, params = hf.load_pretrained(path)
    g = hc.rng(3)
    batch = batch_fn(g)
    labels = [labels_of(g, x, vision_ids) for x in batch]
    samples = [hf.sample_from_inputs(cfg, x, lab, sample_id=i) for i, (x, lab) in enumerate(zip(batch, labels))]
    return cfg, params, samples, reference(model, batch, labels), PlanExecutor(cfg)


def torch_family_cases(tmp_path_factory, families: dict, prefix: str) -> dict:
    """family -> (checkpoint dir, batch inputs, samples, transformers model, (loss, grads), labels)
    for the torch backend's tests: `families` {family: (model class, config maker, batch maker,
    vision token ids)}, each model built by transformers and saved under `prefix`_family, its
    samples read back through `npu_backend.hf.load_family`'s config."""
    from npu_backend.hf import load_family

    out = {}
    for family, (cls, make_config, make_batch, vision_ids) in families.items():
        path = hc.model_dir(tmp_path_factory, f"{prefix}_{family}")
        model = hc.build(cls, make_config(), path)
        config = load_family(path).config
        g = hc.rng(3)
        batch = make_batch(g)
        labels = [labels_of(g, x, vision_ids) for x in batch]
        samples = [hf.sample_from_inputs(config, x, lab, sample_id=i) for i, (x, lab) in enumerate(zip(batch, labels))]
        out[family] = (path, batch, samples, model, reference(model, batch, labels), labels)
    return out


def check_torch_family(family: str, ours, batch: list[dict], samples: list, model, step, ref: tuple) -> None:
    """The torch backend's family model `ours` against transformers' `model`: every sample's logits,
    and the batch's loss and gradients of `step(ours, samples)` -> (loss, grads) against `ref`
    (loss, grads), each at the relative tolerance `hc.TOL`."""
    ref_loss, ref_grads = ref
    worst = max(hc.relative_error(ours.logits(s).numpy(), hc.reference_logits(model, x)) for x, s in zip(batch, samples))
    loss, grads = step(ours, samples)
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    grad_err, name = relative_errors(grads, ref_grads)
    print(f"torch {family}: logits {worst:.1e}, loss {loss_err:.1e}, grads {grad_err:.1e} ({name})")
    assert worst <= hc.TOL and loss_err <= hc.TOL and grad_err <= hc.TOL, (worst, loss_err, grad_err, name)
