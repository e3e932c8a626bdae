"""orbax checkpoints: round trip into the sharding, data position, model-config check, atomicity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dhp_jax.train.checkpoint import CheckpointError, Checkpointer
from dhp_jax.train.train_config import OptimConfig
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


@pytest.mark.parametrize("family", [None, "qwen2_5_vl"])
def test_torch_reader_joins_tp_records_from_the_copies_it_must_read(family):
    """`npu_backend.relayout.unravel_record` (the torch backend's reader of a `dhp train`
    checkpoint, no model config) rebuilds the whole tree from master vectors written at t = 1, 2
    and 4, for a vocabulary that t does not split (255: the last window overlaps the one before
    it) and a single kv head (a shared leaf, on t processes). Every copy the reader must not read
    (the non-owner's rows of an overlapping vocab window, the later holders of a kv head, the
    copies of a replicated leaf past tp index 0, the padding; `TensorLayout.count_once`) is
    overwritten with garbage first, so reading one shows. The family case adds fused leaves
    (Qwen's vision qkv) and a tied embedding."""
    import json

    from dhp_jax.model.mllm_config import MLLMConfig
    from dhp_jax.model.mllm import init_params
    from dhp_jax.sharding.flat import FlatLayout
    from dhp_jax.sharding.tensor_parallel import TensorLayout
    from npu_backend.relayout import unravel_record

    if family is None:
        config = MLLMConfig(vocab_size=255, num_kv_heads=1, vision_heads=4)
        shapes = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))     # no init: 5 s less
        g = np.random.default_rng(0)
        params = jax.tree.map(lambda x: g.standard_normal(x.shape).astype(np.float32), shapes)
    else:
        from dhp_jax.model import hf
        from dhp_jax.model.hf.init import random_params, tiny_config

        raw = tiny_config(family, {"image": 1, "video": 2, "vision_start": 3, "vision_end": 4}, 255)
        raw["text_config"].update(num_key_value_heads=1, tie_word_embeddings=True)
        raw["tie_word_embeddings"] = True
        raw["vision_config"]["num_heads"] = 4           # 1 vision head a device at t = 4
        config = hf.parse_config(raw)
        params = random_params(config, 5)
    want = {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v)
            for p, v in jax.tree.flatten_with_path(params)[0]}
    kinds = set()
    for t in (1, 2, 4):
        layout = FlatLayout.of(params, 2) if t == 1 else TensorLayout(config, params, t, 2)
        flat = np.asarray(layout.ravel(params))
        if t > 1:
            kinds |= {k for _, k, _, _ in layout.record()["split"]}
            once = np.asarray(layout.count_once())
            assert 0 < (~once).sum() < flat.size
            flat = np.where(once, flat, 1e3 + np.arange(flat.size, dtype=np.float32))
        record = json.loads(json.dumps(layout.record()))        # as a checkpoint stores it
        got = unravel_record(flat, record)
        assert list(got) == list(want)
        for path, v in want.items():
            np.testing.assert_array_equal(got[path], v, err_msg=f"t={t}: {path}")
    assert {"vocab", "shared", "replicated", "split"} <= kinds
    if family is not None:
        assert "fused" in kinds
