"""Ulysses and hybrid (Ulysses x ring) attention: values and gradients equal dense attention on the
zigzag packed layout; a DHP step whose micro-batches mix ring, Ulysses and hybrid groups equals
`reference_loss`; the compiled program exchanges the sequence by all-to-all (no all-gather of
activations) and its per-device temp memory at a fixed local length is flat in the degree."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dhp_jax.data import random_samples
from dhp_jax.geometry.layout import pack_group
from dhp_jax.model import MLLMConfig, init_params, reference_loss
from dhp_jax.model.attention import AttnIds, dense_attention
from dhp_jax.planner import Group, MicroBatch, Plan
from dhp_jax.planner.contract.kinds import attention_kinds, check_attention, head_plan
from dhp_jax.sharding import PlanExecutor
from dhp_jax.sharding.ring import local_attention
from dhp_jax.sharding.ulysses import ulysses_attention

C = MLLMConfig.preset("tiny")      # 4 query heads, 2 KV heads; vision encoder 2 heads
TOL = 1e-5


def _rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _case(degree: int, h: int, kvh: int, seed: int):
    lay = pack_group(random_samples(C, [19, 1, 30, 7], seed=seed), degree, C)
    rng = np.random.default_rng(seed)
    s, d = lay.bucket, 8
    q, k, v, ct = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                   for shape in ((s, h, d), (s, kvh, d), (s, kvh, d), (s, h, d)))
    ids = AttnIds(*(jnp.asarray(a) for a in (lay.segment_ids, lay.positions, lay.span_ids)))
    return lay, q, k, v, ct, ids


def _value_and_grads(f, q, k, v, ids, ct):
    """(out, (dq, dk, dv)) of f under the cotangent ct, in one compiled program."""
    @jax.jit
    def both(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, ids), q, k, v)
        return out, vjp(ct)

    return both(q, k, v)


@jax.jit
def _dense_value_and_grads(q, k, v, ids, ct):
    """The reference, one program per shape (the one-device kernel's case shares a shape)."""
    out, vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, ids, ids), q, k, v)
    return out, vjp(ct)


@pytest.mark.parametrize("u,r,h,kvh,devices", [
    (4, 1, 4, 2, (7, 0, 3, 1)),           # GQA: 2 KV heads repeated to 4 for 4 ranks
    (2, 2, 4, 1, (0, 1, 2, 3)),           # hybrid 2x2, one KV head
    (2, 3, 6, 2, (6, 1, 2, 3, 4, 5)),     # hybrid 2x3
    (4, 1, 2, 2, (0, 1, 2, 3)),           # 2 heads on 4 ranks: zero heads pad (the vision encoder's case)
])
def test_ulysses_and_hybrid_equal_dense(u, r, h, kvh, devices):
    lay, q, k, v, ct, ids = _case(u * r, h, kvh, seed=u * 10 + r)
    mesh = Mesh(np.array([jax.devices()[i] for i in devices]).reshape(r, u), ("cp", "sp"))
    spec = P(("cp", "sp"))

    def uly(q, k, v, ids):
        body = functools.partial(ulysses_attention, ulysses=u, ring=r)
        return jax.shard_map(lambda q, k, v, i: body(q, k, v, i, i), mesh=mesh, in_specs=spec,
                             out_specs=spec, check_vma=False)(q, k, v, ids)

    out, grads = _value_and_grads(uly, q, k, v, ids, ct)
    ref_out, ref_grads = _dense_value_and_grads(q, k, v, ids, ct)
    assert _rel(out, ref_out) <= TOL
    for name, a, b in zip("qkv", grads, ref_grads):
        assert _rel(a, b) <= TOL, f"d{name}"
    pad = lay.segment_ids == 0
    assert pad.any() and not np.any(np.asarray(out)[pad]), "padding queries must give zeros"


def test_local_attention_with_small_tiles_equals_dense_on_one_device():
    """The local kernel of a Ulysses group (the ring's tiled custom-VJP kernel on one device), with
    tiles smaller than a chunk and the 2u-chunk layout of a head-sharded stream."""
    _, q, k, v, ct, ids = _case(4, 4, 2, seed=3)
    fn = lambda q, k, v, i: local_attention(q, k, v, i, i, tile=q.shape[0] // 8, chunks=4)
    out, grads = _value_and_grads(fn, q, k, v, ids, ct)
    ref_out, ref_grads = _dense_value_and_grads(q, k, v, ids, ct)
    assert _rel(out, ref_out) <= TOL and max(_rel(a, b) for a, b in zip(grads, ref_grads)) <= TOL


def test_kinds_and_head_plan():
    assert attention_kinds(8, 4) == ["ring", "hybrid:2x4", "hybrid:4x2"]
    assert attention_kinds(8, 32, max_ulysses=8) == ["ring", "hybrid:2x4", "hybrid:4x2", "ulysses"]
    assert attention_kinds(6, 28) == ["ring", "hybrid:2x3"]
    assert check_attention("hybrid:2x3", 6, 4) == (2, 3)
    with pytest.raises(ValueError, match="4 query heads do not split over 3 Ulysses ranks"):
        check_attention("ulysses", 3, 4)
    with pytest.raises(ValueError, match="degree 6"):
        check_attention("hybrid:2x2", 6, 4)
    assert head_plan(4, 2, 4) == (4, 4) and head_plan(28, 4, 7) == (28, 28) and head_plan(32, 8, 4) == (32, 8)
    assert head_plan(2, 2, 4) == (4, 4)                   # padded with zero heads


def _attention_program(u: int, h: int, kvh: int, s_l: int):
    """fwd+bwd of Ulysses attention over u devices at local length s_l, compiled (tiles of s_l / 2
    tokens: the kernel's temporaries are one score tile, so a tile above the local length would
    measure the tile, not the layout)."""
    mesh = Mesh(np.array(jax.devices()[:u]).reshape(1, u), ("cp", "sp"))
    spec = P(("cp", "sp"))
    body = functools.partial(ulysses_attention, ulysses=u, ring=1, tile=s_l // 2)

    def loss(q, k, v, ids, ct):
        o = jax.shard_map(lambda q, k, v, i: body(q, k, v, i, i), mesh=mesh, in_specs=spec, out_specs=spec,
                          check_vma=False)(q, k, v, ids)
        return jnp.sum(o * ct)

    sh = NamedSharding(mesh, spec)
    s = u * s_l
    arr = lambda shape, dt=jnp.float32: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    args = (arr((s, h, 8)), arr((s, kvh, 8)), arr((s, kvh, 8)), AttnIds(*[arr((s,), jnp.int32)] * 3), arr((s, h, 8)))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()


def test_ulysses_memory_flat_in_degree_and_all_to_all_hlo():
    temps = {}
    for u in (2, 8):
        exe = _attention_program(u, h=8, kvh=2, s_l=128)
        temps[u] = exe.memory_analysis().temp_size_in_bytes
        hlo = exe.as_text()
        assert "all-to-all" in hlo
        # the only all-gathers are of the int32 token ids, never of activations
        gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)
        assert gathers and all(g.startswith(("s32", "(s32")) for g in gathers), gathers
    # fixed local length: a 4x larger stream on 4x the devices needs no more temp memory per device
    assert temps[8] <= 1.1 * temps[2], temps


# ----------------------------------------------------------------------------- whole DHP steps
# The two Ulysses groups (ranks out of order) run one executable: 72 and 71 tokens, one bucket.
MIXED = Plan(8, (
    MicroBatch((Group((2, 3), 2, (0, 1)), Group((1, 0), 2, (2, 3), attention="ulysses"),
                Group((4, 5, 6, 7), 4, (4, 5), attention="hybrid:2x2"))),
    MicroBatch((Group((1, 0), 2, (6, 7), attention="ulysses"),
                Group((2, 3, 4, 5, 6, 7), 6, (9,), attention="hybrid:2x3"))),
    # Ulysses size 4 > 2 KV heads: each KV head is repeated (GQA order) before the all-to-all, and
    # the vision encoder's 2 heads are padded to 4
    MicroBatch((Group((7, 6, 5, 4, 3, 2, 1, 0), 8, (8,), attention="hybrid:4x2"),)),
))


def test_mixed_kinds_step_matches_reference_and_group_hlo():
    params = init_params(C, jax.random.key(0))
    samples = random_samples(C, [37, 1, 22, 50, 64, 9, 30, 41, 45, 27], seed=0)
    ex = PlanExecutor(C)
    loss, grads = ex.loss_and_grads(params, samples, MIXED)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: reference_loss(C, p, samples)))(params)
    assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss))
    worst = {"/".join(map(str, k)): _rel(a, b) for (k, a), b in
             zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads))}
    assert max(worst.values()) <= TOL, max(worst.items(), key=lambda kv: kv[1])
    assert sorted(k[3] for k in ex.executable_keys) == ["hybrid:2x2", "hybrid:2x3", "hybrid:4x2", "ring", "ulysses"]
    d, b, ids, kind = next(k for k in ex.executable_keys if k[3] == "ulysses")
    hlo = ex.executable(params, d, b, tuple(jax.devices()[i] for i in ids), kind).as_text()
    assert "all-to-all" in hlo and "collective-permute" not in hlo
    assert all(g.startswith(("s32", "(s32")) for g in re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo))

    # the hybrid:2x2 program on other devices (3, 1, 0, 2: another 2-D (cp, sp) mesh) is loaded from
    # its compile above (`dhp_jax.sharding.rebind`): the device at each mesh position computes what
    # the device at that position of 4, 5, 6, 7 computes on the same inputs, to the last bit (that
    # it is what a compile for these devices builds: tests/test_sharding.py, on a ring)
    (w,) = [w for w in ex.prepare(samples, MIXED) if w.attention == "hybrid:2x2"]
    kind, n, flat = w.attention, len(ex.rebound_keys), ex.flat_params(params)
    devs = tuple(jax.devices()[i] for i in (3, 1, 0, 2))
    outs = []
    for ds in (w.devices, devs):
        view = ex._views(flat, {(ds, kind)})[(ds, kind)]
        mesh, spec = ex._mesh(ds, kind)
        outs.append(ex.executable(None, 4, w.layout.bucket, ds, kind)(
            view, *(jax.device_put(a, NamedSharding(mesh, spec)) for a in ex.model.inputs(w.layout))))
    assert len(ex.rebound_keys) == n + 1 and ex.rebound_keys[-1][2] == devs
    for here, there in zip(*outs):
        assert there.sharding.mesh.devices.shape == (2, 2)
        shards = [{s.device: (s.index, np.asarray(s.data)) for s in a.addressable_shards} for a in (here, there)]
        for a, b in zip(w.devices, devs):            # the same mesh position on either device set
            assert shards[0][a][0] == shards[1][b][0] and np.array_equal(shards[0][a][1], shards[1][b][1])
    assert np.asarray(outs[1][0])[:, 0].sum() > 0                # the loss sums are there


def test_every_attention_kind_has_a_builder_in_each_engine():
    """Adding a kind is one `AttentionKind` and one builder per engine: every kind of `KINDS` has
    the JAX engine's (`dhp_jax.sharding.attention`) and the torch engine's (`npu_backend.attention`),
    and a group runs the one of the kind that runs its shape (no dispatch on the shape elsewhere)."""
    import npu_backend.attention as torch_attention
    from dhp_jax.planner.contract.kinds import KINDS, resolve
    from dhp_jax.sharding import attention as jax_attention

    for kind in KINDS:
        assert callable(kind.builder(jax_attention.ENGINE)) and callable(kind.builder(torch_attention.ENGINE))
    with pytest.raises(LookupError, match="attention kind 'ring' has no builder for the tpu engine"):
        KINDS[0].builder("tpu")
    from dhp_jax.sharding.ulysses import ulysses_attention

    hybrid = jax_attention.attention_fn(resolve("hybrid:2x3", 6), tile=64)
    assert hybrid.func is ulysses_attention and (hybrid.keywords["ulysses"], hybrid.keywords["ring"]) == (2, 3)
    one = jax_attention.attention_fn(resolve("ulysses", 1))                 # runs as the ring
    assert getattr(one, "func", one) is not ulysses_attention
    custom = jax_attention.attention_fn(resolve("ring", 4), custom=lambda axis, d: ("mine", axis, d))
    assert custom == ("mine", "cp", 4)
