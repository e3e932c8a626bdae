"""Ring attention alone: values and gradients equal dense attention for degrees 1, 3 and 5 on
zigzag-ordered packed ids (several samples, vision spans, padding)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from dhp_jax.data import random_samples
from dhp_jax.data.layout import pack_group
from dhp_jax.model import MLLMConfig
from dhp_jax.model.attention import AttnIds, dense_attention
from dhp_jax.sharding.ring import ring_attention

C = MLLMConfig.preset("tiny")


@pytest.mark.parametrize("degree,devices", [(1, (4,)), (3, (2, 7, 0)), (5, (1, 2, 3, 4, 5))])
def test_ring_equals_dense_values_and_grads(degree, devices):
    lay = pack_group(random_samples(C, [19, 1, 30, 7], seed=degree), degree, C)
    s, h, kvh, d = lay.bucket, 4, 2, 8
    rng = np.random.default_rng(degree)
    q, k, v, ct = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                   for shape in ((s, h, d), (s, kvh, d), (s, kvh, d), (s, h, d)))
    ids = AttnIds(*(jnp.asarray(a) for a in (lay.segment_ids, lay.positions, lay.span_ids)))
    mesh = Mesh(np.array([jax.devices()[i] for i in devices]), ("cp",))

    def ring(q, k, v, ids):
        body = functools.partial(ring_attention, axis_name="cp", degree=degree)
        return jax.shard_map(lambda q, k, v, i: body(q, k, v, i, i), mesh=mesh,
                             in_specs=P("cp"), out_specs=P("cp"), check_vma=False)(q, k, v, ids)

    def dense(q, k, v, ids):
        return dense_attention(q, k, v, ids, ids)

    loss = lambda f: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v, ids) * ct), argnums=(0, 1, 2)))
    (lr, gr), (ld, gd) = loss(ring)(q, k, v), loss(dense)(q, k, v)
    assert abs(float(lr) - float(ld)) <= 1e-5 * abs(float(ld))
    for a, b in zip(gr, gd):
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b))
    out = np.asarray(jax.jit(ring)(q, k, v, ids))
    pad = lay.segment_ids == 0
    assert pad.any() and not np.any(out[pad]), "padding queries must give zeros"
