"""Training with tensor and sequence parallelism (`parallel.tensor=2`, `parallel.sequence=true`) on 8
fake CPU devices as 4 ranks of 2,
against the same run at t = 1 on 4 devices replaying its plans: the state is tp-sharded (each
device holds and reduces only its share, `dhp_jax.sharding.tensor.TensorLayout`), the copies of
replicated leaves stay equal under AdamW, the clipped global norm
counts each parameter once, and a t = 2 run stopped and resumed from its checkpoint continues it.
Clipping is on at every step (clip_norm below the gradient norm), so a norm that counted a copy
twice would change every update."""

import jax
import numpy as np
import pytest

from dhp_jax.model import MLLMConfig
from dhp_jax.sharding import PlanExecutor
from dhp_jax.train.checkpoint import CheckpointError
from dhp_jax.train.config import load_config
from dhp_jax.train.metrics import read_jsonl
from dhp_jax.train.trainer import Trainer

C = MLLMConfig.preset("tiny")


def _config(tmp_path, name, *extra):
    return load_config(overrides=[   # the engine's stand-in model (the demo's default is a family model)
        "model=tiny", f"metrics.out_dir={tmp_path / name}", "metrics.progress=false", "data.batch_size=8",
        "data.max_tokens=48",
        "data.num_classes=4", "data.seed=17", "optim.learning_rate=0.01", "optim.warmup_steps=1",
        "optim.clip_norm=0.5", "compare.enabled=false", "num_ranks=4", "steps=3", *extra])


def test_t2_training_equals_t1_and_resumes(tmp_path):
    one = PlanExecutor(C, jax.devices()[:4], min_bucket=512)
    base = Trainer(_config(tmp_path, "t1", "planner.strategy=dhp"), executor=one).run()
    replay = f"planner.plan_file={tmp_path / 't1' / 'plans.jsonl'}"
    two = PlanExecutor(C, jax.devices(), min_bucket=512, tensor_parallel=2, sequence_parallel=True)
    # each device holds its share: about half the params (the norms, the patch embedding and the
    # projector are held by both devices of a rank, the vocab's last window overlaps)
    assert two.layout.row < 0.6 * one.layout.padded and two.layout.padded == 2 * two.layout.row
    cfg = _config(tmp_path, "t2", replay, "parallel.tensor=2", "parallel.sequence=true", "checkpoint.every=2")
    first = Trainer(cfg, executor=two).run(stop_after=2)
    second = Trainer(cfg, executor=two).run(resume=True)
    assert [r["step"] for r in first.records + second.records] == [1, 2, 3]
    rec1, rec2 = read_jsonl(tmp_path / "t1" / "metrics.jsonl"), read_jsonl(tmp_path / "t2" / "metrics.jsonl")
    norms = [[r["grad_norm"] for r in rec] for rec in (rec1, rec2)]
    assert min(norms[0]) > 0.5                     # clipping acted at every step
    np.testing.assert_allclose(norms[1], norms[0], rtol=1e-5)
    np.testing.assert_allclose(first.losses + second.losses, base.losses, rtol=1e-5)
    got, want = two.unshard(second.state.params), one.unshard(base.state.params)
    for (path, a), b in zip(jax.tree.flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
    # the state is the tp layout's master vector, 1/8 per device; the copies of a replicated
    # leaf are still equal after 3 AdamW steps
    params = second.state.params
    assert params.shape == (two.layout.padded,) and params.sharding == two.sharded
    assert {s.data.shape for s in params.addressable_shards} == {(two.layout.padded // 8,)}
    rows = np.asarray(two.layout.rows(params))
    shares = [two.layout.local.unravel(rows[i]) for i in range(2)]
    np.testing.assert_array_equal(shares[0]["final_norm"]["scale"], shares[1]["final_norm"]["scale"])
    np.testing.assert_array_equal(shares[0]["proj_fc1"]["kernel"], shares[1]["proj_fc1"]["kernel"])

    # the t = 2 checkpoint does not resume at t = 1 (another interleaving of the same parameters)
    with pytest.raises(CheckpointError, match="tensor_parallel=2 on 8 devices; this run has tensor_parallel=1 on 4"):
        Trainer(_config(tmp_path, "t2", replay), executor=one).run(resume=True)
