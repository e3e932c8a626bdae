"""The engine's memory: the planner's memory model (fields, not hidden constants), the chunked LM
head, remat, and the compiled-bytes bench on tiny settings."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from dhp_jax.data import random_samples
from dhp_jax.model import MLLMConfig, init_params
from dhp_jax.model.mllm import apply_model, chunked_loss_sum, token_loss_sum
from dhp_jax.model.reference import reference_stream
from dhp_jax.planner import CostModel
from dhp_jax.planner.cost import memory, presets
from dhp_jax.planner.cost.memory import (device_step_bytes, device_step_phases, group_activation_bytes,
                                         group_program_bytes, group_static_bytes,
    rank_state_bytes)


@functools.cache
def _compiled_bytes(cfg: MLLMConfig, degree: int, tokens: int, compute_dtype: str) -> int:
    """`memory_bench.compiled_bytes` on this process's devices, once per program: the tests below
    share their compiles (one group program compiles in tens of seconds on a shared CPU)."""
    from dhp_jax.sharding.memory_bench import compiled_bytes

    return compiled_bytes(cfg, degree, tokens, compute_dtype, jax.devices())


# depth 4 + 3 vision layers: deeper than the extrapolation base in both stacks; bf16 as the bench
DEEP = MLLMConfig.preset("tiny", num_layers=4, vision_layers=3, remat="layer")
SMALL = MLLMConfig("small", 2048, 256, 4, 4, 2, 64, 1024, patch_dim=48, vision_dim=128, vision_layers=2,
                   vision_heads=2, vision_head_dim=64, vision_ff=512, remat="layer")


def test_stand_in_refuses_a_mixture_of_experts_preset():
    """`MLLMConfig.preset` builds no dense stand-in for a stored MoE model: one line names it, and
    `dhp bench memory` keeps such models out of its stand-in default."""
    from dhp_jax.model.mllm_config import MOE_PRESETS
    from dhp_jax.sharding.memory_bench import dense_models

    assert {"qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b", "internvl3.5-30b-a3b"} <= MOE_PRESETS
    for name in sorted(MOE_PRESETS):
        with pytest.raises(ValueError, match=f"model preset '{name}' is a mixture of experts"):
            MLLMConfig.preset(name)
    assert not MOE_PRESETS & set(dense_models()) and "internvl3-8b" in dense_models()


@pytest.mark.parametrize("name", ["tiny"] + sorted(set(presets.MODELS) - {"qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b",
                                                                          "internvl3.5-30b-a3b"}))
def test_engine_params_match_the_model(name):
    """The stand-in engine at a preset's shape: the memory model counts its parameters exactly (the
    real families' counts are checked against transformers in tests/test_model_configs.py)."""
    from dhp_jax.sharding.memory_bench import model_shape

    assert memory.engine_params(model_shape(MLLMConfig.preset(name))) == MLLMConfig.preset(name).num_params()


def test_memory_choices_are_fields_that_move_the_memory():
    base = CostModel.preset("internvl3-2b", "ascend-910b", state_shards=8)
    assert (base.remat, base.compute_bytes, base.state_shards) == ("layer", 2, 8)
    wide = CostModel.preset("internvl3-2b", "ascend-910b", state_shards=64)
    assert rank_state_bytes(wide) == pytest.approx(rank_state_bytes(base) / 8)
    assert wide.memory_budget - base.memory_budget == pytest.approx(rank_state_bytes(base) - rank_state_bytes(wide))
    # one pass over the stream (with chunks a family's "selective" keeps what "layer" keeps:
    # test_family_presets_price_the_family_program)
    per_token = {r: CostModel.preset("internvl3-2b", "ascend-910b", remat=r, linear_chunk=0).mem_per_token
                 for r in ("layer", "selective", "none")}
    assert per_token["layer"] < per_token["selective"] < per_token["none"]
    fp32 = CostModel.preset("internvl3-2b", "ascend-910b", compute_dtype="float32")
    assert fp32.compute_bytes == 4 and group_static_bytes(fp32) > group_static_bytes(base)
    # recompute factor follows the policy: per-layer remat runs the forward twice
    none = CostModel.preset("internvl3-2b", "ascend-910b", remat="none")
    sel = CostModel.preset("internvl3-2b", "ascend-910b", remat="selective")
    assert base.a2 / none.a2 == pytest.approx(4 / 3) and sel.a2 == pytest.approx(none.a2)
    assert sel.a1 == pytest.approx(base.a1)
    # two phases: the blocks' (static + tokens x bytes per token) and the last (params, row, every
    # gradient piece; no activations)
    last = 2 * base.param_count * base.compute_bytes + base.assemble_bytes
    assert base.assemble_bytes > base.param_count * base.compute_bytes > base.backward_bytes
    assert group_program_bytes(base, [8192], 4) == pytest.approx(max(group_static_bytes(base) + 2048 * base.mem_per_token, last))
    assert group_program_bytes(base, [65536], 1) == pytest.approx(group_static_bytes(base) + 65536 * base.mem_per_token)
    # a family program's blocks' phase holds the LM head's kernel and gradient besides the stacked
    # gradients (`memory.family_backward_bytes`): at 2 tokens it is still the larger phase here
    assert group_program_bytes(base, [2], 1) == pytest.approx(
        max(group_static_bytes(base) + group_activation_bytes(base, [2], 1), last))
    assert CostModel.from_dict(base.to_dict()) == base
    with pytest.raises(ValueError, match="remat"):
        CostModel.preset("internvl3-2b", "ascend-910b", remat="sometimes")
    with pytest.raises(ValueError, match="does not fit.*sharded over 1 ranks"):
        CostModel.preset("internvl3-8b", "ascend-910b", state_shards=1)


def test_chunked_loss_equals_full_logits_loss():
    c = MLLMConfig.preset("tiny")
    params = init_params(c, jax.random.key(1))
    st = reference_stream(c, random_samples(c, [40, 3, 25], seed=2))
    batch = {k: v for k, v in st.items() if k not in ("targets", "loss_weights")}

    def full(p):
        return token_loss_sum(apply_model(c, p, batch), st["targets"], st["loss_weights"])

    def chunked(p):
        return chunked_loss_sum(c, p, batch, st["targets"], st["loss_weights"], chunk=7)  # 68 tokens: 10 chunks

    (a, ga), (b, gb) = jax.jit(jax.value_and_grad(full))(params), jax.jit(jax.value_and_grad(chunked))(params)
    assert abs(float(a) - float(b)) <= 1e-5 * abs(float(a))
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        assert float(np.max(np.abs(x - y))) <= 1e-5 * max(float(np.max(np.abs(x))), 1e-30)


def test_remat_changes_memory_not_values():
    # the compiles of test_cost_model_matches_compiled_bytes (blocks in the executor's chunks)
    got = {r: _compiled_bytes(dataclasses.replace(SMALL, remat=r), 1, 16384, "bfloat16") for r in ("none", "layer")}
    assert got["layer"] < got["none"]
    c = MLLMConfig.preset("tiny", remat="layer")
    params = init_params(c, jax.random.key(1))
    st = reference_stream(c, random_samples(c, [30, 12], seed=3))
    batch = {k: v for k, v in st.items() if k not in ("targets", "loss_weights")}
    def grads(cfg):
        return jax.grad(lambda p: token_loss_sum(apply_model(cfg, p, batch), st["targets"], st["loss_weights"]))(params)

    for x, y in zip(jax.tree.leaves(grads(c)), jax.tree.leaves(grads(dataclasses.replace(c, remat="none")))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_bench_extrapolates_depth_linearly():
    from dhp_jax.sharding.memory_bench import program_bytes

    est, extrapolated = program_bytes(DEEP, 2, 512, compute_dtype="bfloat16", devices=jax.devices())
    full = _compiled_bytes(DEEP, 2, 512, "bfloat16")        # what program_bytes(full_depth=True) compiles
    assert extrapolated and abs(est / full - 1) < 0.1, (est, full)


def test_cost_model_matches_compiled_bytes():
    """memory.group_program_bytes (the planner's memory formula) against XLA's compiled bytes of the
    group program, bf16, the blocks in the executor's chunks (`linear_chunk` 256), on a small model:
    layer remat at three degrees and two token counts (16k, 4k and 2k tokens per device), and
    without recompute at 16k tokens (what the chunks keep, `test_chunked_blocks_keep_what_the_
    memory_model_counts`; the compile test_remat_changes_memory_not_values makes): within 10 % (the
    bench's CPU setting: activations computed in fp32, the blocks' loop state in bf16). The full
    grid of presets is `dhp bench memory`."""
    from dhp_jax.sharding.memory_bench import CPU_ACTIVATION_BYTES, model_shape

    cfg = SMALL
    costs = {r: CostModel.preset(model_shape(cfg), "ascend-910b", compute_dtype="bfloat16", remat=r,
                                 activation_bytes=CPU_ACTIVATION_BYTES) for r in ("layer", "none")}
    assert costs["layer"].param_count == cfg.num_params() and costs["none"].geometry.linear_chunk > 0
    for remat, degree, tokens in (("layer", 1, 16384), ("layer", 2, 8192), ("layer", 4, 8192), ("none", 1, 16384)):
        got = _compiled_bytes(dataclasses.replace(cfg, remat=remat), degree, tokens, "bfloat16")
        want = group_program_bytes(costs[remat], [tokens], degree)
        print(f"remat {remat}, degree {degree}, {tokens} tokens: modelled / compiled - 1 = {want / got - 1:+.4f}")
        assert 0.0 <= want / got - 1 <= 0.10, (remat, degree, tokens, got, want)


def test_cost_model_matches_the_compiled_step():
    """memory.device_step_bytes against the compiled step (`dhp bench memory --step`): every program of
    a 2-micro-batch step compiled abstractly on the 8 devices and laid out in dispatch order. The
    peak and each phase other than the group program (gather, reductions, update) within 10 %, and
    the step's peak is its group program: the reductions hold one row and one fp32 piece."""
    from dhp_jax.sharding.memory_bench import CPU_ACTIVATION_BYTES, CPU_MEMORY_OPTIONS, model_shape
    from dhp_jax.bench.step_memory import compiled_phases, step_programs

    cfg = SMALL
    devices = jax.devices()
    cost = CostModel.preset(model_shape(cfg), "ascend-910b", compute_dtype="bfloat16", state_shards=len(devices),
                            activation_bytes=CPU_ACTIVATION_BYTES)
    options = {"xla_backend_optimization_level": 0, **CPU_MEMORY_OPTIONS}
    group = _compiled_bytes(cfg, 2, 8192, "bfloat16")        # shared with the test above
    got = compiled_phases(group, step_programs(cfg, "bfloat16", devices, options), 2)
    want = device_step_phases(cost, [([8192], 2)] * 2)
    assert [k for k, _ in got] == [k for k, _ in want]
    for (name, b), (_, m) in zip(got, want):
        if "group" not in name:
            assert abs(m / b - 1) <= 0.10, (name, b, m)
    peak = max(got, key=lambda p: p[1])
    assert peak[0] == "micro-batch 0 group program", got
    assert abs(device_step_bytes(cost, [([8192], 2)] * 2) / peak[1] - 1) <= 0.10


def _stack_loss(remat: str):
    """(config, flat layout, flat params, loss(flat, stacked)): the tiny model's loss on a fixed
    batch, through the block stacks (`stacked`) or through the module's own block loop."""
    from dhp_jax.model.mllm import block_stack
    from dhp_jax.sharding.flat import FlatLayout

    c = MLLMConfig.preset("tiny", remat=remat)
    params = init_params(c, jax.random.key(1))
    st = reference_stream(c, random_samples(c, [30, 12], seed=3))
    batch = {k: v for k, v in st.items() if k not in ("targets", "loss_weights")}
    lay = FlatLayout.of(params, 1)

    def loss(f, stacked):
        stacks = tuple(block_stack(c, *lay.rows(f, p, n), v) for p, n, v in
                       (("vision_layers_", c.vision_layers, True), ("layers_", c.num_layers, False)))
        return chunked_loss_sum(c, lay.unravel(f), batch, st["targets"], st["loss_weights"],
                                stacks=stacks if stacked else None)

    return c, lay, lay.ravel(params), loss


@functools.cache
def _module_loop_autodiff():
    """Loss and gradient by plain autodiff of the module's block loop (no remat; remat never changes
    values: test_remat_changes_memory_not_values): the reference of every
    remat policy's block stack, compiled once."""
    _, _, flat, loss = _stack_loss("none")
    return jax.jit(jax.value_and_grad(loss), static_argnums=1)(flat, False)


@pytest.mark.parametrize("remat", ["none", "layer", "selective"])
def test_block_stack_vjp_matches_autodiff(remat):
    """The block stacks' own VJP (`mllm.block_stack`) against autodiff of the module's block loop,
    fp32: loss and gradient at 1e-5. In bf16 the forward scan of "layer" keeps the block inputs
    only, bit-cast to uint16 (never the params rows), and the rows' gradient comes out in bf16."""
    import jax.numpy as jnp

    from dhp_jax.model.attention import AttnIds
    from dhp_jax.model.mllm import block_stack

    c, lay, flat, loss = _stack_loss(remat)
    a, ga = jax.jit(jax.value_and_grad(loss), static_argnums=1)(flat, True)
    b, gb = _module_loop_autodiff()
    assert abs(float(a) - float(b)) <= 1e-5 * abs(float(b))
    assert float(jnp.max(jnp.abs(ga - gb))) <= 1e-5 * float(jnp.max(jnp.abs(gb)))

    rows, tree = lay.rows(flat.astype(jnp.bfloat16), "layers_", c.num_layers)
    run = block_stack(c, rows, tree, False)
    s = 16
    ids = AttnIds(jnp.ones(s, jnp.int32), jnp.arange(s, dtype=jnp.int32), jnp.zeros(s, jnp.int32))
    x = jnp.ones((s, c.d_model), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, r: jax.vjp(lambda x_, r_: block_stack(c, r_, tree, False)(x_, ids), x, r))(
        x, rows)
    scan = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan")
    kept = [(v.aval.shape, str(v.aval.dtype)) for v in scan.outvars[1:]]
    if remat == "layer":
        assert kept == [((c.num_layers, s, c.d_model), "uint16")]
    else:
        assert len(kept) > 1 and all(shape[1:] != rows.shape[1:] for shape, _ in kept)
    drows = jax.jit(jax.grad(lambda r: jnp.sum(run(x, ids).astype(jnp.float32))))(rows)
    assert drows.dtype == jnp.bfloat16 and drows.shape == rows.shape


def test_chunked_blocks_keep_what_the_memory_model_counts(monkeypatch):
    """What the stand-in's blocks keep for their backward pass in the executor's chunks, term by term
    the memory model's: per token, the bytes each forward block scan stores per block
    (`mllm.block_stack`: the residuals of the block's `jax.vjp`, in their dtypes) are
    `memory._block`'s kept count in the compute dtype plus `memory._kept_wide`'s in 4 bytes, for
    both stacks at every remat ("selective" keeps the block input only, as "layer"); without
    recompute the blocks also store their weights (`memory.kept_weight_bytes`), in chunks and in one
    pass (`linear_chunk` 0). The program is lowered (traced), not compiled; 3072 tokens: 12 chunks,
    and no weight's size is a multiple of it."""
    import jax.numpy as jnp

    from dhp_jax.model import mllm
    from dhp_jax.sharding import PlanExecutor
    from dhp_jax.sharding.memory_bench import model_shape

    m, tokens, kb = model_shape(SMALL), 3072, 2
    dec, vis = memory.stack_params(m)
    stacks = ((m.vision_layers, (m.vision_hidden, m.vision_heads, m.vision_heads, m.vision_head_dim)),
              (m.layers, (m.hidden, m.heads, m.kv_heads, m.head_dim)))
    rows = {(m.vision_layers, vis // m.vision_layers), (m.layers, dec // m.layers)}
    stored = []
    store = mllm._store
    monkeypatch.setattr(mllm, "_store", lambda x: (stored.append(x), store(x))[1])
    for remat, chunk in [(r, 256) for r in memory.REMATS] + [("none", 0)]:
        ex = PlanExecutor(dataclasses.replace(SMALL, remat=remat), jax.devices()[:1], compute_dtype="bfloat16",
                          linear_chunk=chunk)
        del stored[:]
        ex.lower(1, tokens, tuple(jax.devices()[:1]))
        # each forward scan stores its params rows [count, n] first, then one block's residuals: the
        # vision stack's scan, then the decoder's (then the backward scans)
        starts = [i for i, x in enumerate(stored) if tuple(x.shape) in rows][:3]
        per_token, weights = [], 0
        for (a, b), (count, _) in zip(zip(starts, starts[1:]), stacks):
            kept = [x.size * x.dtype.itemsize for x in stored[a + 1:b] if x.dtype != jnp.bool_]   # not the live flags
            per_token.append(count * sum(k for k in kept if k % tokens == 0) / tokens)
            weights += count * sum(k for k in kept if k % tokens)
        assert weights == memory.kept_weight_bytes(m, remat, kb), (remat, chunk, weights)
        if chunk:
            want = [count * (kb * memory._block(d, h, kv, hd, 1, remat, True)[0]
                             + 4 * memory._kept_wide(h, kv, hd, remat, True)) for count, (d, h, kv, hd) in stacks]
            assert per_token == want, (remat, per_token, want)


def test_preset_memory_follows_its_linear_chunk():
    """A preset prices the blocks the executor runs: chunked (the default chunk) or one pass
    (`linear_chunk=0`, every intermediate over the whole stream)."""
    from dhp_jax.planner.cost import memory as engine_memory, presets

    m = presets.MODELS["internvl3-8b"]
    chunked = CostModel.preset("internvl3-8b", "ascend-910b")
    one_pass = CostModel.preset("internvl3-8b", "ascend-910b", linear_chunk=0)
    assert chunked.geometry.linear_chunk > 0 and one_pass.geometry.linear_chunk == 0
    assert one_pass.mem_per_token > chunked.mem_per_token
    assert one_pass.mem_per_token == engine_memory.activation_bytes_per_token(m, "layer", 2)
    assert chunked.mem_per_token == engine_memory.activation_bytes_per_token(m, "layer", 2, chunked=True)


FAMILY_PRESETS = {"internvl3-8b": "internvl", "qwen3-vl-8b": "qwen3_vl", "qwen2.5-vl-32b": "qwen2_5_vl"}


@pytest.mark.parametrize("name", sorted(FAMILY_PRESETS))
def test_family_presets_price_the_family_program(name):
    """A Hugging Face family's preset prices its activations as the family program runs
    (`memory.family_bytes_per_token`, which tests/test_family_memory.py holds against compiled
    programs) at every remat, with and without chunks, in each dtype: its own blocks, never the
    stand-in's; the stand-in's shape keeps the stand-in's formula. The inputs are int32 / fp32 in
    any compute dtype, the boolean masks a byte."""
    m = presets.MODELS[name]
    assert m.family == FAMILY_PRESETS[name]
    stand_in = dataclasses.replace(m, family="", param_count=0, patches_per_token=1, vision_mlp=3, deepstack=0,
                                   projector_hidden=0)
    for remat in memory.REMATS:
        for chunk in (0, 256):
            for hardware, kw, ab in (("ascend-910b", {}, 2), ("cpu", {}, 4), ("h100", {"activation_bytes": 4}, 4)):
                cost = CostModel.preset(name, hardware, remat=remat, linear_chunk=chunk, require_fit=False, **kw)
                want = memory.family_bytes_per_token(m, ab, remat, chunk > 0, kb=cost.compute_bytes)
                assert cost.mem_per_token == want, (remat, chunk, hardware)
                assert cost.mem_per_token != memory.activation_bytes_per_token(stand_in, remat, cost.compute_bytes,
                                                                               ab, chunk > 0)
                base = CostModel.preset(stand_in, hardware, remat=remat, linear_chunk=chunk, require_fit=False, **kw)
                assert base.mem_per_token == memory.activation_bytes_per_token(stand_in, remat, cost.compute_bytes,
                                                                               ab, chunk > 0)
        # the inputs: 4 bytes an element whatever the dtype, the masks a byte, the values the program
        # casts to fp32 itself 4 bytes (`_family_block_wide`), the rest in the activations' bytes
        two = memory.family_bytes_per_token(m, 2, remat)
        four = memory.family_bytes_per_token(m, 4, remat)
        inputs = 4.0 * memory.family_input_elements(m) + memory.family_tail(m)[1]
        assert memory.input_bytes_per_token(m) == 4.0 * memory.family_input_elements(m)
        rows = memory.encoder_rows(m)
        (dec_kept, dec_work), (vit_kept, vit_work) = (memory._family_block_wide(m, v, remat, False) for v in (0, 1))
        llm_work = (memory._llm_blocks(m, remat, False)[1] if memory._moe(m) else
                    memory._family_block(m, False, remat, False)[1])
        # the peak block's working set, its fp32 part 4 bytes in both dtypes (the peak may be the LLM
        # layer's in one dtype and the encoder block's in the other)
        vit_block = memory._family_block(m, True, remat, False)[1]
        work2 = max(2 * llm_work + 2 * dec_work, rows * (2 * vit_block + 2 * vit_work))
        work4 = 4 * max(llm_work, rows * vit_block)
        fp32 = m.layers * dec_kept + rows * m.vision_layers * vit_kept
        assert four - inputs == pytest.approx(2 * (two - inputs) - 4 * fp32 - 2 * work2 + work4)
    # with chunks "selective" keeps what "layer" keeps; in one pass it keeps the GEMMs' outputs too
    chunked = {r: CostModel.preset(name, "h100", remat=r, require_fit=False).mem_per_token for r in memory.REMATS}
    one_pass = {r: CostModel.preset(name, "h100", remat=r, linear_chunk=0, require_fit=False).mem_per_token
                for r in memory.REMATS}
    assert chunked["layer"] == chunked["selective"] < chunked["none"]
    assert one_pass["layer"] < one_pass["selective"] < one_pass["none"]
    assert all(chunked[r] < one_pass[r] for r in memory.REMATS)


def test_family_inputs_are_the_family_programs_input_columns():
    """`memory.family_input_elements` counts the family program's input columns per LLM token: the
    shapes the executor lowers a `FamilyModel` its group program with."""
    from dhp_jax.data.model_configs import hf_layout, model_config
    from dhp_jax.model.hf.api import parse_config
    from dhp_jax.model.hf.packed import LLM_INTS, TAPS, VISION_INTS, patch_dim, rope_axes, unit

    for name in FAMILY_PRESETS:
        config, m = parse_config(hf_layout(model_config(name))), presets.MODELS[name]
        columns = len(LLM_INTS) + rope_axes(config) + 1 + unit(config) * (len(VISION_INTS) + patch_dim(config) + TAPS)
        assert memory.family_input_elements(m) == columns, name
        assert memory.encoder_rows(m) == unit(config), name


def test_replace_linear_chunk_rederives_a_presets_memory():
    """A preset's chunk change through `replace` (the trainer follows its executor's chunk so) prices
    the memory of the new block form, exactly as the preset made with that chunk; figures the preset
    did not derive (an override, a field the change names, a cost loaded from a profile) are kept."""
    kw = {"remat": "selective", "state_shards": 16}
    base = CostModel.preset("internvl3-2b", "ascend-910b", **kw)
    for chunk in (0, 128, 8192, base.geometry.linear_chunk):
        assert base.replace(linear_chunk=chunk) == CostModel.preset("internvl3-2b", "ascend-910b", linear_chunk=chunk, **kw)
    one_pass = base.replace(linear_chunk=0)
    assert one_pass.mem_per_token > base.mem_per_token
    wide = base.replace(linear_chunk=8192)     # a chunk whose working set outgrows the loss chunk's logits
    assert wide.fixed_bytes > base.fixed_bytes and wide.memory_budget < base.memory_budget
    assert one_pass.replace(linear_chunk=base.geometry.linear_chunk) == base
    pinned = CostModel.preset("internvl3-2b", "ascend-910b", memory_budget=5e9, **kw).replace(linear_chunk=0)
    assert pinned.memory_budget == 5e9 and pinned.mem_per_token == one_pass.mem_per_token
    named = base.replace(linear_chunk=0, mem_per_token=123.0)
    assert named.mem_per_token == 123.0 and named.fixed_bytes == one_pass.fixed_bytes
    loaded = CostModel.from_dict(base.to_dict()).replace(linear_chunk=0)
    assert (loaded.mem_per_token, loaded.fixed_bytes, loaded.memory_budget) == \
        (base.mem_per_token, base.fixed_bytes, base.memory_budget)


def test_tensor_parallel_memory_matches_compiled_bytes():
    """With tensor_parallel 2 (ranks of 2 devices), the group program holds one device's share of
    the params and returns its share's gradient (`TensorLayout`): its params argument is the
    share's row, about half the t = 1 vector; and `CostModel.preset(..., tensor_parallel=2)`
    (weights / 2, activations in the psum form) is within 10 % of the compiled bytes. So is the
    sequence-parallel program at remat "none" in one pass (`linear_chunk` 0): the case where a
    block's residual sum after attention is 1/t of the rows besides its input (the second term of
    `tensor.sequence_saving`; with recompute or chunks only the input is)."""
    from dhp_jax.sharding import PlanExecutor
    from dhp_jax.sharding.memory_bench import CPU_ACTIVATION_BYTES, CPU_MEMORY_OPTIONS, compiled_bytes, model_shape

    cfg, devices = SMALL, jax.devices()
    one, two = PlanExecutor(cfg, devices[:2]), PlanExecutor(cfg, devices[:4], tensor_parallel=2)
    assert two.layout.row < 0.55 * one.layout.padded
    none = dataclasses.replace(cfg, remat="none")
    sp = PlanExecutor(none, devices[:4], compute_dtype="bfloat16", tensor_parallel=2, sequence_parallel=True,
                      linear_chunk=0)
    assert sp.layout.row == two.layout.row
    compiled = sp.lower(1, 8192, tuple(devices[:2])).compile(
        compiler_options={**sp.compiler_options, **CPU_MEMORY_OPTIONS}).memory_analysis()
    args = [one.lower(1, 256, tuple(devices[:1])).compile().memory_analysis().argument_size_in_bytes,
            compiled.argument_size_in_bytes]
    inputs = 4 * (8 + cfg.patch_dim + 1)
    # fp32 params (t = 1), bf16 params (the sequence-parallel program computes in bf16), then the inputs
    assert args == [4 * one.layout.padded + 256 * inputs, 2 * two.layout.row + 8192 * inputs], args
    cost = CostModel.preset(model_shape(cfg), "ascend-910b", compute_dtype="bfloat16",
                            activation_bytes=CPU_ACTIVATION_BYTES, tensor_parallel=2, ranks_per_node=4)
    for degree, tokens in ((1, 8192),):       # the grid: `dhp bench memory --tensor-parallel` (docs/executor.md)
        got = compiled_bytes(cfg, degree, tokens, "bfloat16", devices, tensor_parallel=2)
        want = group_program_bytes(cost, [tokens], degree)
        print(f"t = 2, remat layer, degree {degree}, {tokens} tokens: modelled / compiled - 1 = {want / got - 1:+.4f}")
        assert 0.0 <= want / got - 1 <= 0.10, (degree, tokens, got, want)
    got = (compiled.argument_size_in_bytes + compiled.output_size_in_bytes + compiled.temp_size_in_bytes
           - compiled.alias_size_in_bytes)
    cost = CostModel.preset(model_shape(none), "ascend-910b", compute_dtype="bfloat16", remat="none", linear_chunk=0,
                            activation_bytes=CPU_ACTIVATION_BYTES, tensor_parallel=2, sequence_parallel=True,
                            ranks_per_node=4)
    want = group_program_bytes(cost, [8192], 1)
    print(f"t = 2 sequence-parallel, remat none, one pass: modelled / compiled - 1 = {want / got - 1:+.4f}")
    assert 0.0 <= want / got - 1 <= 0.10, (got, want)


def test_memory_device_check_on_cpu_prints_one_line():
    """`dhp bench memory --device-check` compiles the bf16 family rows for a GPU only; without one it
    says so in one line and compiles nothing."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dhp_jax", "bench", "memory", "--device-check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines() == [
        "dhp bench memory --device-check: no GPU here (CPU only); nothing to check"], (out.stdout, out.stderr)
