"""Mixture-of-experts models in the cost model: each term against a hand count on a tiny MoE shape
(a Qwen3-VL-MoE config.json shrunk: 4 LLM layers, layers 1 and 3 sparse with 8 experts of width
32, 2 per token; layers 0 and 2 dense of width 96), and the planner's choice of t for
Qwen3-VL-30B-A3B. The dense presets' figures are guarded by tests/test_cost.py and
tests/test_model_configs.py."""

import dataclasses

import numpy as np
import pytest

from dhp_jax.data import model_configs
from dhp_jax.planner import CostModel
from dhp_jax.planner.cost import memory, presets, tensor_parallel as tp
from dhp_jax.planner.cost.memory import group_program_bytes, rank_state_bytes

D, FF, L, H, KV, HD, V = 64, 96, 4, 4, 2, 16, 512          # the LLM
E, K, FE, SPARSE = 8, 2, 32, 2                              # experts, top-k, expert width, sparse layers


def _tiny() -> dict:
    q = model_configs.model_config("qwen3-vl-30b-a3b")
    return {**q, "text_config": {**q["text_config"], "hidden_size": D, "intermediate_size": FF,
                                 "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
                                 "head_dim": HD, "vocab_size": V, "num_experts": E, "num_experts_per_tok": K,
                                 "moe_intermediate_size": FE, "decoder_sparse_step": 2},
            "vision_config": {**q["vision_config"], "hidden_size": 32, "num_heads": 4, "intermediate_size": 32,
                              "depth": 1, "out_hidden_size": D, "deepstack_visual_indexes": [],
                              "num_position_embeddings": 16}}


M = presets.ModelShape.from_config(_tiny())
# the same model with every layer's MLP dense (what the MoE terms replace)
DENSE = dataclasses.replace(M, experts=0, experts_per_token=0, expert_intermediate=0, sparse_layers=0)
ATTN = D * H * HD * 2 + D * KV * HD * 2                     # q, o; k, v


def test_shape_reads_the_sparse_layers():
    assert (M.experts, M.experts_per_token, M.expert_intermediate, M.sparse_layers, M.dense_layers) == \
        (E, K, FE, SPARSE, L - SPARSE)
    assert M.router_params == SPARSE * D * E
    assert M.expert_params == SPARSE * E * 3 * D * FE
    # all parameters: the dense model's, less 2 dense MLPs, plus 2 routers and 16 experts
    dense_params = model_configs.facts_from_config({**_tiny(), "text_config": {**_tiny()["text_config"],
                                                                               "num_experts": 0}}).params
    assert M.param_count == dense_params - SPARSE * 3 * D * FF + SPARSE * (D * E + E * 3 * D * FE)
    # active: less the 6 experts a token does not reach in each sparse layer
    assert M.active_param_count == M.param_count - SPARSE * (E - K) * 3 * D * FE


def test_compute_is_priced_on_active_parameters():
    """a2 (s per token, fwd + bwd + recompute at remat "layer": 4 passes of 2 FLOPs a weight): the
    dense layers' GEMMs, the sparse layers' attention, router and k experts' GEMMs, the LM head."""
    hw = presets.HARDWARE["h100"]
    per_token = 2 * (ATTN + 3 * D * FF) + 2 * (ATTN + D * E + K * 3 * D * FE) + V * D
    assert M.llm_gemm_params + V * D == per_token
    c = CostModel.preset(M, "h100", state_shards=1)
    assert c.a2 == pytest.approx(4 * 2.0 * per_token / (hw.peak_flops * hw.mfu_linear), rel=1e-12)
    # attention and the encoder do not change with the experts
    d = CostModel.preset(DENSE, "h100", state_shards=1)
    assert (c.a1, c.a2_vision, c.kv_bytes_per_token) == (d.a1, d.a2_vision, d.kv_bytes_per_token)
    # more experts at the same top-k: the same compute, more memory
    wide = CostModel.preset(dataclasses.replace(M, experts=2 * E, param_count=M.param_count + M.expert_params),
                            "h100", state_shards=1)
    assert wide.a2 - c.a2 == pytest.approx(4 * 2.0 * SPARSE * D * E / (hw.peak_flops * hw.mfu_linear), rel=1e-9)
    assert wide.memory_budget < c.memory_budget


def test_tensor_parallel_compute_and_the_rows_exchange():
    """t = 4: a device computes attention, the dense MLPs and a token's k experts / t, the router
    whole; each sparse layer joins the rank's rows on every device and scatters the experts'
    partial sums back (fwd, bwd and recompute: 3 passes), (t-1)/t of [tokens, D] each, the bytes
    of the dense MLP's gather and scatter."""
    t, el = 4, 2
    assert tp.device_gemm_params(M, t) == (2 * (ATTN + 3 * D * FF) + 2 * (ATTN + K * 3 * D * FE)) / t + 2 * D * E
    exchange = SPARSE * 2 * 3 * ((t - 1) / t) * el * D
    assert tp.moe_exchange_bytes(M, t, el, 4.0) == pytest.approx(exchange, rel=1e-12) == pytest.approx(1152)
    assert tp.moe_exchange_bytes(M, 1, el, 4.0) == 0.0
    # remat "selective" (3 linear passes): the collectives of the forward and backward passes only
    assert tp.moe_exchange_bytes(M, t, el, 3.0) == pytest.approx(SPARSE * 2 * 2 * ((t - 1) / t) * el * D)
    llm, vision = tp.sequence_parallel_bytes(M, t, el, 4.0, False)
    # per sparse layer: the attention's gather and scatter, then the rows' exchange
    attention = L * 2 * 3 * ((t - 1) / t) * el * D
    dense_mlps = (L - SPARSE) * 2 * 3 * ((t - 1) / t) * el * D
    assert llm == pytest.approx(attention + dense_mlps + exchange, rel=1e-12)
    assert (llm, vision) == pytest.approx(tp.sequence_parallel_bytes(DENSE, t, el, 4.0, False), rel=1e-12)
    hw = presets.HARDWARE["ascend-910b"]
    c = CostModel.preset(M, "ascend-910b", tensor_parallel=t, ranks_per_node=2, state_shards=8,
                         sequence_parallel=True)
    want = 4 * 2.0 * (tp.device_gemm_params(M, t) + V / t * D) / (hw.peak_flops * hw.mfu_linear) \
        + llm / min(hw.a2a_bw_intra, (t - 1) * hw.p2p_bw_intra)
    assert c.a2 == pytest.approx(want, rel=1e-12)
    # experts are split over the rank's devices: t must divide their count
    with pytest.raises(ValueError, match="tensor_parallel 16 cannot split text_config.num_experts = 8"):
        tp.check_tensor_parallel(dataclasses.replace(M, heads=16, kv_heads=16, intermediate=96 * 16,
                                                     vision_heads=16, vision_intermediate=32 * 16), 16, "tiny")


def test_a_moe_shape_without_its_family_is_refused():
    with pytest.raises(ValueError, match="a mixture-of-experts shape is priced as its family's program"):
        CostModel.preset(dataclasses.replace(M, family=""), "h100")


def test_memory_holds_every_weight_and_splits_the_experts():
    """Weights, gradients and optimizer state on all parameters; at t the experts (and every other
    split weight) / t, the routers whole on each device; the decoder's stacked gradients hold the
    routers and all experts."""
    assert memory.engine_params(M) == M.param_count
    c = CostModel.preset(M, "h100", state_shards=1)
    assert c.param_count == M.param_count and c.grad_bytes == (4 + 2) * M.param_count / 2
    assert rank_state_bytes(c) == 16 * M.param_count
    dec = L * (ATTN + 2 * D) + (L - SPARSE) * 3 * D * FF + SPARSE * (D * E + E * 3 * D * FE)
    assert memory.stack_params(M)[0] == dec
    assert memory.stack_params(DENSE)[0] == L * (ATTN + 2 * D + 3 * D * FF)
    t = 4
    rep = (2 * L + 1) * D + 4 * 1 * 32 + M.patch_dim * 32 + SPARSE * D * E    # norms, patch embedding, routers
    assert tp.replicated_params(M) == rep
    kv_replica = L * 2 * D * HD * (1 - KV / t)            # 2 kv heads over 4 devices: one each, replicated
    assert tp.device_params(M, M.param_count, t) == pytest.approx(rep + (M.param_count - rep) / t + kv_replica,
                                                                  rel=1e-12)
    ct = CostModel.preset(M, "ascend-910b", tensor_parallel=t, ranks_per_node=2, state_shards=8)
    assert ct.param_count == tp.device_params(M, M.param_count, t)
    assert rank_state_bytes(ct) == pytest.approx(16 * ct.param_count / 2, rel=1e-12)   # 8 devices / t


def test_router_and_dispatch_activations():
    """Per token, a sparse layer keeps, without recompute, in place of the dense MLP's gate, up and
    product (3 x 96): the router's logits and softmax (2 x 8), the top-k gates and indices (2 x 2),
    the dispatch buffer and the expert outputs (2 x 2 rows of 64), and each routed row's gate, up and
    product (3 x 2 x 32); its backward pass holds the cotangents of the routed rows' MLP values
    (3 x 2 x 32 without recompute, 1 x with), two (three) hidden-wide ones and the dispatch buffer's
    and the outputs' (2 x 2 x 64)."""
    assert memory.moe_saved(M) == 2 * E + 2 * K + 2 * K * D + 3 * K * FE == 468
    assert memory.moe_cotangents(M, "none") == 3 * K * FE + 2 * D + 2 * K * D == 576
    assert memory.moe_cotangents(M, "layer") == 1 * K * FE + 3 * D + 2 * K * D == 512
    saved = 4 * D + 2 * HD + (H + KV) * HD + 2 * (H + KV) * HD + H + H * HD + 3 * FF     # a dense layer's
    assert memory.family_llm_saved(M) == saved == 932
    # a layer's backward pass holds the larger of its MLP's phase and its attention's (the ring's
    # backward pass, 4 H HD + 8 KV HD + H, and the cotangents of o, q, k, v, the input and its norm's
    # output): here the attention's, in dense and sparse layers alike
    attention = 4 * H * HD + 8 * KV * HD + H + 2 * (H + KV) * HD + 2 * D
    assert memory.family_attention_phase(H, KV, HD, D) == attention == 836 > 576
    # remat "none": 2 dense + 2 sparse layers keep their residuals; the peak holds the larger cotangents
    assert memory._llm_blocks(M, "none", False) == (2 * saved + 2 * (saved - 3 * FF + 468), max(576, attention))
    # remat "layer": each layer keeps its input; the peak is the sparse layer's recomputed backward pass
    assert memory._llm_blocks(M, "layer", False) == (L * D, saved - 3 * FF + 468 + max(512, attention))
    # bytes per token (bf16): the sparse layers' residuals over the dense model's (the encoder's working
    # set, 4 rows x 160, stays the peak at remat "none")
    assert memory.family_bytes_per_token(M, 2, "none") - memory.family_bytes_per_token(DENSE, 2, "none") == \
        2 * SPARSE * (468 - 3 * FF)
    # at t the expert buffers stay whole (static shapes: tokens x k rows on every device)
    local = tp.local_shape(M, 4)
    assert (local.experts, local.experts_per_token, local.expert_intermediate) == (E, K, FE)
    assert memory.moe_saved(local) == memory.moe_saved(M)


@pytest.fixture(scope="module")
def choice_30b():
    return tp.choose("qwen3-vl-30b-a3b", "ascend-910b", 65536, 64, vision_share=0.9)


def test_the_planner_chooses_t_for_qwen3_vl_30b_a3b(choice_30b):
    """64k tokens on 64 Ascend 910B devices: t = 1 and 2 hold too many weights per device; the
    planner picks the fastest (t, degree) that fits by the memory model (group program + state
    shard), at or above each t's least fitting degree."""
    r = choice_30b
    assert "does not fit" in r["tried"][1] and "does not fit" in r["tried"][2]
    assert r["t"] in (4, 8) and r["fits"] and 1 <= r["degree"] <= r["ranks"] == 64 // r["t"]
    cost = CostModel.preset("qwen3-vl-30b-a3b", "ascend-910b", tensor_parallel=r["t"], ranks_per_node=8 // r["t"],
                            state_shards=64, sequence_parallel=True)
    total = group_program_bytes(cost, [65536], r["degree"]) + rank_state_bytes(cost)
    assert total == r["device_bytes"] <= cost.usable_bytes
    least = r["tried"][r["t"]]["least_degree"]
    assert least <= r["degree"]
    if least > 1:            # below the least degree the sample does not fit
        assert group_program_bytes(cost, [65536], least - 1) + rank_state_bytes(cost) > cost.usable_bytes
    for t, v in r["tried"].items():
        if isinstance(v, dict):
            assert v["step_s"] >= r["step_s"]
    # DHP's own plan of that sample at the chosen t: the same degree and step time
    from dhp_jax.planner.compare import compare_strategies

    comp = compare_strategies([(np.array([65536]), np.array([0.81]))], 64 // r["t"], cost, ["dhp"], errors="raise",
                              ranks_per_node=8 // r["t"])
    group = next(g for mb in comp.runs["dhp"].plans[0].micro_batches for g in mb.groups if g.samples)
    assert group.degree == r["degree"] and comp.mean("dhp") == pytest.approx(r["step_s"], rel=1e-9)


def test_choose_says_why_nothing_fits():
    with pytest.raises(ValueError, match=r"no tensor-parallel size fits one 65536-token sample on 64 devices "
                                         r"of ascend-910b: t=1: qwen3-vl-235b-a22b does not fit"):
        tp.choose("qwen3-vl-235b-a22b", "ascend-910b", 65536, 64)
    with pytest.raises(ValueError, match="unknown model 'mixtral'"):
        tp.choose("mixtral", "ascend-910b", 65536, 64)


# the router phase (`CostModel.router_phase`): layer 3 dense too, so the router program stops at layer 1
ROUTED = presets.ModelShape.from_config({**_tiny(), "text_config": {**_tiny()["text_config"], "mlp_only_layers": [3]}})


def test_the_router_phase_adds_one_forward_pass_to_the_step():
    """With the load-balancing loss on, each group first runs the router program: the vision encoder
    and projector and the LLM layers through the last sparse one (here 0 dense and 1 sparse), forward
    only, no LM head. Each time term grows by that pass, counted by hand; a group's priced time by
    those terms at the same lengths."""
    from dhp_jax.planner.cost import pricing

    assert (ROUTED.sparse_layers, ROUTED.router_depth, M.router_depth) == (1, 2, L)
    hw, el = presets.HARDWARE["ascend-910b"], 2
    off = CostModel.preset(ROUTED, "ascend-910b", state_shards=8)
    on = CostModel.preset(ROUTED, "ascend-910b", state_shards=8, router_phase=True)
    assert (off.router_phase, on.router_phase) == (False, True)
    lin, att = hw.peak_flops * hw.mfu_linear, hw.peak_flops * hw.mfu_attention
    gemm = (ATTN + 3 * D * FF) + (ATTN + D * E + K * 3 * D * FE)      # layers 0 and 1; no LM head
    want = {"a1": 2.0 * H * HD * 2 / att, "a2": 2.0 * gemm / lin,
            "a2_vision": off.a2_vision / 4,         # the step runs the encoder 4 times at remat "layer"
            "b1": 2 * 100e-6, "kv_bytes_per_token": 2 * 2 * KV * HD * el,
            "a2a_bytes_per_token": 2 * (2 * H + 2 * KV) * HD * el,
            "lat_intra": 2 * hw.lat_intra, "lat_inter": 2 * hw.lat_inter}
    for field, extra in want.items():
        assert getattr(on, field) - getattr(off, field) == pytest.approx(extra, rel=1e-9), field
    same = {f.name for f in dataclasses.fields(CostModel)} - set(want) - {"router_phase"}
    assert all(getattr(on, f) == getattr(off, f) for f in same)          # memory and the rest: unchanged
    # one rank, no traffic: the group's time is linear in (a1, a2, a2_vision, b1)
    fwd = off.replace(**{f: getattr(on, f) - getattr(off, f) for f in ("a1", "a2", "a2_vision", "b1")})
    lengths, etas = [3000, 700], [0.3, 0.0]
    t_on, t_off = pricing.group_time(on, lengths, 1, etas), pricing.group_time(off, lengths, 1, etas)
    assert t_on - t_off == pytest.approx(pricing.group_time(fwd, lengths, 1, etas), rel=1e-9)
    assert t_on > t_off
    # every layer sparse (Qwen3-VL-30B-A3B's layout): attention grows by exactly one pass of 4
    a, b = (CostModel.preset("qwen3-vl-30b-a3b", "ascend-910b", state_shards=512, require_fit=False, router_phase=r)
            for r in (False, True))
    assert b.a1 == pytest.approx(a.a1 * 5 / 4, rel=1e-12) and b.a2_vision == pytest.approx(a.a2_vision * 5 / 4)


def test_the_router_phase_under_tensor_parallelism():
    """t = 2: one device's share of the pass and one pass of the sequence-parallel collectives
    (the step's 3 at remat "layer"), the sparse layer's rows exchange among them."""
    t, el = 2, 2
    hw = presets.HARDWARE["ascend-910b"]
    kw = dict(tensor_parallel=t, ranks_per_node=4, state_shards=8, sequence_parallel=True)
    off = CostModel.preset(ROUTED, "ascend-910b", **kw)
    on = CostModel.preset(ROUTED, "ascend-910b", router_phase=True, **kw)
    bw = min(hw.a2a_bw_intra, (t - 1) * hw.p2p_bw_intra)
    share = (t - 1) / t * el * D
    # layer 0: 2 gathers + 2 scatters; layer 1: the attention's 2 and the rows' join and scatter
    rows = (4 + 2 + 2) * share
    gemm = (ATTN + 3 * D * FF + ATTN + K * 3 * D * FE) / t + D * E
    assert on.a2 - off.a2 == pytest.approx(2.0 * gemm / (hw.peak_flops * hw.mfu_linear) + rows / bw, rel=1e-9)
    assert on.a1 - off.a1 == pytest.approx(2.0 * H * HD * 2 / (hw.peak_flops * hw.mfu_attention) / t, rel=1e-9)


def test_a_saved_cost_model_keeps_the_router_phase(tmp_path):
    on = CostModel.preset(ROUTED, "ascend-910b", state_shards=8, router_phase=True)
    on.save(tmp_path / "cost.json")
    back = CostModel.from_profile(tmp_path / "cost.json")
    assert back == on and back.router_phase
    assert CostModel.from_dict({k: v for k, v in on.to_dict().items() if k != "router_phase"}).router_phase is False
    with pytest.raises(ValueError, match=r"replace\(router_phase=False\): the router program's forward pass is part"):
        on.replace(router_phase=False)


def test_the_planning_commands_take_the_router_phase(tmp_path):
    """`dhp plan` / `simulate` / `analyze` price the router program with `--router-phase` (the same
    model as `dhp train` with the load-balancing loss on), for a preset with routers only: a dense
    model and a profile are refused by name."""
    import argparse

    from dhp_jax.planner.cli_args import add_cost_args, add_tensor_parallel_arg, cost_from_args

    parser = argparse.ArgumentParser()
    add_cost_args(parser, model="qwen3-vl-30b-a3b", ranks=64, router_phase=True)
    add_tensor_parallel_arg(parser)
    tp4 = ["--tensor-parallel", "4"]
    on = cost_from_args(parser.parse_args([*tp4, "--router-phase"]))
    assert on == CostModel.preset("qwen3-vl-30b-a3b", "ascend-910b", state_shards=64, tensor_parallel=4,
                                  ranks_per_node=2, router_phase=True)
    assert not cost_from_args(parser.parse_args(tp4)).router_phase
    with pytest.raises(ValueError, match="--router-phase: 'qwen3-vl-8b' has no mixture-of-experts layer"):
        cost_from_args(parser.parse_args(["--router-phase", "--model", "qwen3-vl-8b"]))
    on.save(tmp_path / "cost.json")
    with pytest.raises(ValueError, match="--router-phase needs a preset: the profile"):
        cost_from_args(parser.parse_args(["--router-phase", "--cost", str(tmp_path / "cost.json")]))
