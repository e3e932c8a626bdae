"""The torch backend runs the Hugging Face families (`npu_backend.hf`) exactly as transformers does.

For Qwen2.5-VL, Qwen3-VL and InternVL (the tiny configs of tests/test_hf_engine_*.py, 2 LLM
layers, 2 vision blocks; per family a batch of 3 samples: video + image, image, text; DeepStack,
tied embeddings, window attention), each model saved by
transformers and loaded by `npu_backend.hf.load_family` (the project's safetensors reader):

- one process, dense attention: the logits of every sample, and the batch loss and its gradients
  (by transformers parameter name), vs transformers' logits, loss and autograd gradients;
- one world of 4 gloo processes: DHP steps of irregular plans (ring 3 + 1; Ulysses 2 + ring 2,
  then a hybrid 2 x 2) give transformers' loss and gradients on every rank.

All at fp32, relative error <= 1e-5 (`hf_engine_cases.relative_errors`).
"""

from __future__ import annotations

import numpy as np
import pytest

import hf_cases as hc
import hf_engine_cases as ec
from hf_cases import torch, transformers

from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan
from npu_backend.launch import run_world


def _families():
    """family -> (model class, config, batch of 3 samples: the most vision first, text last, vision ids)."""
    import test_hf_engine_internvl as iv
    import test_hf_engine_qwen3_vl as q3
    import test_hf_qwen2_5_vl
    import test_hf_qwen3_vl
    return {"qwen2_5_vl": (transformers.Qwen2_5_VLForConditionalGeneration, lambda: hc.qwen2_5_vl_config(depth=2),
                           lambda g: [test_hf_qwen2_5_vl.video_inputs(g), ec.qwen_image(g, 4, 8, 5, 2),
                                      hc.qwen_text_inputs()], (hc.QWEN_IMAGE, hc.QWEN_VIDEO)),
            "qwen3_vl": (transformers.Qwen3VLForConditionalGeneration, q3.config,
                         lambda g: [test_hf_qwen3_vl.video_inputs(g), ec.qwen_image(g, 8, 4, 1, 6),
                                    hc.qwen_text_inputs()], (q3.IMAGE, q3.VIDEO)),
            "internvl": (transformers.InternVLForConditionalGeneration, iv.config,
                         lambda g: [iv.image(g, 2, 3, 4), iv.image(g, 1, 5, 2), hc.text_inputs([5, 6, 7, 8, 9, 10])],
                         (iv.IMAGE,))}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """family -> (checkpoint dir, batch inputs, samples, transformers model, (loss, grads))."""
    return {f: case[:5] for f, case in ec.torch_family_cases(tmp_path_factory, _families(), "npu").items()}


def _dense_step(model, samples):
    """(loss, {name: grad}) of the whole batch on one process, every sample its own dense group."""
    from dhp_jax.model.hf.packed import pack_family_group
    from npu_backend.hf import stream_tensors
    layouts = [pack_family_group([s], 1, model.config) for s in samples]
    total = sum(lay.num_loss_tokens for lay in layouts)
    loss = sum(model.loss_sum(*stream_tensors(lay)) for lay in layouts) / total
    loss.backward()
    return float(loss.detach()), model.grads()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "internvl"])
def test_family_forward_and_grads_match_transformers(cases, family, tmp_path):
    from npu_backend.hf import load_family, save_family
    path, batch, samples, model, ref = cases[family]
    ours = load_family(path)
    save_family(ours, str(tmp_path))                 # what it writes loads back the same, names and values
    # under the names transformers' own save_pretrained wrote for this model (`path`, by `hc.build`)
    hc.check_saved_like_transformers(ours.config, hc.saved_shapes(str(tmp_path)), hc.saved_shapes(path))
    again = load_family(str(tmp_path))
    assert list(again.params) == list(ours.params)
    assert all(torch.equal(again.params[k], p) for k, p in ours.params.items())
    kinds = {s.segments[i].modality for s in samples for i in range(len(s.segments))}
    assert kinds >= ({"text", "image", "video"} if family != "internvl" else {"text", "image"}), kinds
    ec.check_torch_family(family, ours, batch, samples, model, _dense_step, ref)


def _plan(*micro_batches) -> Plan:
    return Plan(4, tuple(MicroBatch(tuple(Group(tuple(r), len(r), tuple(s), kind) for r, s, kind in mb))
                         for mb in micro_batches))


# Irregular plans of 4 ranks for the 3 samples (ranks out of order). The LLMs have 4 query and 2 KV
# heads, the encoders 2 heads.
PLANS = {
    "ring 3 + dense 1": _plan([((2, 0, 1), (0, 2), "ring"), ((3,), (1,), "ring")]),
    "ulysses 2 + ring 2, then hybrid 2x2": _plan([((1, 3), (1,), "ulysses"), ((0, 2), (2,), "ring")],
                                                [((3, 1, 0, 2), (0,), "hybrid:2x2")]),
}


def _world_worker(rank: int, world: int, jobs: dict, bad: dict | None = None) -> dict:
    from npu_backend.executor import StepError, TorchPlanExecutor
    from npu_backend.hf import load_family
    out = {}
    for family, (path, samples, plans) in jobs.items():
        model = load_family(path)
        ex = TorchPlanExecutor(model)
        for name, plan in plans.items():
            loss, tokens, _ = ex.loss_and_grads(plan, samples)
            g = model.grads()
            out[family, name] = {"loss": loss, "checksum": float(sum(np.abs(v).sum() for v in g.values())),
                                 "grads": g if rank == 0 else None, "sent": ex.tensors_sent}
        for name, samples_bad in (bad or {}).get(family, {}).items():
            try:
                ex.loss_and_grads(PLANS["ring 3 + dense 1"], samples_bad)
            except StepError as e:
                out[family, name] = str(e)
    return out


def test_family_dhp_steps_in_processes_match_transformers(cases):
    """Every family, both plans, in one world of 4 gloo processes (start-up paid once)."""
    import dataclasses

    from dhp_jax.data.sample import Sample
    jobs = {f: (path, samples, PLANS) for f, (path, _, samples, _, _) in cases.items()}
    samples = cases["qwen2_5_vl"][2]

    def with_segment(i, j, **meta):
        segs = list(samples[i].segments)
        segs[j] = dataclasses.replace(segs[j], meta=meta)
        return samples[:i] + [Sample(tuple(segs), sample_id=i)] + samples[i + 1:]

    first = samples[0].segments[0].meta
    image = samples[1].segments[1].meta                                # sample 1: rank 3's alone in the plan
    bad = {"qwen2_5_vl": {"no positions": with_segment(0, 0, **{k: v for k, v in first.items() if k != "positions"}),
                          "bad grid": with_segment(1, 1, **{**image, "grid_thw": (1, 8, 8)})}}
    res = run_world(_world_worker, 4, (jobs, bad), timeout=240)
    for r, o in enumerate(res):          # every rank raises, before any collective or through the status
        assert "sample 0 segment 0: no meta['positions']" in o["qwen2_5_vl", "no positions"], (r, o)
        want = "sample 1 segment 1: image pixels" if r == 3 else "ranks [3] could not pack"
        assert want in o["qwen2_5_vl", "bad grid"], (r, o["qwen2_5_vl", "bad grid"])
    for family, (_, _, _, _, (ref_loss, ref_grads)) in cases.items():
        for name in PLANS:
            r0 = res[0][family, name]
            for r, other in enumerate(res):          # the all-reduce leaves the same gradient everywhere
                assert other[family, name]["loss"] == r0["loss"], (family, name, r)
                assert other[family, name]["checksum"] == r0["checksum"], (family, name, r)
            loss_err = abs(r0["loss"] - ref_loss) / abs(ref_loss)
            grad_err, worst = ec.relative_errors(r0["grads"], ref_grads)
            print(f"torch {family} {name}: loss {loss_err:.1e}, grads {grad_err:.1e} ({worst})")
            assert loss_err <= hc.TOL and grad_err <= hc.TOL, (family, name, loss_err, grad_err, worst)
    last = list(PLANS)[-1]
    assert all(o["qwen3_vl", last]["sent"] > 0 for o in res)           # every rank sent ring / all-to-all blocks
