"""The mixture-of-experts families in the torch backend (`npu_backend.moe`) run as transformers does.

- The sparse block alone vs transformers' `Qwen3MoeSparseMoeBlock` (norm_topk_prob off and on) and
  `Qwen3VLMoeTextSparseMoeBlock`, and the load-balancing loss vs `load_balancing_loss_func` (dead
  rows masked): outputs and gradients.
- Tiny Qwen3-VL-MoE (DeepStack; video, image, text) and InternVL with a Qwen3-MoE LLM, each 8
  experts, top 2, one dense layer among two sparse ones, saved by transformers (fused experts;
  per expert) and loaded by `load_family`: logits, batch loss and gradients vs transformers, the
  load-balancing loss on (Qwen3-VL-MoE with `output_router_logits`; InternVL's transformers model
  never adds it).
- The same weights saved by the JAX engine and by the torch backend: identical files, the experts in
  the family's published layout (`expert_layouts.to_published`), read back by transformers and both
  loaders.
- One world of 4 gloo processes: the block with its experts split over t = 2 and t = 4 processes
  (all-to-all dispatch) equals one process; both families (vision and LLM heads divisible by 4) as
  4 ranks of t = 1, 2 ranks of t = 2 and 1 rank of t = 4, each on an irregular DHP plan (`PLANS`),
  at t = 2 and 4 with and without sequence parallelism, equal transformers (loss and gradients),
  and route the tokens one process routes (the same count per expert). With the load-balancing
  loss on, one router pass per micro-batch runs first (none with it off), a process holds one
  micro-batch's saved tensors at a time (peak = the largest micro-batch's, metered with
  `saved_tensors_hooks`), and the torch trainer's cost model prices the router phase exactly then.
- The router pass stops after the last sparse layer (no LM head, no gradient) and routes as the
  full forward pass; a `--cost` profile pricing the router phase otherwise is refused.

fp32, relative error <= 1e-5.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import hf_cases as hc
import hf_engine_cases as ec
from hf_cases import torch, transformers

from dhp_jax.model import hf
from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan
from npu_backend.launch import run_world

E, K, INTER, D = 8, 2, 16, 64          # experts, top k, expert width (2 I != d: a transposition shows), width


def _qwen3_vl_moe_config():
    import test_hf_qwen3_vl

    c = test_hf_qwen3_vl.make_config(False).to_dict()
    c["text_config"].update(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=INTER, mlp_only_layers=[1])
    c["vision_config"].update(depth=2, deepstack_visual_indexes=[0], num_heads=4)   # heads split over t = 4
    for part in (c, c["text_config"], c["vision_config"]):
        part.pop("model_type", None)
    return transformers.Qwen3VLMoeConfig(**c)


def _internvl_moe_config():
    import test_hf_engine_internvl as iv

    return transformers.InternVLConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                           image_size=16, patch_size=4, attention_bias=True, initializer_range=0.2),
        text_config=dict(model_type="qwen3_moe", vocab_size=128, hidden_size=D, intermediate_size=96,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_experts=E,
                         num_experts_per_tok=K, moe_intermediate_size=INTER, mlp_only_layers=[0],
                         norm_topk_prob=False),
        image_token_id=iv.IMAGE, image_seq_length=4)


def _batches():
    import test_hf_engine_internvl as iv
    import test_hf_qwen3_vl

    return {"qwen3_vl_moe": (transformers.Qwen3VLMoeForConditionalGeneration, _qwen3_vl_moe_config,
                             lambda g: [test_hf_qwen3_vl.video_inputs(g), ec.qwen_image(g, 8, 4, 1, 6),
                                        hc.qwen_text_inputs()], (hc.QWEN_IMAGE, hc.QWEN_VIDEO)),
            "internvl": (transformers.InternVLForConditionalGeneration, _internvl_moe_config,
                         lambda g: [iv.image(g, 2, 3, 4), iv.image(g, 1, 5, 2), hc.text_inputs([5, 6, 7, 8, 9, 10])],
                         (iv.IMAGE,))}


def _with_router_loss(path: str, out: str) -> str:
    """A copy of checkpoint `path` whose config.json sets text_config.output_router_logits."""
    shutil.copytree(path, out)
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    raw["text_config"]["output_router_logits"] = True
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f)
    return out


def _reference_with_router_loss(model, batch, labels, num_experts: int, top_k: int, coef: float):
    """transformers' token-weighted batch loss plus coef * load_balancing_loss_func over the whole
    batch's router logits (every sample's rows, every sparse layer), and its gradients."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    model.zero_grad()
    total, count, logits = 0.0, 0, []
    for inputs, lab in zip(batch, labels):
        n = int((lab[0, 1:] != -100).sum())
        out = model(**hc.torch_inputs(inputs), labels=torch.as_tensor(lab), output_router_logits=False)
        total = total + out.loss * n
        count += n
        logits.append(model(**hc.torch_inputs(inputs), output_router_logits=True).router_logits)
    per_layer = tuple(torch.cat([lg[i] for lg in logits]) for i in range(len(logits[0])))
    loss = total / count + coef * load_balancing_loss_func(per_layer, num_experts, top_k)
    loss.backward()
    return float(loss.detach()), {k: p.grad.numpy().copy() for k, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """family -> (checkpoint dir, batch, samples, transformers model, (loss, grads)); "router loss":
    Qwen3-VL-MoE with output_router_logits (its dir, its (loss, grads))."""
    out = ec.torch_family_cases(tmp_path_factory, _batches(), "moe")
    path, batch, _, model, _, labels = out["qwen3_vl_moe"]
    routed = _with_router_loss(path, os.path.join(hc.model_dir(tmp_path_factory, "moe_aux"), "ckpt"))
    coef = model.config.text_config.router_aux_loss_coef
    out["router loss"] = (routed, _reference_with_router_loss(model, batch, labels, E, K, coef))
    return out


def _one_process(model, samples):
    """(loss, grads) of the batch on one process, each sample its own dense group, with the
    load-balancing loss when the config turns it on."""
    from dhp_jax.model.hf.packed import pack_family_group
    from npu_backend import moe
    from npu_backend.hf import stream_tensors

    layouts = [pack_family_group([s], 1, model.config) for s in samples]
    total = sum(lay.num_loss_tokens for lay in layouts)
    loss, stats = 0.0, []
    for lay in layouts:
        loss = loss + model.loss_sum(*stream_tensors(lay)) / total
        stats += model.router_stats
    coef = moe.aux_loss_coef(model.config)
    loss = loss + coef * moe.batch_aux_loss(stats, model.config.text.moe.num_experts)
    loss.backward()
    return float(loss.detach()), model.grads()


# ---------------------------------------------------------------------------------------- the block
def _blocks():
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    size = dict(hidden_size=16, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=12)
    return {("qwen3_moe", False): Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**size, norm_topk_prob=False)),
            ("qwen3_moe", True): Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**size, norm_topk_prob=True)),
            ("qwen3_vl_moe", True): Qwen3VLMoeTextSparseMoeBlock(Qwen3VLMoeTextConfig(**size))}


def _block_case(seed: int = 0):
    """Weights [E, d] router, [E, 2 I, d], [E, d, I] experts; rows x [37, 16]; 5 dead rows; a cotangent."""
    g = torch.Generator().manual_seed(seed)
    w = {"gate.weight": torch.randn((E, 16), generator=g), "experts.gate_up_proj": 0.5 * torch.randn((E, 24, 16), generator=g),
         "experts.down_proj": 0.5 * torch.randn((E, 16, 12), generator=g)}
    x, cot = torch.randn((37, 16), generator=g), torch.randn((37, 16), generator=g)
    live = torch.ones(37, dtype=torch.bool)
    live[[3, 10, 11, 20, 36]] = False
    return w, x, cot, live


def _block_reference(norm: bool, aux: float):
    """(y, {name: grad} with "x") of `sparse_block` on one process, objective (y * cot).sum() + aux * loss."""
    from npu_backend import moe

    w, x, cot, live = _block_case()
    w = {k: v.clone().requires_grad_() for k, v in w.items()}
    x = x.clone().requires_grad_()
    y, stats = moe.sparse_block(x, w["gate.weight"], w["experts.gate_up_proj"], w["experts.down_proj"], K, norm,
                                torch.nn.functional.silu, live=live)
    ((y * cot).sum() + aux * moe.batch_aux_loss([stats], E)).backward()
    return y.detach().numpy(), {"x": x.grad.numpy(), **{k: v.grad.numpy() for k, v in w.items()}}


def test_sparse_block_and_router_loss_match_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from npu_backend import moe

    w, x, cot, live = _block_case()
    for (kind, norm), block in _blocks().items():
        with torch.no_grad():
            for name, p in block.named_parameters():
                p.copy_(w[name])
        xt = x[None].clone().requires_grad_()
        (block(xt)[0] * cot).sum().backward()
        y, grads = _block_reference(norm, 0.0)
        theirs = {"x": xt.grad[0].numpy(), **{n: p.grad.numpy() for n, p in block.named_parameters()}}
        out_err = hc.relative_error(y, block(x[None])[0].detach().numpy())
        grad_err, worst = ec.relative_errors(grads, theirs)
        print(f"{kind} block (norm_topk_prob {norm}): output {out_err:.1e}, grads {grad_err:.1e} ({worst})")
        assert out_err <= hc.TOL and grad_err <= hc.TOL, (kind, norm, out_err, grad_err, worst)
    # the load-balancing loss of two layers' routing over the live rows, and its gradient
    gates = [w["gate.weight"].clone().requires_grad_(), (0.5 * w["gate.weight"]).clone().requires_grad_()]
    stats = [moe.sparse_block(x, gt, w["experts.gate_up_proj"], w["experts.down_proj"], K, True,
                              torch.nn.functional.silu, live=live)[1] for gt in gates]
    ours = moe.batch_aux_loss(stats, E)
    ours.backward()
    mine = [gt.grad.clone() for gt in gates]
    for gt in gates:
        gt.grad = None
    theirs = load_balancing_loss_func(tuple(x @ gt.T for gt in gates), E, K, live[None].long())
    theirs.backward()
    ours, theirs = float(ours.detach()), float(theirs.detach())
    assert abs(ours - theirs) <= hc.TOL * theirs, (ours, theirs)
    for a, gt in zip(mine, gates):
        assert hc.relative_error(a.numpy(), gt.grad.numpy()) <= hc.TOL


# ---------------------------------------------------------------------------------------- the families
@pytest.mark.parametrize("family", ["qwen3_vl_moe", "internvl"])
def test_moe_family_matches_transformers(cases, family, tmp_path):
    from npu_backend.hf import load_family

    path, batch, samples, model, ref, _ = cases[family]
    ours = load_family(path)
    spec = ours.config.text.moe
    assert (spec.num_experts, spec.top_k, sum(spec.sparse), len(spec.sparse)) == (E, K, 2, 3), spec
    ec.check_torch_family(family, ours, batch, samples, model, _one_process, ref)
    if family == "internvl":      # transformers' model never adds the router loss, so neither do we
        routed = load_family(_with_router_loss(path, str(tmp_path / "routed")))
        assert abs(_one_process(routed, samples)[0] - ref[0]) <= hc.TOL * ref[0]


def test_router_pass_stops_after_the_last_sparse_layer(cases):
    """`TorchFamilyModel.router_pass` (the first phase of a step with the load-balancing loss): the
    full forward pass's routing, no gradient kept, the LLM layers up to the last sparse one and
    no LM head."""
    import dataclasses

    from dhp_jax.model.hf.packed import pack_family_group
    from npu_backend.hf import TorchFamilyModel, load_family, stream_tensors

    path, _, samples, _, _, _ = cases["qwen3_vl_moe"]
    model = load_family(path)
    shard = stream_tensors(pack_family_group(samples[:2], 1, model.config))
    model.loss_sum(*shard)
    full = model.router_stats
    blocks, heads = [], []
    for m in (model, TorchFamilyModel(dataclasses.replace(model.config, text=dataclasses.replace(
            model.config.text, moe=dataclasses.replace(model.config.text.moe, sparse=(True, False, False)))),
            {k: p.detach() for k, p in model.params.items()})):
        block, head = m.decoder_block, m.head
        m.decoder_block = lambda *a, **k: blocks.append(a[0]) or block(*a, **k)
        m.head = lambda: heads.append(1) or head()
        got = m.router_pass(*shard)
        assert len(got) == sum(m.config.text.moe.sparse) and not any(s.probs.requires_grad for s in got)
        for a, b in zip(got, full):
            assert torch.equal(a.counts, b.counts) and a.rows == b.rows
            assert hc.relative_error(a.probs.numpy(), b.probs.detach().numpy()) <= hc.TOL
    # layers 0-2 (the last sparse: 2), then layer 0 alone (sparse: layer 0 only); never the head
    assert [int(b.rsplit(".", 1)[1]) for b in blocks] == [0, 1, 2, 0] and heads == []


# the published layout of each family's experts: Qwen3-VL-MoE's releases fused and transposed, InternVL3.5's
# Qwen3-MoE LLM per expert (`dhp_jax.model.hf.expert_layouts`)
PUBLISHED = {"qwen3_vl_moe": lambda w: [(k, v.shape) for k, v in w.items() if k.endswith("layers.0.mlp.experts.gate_up_proj")]
             == [("model.language_model.layers.0.mlp.experts.gate_up_proj", (E, D, 2 * INTER))],
             "internvl": lambda w: not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in w)
             and w["language_model.model.layers.1.mlp.experts.7.up_proj.weight"].shape == (INTER, D)}


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "internvl"])
def test_both_engines_save_the_published_expert_layout(cases, family, tmp_path):
    """The same weights saved by the JAX engine (`hf.save_pretrained`) and the torch backend
    (`save_family`): the same names, shapes and values, the names transformers' `save_pretrained`
    writes, the experts in the family's published layout;
    transformers and both engines' loaders read either back to the weights saved."""
    from dhp_jax.model.hf import expert_layouts as xl, safetensors_io
    from npu_backend.hf import load_family, save_family

    path, _, _, model, _, _ = cases[family]
    config, params = hf.load_pretrained(path)
    hf.save_pretrained(config, params, str(tmp_path / "jax"))
    ours = load_family(path)
    save_family(ours, str(tmp_path / "torch"))
    saved = {e: dict(safetensors_io.read_checkpoint(str(tmp_path / e))) for e in ("jax", "torch")}
    assert sorted(saved["jax"]) == sorted(saved["torch"])
    for k, a in saved["jax"].items():
        b = saved["torch"][k]
        assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b), (k, a.shape, b.shape)
    assert PUBLISHED[family](saved["torch"]), sorted((k, v.shape) for k, v in saved["torch"].items() if "experts" in k)
    # the names transformers' own save_pretrained wrote for this model (`path`, by `hc.build`)
    hc.check_saved_like_transformers(config, {k: v.shape for k, v in saved["torch"].items()}, hc.saved_shapes(path))
    for engine in ("jax", "torch"):
        back = type(model).from_pretrained(str(tmp_path / engine)).state_dict()
        for k, p in model.state_dict().items():
            assert torch.equal(back[k], p), (engine, k)
        again = load_family(str(tmp_path / engine))
        assert all(torch.equal(again.params[k], p) for k, p in ours.params.items()), engine
        _, tree = hf.load_pretrained(str(tmp_path / engine))
        state = hf.to_state_dict(config, tree)
        assert all(np.array_equal(state[k], p.detach().numpy()) for k, p in ours.params.items()), engine
    # a fused weight whose transpose has its own shape (2 I = d) stays as transformers holds it: every
    # loader reads a weight of the module's shape untransposed
    square = {"m.layers.0.mlp.experts.gate_up_proj": np.arange(2 * 4 * 4.0).reshape(2, 4, 4)}
    assert np.array_equal(xl.to_published(square, "fused_transposed")["m.layers.0.mlp.experts.gate_up_proj"],
                          square["m.layers.0.mlp.experts.gate_up_proj"])


def test_router_loss_matches_transformers(cases):
    """Qwen3-VL-MoE with output_router_logits: transformers' batch loss + coef * load-balancing loss."""
    from npu_backend.hf import load_family

    routed, (ref_loss, ref_grads) = cases["router loss"]
    _, batch, samples, model, (plain_loss, _), labels = cases["qwen3_vl_moe"]
    ours = load_family(routed)
    loss, grads = _one_process(ours, samples)
    assert loss - plain_loss > 1e-4 * plain_loss          # the loss is on
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    grad_err, name = ec.relative_errors(grads, ref_grads)
    # one sample alone: transformers' own loss with output_router_logits
    model.config.text_config.output_router_logits = True
    try:
        with torch.no_grad():
            one = float(model(**hc.torch_inputs(batch[0]), labels=torch.as_tensor(labels[0])).loss)
    finally:
        model.config.text_config.output_router_logits = False
    mine = _one_process(ours, samples[:1])[0]
    print(f"torch qwen3_vl_moe + router loss: loss {loss_err:.1e}, grads {grad_err:.1e} ({name}); "
          f"one sample {abs(mine - one) / one:.1e}")
    assert loss_err <= hc.TOL and grad_err <= hc.TOL and abs(mine - one) <= hc.TOL * one, (loss_err, grad_err, name)


# ---------------------------------------------------------------------------------------- one world
# The world of 4 processes as 4 ranks of t = 1, 2 ranks of t = 2 and 1 rank of t = 4, each on an
# irregular plan of the batch's 3 samples (with the load-balancing loss on, every micro-batch's
# router pass runs first, then each micro-batch's forward and backward):
# - t = 1: Ulysses over ranks 1, 0 (out of order) for sample 0 beside a ring over ranks 2, 3 for
#   sample 2, then rank 3 alone for sample 1 while the others idle;
# - t = 2: Ulysses over both ranks (out of order) for sample 0, a ring over both for sample 2, then
#   rank 0 alone for sample 1 while rank 1 idles;
# - t = 4: samples 2 and 0 packed in one stream, then sample 1 alone.
PLANS = {
    1: Plan(4, (MicroBatch((Group((1, 0), 2, (0,), "ulysses"), Group((2, 3), 2, (2,), "ring"))),
                MicroBatch((Group((3,), 1, (1,), "ring"),)))),
    2: Plan(2, (MicroBatch((Group((1, 0), 2, (0,), "ulysses"),)), MicroBatch((Group((0, 1), 2, (2,), "ring"),)),
                MicroBatch((Group((0,), 1, (1,), "ring"),)))),
    4: Plan(1, (MicroBatch((Group((0,), 1, (2, 0), "ring"),)), MicroBatch((Group((0,), 1, (1,), "ulysses"),)))),
}
RUNS = ((1, False), (2, False), (2, True), (4, False), (4, True))    # (t, sequence parallelism)


def _block_world(rank: int, world: int) -> dict:
    """The block with experts split over t = 2 and t = 4 processes: output and whole gradients."""
    import torch.distributed as dist

    from npu_backend import moe
    from npu_backend.tensor_parallel import TensorParallel

    out = {}
    for t in (2, 4):
        tp = TensorParallel.create(world, t)
        w, x, cot, live = _block_case()
        per = E // t
        mine = {k: (v[tp.index * per:(tp.index + 1) * per] if k.startswith("experts") else v).clone().requires_grad_()
                for k, v in w.items()}
        xl = x.clone().requires_grad_()
        y, stats = moe.sparse_block(tp.rows(xl), mine["gate.weight"], mine["experts.gate_up_proj"],
                                    mine["experts.down_proj"], K, True, torch.nn.functional.silu, tp, tp.local_rows(live))
        y = tp.stream(y, x.shape[0])
        ((y * cot).sum() + 0.5 * moe.batch_aux_loss([stats], E, tp.group)).backward()
        grads = {"x": xl.grad, "gate.weight": tp.sum(mine["gate.weight"].grad)}
        for k in ("experts.gate_up_proj", "experts.down_proj"):
            parts = [torch.empty_like(mine[k].grad) for _ in range(t)]
            dist.all_gather(parts, mine[k].grad.contiguous(), group=tp.group)
            grads[k] = torch.cat(parts)
        out[t] = (y.detach().numpy(), {k: v.numpy() for k, v in grads.items()})
    return out


class _SavedMeter:
    """Counts a model's forward passes (router passes, loss forwards) and the bytes autograd saves
    for backward (`saved_tensors_hooks`): per loss forward, and the peak held at once over a step."""

    def __init__(self, model):
        self.router, self.saved, self.live, self.peak = 0, [], 0, 0
        router_pass, loss_sum = model.router_pass, model.loss_sum

        def counted_router(*a, **k):
            self.router += 1
            before = sum(self.saved)
            out = router_pass(*a, **k)
            assert sum(self.saved) == before and self.live == 0, "a router pass kept tensors for backward"
            return out

        def counted_loss(*a, **k):
            self.saved.append(0)
            return loss_sum(*a, **k)

        model.router_pass, model.loss_sum = counted_router, counted_loss

    def pack(self, tensor):
        n = tensor.numel() * tensor.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        if self.saved:
            self.saved[-1] += n
        return _Held(tensor, n, self)

    @staticmethod
    def unpack(held):
        return held.tensor


class _Held:
    """A saved tensor; the meter's live bytes drop when autograd frees it."""

    __slots__ = ("tensor", "n", "meter")

    def __init__(self, tensor, n, meter):
        self.tensor, self.n, self.meter = tensor, n, meter

    def __del__(self):
        self.meter.live -= self.n


def _family_world(rank: int, jobs: dict) -> dict:
    """{(family, t, sequence): loss, whole gradients (processes 0 and 3), expert weights held, tokens
    per expert, forward passes and saved bytes (`_SavedMeter`)} of each of `RUNS` on its plan."""
    from npu_backend.executor import TorchPlanExecutor
    from npu_backend.hf import load_family

    out = {}
    for family, (path, samples) in jobs.items():
        for t, sequence in RUNS:
            model = load_family(path)
            ex = TorchPlanExecutor(model, tensor_parallel=t, sequence_parallel=sequence)
            meter = _SavedMeter(model)
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                loss, _, _ = ex.loss_and_grads(PLANS[t], samples)
            grads = {n: g.numpy() for n, g in ex.tp.gather(model, grads=True).items()}
            held = sum(p.numel() for n, p in model.params.items() if ".experts." in n)
            out[family, t, sequence] = {"loss": loss, "grads": grads if rank in (0, 3) else None,
                                        "experts held": held, "expert tokens": ex.expert_tokens,
                                        "aux": ex.aux_coef, "router passes": meter.router, "saved": meter.saved,
                                        "peak saved": meter.peak}
            if t == 1:      # the torch trainer's planner for this executor (`npu_backend.train`)
                from npu_backend.train import build_parser, planner_for

                cost = planner_for(build_parser().parse_args([]), 4, rank, ex).cost
                out[family, t, sequence]["router phase priced"] = cost.router_phase
    return out


def _expert_tokens(path: str, samples) -> list[float]:
    """Tokens routed to each expert over the batch, per sparse layer, on one process."""
    from dhp_jax.model.hf.packed import pack_family_group
    from npu_backend import moe
    from npu_backend.hf import load_family, stream_tensors

    model, stats = load_family(path), []
    with torch.no_grad():
        for s in samples:
            model.loss_sum(*stream_tensors(pack_family_group([s], 1, model.config)))
            stats += model.router_stats
    return (moe.batch_totals(stats, E)[:-1] / sum(model.config.text.moe.sparse)).tolist()


def _worker(rank: int, world: int, jobs: dict) -> dict:
    return {"block": _block_world(rank, world), "family": _family_world(rank, jobs)}


def test_world_experts_split_over_the_rank_match(cases):
    routed, (ref_loss, ref_grads) = cases["router loss"]
    path, _, samples, _, iv_ref, _ = cases["internvl"]
    jobs = {"qwen3_vl_moe": (routed, cases["qwen3_vl_moe"][2]), "internvl": (path, samples)}
    res = run_world(_worker, 4, (jobs,), timeout=300)
    y_ref, g_ref = _block_reference(True, 0.5)
    for t in (2, 4):
        for r, o in enumerate(res):
            y, grads = o["block"][t]
            out_err, (grad_err, worst) = hc.relative_error(y, y_ref), ec.relative_errors(grads, g_ref)
            assert out_err <= hc.TOL and grad_err <= hc.TOL, (t, r, out_err, grad_err, worst)
        print(f"block, experts over t = {t}: output {out_err:.1e}, grads {grad_err:.1e}")
    # at every t a process runs >= 2 micro-batches (the memory assertion below needs it)
    assert all(max(sum(any(r // t in g.ranks for g in mb.groups) for mb in PLANS[t].micro_batches)
                   for r in range(4)) >= 2 for t in (1, 2, 4))
    refs = {"qwen3_vl_moe": (ref_loss, ref_grads), "internvl": iv_ref}
    routed_tokens = {f: _expert_tokens(jobs[f][0], jobs[f][1]) for f in refs}
    whole = {f: sum(p.numel() for n, p in cases[f][3].named_parameters() if ".experts." in n) for f in refs}
    for family, (loss_ref, grads_ref) in refs.items():
        for t, sequence in RUNS:
            for r, o in enumerate(res):
                got = o["family"][family, t, sequence]
                # one micro-batch's graph at a time: the step's peak of saved bytes is its largest
                # micro-batch's, not their sum (this process runs >= 2 micro-batches where asserted)
                runs = sum(any(r // t in g.ranks for g in mb.groups) for mb in PLANS[t].micro_batches)
                assert len(got["saved"]) == runs and min(got["saved"]) > 0, (family, t, r, got["saved"])
                assert got["peak saved"] == max(got["saved"]), (family, t, sequence, r, got["peak saved"], got["saved"])
                # the load-balancing loss on (Qwen3-VL-MoE with output_router_logits): one router pass
                # per micro-batch first; off (InternVL's transformers model never adds it): none
                assert (got["aux"] > 0) == (family == "qwen3_vl_moe"), (family, got["aux"])
                assert got["router passes"] == (runs if got["aux"] else 0), (family, t, r, got["router passes"])
                # the trainer's cost model prices the router pass exactly when the loss is on
                assert got.get("router phase priced", got["aux"] > 0) == (got["aux"] > 0), (family, t, r)
                assert got["experts held"] * t == whole[family], (family, t, got["experts held"], whole[family])
                # dropless: each token's k pairs reach experts; the counts one process finds
                assert sum(got["expert tokens"]) == K * sum(s.num_tokens for s in jobs[family][1])
                assert got["expert tokens"] == routed_tokens[family], (family, t, sequence, r)
                loss_err = abs(got["loss"] - loss_ref) / loss_ref
                assert loss_err <= hc.TOL, (family, t, sequence, r, got["loss"], loss_ref)
                if got["grads"] is not None:
                    grad_err, worst = ec.relative_errors(got["grads"], grads_ref)
                    assert grad_err <= hc.TOL, (family, t, sequence, r, grad_err, worst)
            print(f"torch {family}, t = {t}{' sequence-parallel' if sequence else ''}, irregular plan: "
                  f"loss {loss_err:.1e}, grads {grad_err:.1e} ({worst})")


def test_torch_trainer_refuses_a_profile_pricing_the_router_pass_otherwise(tmp_path):
    """`npu_backend.train`'s planner: the preset prices the router pass as asked; a profile (--cost)
    measured with the other choice is refused, naming it."""
    from npu_backend.train import Planner, build_parser

    costs = {on: Planner(build_parser().parse_args([]), 4, 0, router_phase=on).cost for on in (False, True)}
    assert [costs[on].router_phase for on in (False, True)] == [False, True]
    for on in (False, True):
        costs[on].save(tmp_path / f"{on}.json")
        args = build_parser().parse_args(["--cost", str(tmp_path / f"{on}.json")])
        assert Planner(args, 4, 0, router_phase=on).cost.router_phase == on
        with pytest.raises(ValueError, match=rf"--cost .*{on}.json' prices {'a' if on else 'no'} router phase"):
            Planner(args, 4, 0, router_phase=not on)


def test_experts_tensor_parallel_cannot_split_are_refused():
    from npu_backend.tensor_parallel import check_model

    raw = json.loads(_qwen3_vl_moe_config().to_json_string())
    raw["vision_config"]["num_heads"] = 4
    raw["text_config"]["num_local_experts"] = 6
    config = hf.parse_config(raw)
    with pytest.raises(ValueError, match=r"tensor_parallel 4 cannot split text_config.num_experts = 6"):
        check_model(config, 4)
    check_model(config, 2)
