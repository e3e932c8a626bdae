"""The memory model vs the compiled group program of a Hugging Face family (`dhp bench memory
--families` at published sizes; here a tiny Qwen3-VL with DeepStack): the family program compiled
with abstract params (shapes from config.json, nothing allocated) for a ring group, and
`group_program_bytes` of the same shape, agree within 10 % and the model is never under the compiled
bytes (the unsafe direction: the planner could over-pack)."""

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from test_hf_qwen3_vl import make_config  # noqa: E402

TOLERANCE = 0.10


def raw_config():
    raw = make_config(tied=False).to_dict()
    raw["architectures"] = ["Qwen3VLForConditionalGeneration"]
    return raw


def test_abstract_params_are_the_checkpoint_tree():
    """The shape tree has every weight transformers' model has, under our checkpoint names."""
    from dhp_jax.model import hf
    import torch
    import transformers

    from dhp_jax.model.hf.abstract import abstract_params
    from dhp_jax.model.hf.api import parse_config

    raw = raw_config()
    config = parse_config(raw)
    import jax
    import numpy as np
    tree = abstract_params(config)
    names = hf.to_state_dict(config, jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), tree))
    with torch.device("meta"):  # transformers' own model, no weight allocated
        model = transformers.Qwen3VLForConditionalGeneration(make_config(tied=False))
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert sorted(names) == sorted(theirs)
    assert all(tuple(names[k].shape) == theirs[k] for k in theirs)


@pytest.mark.parametrize("degree,tokens", [(2, 4096)])
def test_family_program_bytes_match_the_memory_model(degree, tokens):
    import jax

    from dhp_jax.sharding.family_memory import compiled, modelled

    raw = raw_config()
    got, params = compiled(raw, degree, tokens, jax.devices())
    want = modelled(raw, params, degree, tokens)
    print(f"tiny qwen3_vl degree {degree}, {tokens} tokens: compiled {got / 1e6:.1f} MB, model {want / 1e6:.1f} MB, "
          f"ratio {want / got:.3f}")
    assert 1.0 <= want / got <= 1.0 + TOLERANCE, (got, want)


def test_family_remat_layer_program_bytes_match_the_memory_model():
    """Remat "layer" (`layers.remat_block`: each LLM layer and encoder block keeps its input only and
    is recomputed in the backward pass) shrinks the whole family group program well below its
    remat "none" bytes (priced by the model, which the test above holds within 10 % of the
    compiled program), and `family_bytes_per_token` (remat "layer") prices it at 1.00-1.10 of it:
    the peak is an encoder block's ring-attention backward pass (`memory._family_cotangents`)."""
    import jax

    from dhp_jax.sharding.family_memory import compiled, modelled

    raw, degree, tokens = raw_config(), 2, 4096
    got, params = compiled(raw, degree, tokens, jax.devices(), remat="layer")
    want = modelled(raw, params, degree, tokens, remat="layer")
    none = modelled(raw, params, degree, tokens)
    print(f"tiny qwen3_vl degree {degree}, {tokens} tokens, remat layer: compiled {got / 1e6:.1f} MB, model "
          f"{want / 1e6:.1f} MB (remat none: model {none / 1e6:.1f} MB)")
    assert got < 0.7 * none, (got, none)
    assert 1.0 <= want / got <= 1.0 + TOLERANCE, (got, want)


def test_family_pad_skipping_program_bytes_match_the_memory_model():
    """With `linear_chunk` (the executor's default pad skipping) a block keeps its chunks' inputs
    only: the family program compiles smaller, and `family_bytes_per_token` (chunked: the blocks'
    kept inputs and the attention's phase of the peak block's backward pass, the ring attention's
    backward pass, `memory.family_chunked_attention_phase`) prices it at 1.00-1.10 of its compiled
    bytes."""
    import jax

    from dhp_jax.sharding.family_memory import compiled, modelled

    raw, tokens = raw_config(), 2048
    got, params = compiled(raw, 2, tokens, jax.devices(), linear_chunk=256)
    want = modelled(raw, params, 2, tokens, linear_chunk=256)
    whole = modelled(raw, params, 2, tokens)
    print(f"tiny qwen3_vl degree 2, {tokens} tokens, chunks of 256: compiled {got / 1e6:.1f} MB, "
          f"model {want / 1e6:.1f} MB (unchunked model {whole / 1e6:.1f} MB)")
    assert want < 0.8 * whole
    assert 1.0 <= want / got <= 1.0 + TOLERANCE, (got, want)


def test_family_remat_selective_with_chunks_is_priced_as_layer():
    """Remat "selective" with chunks (tiny InternVL): `jax.checkpoint`'s policy sees no weight GEMM
    (each runs in a chunk's custom VJP), so the block keeps its input only, as with remat "layer"
    (their compiled programs are the same bytes); the preset prices it so, at 1.00-1.10 of the
    compiled program, with the recomputed block's attention phase at the peak
    (`memory.family_chunked_attention_phase`: the ring's backward pass, the recomputed q, k, v and
    three hidden-wide cotangents)."""
    import jax

    from dhp_jax.sharding.family_memory import compiled, modelled

    raw, tokens = tiny_raw_config("internvl"), 4096
    got, params = compiled(raw, 2, tokens, jax.devices(), remat="selective", linear_chunk=256)
    want = modelled(raw, params, 2, tokens, remat="selective", linear_chunk=256)
    print(f"tiny internvl degree 2, {tokens} tokens, chunks of 256, remat selective: compiled {got / 1e6:.1f} MB, "
          f"model {want / 1e6:.1f} MB")
    assert want == modelled(raw, params, 2, tokens, remat="layer", linear_chunk=256)
    assert 1.0 <= want / got <= 1.0 + TOLERANCE, (got, want)


def test_chunked_block_prices_its_attention_phase():
    """In chunks the peak of a block's backward pass is its attention's phase, run on the whole rows
    outside the chunks' VJP: without recompute the ring attention's backward pass
    (`family_ring_backward`, fp32 on every platform); with recompute that less the folded and the
    received key block (the recomputed k and v are the one it folds), the recomputed q, k, v and
    three hidden-wide cotangents. Per row: the terms scale with the widths, not with the tokens,
    and the chunked working set is that phase (a sparse layer adds its routed rows)."""
    import dataclasses

    from dhp_jax.planner.cost import memory
    from dhp_jax.sharding.family_memory import model_shape

    m = model_shape(raw_config(), 1)
    h, kv, d, hidden = m.vision_heads, m.vision_heads, m.vision_head_dim, m.vision_hidden
    ring = memory.family_ring_backward(h, kv, d)
    assert memory.family_chunked_attention_phase(h, kv, d, hidden, "none") == ring
    assert memory.family_chunked_attention_phase(h, kv, d, hidden, "layer") == \
        ring - 4 * kv * d + (h + 2 * kv) * d + 3 * hidden
    for remat in ("none", "layer", "selective"):
        as_run = "layer" if remat == "selective" else remat
        for vision in (False, True):
            heads, kvh, hd, width = (h, kv, d, hidden) if vision else (m.heads, m.kv_heads, m.head_dim, m.hidden)
            work = memory._family_block(m, vision, remat, True)[1]
            assert work == memory.family_chunked_attention_phase(heads, kvh, hd, width, as_run) > 0, (remat, vision)
            wide = memory._family_block_wide(m, vision, remat, True)[1]
            assert wide == memory.family_chunked_ring_backward(heads, kvh, hd, as_run) > 0, (remat, vision)
    double = dataclasses.replace(m, vision_heads=2 * h, vision_hidden=2 * hidden)
    assert memory._family_block(double, True, "layer", True)[1] == 2 * memory._family_block(m, True, "layer", True)[1]


def test_family_last_phase_holds_the_lm_head_copy():
    """The last phase of a family program (no activations: the gradient row concatenated from its
    pieces) holds, besides the pieces, the embedding's gradient accumulator and the LM head's kernel
    copy the loss chunks read (`memory.family_head_copy_bytes`, in the compute dtype, live from the
    loss to the end); the stand-in's holds two accumulators and no copy."""
    import dataclasses

    from dhp_jax.planner.cost import memory
    from dhp_jax.sharding.family_memory import model_shape

    m, params = model_shape(raw_config(), 1000), 1000.0
    vh = m.vocab * m.hidden
    assert memory.family_head_copy_bytes(m, 2) == 2.0 * vh
    for cb, ab in ((4, 4), (2, 4), (2, 2)):
        assert memory.assemble_bytes(params, m, cb, ab) == params * cb + vh * ab + vh * cb, (cb, ab)
        assert memory.family_backward_bytes(m, cb, ab) == sum(memory.stack_params(m)) * cb + vh * cb + vh * ab
    stand_in = dataclasses.replace(m, family="")
    assert memory.assemble_bytes(params, stand_in, 2, 4) == params * 2 + 2 * vh * 4


def test_remat_layer_block_runs_in_a_scan_body():
    """`layers.remat_block` "layer" is a plain fn -> fn wrapper: per block in a `lax.scan` body, its
    block closing over a per-step value (a tracer of the body), the gradients are those of the
    block without remat (fp32, 1e-5)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dhp_jax.model.hf.layers import remat_block

    def loss(ws, x, offsets, remat):
        def body(h, step):
            w, o = step
            block = remat_block(lambda p, y: jnp.tanh(y @ p["w"] + o), remat)
            return block({"w": w}, h), None
        return jnp.sum(jax.lax.scan(body, x, (ws, offsets))[0] ** 2)

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    args = (0.3 * jax.random.normal(k[0], (3, 8, 8)), jax.random.normal(k[1], (16, 8)), jax.random.normal(k[2], (3, 8)))
    want = jax.grad(loss, (0, 1, 2))(*args, "none")
    got = jax.grad(loss, (0, 1, 2))(*args, "layer")
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_family_sequence_parallel_program_bytes_match_the_memory_model():
    """Tensor parallelism over 2 devices with the LLM layers and the encoder blocks sequence-parallel
    (a group of 2 ranks of 2 devices): `CostModel.preset(..., tensor_parallel=2,
    sequence_parallel=True)` (the family terms at one device's widths; each LLM layer's and
    encoder block's input and residual sum, remat "none" without chunks, and the DeepStack features
    / 2) prices the compiled program at 1.00-1.10 of its compiled bytes."""
    import jax

    from dhp_jax.sharding.family_memory import compiled, modelled

    raw, tokens = raw_config(), 4096
    got, params = compiled(raw, 2, tokens, jax.devices(), tensor_parallel=2, sequence_parallel=True)
    want = modelled(raw, params, 2, tokens, tensor_parallel=2, sequence_parallel=True)
    psum = modelled(raw, params, 2, tokens, tensor_parallel=2)
    print(f"tiny qwen3_vl degree 2 x t=2, {tokens} tokens, sequence-parallel: compiled {got / 1e6:.1f} MB, "
          f"model {want / 1e6:.1f} MB (psum form: model {psum / 1e6:.1f} MB)")
    assert want < psum
    assert 1.0 <= want / got <= 1.0 + TOLERANCE, (got, want)


def test_internvl_tensor_parallel_block_holds_its_collective_buffers():
    """InternVL on a rank of 2 devices in the psum form (degree 2, 4096 tokens, remat "layer", fp32):
    the backward pass of an encoder block (one head per device) holds, besides its ring's backward
    pass, its all-reduces' buffers (`memory.family_collective_buffers`, three [rows, hidden]) and
    three tile arrays (`memory.FAMILY_LIVE_TILES_ONE_HEAD`); the model prices the program at
    1.00-1.10 of its compiled bytes. Both terms are per encoder row / per tile: doubling the
    encoder width doubles the first, and they are 0 at t = 1."""
    import dataclasses

    import jax

    from dhp_jax.planner.cost import memory
    from dhp_jax.planner.cost.tensor_parallel import local_shape
    from dhp_jax.sharding.family_memory import compiled, model_shape, modelled

    raw, degree, tokens = tiny_raw_config("internvl"), 2, 4096
    kw = dict(remat="layer", tensor_parallel=2)
    got, params = compiled(raw, degree, tokens, jax.devices(), **kw)
    want = modelled(raw, params, degree, tokens, **kw)
    print(f"tiny internvl degree {degree} x t=2 (psum form), {tokens} tokens, remat layer: compiled "
          f"{got / 1e6:.1f} MB, model {want / 1e6:.1f} MB ({want / got:.3f})")
    assert 1.0 <= want / got <= 1.0 + TOLERANCE, (got, want)
    m = local_shape(model_shape(raw, params), 2)
    psum = memory.family_collective_buffers(m, 2, False, False)
    assert psum == 3 * m.vision_hidden and memory.family_collective_buffers(m, 1, False, False) == 0
    assert memory.family_collective_buffers(m, 2, True, False) == 0 == memory.family_collective_buffers(m, 2, False, True)
    wide = dataclasses.replace(m, vision_hidden=2 * m.vision_hidden)
    assert memory.family_collective_buffers(wide, 2, False, False) == 2 * psum
    assert memory.family_collective_buffers(local_shape(model_shape(raw_config(), 1), 2), 2, False, False) == 0


# ------------------------------------------------------------------ bf16 rows (tiny families, XLA:CPU)
def tiny_raw_config(family: str) -> dict:
    """The tiny config.json of a family (the transformers tests' configs)."""
    if family == "qwen3_vl":
        return raw_config()
    if family == "internvl":
        from test_hf_internvl import make_config as internvl_config

        raw = internvl_config().to_dict()
        raw["architectures"] = ["InternVLForConditionalGeneration"]
        return raw
    import hf_cases

    raw = hf_cases.qwen2_5_vl_config(depth=3).to_dict()
    raw["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    return raw


@pytest.mark.parametrize("family,t,remat", [("qwen3_vl", 1, "none"), ("internvl", 1, "none"), ("qwen2_5_vl", 1, "layer")])
def test_bf16_family_program_bytes_are_never_under_priced(family, t, remat):
    """A bf16 family group program (degree 2, 4096 tokens; at t = 2 sequence-parallel) compiled for CPU
    devices is priced by the CPU figure (`modelled(..., activation_bytes=CPU_ACTIVATION_BYTES,
    cpu_terms=True)`: XLA:CPU computes bf16 in fp32) at 1.00-1.10 of its compiled bytes, never under:
    the block scans' loop state in bf16 (stored bit-cast), the ring attention's residuals and the
    rotary tables in fp32 (`memory._family_block_wide`) whatever the platform, the working set in
    fp32, and the ring attention's backward pass (`memory.family_ring_backward`) in fp32. The
    accelerator's figure (the working set in bf16) is the smaller."""
    import jax

    from dhp_jax.sharding.family_memory import compiled, modelled
    from dhp_jax.sharding.memory_bench import CPU_ACTIVATION_BYTES

    raw, degree, tokens = tiny_raw_config(family), 2, 4096
    kw = dict(compute_dtype="bfloat16", remat=remat, tensor_parallel=t, sequence_parallel=t > 1)
    got, params = compiled(raw, degree, tokens, jax.devices(), **kw)
    cpu = modelled(raw, params, degree, tokens, activation_bytes=CPU_ACTIVATION_BYTES, cpu_terms=True, **kw)
    device = modelled(raw, params, degree, tokens, **kw)
    print(f"tiny {family} bf16 degree {degree} x t={t}, {tokens} tokens, remat {remat}: compiled {got / 1e6:.1f} MB, "
          f"CPU figure {cpu / 1e6:.1f} MB ({cpu / got:.3f}), accelerator figure {device / 1e6:.1f} MB")
    assert device < cpu
    assert 1.0 <= cpu / got <= 1.0 + TOLERANCE, (got, cpu)


def test_bf16_family_terms_split_what_the_program_holds_in_fp32():
    """The family terms price a bf16 block's kept values as the program holds them: the loop state
    of the block scans in 2 bytes, the ring attention's residuals (q, k, v, output, log-sum-exp) and
    the rotary tables in 4 on every platform; in fp32 everything is 4 bytes, as before the split."""
    from dhp_jax.planner.cost import memory
    from dhp_jax.sharding.family_memory import model_shape

    m = model_shape(raw_config(), 1)
    kept, _ = memory._family_block(m, False, "none", False)
    wide, _ = memory._family_block_wide(m, False, "none", False)
    assert wide == 2 * (m.heads + m.kv_heads) * m.head_dim + m.heads + 2 * m.head_dim and 0 < wide < kept
    ring = memory.family_ring_backward(m.heads, m.kv_heads, m.head_dim)
    assert ring == 4 * m.heads * m.head_dim + 8 * m.kv_heads * m.head_dim + m.heads
    assert memory._family_block_wide(m, False, "layer", False) == (0.0, wide + ring)
    assert memory.family_rotary(m, True) == 2 * m.vision_head_dim
    assert memory.family_rotary(model_shape(tiny_raw_config("internvl"), 1), True) == 0
    fp32 = memory.family_bytes_per_token(m, 4.0, "none")
    assert memory.family_bytes_per_token(m, 4.0, "none", kb=4.0) == fp32
    fixed = memory.input_bytes_per_token(m) + memory.family_tail(m)[1]    # inputs and masks: bytes of their own
    every_value_in_bf16 = fixed + (fp32 - fixed) / 2
    rows = memory.encoder_rows(m)
    vit_wide, _ = memory._family_block_wide(m, True, "none", False)
    fp32_values = m.layers * wide + rows * m.vision_layers * vit_wide
    # the working set of the peak block: its ring backward pass in fp32 whatever the dtype
    dec_work, vit_work = memory._family_block(m, False, "none", False)[1], memory._family_block(m, True, "none", False)[1]
    dec_ring, vit_ring = memory._family_block_wide(m, False, "none", False)[1], memory._family_block_wide(m, True, "none", False)[1]
    assert dec_ring == ring
    work32 = 4.0 * max(dec_work, rows * vit_work)
    work16 = max(2.0 * dec_work + 2.0 * dec_ring, rows * (2.0 * vit_work + 2.0 * vit_ring))
    assert memory.family_bytes_per_token(m, 2.0, "none", kb=2.0) == pytest.approx(
        fixed + (fp32 - fixed - work32) / 2 + work16 + 2.0 * fp32_values, rel=1e-12)


def test_family_ring_phase_is_the_larger_of_the_two():
    """The backward pass of a family block holds, on top of its residuals, the larger of its MLP's
    cotangents (the family's fitted counts) and its attention's working set: the ring's fp32
    backward pass (`family_ring_backward`) with the cotangents of the attention output, q, k, v and
    the block input. Per row: both scale with the widths, not with the tokens."""
    import dataclasses

    from dhp_jax.planner.cost import memory
    from dhp_jax.sharding.family_memory import model_shape

    m = model_shape(raw_config(), 1)
    work, ring = memory._family_cotangents(m, True, "layer")
    attention = ring + 2 * (2 * m.vision_heads) * m.vision_head_dim + 2 * m.vision_hidden
    assert ring == memory.family_ring_backward(m.vision_heads, m.vision_heads, m.vision_head_dim) and work == attention
    wide_mlp = dataclasses.replace(m, vision_intermediate=100 * m.vision_intermediate)   # the MLP's phase wins
    cf, cw = memory._terms(m).encoder_cotangents
    assert memory._family_cotangents(wide_mlp, True, "layer") == (cf * wide_mlp.vision_intermediate
                                                                   + cw * m.vision_hidden, 0)
    double = dataclasses.replace(m, vision_heads=2 * m.vision_heads, vision_hidden=2 * m.vision_hidden)
    assert memory._family_cotangents(double, True, "layer")[0] == pytest.approx(2 * work, rel=0.01)


PUBLISHED = ("internvl3-8b", "experiments/configs/models/qwen2.5-vl-7b", "qwen3-vl-8b")


@pytest.mark.parametrize("spec", PUBLISHED)
def test_block_counts_are_what_the_block_scans_store(spec, monkeypatch):
    """`memory.family_llm_saved` and `memory.family_encoder_saved` (what a block keeps for its
    backward pass without recompute, the terms `family_bytes_per_token` sums per layer) are, per
    row, the elements each forward block scan of the family program stores (`scan.run_blocks`: the
    residuals of the block's `jax.vjp`), at the published widths; with remat "layer" each block
    stores its input only. The program is lowered (traced), not compiled."""
    import dataclasses

    import jax
    import numpy as np

    from dhp_jax.model.hf import scan
    from dhp_jax.model.hf.abstract import abstract_params
    from dhp_jax.model.hf.api import parse_config
    from dhp_jax.model.hf.config import with_depth
    from dhp_jax.model.hf.packed import unit
    from dhp_jax.planner.cost import memory
    from dhp_jax.planner.cost.presets import ModelShape
    from dhp_jax.sharding.executor import PlanExecutor
    from dhp_jax.sharding.family_memory import load_model_config

    _, raw = load_model_config(spec)
    raw = with_depth(raw, 1, 1)
    m, tokens = ModelShape.from_config(raw), 1536    # whole attention tiles of 512 rows in both streams
    stored = []
    store = scan._store
    monkeypatch.setattr(scan, "_store", lambda x: (stored.append(tuple(x.shape)), store(x))[1])
    for remat in ("none", "layer"):
        if remat == "layer" and spec != PUBLISHED[0]:      # one family suffices: the same remat_block
            continue
        config = dataclasses.replace(parse_config(raw), remat=remat)
        ex = PlanExecutor(config, jax.devices()[:1], compute_dtype="float32", linear_chunk=0)
        ex.bind(abstract_params(config))
        del stored[:]
        ex.lower(1, tokens, tuple(jax.devices()[:1]))
        # each forward scan stores its stack's rows [1, n] (n: a block's params) first, then each block's residuals:
        # the encoder's scan, then the LLM's (then the backward scans)
        starts = [i for i, s in enumerate(stored) if len(s) == 2 and s[0] == 1 and s[1] > 10**5][:3]
        per_row = []
        for (a, b), rows in zip(zip(starts, starts[1:]), (tokens * unit(config), tokens)):
            sizes = [int(np.prod(s)) for s in stored[a + 1:b]]
            per_row.append(sum(x for x in sizes if x % rows == 0) // rows)    # not the layer scales [1, v]
        want = ((memory.family_encoder_saved(m), memory.family_llm_saved(m)) if remat == "none"
                else (m.vision_hidden, m.hidden))
        assert tuple(per_row) == want, (remat, per_row, want)


# ------------------------------------------------------------------ MoE rows (tiny Qwen3-VL-MoE)
def moe_raw_config():
    """tests/test_hf_moe.py's tiny Qwen3-VL-MoE (8 experts of width 24, top-2; layer 0 dense, 1 and 2
    sparse), as transformers writes it (`num_local_experts`)."""
    from test_hf_moe import qwen3_vl_moe_config

    raw = qwen3_vl_moe_config().to_dict()
    raw["architectures"] = ["Qwen3VLMoeForConditionalGeneration"]
    return raw


def test_moe_shape_reads_transformers_expert_count():
    """The planner's shape of a config.json written by transformers (`num_local_experts`) has its
    expert count, and the XLA:CPU term prices the padding of the blocked grouped GEMM: 1 / 16 of
    the routed rows every sparse layer keeps (remat "none") and one layer's backward pass holds;
    a dense model has none."""
    from dhp_jax.model.hf import moe
    from dhp_jax.planner.cost import memory
    from dhp_jax.sharding.family_memory import model_shape

    m = model_shape(moe_raw_config(), 1)
    assert (m.experts, m.experts_per_token, m.expert_intermediate, m.sparse_layers) == (8, 2, 24, 2)
    assert memory.CPU_BLOCKS_PER_EXPERT == moe.BLOCKS_PER_EXPERT == 16
    rows = 2 * 2 * 64 + 3 * 2 * 24                              # dispatch, outputs; gate, up, product
    assert memory.moe_routed_rows(m, "none") == (rows, 3 * 2 * 24 + 2 * 2 * 64)
    assert memory.cpu_grouped_gemm_padding(m, "none") == (2 * rows + 3 * 2 * 24 + 2 * 2 * 64) / 16
    assert memory.cpu_grouped_gemm_padding(m, "layer") == (rows + 2 * 24 + 2 * 2 * 64) / 16
    assert memory.cpu_grouped_gemm_padding(model_shape(raw_config(), 1), "none") == 0


MOE_ROWS = [(1, "none"), (1, "layer"), (2, "none"), (2, "layer")]
_MOE_MEASURED: dict = {}


def _moe_row(t: int, remat: str) -> tuple[int, float, float]:
    """(compiled bytes, model with the CPU term, model without) of the tiny MoE group program
    (degree 2, 4096 tokens, fp32; at t = 2 sequence-parallel), compiled once per row."""
    import jax

    from dhp_jax.sharding.family_memory import compiled, modelled

    if (t, remat) not in _MOE_MEASURED:
        raw, degree, tokens = moe_raw_config(), 2, 4096
        got, params = compiled(raw, degree, tokens, jax.devices(), remat=remat, tensor_parallel=t,
                               sequence_parallel=t > 1)
        kw = dict(remat=remat, tensor_parallel=t, sequence_parallel=t > 1)
        cpu = modelled(raw, params, degree, tokens, cpu_terms=True, **kw)
        device = modelled(raw, params, degree, tokens, **kw)
        print(f"tiny qwen3_vl_moe degree {degree} x t={t}, {tokens} tokens, remat {remat}: compiled "
              f"{got / 1e6:.1f} MB, model {cpu / 1e6:.1f} MB with the CPU term ({cpu / got:.3f}), "
              f"{device / 1e6:.1f} MB without ({device / got:.3f})")
        _MOE_MEASURED[t, remat] = got, cpu, device
    return _MOE_MEASURED[t, remat]


@pytest.mark.parametrize("t,remat", MOE_ROWS)
def test_moe_program_bytes_match_the_memory_model(t, remat):
    """A MoE family's group program compiled for CPU devices (its grouped GEMM the blocked one,
    `moe.grouped_experts`) is priced by the model with its named XLA:CPU term
    (`cpu_grouped_gemm_padding`) within the family rows' 10 % of its compiled bytes; the
    accelerator's figure (no CPU term) is the smaller."""
    got, cpu, device = _moe_row(t, remat)
    assert device < cpu
    assert abs(cpu / got - 1.0) <= TOLERANCE, (got, cpu)


@pytest.mark.parametrize("t,remat", MOE_ROWS)
def test_moe_program_bytes_are_never_under_priced(t, remat):
    """The same rows at 1.00-1.10: never under the compiled bytes."""
    got, cpu, _ = _moe_row(t, remat)
    assert 1.0 <= cpu / got <= 1.0 + TOLERANCE, (got, cpu)


def test_moe_chunked_layer_prices_the_routed_rows():
    """With linear chunks the sparse MLP still runs on the whole rows (`layers.moe_decoder_block`,
    outside the chunks' VJP): a sparse layer's block keeps or holds its routed rows
    (`moe_routed_rows`) and the router's values on top of a chunked dense layer's."""
    from dhp_jax.planner.cost import memory
    from dhp_jax.sharding.family_memory import model_shape

    m = model_shape(moe_raw_config(), 1)
    for remat in ("none", "layer"):
        kept, rows = memory.moe_routed_rows(m, remat)
        dense = memory._family_block(m, False, remat, True)
        sparse = memory._family_block(m, False, remat, True, sparse=True)
        router = 2 * m.experts + 2 * m.experts_per_token if remat == "none" else 0
        assert sparse[0] - dense[0] == kept + router and sparse[1] - dense[1] == rows > 0, (remat, sparse, dense)
