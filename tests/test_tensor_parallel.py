"""Tensor parallelism inside a rank, planning side (dhp_jax.planner.cost.tensor_parallel): one device's
coefficients of a rank of t devices against hand-derived figures, the refusals naming model, field
and t, and the surfaces that take t (Cluster, dhp plan, dhp simulate, the train config)."""

import re
import types

import pytest

from dhp_jax.planner import CostModel
from dhp_jax.planner.cost import memory, presets, tensor_parallel
from dhp_jax.planner.cost.memory import min_degree
from dhp_jax.sim.cluster import Cluster

GB = 1e9


def _costs(model="qwen3-vl-8b", t=4):
    one = CostModel.preset(model, "ascend-910b", ranks_per_node=8)
    return one, CostModel.preset(model, "ascend-910b", ranks_per_node=8 // t, tensor_parallel=t)


def test_t1_is_the_model_without_tensor_parallelism():
    for model in ("internvl3-2b", "qwen3-vl-8b"):
        assert CostModel.preset(model, "h100", tensor_parallel=1).to_dict() == CostModel.preset(model, "h100").to_dict()


def test_one_device_of_four_by_hand():
    """Qwen3-VL-8B (36 layers, width 4096, 32 heads over 8 kv heads, vocab 151936), remat "layer"
    (4 linear passes: 3 of them run the collectives), bf16, on the 910B preset (HCCS 56 GB/s per link,
    392 GB/s injection): per block and pass 2 all-gathers + 2 reduce-scatters, each 3/4 of the
    token's 4096 x 2 bytes."""
    one, four = _costs()
    m, hw = presets.MODELS["qwen3-vl-8b"], presets.HARDWARE["ascend-910b"]
    assert four.a1 == pytest.approx(one.a1 / 4, rel=1e-12)
    bw = min(392 * GB, 3 * 56 * GB)
    llm_bytes = 3 * 36 * 4 * 0.75 * 4096 * 2
    compute = 4 * 2.0 * (36 * m.llm_layer_params / 4 + 151936 / 4 * 4096) / (hw.peak_flops * hw.mfu_linear)
    assert four.a2 == pytest.approx(compute + llm_bytes / bw, rel=1e-12)
    # the encoder: 27 layers x 4 patch rows of width 1152 per LLM vision token
    vision_bytes = 3 * 27 * 4 * 4 * 0.75 * 1152 * 2
    assert four.a2_vision == pytest.approx(one.a2_vision / 4 + vision_bytes / bw, rel=1e-12)
    assert four.b1 == pytest.approx(one.b1 + 4 * 3 * (3 * 36 + 3 * 27) * hw.lat_intra, rel=1e-12)
    assert four.kv_bytes_per_token == one.kv_bytes_per_token / 4 and four.num_heads == 8
    assert (four.tensor_parallel, four.state_shards, four.ranks_per_node) == (4, 16, 2)
    # activations as the engines run them (psum form): the model at one device's widths (heads, kv
    # heads, MLP, vocabulary / 4), the hidden width whole; so more than a quarter of t = 1's
    local = tensor_parallel.local_shape(m, 4)
    assert (local.heads, local.kv_heads, local.intermediate, local.vocab, local.hidden) == (8, 2, 3072, 37984, 4096)
    alone = CostModel.preset(local, "ascend-910b", ranks_per_node=8, require_fit=False)
    assert (four.mem_per_token, four.fixed_bytes) == (alone.mem_per_token, alone.fixed_bytes)
    inputs = memory.input_bytes_per_token(m)
    assert four.mem_per_token > inputs + (one.mem_per_token - inputs) / 4
    # weights: all but the norms and the patch embedding split 4 ways
    assert one.param_count / 4 < four.param_count < one.param_count / 4 * 1.01
    # a 64k-token sample needs fewer ranks of 4 devices than single-device ranks
    assert min_degree(four, [65536])[0] < min_degree(one, [65536])[0]


def test_kv_heads_fewer_than_t_are_replicated():
    m = presets.ModelShape(layers=2, heads=16, kv_heads=2, hidden=256, intermediate=512, head_dim=16, vocab=1000,
                           vision_layers=1, vision_hidden=64, vision_intermediate=128, vision_heads=8,
                           vision_head_dim=8)
    assert tensor_parallel.kv_heads_per_device(m, 8) == 1 and tensor_parallel.unsplittable(m, 8) is None
    c1 = CostModel.preset(m, "h100", require_fit=False)
    c8 = CostModel.preset(m, "h100", require_fit=False, tensor_parallel=8, ranks_per_node=1)
    assert c8.kv_bytes_per_token == c1.kv_bytes_per_token / 2       # one of the 2 kv heads per device
    assert tensor_parallel.vocab_share(m, 8) == 125 and tensor_parallel.vocab_share(m, 3) == 334   # padded as Megatron pads


@pytest.mark.parametrize("model, t, field", [
    ("internvl3-8b", 8, "text_config.num_attention_heads = 28"),
    ("internvl3-38b", 2, "vision_config heads (num_heads / num_attention_heads) = 25"),
])
def test_a_layout_tensor_parallelism_cannot_split_is_refused(model, t, field):
    with pytest.raises(ValueError, match=re.escape(f"model '{model}': tensor_parallel {t} cannot split {field} evenly")):
        CostModel.preset(model, "ascend-910b", tensor_parallel=t, ranks_per_node=8 // t)
    odd_kv = types.SimpleNamespace(heads=12, kv_heads=3, intermediate=64, vision_heads=4, vision_intermediate=64)
    assert "num_key_value_heads = 3" in tensor_parallel.unsplittable(odd_kv, 2)
    assert tensor_parallel.valid_degrees(presets.MODELS["internvl3-38b"], 8) == [1]
    assert tensor_parallel.valid_degrees(presets.MODELS["qwen2.5-vl-32b"], 8) == [1, 2, 4, 8]


def test_a_rank_sits_in_one_node():
    with pytest.raises(ValueError, match="tensor_parallel 4 does not divide the 6 devices of a node"):
        Cluster.with_devices(48, 6, 4, model="qwen3-vl-8b")
    c = Cluster.with_devices(64, 8, 4, model="qwen3-vl-8b")
    assert (c.nodes, c.ranks_per_node, c.num_ranks, c.devices) == (8, 2, 16, 64)
    assert "of 4 devices (64 devices)" in c.describe() and c.cost_model().tensor_parallel == 4


def test_plan_and_simulate_take_tensor_parallel(capsys):
    from dhp_jax.cli import main

    assert main(["plan", "--model", "qwen3-vl-8b", "--ranks", "16", "--tensor-parallel", "4", "--batch", "8",
                 "--compare", "", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["num_ranks"] == 4 and out["config"]["tensor_parallel"] == 4
    assert max(r for mb in out["plan"]["micro_batches"] for g in mb["groups"] for r in g["ranks"]) < 4
    assert main(["plan", "--model", "qwen3-vl-8b", "--ranks", "16", "--ranks-per-node", "6",
                 "--tensor-parallel", "4"]) == 2
    assert "does not divide the 6 devices of a node" in capsys.readouterr().err
    assert main(["simulate", "--model", "qwen3-vl-8b", "--nodes", "1", "--tensor-parallel", "2", "--batch", "8",
                 "--steps", "1", "--strategies", "dhp", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["runs"][0]["ranks"] == 4 and "of 2 devices (8 devices)" in sim["cluster"]
    # --sequence-parallel: priced as CostModel.preset(..., sequence_parallel=True) (the rows a device
    # carries through the LLM layers and encoder blocks / t: less memory a token), refused without T > 1
    assert main(["plan", "--model", "qwen3-vl-8b", "--ranks", "16", "--tensor-parallel", "4", "--sequence-parallel",
                 "--batch", "8", "--compare", "", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["sequence_parallel"] is True
    assert main(["plan", "--model", "qwen3-vl-8b", "--sequence-parallel"]) == 2
    assert "--sequence-parallel needs --tensor-parallel T > 1" in capsys.readouterr().err
    assert main(["simulate", "--model", "qwen3-vl-8b", "--nodes", "1", "--tensor-parallel", "2", "--sequence-parallel",
                 "--batch", "8", "--steps", "1", "--strategies", "dhp", "--json"]) == 0
    assert "of 2 devices, sequence-parallel (8 devices)" in json.loads(capsys.readouterr().out)["cluster"]
    from dhp_jax.sim.cluster import Cluster

    psum, sp = (Cluster(nodes=1, ranks_per_node=4, model="qwen3-vl-8b", tensor_parallel=2, sequence_parallel=s)
                .cost_model() for s in (False, True))
    assert sp.sequence_parallel and sp.mem_per_token < psum.mem_per_token


def test_train_config_validates_tensor_parallel_and_a_family_prepares():
    from dhp_jax.train.train_config import ConfigError, config_from_dict
    from dhp_jax.train.trainer import prepare_run

    with pytest.raises(ConfigError, match="need 16 devices but devices.count=8"):
        config_from_dict({"kind": "train", "parallel": {"tensor": 2}})
    with pytest.raises(ConfigError, match="planner.cost_model='internvl3-8b': tensor_parallel 8 cannot split"):
        config_from_dict({"kind": "train", "num_ranks": 1, "parallel": {"tensor": 8},
                          "model": {"preset": "qwen3-vl-8b"}, "planner": {"cost_model": "internvl3-8b"}})
    with pytest.raises(ConfigError, match="model.preset='tiny': tensor_parallel 8 cannot split MLLMConfig.num_heads = 4"):
        config_from_dict({"kind": "train", "num_ranks": 1, "parallel": {"tensor": 8}})
    # the stand-in model runs it (tests/test_tp_engine.py): 4 ranks of 2 devices, plans for 4 ranks
    setup = prepare_run(config_from_dict({"kind": "train", "num_ranks": 4, "parallel": {"tensor": 2}}))
    assert len(setup.devices) == 8 and setup.first_plan.num_ranks == 4
    # the planner prices what runs: a rank of 2 devices, the state over all 8
    assert (setup.cost.tensor_parallel, setup.cost.state_shards * 2) == (2, 8)
    family = config_from_dict({"kind": "train", "num_ranks": 4, "parallel": {"tensor": 2},
                               "model": {"preset": "tiny-qwen3_vl"}})
    # a family model too (tests/test_tp_family.py): its LLM split, its encoder replicated
    setup = prepare_run(family)
    assert setup.hf_config.family == "qwen3_vl" and len(setup.devices) == 8 and setup.first_plan.num_ranks == 4


def test_replace_refuses_a_new_tensor_parallel():
    """`replace` would change the field but none of the coefficients it prices (compute per device,
    TP traffic, memory per device): refused, naming the way to get it; the same t is a no-op."""
    one = CostModel.preset("qwen3-vl-8b", "h100")
    with pytest.raises(ValueError, match=r"tensor_parallel=2.*qwen3-vl-8b.*preset\(\.\.\., tensor_parallel=t\)"):
        one.replace(tensor_parallel=2)
    assert one.replace(tensor_parallel=1).to_dict() == one.to_dict()


def test_memory_bench_takes_tensor_parallel():
    """`dhp bench memory --tensor-parallel T` compiles the group program (the stand-in's, or with
    `--families` the family's) on ranks of T devices (docs/cli.md); `--step` does not split and
    refuses it by name, and `--sequence-parallel` needs T > 1."""
    import argparse

    from dhp_jax.bench import step_memory

    parser = argparse.ArgumentParser()
    step_memory.configure(parser)
    args = parser.parse_args([])
    assert args.tensor_parallel == 1 and args.dtype is None
    with pytest.raises(SystemExit, match="--tensor-parallel 2: not with --step"):
        step_memory.run(parser.parse_args(["--tensor-parallel", "2", "--step"]))
    with pytest.raises(SystemExit, match="--sequence-parallel needs --tensor-parallel T > 1"):
        step_memory.run(parser.parse_args(["--sequence-parallel", "--families", "qwen3-vl-8b"]))
