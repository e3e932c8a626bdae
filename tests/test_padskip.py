"""Pad skipping: a shard's padding tail goes through no linear layer (chunks with no real token
are skipped under `lax.cond`), and loss and gradients stay exact (fp32 1e-5 vs `reference_loss`)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dhp_jax.data import random_samples
from dhp_jax.data.layout import bucket_length, chunk_size, linear_tokens, pack_group
from dhp_jax.model import MLLMConfig, init_params, reference_loss
from dhp_jax.model.mllm import live_chunks
from dhp_jax.planner.plan import Group, MicroBatch, Plan
from dhp_jax.sharding import PlanExecutor
from dhp_jax.sharding.mesh import CP_AXIS

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


GROUPS = [((0, 1, 2), (0, 1, 2, 4), "ring"), ((3, 4), (3, 5), "ulysses"), ((5, 6, 7), (6, 7), "ring")]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.fixture(scope="module")
def setup():
    params = init_params(C, jax.random.key(0))
    samples = random_samples(C, LENGTHS, seed=21)
    ref = jax.value_and_grad(lambda p: reference_loss(C, p, samples))(params)
    return params, samples, _plan(samples, GROUPS), ref


def test_pad_skipping_on_and_off_give_the_same_exact_loss_and_grads(setup):
    params, samples, plan, (ref_loss, ref_grads) = setup
    got = {}
    for chunk in (0, CHUNK):
        ex = PlanExecutor(C, linear_chunk=chunk)
        loss, grads = ex.loss_and_grads(params, samples, plan)
        assert _rel(loss, ref_loss) <= 1e-5, (chunk, float(loss), float(ref_loss))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            assert _rel(a, b) <= 1e-5, (chunk, _rel(a, b))
        got[chunk] = (loss, grads)
    assert _rel(got[CHUNK][0], got[0][0]) <= 1e-5
    for a, b in zip(jax.tree.leaves(got[CHUNK][1]), jax.tree.leaves(got[0][1])):
        assert _rel(a, b) <= 1e-5


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


def test_computed_chunks_per_rank_are_ceil_of_real_tokens(setup):
    _, samples, plan, _ = setup
    ex = PlanExecutor(C, linear_chunk=CHUNK)
    for w in ex.prepare(samples, plan):
        lay, d = w.layout, w.layout.degree
        mesh = jax.make_mesh((d,), (CP_AXIS,), devices=jax.devices()[:d])
        # the predicate `block_apply` branches on, evaluated on each rank's shard of the stream
        seg = jax.device_put(lay.segment_ids, NamedSharding(mesh, P(CP_AXIS)))
        count = jax.jit(jax.shard_map(lambda s: jnp.sum(live_chunks(s, CHUNK))[None], mesh=mesh,
                                      in_specs=P(CP_AXIS), out_specs=P(CP_AXIS)))(seg)
        c = chunk_size(lay.bucket // d, CHUNK)
        want = [math.ceil(r / c) for r in lay.real_per_shard]
        assert np.asarray(count).tolist() == want
        assert sum(want) < d * math.ceil(lay.bucket // d / c)    # padding chunks were skipped
        # what the cost model prices: the busiest shard's chunks
        assert linear_tokens(lay.num_tokens, lay.bucket, d, CHUNK) == max(want) * c
        assert linear_tokens([lay.num_tokens], [lay.bucket], [d], CHUNK).tolist() == [max(want) * c]


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

    def real_sum(params, c):
        return jnp.sum(block_apply(params, jnp.asarray(x), ids, blk, c)[:real])

    assert not np.isfinite(float(real_sum(p, 0)))
    value, grads = jax.value_and_grad(real_sum)(p, chunk)
    assert np.isfinite(float(value)) and all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    clean = x.copy()
    clean[3 * chunk:] = 0.0                          # and the real rows are the unchunked block's
    want = block_apply(p, jnp.asarray(clean), ids, blk, 0)[:real]
    np.testing.assert_allclose(block_apply(p, jnp.asarray(x), ids, blk, chunk)[:real], want, rtol=1e-5, atol=1e-6)


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
