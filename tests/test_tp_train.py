"""Training with tensor and sequence parallelism (`parallel.tensor=2`, `parallel.sequence=true`) on 8
fake CPU devices as 4 ranks of 2,
against the same run at t = 1 on 4 devices replaying the t = 2 run's plans: the state is tp-sharded (each
device holds and reduces only its share, `dhp_jax.sharding.tensor_parallel.TensorLayout`), the copies of
replicated leaves stay equal under AdamW, the clipped global norm
counts each parameter once, and a t = 2 run stopped and resumed from its checkpoint continues it;
its state converts to t = 1 on 4 devices and to t = 2 on 4 through the params tree, params and
AdamW's moments (`dhp_jax.train.checkpoint`; a t = 1 checkpoint resumed at t = 2 runs in
`tests/test_multiprocess_jax.py`, in two processes).
Clipping is on at every step (clip_norm below the gradient norm), so a norm that counted a copy
twice would change every update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dhp_jax.model import MLLMConfig
from dhp_jax.sharding import PlanExecutor
from dhp_jax.train.checkpoint import CheckpointError, Checkpointer
from dhp_jax.train.train_config import load_config
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
    # the t = 2 run plans live (its planner splits the heads a device holds, C.num_heads // 2), is
    # stopped and resumed; the t = 1 run replays its plans (a Ulysses size that divides the heads of
    # a t = 2 device divides those of a t = 1 device; the other way round the replay is refused at
    # load, test_plan_file_of_another_t_is_refused_at_load)
    one = PlanExecutor(C, jax.devices()[:4], min_bucket=512)
    two = PlanExecutor(C, jax.devices(), min_bucket=512, tensor_parallel=2, sequence_parallel=True)
    # each device holds its share: about half the params (the norms, the patch embedding and the
    # projector are held by both devices of a rank, the vocab's last window overlaps)
    assert two.layout.row < 0.6 * one.layout.padded and two.layout.padded == 2 * two.layout.row
    cfg = _config(tmp_path, "t2", "planner.strategy=dhp", "parallel.tensor=2", "parallel.sequence=true",
                  "checkpoint.every=2")
    first = Trainer(cfg, executor=two).run(stop_after=2)
    second = Trainer(cfg, executor=two).run(resume=True)
    replay = f"planner.plan_file={tmp_path / 't2' / 'plans.jsonl'}"
    base = Trainer(_config(tmp_path, "t1", replay, "checkpoint.every=2"), executor=one).run()
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
    # the torch backend's reader joins the t = 2 checkpoint's shares from its layout record alone
    from npu_backend.weights import flatten_tree, load_jax_checkpoint
    read = flatten_tree(load_jax_checkpoint(tmp_path / "t2").params)
    for path, a in jax.tree.flatten_with_path(got)[0]:
        np.testing.assert_array_equal(read[jax.tree_util.keystr(path, simple=True, separator="/")], np.asarray(a))
    # the state is the tp layout's master vector, 1/8 per device; the copies of a replicated
    # leaf are still equal after 3 AdamW steps
    params = second.state.params
    assert params.shape == (two.layout.padded,) and params.sharding == two.sharded
    assert {s.data.shape for s in params.addressable_shards} == {(two.layout.padded // 8,)}
    rows = np.asarray(two.layout.rows(params))
    shares = [two.layout.local.unravel(rows[i]) for i in range(2)]
    np.testing.assert_array_equal(shares[0]["final_norm"]["scale"], shares[1]["final_norm"]["scale"])
    np.testing.assert_array_equal(shares[0]["proj_fc1"]["kernel"], shares[1]["proj_fc1"]["kernel"])

    # the layout alone: the t = 2 master on 8 devices as t = 1 on 4 and as t = 2 on 4 (other t,
    # other rank count) holds the same tree, for the params and for AdamW's moments (what a
    # resume at another t converts, `dhp_jax.train.checkpoint`; a resume of t = 1 at t = 2 runs in
    # tests/test_multiprocess_jax.py)
    from dhp_jax.train.checkpoint import convert
    cpu0 = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for record in ({"tensor_parallel": 1, "num_shards": 4}, {"tensor_parallel": 2, "num_shards": 4}):
        dst = two.layout_for(record)
        for vector in (params, second.state.opt_state[1][0].mu, second.state.opt_state[1][0].nu):
            x = convert(jax.device_put(vector, cpu0), two.layout, dst, cpu0)
            for a, b in zip(jax.tree.leaves(dst.unravel(x)), jax.tree.leaves(two.layout.unravel(vector))):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rows = np.asarray(two.layout.rows(second.state.opt_state[1][0].nu))
    shares = [two.layout.local.unravel(rows[i]) for i in range(2)]   # a replicated leaf's copies
    np.testing.assert_array_equal(shares[0]["final_norm"]["scale"], shares[1]["final_norm"]["scale"])

    # a t = 2 state whose copies of a replicated leaf disagree is refused, naming the leaf
    i = two.layout.paths.index("final_norm/scale")
    bad = np.asarray(params).copy()
    r, e = divmod(two.layout.local._offsets()[i], two.layout.shard_size)
    bad[(2 * r + 1) * two.layout.shard_size + e] += 1.0      # its copy in row 1 (device 2 r + 1's part)
    ck = Checkpointer(tmp_path / "bad")
    ck.save(1, {"params": jnp.asarray(bad)}, data_position=1, model_config={},
            extra={"layout": two.layout.record()})
    target = {"params": jax.ShapeDtypeStruct((one.layout.padded,), jnp.float32, sharding=one.sharded)}
    with pytest.raises(CheckpointError, match=r"copies of replicated parameters disagree.*params final_norm/scale"):
        ck.restore(target, {}, layout=one.layout, layouts=one.layout_for)
    ck.close()



def test_plan_file_of_another_t_is_refused_at_load(tmp_path):
    """A plan that gives a group Ulysses over 4 ranks runs at t = 1 (4 heads a device) but not at
    t = 2 (2 heads a device): replaying it at t = 2 is refused when the run starts, naming the file,
    the step, the group and the heads a device holds, before anything is compiled."""
    from dhp_jax.planner import Group, MicroBatch, Plan
    from dhp_jax.train.plans import PlanFileError
    from dhp_jax.train.trainer import prepare_run

    assert C.num_heads == 4
    plan = Plan(4, (MicroBatch((Group((0, 1, 2, 3), 4, tuple(range(8)), attention="ulysses"),)),))
    path = tmp_path / "plans.json"
    path.write_text(plan.to_json())
    ok = prepare_run(_config(tmp_path, "t1", f"planner.plan_file={path}"), devices=jax.devices()[:4])
    assert ok.plan_source(0, ok.pipeline.batch(0)).groups[0].attention == "ulysses"
    with pytest.raises(PlanFileError, match=r"plans.json', plan 1 \(step 1\): micro-batch 0 group.*'ulysses' splits "
                                            r"2 heads over 4 ranks.*4 query heads over parallel.tensor=2 device\(s\) "
                                            r"a rank: 2 a device"):
        prepare_run(_config(tmp_path, "t2", f"planner.plan_file={path}", "parallel.tensor=2"))
