"""Pad skipping: a shard's padding tail goes through no linear layer (chunks with no real token
are skipped under `lax.cond`), and loss and gradients stay exact (fp32 1e-5 vs `reference_loss`)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dhp_jax.data import random_samples
from dhp_jax.geometry.layout import bucket_length, chunk_size, linear_tokens, pack_group
from dhp_jax.model import MLLMConfig, init_params, reference_loss
from dhp_jax.model.executed import counting
from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan
from dhp_jax.planner.cost.pricing import sample_terms
from dhp_jax.sharding import PlanExecutor

C = MLLMConfig.preset("tiny")
CHUNK = 16
LENGTHS = [37, 1, 22, 50, 9, 31, 17, 26]


def _plan(samples, groups):
    """A plan whose groups run `padded` slots (much more than their tokens: long padding tails)."""
    out = []
    for ranks, members, kind in groups:
        d = len(ranks)
        tokens = sum(samples[i].num_tokens for i in members)
        padded = bucket_length(tokens, d) + 2 * d * 24
        out.append(Group(tuple(ranks), d, tuple(members), attention=kind, tokens=tokens, padded_tokens=padded))
    return Plan(8, (MicroBatch(tuple(out)),))


# a ring and a Ulysses group (two executables with pad skipping on), long padding tails
GROUPS = [((0, 1, 2), (0, 1, 2, 4, 7), "ring"), ((3, 4), (3, 5, 6), "ulysses")]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _assert_exact(got, want, what):
    assert _rel(got[0], want[0]) <= 1e-5, (what, float(got[0]), float(want[0]))
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert _rel(a, b) <= 1e-5, (what, _rel(a, b))


@pytest.fixture(scope="module")
def setup():
    params = init_params(C, jax.random.key(0))
    samples = random_samples(C, LENGTHS, seed=21)
    ref = jax.jit(jax.value_and_grad(lambda p: reference_loss(C, p, samples)))(params)    # one program
    return params, samples, _plan(samples, GROUPS), ref


def test_pad_skipping_is_exact_and_runs_the_real_tokens_in_whole_chunks(setup):
    """Pad skipping on (ring and Ulysses groups) and off (one pass, one ring group): loss and grads
    equal `reference_loss` at fp32 1e-5. With it on, the chunks counted as they run
    (`executed.counting`: a host callback in the work of a live chunk, on every device; summed over
    ranks, groups and blocks) equal each rank's real tokens (its vision rows, for the vision
    encoder's blocks) in whole chunks: a chunk of padding never runs. Each live chunk ticks 4 times
    per block and step: its q/k/v projection and its MLP, forward, and both again in the backward
    pass (`_skippable`'s pullback recomputes the live branch). Switching the skip off (`lax.cond`
    replaced, or every chunk live) counts the padding chunks too."""
    params, samples, plan, ref = setup
    with counting() as counts:
        ex = PlanExecutor(C, linear_chunk=CHUNK)
        on = ex.loss_and_grads(params, samples, plan)
    _assert_exact(on, ref, "on")
    want = vision = 0
    for w in ex.prepare(samples, plan):
        lay, d = w.layout, w.layout.degree
        shard = lay.bucket // d
        c = chunk_size(shard, CHUNK)
        real = [math.ceil(r / c) for r in lay.real_per_shard]
        want += sum(real)
        vision += sum(math.ceil(int(lay.vision_mask[i * shard:(i + 1) * shard].sum()) / c) for i in range(d))
        assert sum(real) < d * math.ceil(shard / c)        # this plan has padding chunks to skip
        # what the cost model prices: the busiest shard's chunks
        assert linear_tokens(lay.num_tokens, lay.bucket, d, CHUNK) == max(real) * c
        assert linear_tokens([lay.num_tokens], [lay.bucket], [d], CHUNK).tolist() == [max(real) * c]
    assert vision > 0
    assert counts["linear_chunks"] == 4 * (C.num_layers * want + C.vision_layers * vision), (want, vision)
    off = PlanExecutor(C, linear_chunk=0).loss_and_grads(params, samples, _plan(samples, [((0, 1, 2), range(8), "ring")]))
    _assert_exact(off, ref, "off")
    _assert_exact(on, off, "on vs off")


def test_group_program_has_the_chunk_conditionals(setup):
    params, samples, plan, _ = setup
    conds = {}
    for chunk in (0, CHUNK):
        ex = PlanExecutor(C, linear_chunk=chunk)
        d, b, ids, kind = ex.plan_keys(samples, plan)[0]
        hlo = ex.lower(d, b, tuple(jax.devices()[i] for i in ids), kind).as_text()
        conds[chunk] = hlo.count("stablehlo.case") + hlo.count("stablehlo.if")
    # the ring's tile pairs are conditional either way; the chunks add their own (q/k/v and the
    # MLP, forward and backward, per block stack)
    assert conds[CHUNK] >= conds[0] + 4, conds


def test_linear_chunk_is_checked():
    with pytest.raises(ValueError, match="linear_chunk"):
        PlanExecutor(C, linear_chunk=-1)
    with pytest.raises(ValueError, match="linear_chunk"):
        MLLMConfig.preset("tiny", linear_chunk=1.5)


def test_skipped_chunks_are_never_computed():
    """NaN in the rows of dead chunks: the full pass lets them into the real rows (0 * NaN in the
    attention's p @ v), the chunked pass never reads them, forward or backward."""
    from dhp_jax.model.attention import AttnIds, dense_attention
    from dhp_jax.model.mllm import Block, block_apply

    p = init_params(C, jax.random.key(0))["layers_0"]
    s, real, chunk = 64, 21, 8                       # chunks 0-2 live, 3-7 dead
    ids = AttnIds(jnp.asarray((np.arange(s) < real).astype(np.int32)), jnp.arange(s, dtype=jnp.int32),
                  jnp.zeros(s, jnp.int32))
    x = np.random.default_rng(0).normal(size=(s, C.d_model)).astype(np.float32)
    x[3 * chunk:] = np.nan
    blk = Block(C.num_heads, C.num_kv_heads, C.head_dim, C.d_ff, C.rope_base, C.rms_eps, dense_attention)

    clean = x.copy()
    clean[3 * chunk:] = 0.0                          # and the real rows are the unchunked block's

    def real_sum(params, x, c):
        return jnp.sum(block_apply(params, x, ids, blk, c)[:real])

    @jax.jit        # everything in one program (eager, every op compiles on its own)
    def run(params, x, clean):
        return (real_sum(params, x, 0), jax.value_and_grad(real_sum)(params, x, chunk),
                block_apply(params, x, ids, blk, chunk)[:real], block_apply(params, clean, ids, blk, 0)[:real])

    full, (value, grads), got, want = run(p, jnp.asarray(x), jnp.asarray(clean))
    assert not np.isfinite(float(full))
    assert np.isfinite(float(value)) and all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_chunk_loops_keep_the_weights_as_loop_constants():
    """The chunk loops' autodiff must not stack a block's weights once per chunk (a bare `lax.cond`
    does: its forwarded operands become per-iteration residuals; internvl3-8b at 64k tokens compiled
    29 GB larger): with 32 chunks per shard, the chunked group program is about as large as the
    one-pass one."""
    devices = jax.devices()
    sizes = {}
    for chunk in (0, 8):
        ex = PlanExecutor(C, devices, linear_chunk=chunk)
        m = ex.lower(2, 512, tuple(devices[:2])).compile().memory_analysis()
        sizes[chunk] = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    assert sizes[8] <= 1.2 * sizes[0], sizes


def test_vision_encoder_computes_its_vision_rows_in_whole_chunks(monkeypatch):
    """On a layout that mixes text and vision inside chunks, the vision encoder's blocks compute,
    on each rank, that rank's vision rows rounded up to whole chunks (`vision_first`): no chunk
    that a vision span starts or ends in drags its text rows in. The cost model prices the same
    vision tokens (sqrt(eta) L per sample, one span each), split over the ranks: the executor
    computes at most one partly filled chunk more per rank."""
    from dhp_jax.model import mllm
    from dhp_jax.planner.cost.model import CostModel

    config = MLLMConfig.preset("tiny", linear_chunk=CHUNK)
    params = init_params(config, jax.random.key(0))
    samples = random_samples(config, [37, 22, 50, 31, 26, 45, 19], seed=3, kinds=("text", "image", "video"))
    assert all(len(s.vision_spans) <= 1 for s in samples) and any(s.vision_tokens for s in samples)
    d = 2
    lay = pack_group(samples, d, config, bucket=bucket_length(sum(s.num_tokens for s in samples), d) + 2 * d * 24)
    shard = lay.bucket // d
    c = chunk_size(shard, CHUNK)
    seen = []
    real_live = mllm.live_chunks
    monkeypatch.setattr(mllm, "live_chunks", lambda seg, chunk, *t: seen.append(real_live(seg, chunk, *t)) or seen[-1])
    rows, scattered = [], []
    for i in range(d):     # the model the executor runs, on each rank's shard (eager: the predicate's values)
        batch = {k: jnp.asarray(v[i * shard:(i + 1) * shard]) for k, v in lay.arrays().items()}
        batch["vision_mask"] = batch["vision_mask"].astype(bool)
        seen.clear()
        mllm.apply_model(config, params, batch)
        vision_calls = seen[:config.vision_layers]          # the vision blocks run first
        assert all(np.array_equal(a, vision_calls[0]) for a in vision_calls)
        rows.append(int(np.sum(vision_calls[0])) * c)
        scattered.append(int(np.sum(real_live(batch["frame_ids"], CHUNK))))
        vision = int(np.sum(lay.vision_mask[i * shard:(i + 1) * shard]))
        assert rows[-1] == math.ceil(vision / c) * c, (i, rows[-1], vision, c)
    assert sum(scattered) * c > sum(rows)      # the layout's order would have computed mixed chunks
    etas = [s.bidirectional_share for s in samples]
    cost = CostModel.preset("internvl3-2b", "cpu")
    _, lin, L = sample_terms(cost, [s.num_tokens for s in samples], etas)
    priced = float(np.sum(lin - cost.a2 * L)) / cost.a2_vision    # the vision tokens the cost model prices
    assert priced == pytest.approx(int(lay.vision_mask.sum()), rel=1e-12)
    assert 0 <= sum(rows) - priced < d * c
