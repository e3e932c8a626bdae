"""orbax checkpoints: round trip into the sharding, data position, model-config check, atomicity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dhp_jax.train.checkpoint import CheckpointError, Checkpointer
from dhp_jax.train.config import OptimConfig
from dhp_jax.train.state import create_state, make_optimizer, make_update


@pytest.fixture(scope="module")
def replicated():
    return NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P())


def _init(key):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (6, 5)), "b": jax.random.normal(k2, (5,))}


def _state(replicated, steps=10):
    opt = make_optimizer(OptimConfig(learning_rate=0.1, warmup_steps=0), steps)
    state = create_state(_init, opt, seed=3, sharding=replicated)
    return opt, state


def test_update_matches_hand_written_adamw(replicated):
    cfg = OptimConfig(learning_rate=0.1, warmup_steps=0, weight_decay=0.01, clip_norm=1.0, b1=0.9, b2=0.95)
    opt = make_optimizer(cfg, 10)
    state = create_state(_init, opt, seed=3, sharding=replicated)
    p0 = jax.tree.map(lambda x: np.array(x, copy=True), state.params)
    grads = jax.device_put({"w": jnp.full((6, 5), 0.3), "b": jnp.arange(5.0)}, replicated)
    g = jax.tree.map(lambda x: np.array(x, copy=True), grads)
    update = make_update(opt, replicated, state)
    new, gnorm = update(state, grads)
    # independent reference: clip by global norm, one AdamW step with bias correction
    norm = np.sqrt(sum((x.astype(np.float64) ** 2).sum() for x in g.values()))
    assert float(gnorm) == pytest.approx(norm, rel=1e-6)
    scale = min(1.0, 1.0 / norm)
    lr = 0.1  # cosine at step 0 with no warm-up is the peak
    for k in p0:
        gk = g[k] * scale
        m, v = (1 - 0.9) * gk / (1 - 0.9), (1 - 0.95) * gk ** 2 / (1 - 0.95)
        want = p0[k] - lr * (m / (np.sqrt(v) + 1e-8) + 0.01 * p0[k])
        np.testing.assert_allclose(np.asarray(new.params[k]), want, rtol=1e-5, atol=1e-6)
    assert int(new.step) == 1
    assert new.params["w"].sharding == replicated
    assert state.params["w"].is_deleted()  # the old state was donated


def test_round_trip_restores_state_sharding_and_position(tmp_path, replicated):
    opt, state = _state(replicated)
    ck = Checkpointer(tmp_path / "ck", every=2, keep=2)
    ck.save(4, state, data_position=4, model_config={"name": "tiny", "d_model": 32})
    fresh = create_state(lambda k: jax.tree.map(jnp.zeros_like, _init(k)), opt, seed=9, sharding=replicated)
    r = ck.restore(fresh, {"name": "tiny", "d_model": 32})
    assert r.step == 4 and r.data_position == 4
    for a, b in zip(jax.tree.leaves(r.state), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert r.state.params["w"].sharding == replicated
    ck.close()


def test_different_model_config_is_refused_before_reading_arrays(tmp_path, replicated):
    _, state = _state(replicated)
    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, state, data_position=1, model_config={"name": "tiny", "d_model": 32})
    with pytest.raises(CheckpointError, match=r"different model config \(d_model: checkpoint 32 vs run 64\)"):
        ck.restore(state, {"name": "tiny", "d_model": 64})
    ck.close()


def test_keep_last_and_ignore_unfinished(tmp_path, replicated):
    _, state = _state(replicated)
    ck = Checkpointer(tmp_path / "ck", every=1, keep=2)
    for s in (1, 2, 3):
        ck.save(s, state, data_position=s, model_config={})
    ck.close()
    # a save interrupted mid-write leaves only a temporary directory: it must never become "latest"
    (tmp_path / "ck" / "7.orbax-checkpoint-tmp-123").mkdir()
    ck2 = Checkpointer(tmp_path / "ck", every=1, keep=2)
    assert ck2.latest_step() == 3
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.isdigit()) == ["2", "3"]
    ck2.close()


def test_no_checkpoint_is_a_clear_error(tmp_path):
    ck = Checkpointer(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        ck.read_meta()
    ck.close()


def test_clear_removes_every_step(tmp_path, replicated):
    _, state = _state(replicated)
    ck = Checkpointer(tmp_path / "ck", every=1, keep=3)
    for s in (1, 2):
        ck.save(s, state, data_position=s, model_config={})
    assert ck.clear() == [1, 2] and ck.latest_step() is None
    ck.save(1, state, data_position=1, model_config={})  # the step number can be written again
    assert ck.latest_step() == 1
    ck.close()


def test_flat_state_is_re_padded_for_another_rank_count_and_other_leaves_are_named(tmp_path):
    """A flat state saved padded for 3 shards is read into the padding of 8 (and back): the same P
    values, a zero tail; a layout with other leaves is refused naming them."""
    from dhp_jax.sharding.flat import FlatLayout

    def shard(n):
        return NamedSharding(Mesh(np.array(jax.devices()[:n]), ("dp",)), P("dp"))

    tree = {"a": jnp.arange(1.0, 8.0).reshape(7, 1), "b": {"c": jnp.arange(10.0, 16.0)}}   # P = 13
    three, eight = FlatLayout.of(tree, 3), FlatLayout.of(tree, 8)
    assert (three.padded, eight.padded) == (15, 16)
    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, {"x": jax.device_put(three.ravel(tree), shard(3))}, data_position=1, model_config={},
            extra={"layout": three.record()})
    target = {"x": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=shard(8))}
    got = ck.restore(target, {}, layout=eight.record()).state["x"]
    assert got.sharding == shard(8)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(eight.ravel(tree)))
    with pytest.raises(CheckpointError, match="does not match this run's train state"):
        ck.restore(target, {})                       # without the run's layout: no re-padding
    other = FlatLayout.of({"a": tree["a"], "b": {"c": jnp.zeros(5)}, "d": jnp.zeros(2)}, 8).record()
    with pytest.raises(CheckpointError, match=r"holds other parameters than this run's model \(13 vs 14 values; "
                                              r"b/c: checkpoint \[6\] float32 vs run \[5\] float32; d only in the run\)"):
        ck.restore(target, {}, layout=other)
    ck.close()
