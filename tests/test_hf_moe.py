"""The mixture-of-experts families in JAX vs transformers on tiny random configs built by
transformers (8 experts, top-2, a dense layer among sparse ones): Qwen3-VL-MoE
(`Qwen3VLMoeForConditionalGeneration`: DeepStack, video) and InternVL with a Qwen3-MoE LLM
(`InternVLForConditionalGeneration`). Logits, loss and gradients at fp32 (relative error
<= 1e-5), the load-balancing loss off (transformers' default) and on (`output_router_logits`),
no token dropped by the routing, which layers are sparse, the checkpoint names and the
published expert layouts both ways."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_cases as hc
import hf_engine_cases as hec
from hf_cases import torch, transformers
from test_hf_internvl import image_inputs as internvl_image
from test_hf_qwen3_vl import END, IMAGE, START, VIDEO, image_inputs as qwen_image, video_inputs as qwen_video

from dhp_jax.model import hf
from dhp_jax.model.hf import moe
from dhp_jax.model.hf.spec import MoeSpec

EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 24      # 2 * 24 differs from the width 64: the transposed layout shows
AUX = 0.5                                    # a large load-balancing weight, so that the term shows in the loss


def qwen3_vl_moe_config():
    """Layer 0 dense (mlp_only_layers), layers 1 and 2 sparse; DeepStack from vision blocks 0 and 1."""
    return transformers.Qwen3VLMoeConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_WIDTH,
                         mlp_only_layers=[0], router_aux_loss_coef=AUX,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                          "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=False)


def internvl_moe_config():
    """A Qwen3-MoE LLM (InternVL3.5-30B-A3B's layout): decoder_sparse_step 2 (layer 1 sparse, 0 and 2
    dense), norm_topk_prob off (Qwen3MoeConfig's default)."""
    return transformers.InternVLConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                           image_size=16, patch_size=4, attention_bias=True),
        text_config=dict(model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_WIDTH,
                         decoder_sparse_step=2, router_aux_loss_coef=AUX,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        image_token_id=hc.QWEN_IMAGE, image_seq_length=4)


CASES = {
    "qwen3_vl_moe": (transformers.Qwen3VLMoeForConditionalGeneration, qwen3_vl_moe_config,
                     {"text": hc.qwen_text_inputs, "image": lambda: qwen_image(hc.rng(1)),
                      "video": lambda: qwen_video(hc.rng(2))}, (IMAGE, VIDEO)),
    "internvl_moe": (transformers.InternVLForConditionalGeneration, internvl_moe_config,
                     {"text": lambda: hc.text_inputs([5, 6, 7, 8, 9, 10, 11]),
                      "image": lambda: internvl_image(hc.rng(1))}, (hc.QWEN_IMAGE,)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    model_cls, make, inputs, vision_ids = CASES[request.param]
    path = hc.model_dir(tmp_path_factory, request.param)
    model = hc.build(model_cls, make(), path)
    cfg, params = hf.load_pretrained(path)
    return request.param, model, cfg, params, inputs, vision_ids


def test_logits_match_transformers(case):
    name, model, cfg, params, inputs, _ = case
    assert cfg.text.moe is not None and cfg.text.moe.num_experts == EXPERTS and any(cfg.text.moe.sparse)
    assert not all(cfg.text.moe.sparse)
    for kind, make in inputs.items():
        hc.check_logits(model, cfg, params, make(), f"{name} {kind}")


def jax_loss(cfg, params, inputs, labels, aux_coef: float):
    """transformers' loss of one sample: the mean cross-entropy of the shifted labels, plus
    aux_coef x the load-balancing loss of its router statistics (`moe.collect`)."""
    with moe.collect() as stats:
        logits = hf.logits(cfg, params, inputs)
    (summed, rows), = stats
    target = jnp.asarray(labels[0, 1:])
    logp = jax.nn.log_softmax(logits[:-1], axis=-1)
    keep = target != -100
    nll = -jnp.take_along_axis(logp, jnp.where(keep, target, 0)[:, None], axis=1)[:, 0]
    loss = jnp.sum(jnp.where(keep, nll, 0.0)) / jnp.sum(keep)
    return loss + aux_coef * moe.aux_loss(summed, rows, cfg.text.moe.num_experts), (summed, rows)


def internvl_reference_with_aux(model, inputs, labels):
    """transformers' InternVL forward has no `output_router_logits`; its LLM's own class,
    Qwen3MoeForCausalLM, adds coef x load_balancing_loss_func(router logits of every sparse layer,
    attention mask) to the loss: the same, on the router logits recorded from the InternVL model."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m
    logits = []
    hooks = [mod.register_forward_hook(lambda _m, _i, out: logits.append(out[0]))
             for mod in model.modules() if isinstance(mod, m.Qwen3MoeTopKRouter)]
    try:
        model.zero_grad()
        t = hc.torch_inputs(inputs)
        out = model(**t, labels=torch.as_tensor(labels))
        text = model.config.text_config
        aux = m.load_balancing_loss_func(tuple(logits), text.num_experts, text.num_experts_per_tok,
                                         t["attention_mask"])
        loss = out.loss + text.router_aux_loss_coef * aux
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    return float(loss.detach()), {k: p.grad.numpy().copy() for k, p in model.named_parameters() if p.grad is not None}


_COMPILED: dict = {}


def _loss_and_grads(name, cfg, sample, labels):
    """The jitted (loss, stats), grads of `jax_loss` of a case's sample, with the load-balancing
    weight an argument: the runs with the loss off and on share one compiled program."""
    if name not in _COMPILED:
        _COMPILED[name] = jax.jit(jax.value_and_grad(lambda p, c: jax_loss(cfg, p, sample, labels, c), has_aux=True))
    return _COMPILED[name]


@pytest.mark.parametrize("aux", [False, True])
def test_loss_and_grads_match_transformers(case, aux):
    """Loss and every gradient vs transformers' autograd; the load-balancing loss added as
    transformers adds it (`output_router_logits=True`: coef x load_balancing_loss_func), or not."""
    name, model, cfg, params, inputs, vision_ids = case
    sample = inputs["video" if "video" in inputs else "image"]()
    labels = hec.labels_of(hc.rng(3), sample, vision_ids)
    if aux and name == "internvl_moe":
        ref_loss, ref_grads = internvl_reference_with_aux(model, sample, labels)
    else:
        ref_loss, ref_grads = hec.reference(model, [sample], [labels], output_router_logits=aux)
    coef = cfg.text.moe.router_aux_loss_coef if aux else 0.0
    (loss, (summed, rows)), grads = _loss_and_grads(name, cfg, sample, labels)(params, coef)
    loss_err = abs(float(loss) - ref_loss) / abs(ref_loss)
    grad_err, worst = hec.relative_errors(hf.to_state_dict(cfg, grads), ref_grads)
    print(f"{name} aux={aux}: loss {float(loss):.6f} vs {ref_loss:.6f} (rel {loss_err:.1e}), "
          f"grads max rel {grad_err:.1e} ({worst})")
    assert loss_err <= hc.TOL and grad_err <= hc.TOL, (loss_err, grad_err, worst)
    # dropless: every live token reaches its k experts in every sparse layer
    tokens = sample["input_ids"].shape[1]
    assert float(rows) == tokens * sum(cfg.text.moe.sparse)
    assert float(jnp.sum(summed[0])) == TOP_K * float(rows)
    if aux:     # the term is large enough that leaving it out fails the comparison above
        assert float(AUX * moe.aux_loss(summed, rows, EXPERTS)) > 100 * hc.TOL * ref_loss


@pytest.mark.parametrize("step,dense", [(1, []), (2, []), (1, [0, 3]), (3, [2])])
def test_sparse_layers_follow_transformers(step, dense):
    """MoeSpec.sparse is transformers' rule: a decoder layer gets the sparse block iff it is not in
    mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    raw = {"model_type": "internvl", "text_config": {"model_type": "qwen3_moe", "num_hidden_layers": 5,
                                                     "hidden_size": 16, "num_attention_heads": 2,
                                                     "num_key_value_heads": 1, "num_experts": 4,
                                                     "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                                                     "intermediate_size": 8, "decoder_sparse_step": step,
                                                     "mlp_only_layers": dense}}
    ours = hf.parse_config(raw).text.moe
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in raw["text_config"].items() if k != "model_type"})
    theirs = tuple(isinstance(m.Qwen3MoeDecoderLayer(config, i).mlp, m.Qwen3MoeSparseMoeBlock) for i in range(5))
    assert ours.sparse == theirs and ours.norm_topk_prob is False


def test_state_dict_names_and_shapes(case):
    _, model, cfg, params, _, _ = case
    hc.check_state_dict(model, cfg, params)


def test_published_layout_round_trip(case, tmp_path):
    """save_pretrained writes transformers' names (InternVL's LLM as `language_model.model.*`), the
    experts as the releases store them (Qwen3-VL-MoE fused and transposed, [E, d, 2I] and [E, I, d];
    Qwen3-MoE one Linear per expert); transformers and our loader read it back to the same model."""
    name, model, cfg, params, inputs, _ = case
    hc.check_save_roundtrip(model, cfg, params, list(inputs.values())[-1](), str(tmp_path))
    index = json.loads((tmp_path / "config.json").read_text())
    assert index["model_type"] == ("qwen3_vl_moe" if name == "qwen3_vl_moe" else "internvl")
    from dhp_jax.model.hf import safetensors_io
    saved = {k: v.shape for k, v in safetensors_io.read_checkpoint(str(tmp_path))}
    layer = cfg.text.moe.sparse_layers[0]
    llm = "model.language_model" if name == "qwen3_vl_moe" else "language_model.model"
    pre = f"{llm}.layers.{layer}.mlp.experts"
    if name == "qwen3_vl_moe":
        assert saved[f"{pre}.gate_up_proj"] == (EXPERTS, 64, 2 * EXPERT_WIDTH)
        assert saved[f"{pre}.down_proj"] == (EXPERTS, EXPERT_WIDTH, 64)
    else:
        assert saved[f"{pre}.{EXPERTS - 1}.gate_proj.weight"] == (EXPERT_WIDTH, 64)
        assert saved[f"{pre}.0.down_proj.weight"] == (64, EXPERT_WIDTH)
        assert f"{pre}.gate_up_proj" not in saved


def test_incomplete_experts_are_refused():
    named = [("m.layers.1.mlp.experts.0.gate_proj.weight", np.zeros((2, 3))),
             ("m.layers.1.mlp.experts.0.up_proj.weight", np.zeros((2, 3)))]
    with pytest.raises(ValueError, match=r"experts.0.down_proj.weight"):
        list(moe.load_experts(named, "per_expert"))


def test_moe_spec_is_frozen():
    spec = MoeSpec(8, 2, 24, True, (False, True), 0.001)
    with pytest.raises(Exception):
        spec.top_k = 3


def test_streamed_sources_read_the_published_layout(case, tmp_path):
    """The executor's streaming load (`stream.checkpoint_sources`, used by `dhp train` and `dhp
    export`) reads the published expert layout into transformers' fused leaves, in pieces that
    cross experts, equal to `load_pretrained`'s."""
    from dhp_jax.model.hf.stream import ExpertSource, checkpoint_sources
    _, _, cfg, params, _, _ = case
    hf.save_pretrained(cfg, params, str(tmp_path))
    _, sources = checkpoint_sources(str(tmp_path))
    want = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    got = dict(jax.tree_util.tree_flatten_with_path(sources)[0])
    assert sorted(map(str, want)) == sorted(map(str, got))
    experts = 0
    for key, src in got.items():
        ref = np.asarray(want[key]).reshape(-1)
        assert tuple(src.shape) == tuple(want[key].shape), key
        out = np.empty(ref.size, np.float32)
        cut = ref.size // 3 + 1              # two reads, the cut inside an expert
        src.read(0, cut, out[:cut])
        src.read(cut, ref.size, out[cut:])
        np.testing.assert_array_equal(out, ref, err_msg=str(key))
        experts += isinstance(src, ExpertSource)
    assert experts == 2 * sum(cfg.text.moe.sparse)


def test_router_stats_report_and_refuse_dropped_pairs():
    """The step's router figures (metrics.jsonl): tokens per expert max / mean over the sparse
    layers; (token, expert) pairs missing from k x the live rows are an error naming them."""
    from dhp_jax.sharding.family_adapter import router_stats
    cfg = hf.parse_config(qwen3_vl_moe_config().to_dict())
    counts = np.array([6, 2, 0, 4, 4, 4, 8, 4], np.float64)       # 32 pairs over 2 sparse layers
    got = router_stats(np.append(counts, 16.0), cfg)             # 8 live rows x 2 sparse layers
    assert got == {"moe_tokens_per_expert_max": 4.0, "moe_tokens_per_expert_mean": 2.0, "moe_pairs_dropped": 0}
    with pytest.raises(ValueError, match=r"router: 2 \(token, expert\) pairs dropped"):
        router_stats(np.append(counts - np.eye(8)[0] * 2, 16.0), cfg)


def test_tiny_moe_trains_with_experts_split_and_nothing_dropped(tmp_path):
    """`dhp train model=tiny-qwen3_vl_moe parallel.tensor=2 model.router_aux_loss_coef=0.01`: 4 ranks
    of 2 devices, each device 4 of the 8 experts; every step's metrics.jsonl record has the router's
    tokens per expert, no dropped (token, expert) pair and the load-balancing loss's value; an
    executor made with another weight is refused."""
    from dhp_jax.train.metrics import read_jsonl
    from dhp_jax.train.train_config import load_config
    from dhp_jax.train.trainer import Trainer, TrainError

    args = ["model=tiny-qwen3_vl_moe", "num_ranks=4", "parallel.tensor=2", "steps=2", "data.batch_size=4",
            "data.max_tokens=48", "planner.strategy=static-ring:4", "compare.enabled=false", "metrics.progress=false",
            "compilation_cache=null"]
    trainer = Trainer(load_config(None, [*args, "model.router_aux_loss_coef=0.01", f"metrics.out_dir={tmp_path}"]))
    trainer.run()
    with pytest.raises(TrainError, match=r"executor adds the load-balancing loss with weight 0.01, the config "
                                         r"model.router_aux_loss_coef=0.02"):
        Trainer(load_config(None, [*args, "model.router_aux_loss_coef=0.02", f"metrics.out_dir={tmp_path / 'b'}"]),
                executor=trainer.executor)
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "step" in r]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["moe_pairs_dropped"] == 0
        assert r["moe_tokens_per_expert_max"] >= r["moe_tokens_per_expert_mean"] > 0
        assert r["moe_aux_loss"] > 0          # E sum_e f_e P_e (2 = k for a router of uniform probabilities)


@pytest.mark.parametrize("family,flag,want", [("qwen3_vl_moe", True, AUX), ("qwen3_vl_moe", False, 0.0),
                                              ("internvl_moe", True, 0.0), ("internvl_moe", False, 0.0)])
def test_the_default_router_loss_follows_the_family_on_both_engines(family, flag, want):
    """Without `router_aux_loss_coef` set, each engine adds the load-balancing loss where transformers'
    model adds it: Qwen3-VL-MoE when config.json sets `output_router_logits`; InternVL never (its
    model does not read the LLM's router logits). One rule (`spec.default_router_aux_loss_coef`)."""
    from dhp_jax.model.hf.families import parse_config
    from npu_backend import moe as torch_moe

    raw = CASES[family][1]().to_dict()
    raw["text_config"]["output_router_logits"] = flag
    cfg = parse_config(raw)
    assert moe.aux_loss_coef(cfg) == torch_moe.aux_loss_coef(cfg) == want
    assert moe.aux_loss_coef(cfg, 0.25) == 0.25            # a weight set for the run overrides config.json
