"""End-to-end trainer runs on 8 fake CPU devices: the loss falls, resume equals uninterrupted, bad input.

One executor is shared by the module (its compiled group programs are reused) and its minimum
bucket is large, so that every group of these small batches lands in one bucket per degree:
the tests pay for few compiles on the shared CPU. The data seed is one whose plans need few group
executables over the whole module (13 on 8 and 6 ranks, against 16 for seed 0) while the DHP run
keeps groups of degree 3 and 6.
"""

import json

import jax
import numpy as np
import pytest

from dhp_jax.model import MLLMConfig
from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan
from dhp_jax.planner.cost.pricing import group_time
from dhp_jax.train.checkpoint import CheckpointError, Checkpointer
from dhp_jax.train.train_config import load_config
from dhp_jax.train.metrics import read_jsonl
from dhp_jax.train.plans import PlanFileError
from dhp_jax.train.trainer import Trainer, TrainError

BATCH = 8


@pytest.fixture(scope="module")
def executor():
    from dhp_jax.sharding import PlanExecutor

    return PlanExecutor(MLLMConfig.preset("tiny"), jax.devices(), min_bucket=512)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, executor):
    """The uninterrupted 6-step DHP run (run directory, result): its loss falls, and the resume tests
    compare with it."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return out / "full", Trainer(_config(out, "full", "steps=6", "planner.strategy=dhp"), executor=executor).run()


def _config(tmp_path, name, *extra):
    return load_config(overrides=[   # the engine's stand-in model (the demo's default is a family model)
        "model=tiny", f"metrics.out_dir={tmp_path / name}", "metrics.progress=false", f"data.batch_size={BATCH}",
        "data.max_tokens=48", "data.num_classes=4", "data.seed=17", "optim.learning_rate=0.01", "optim.warmup_steps=1",
        "compare.enabled=false", *extra])


def test_short_dhp_run_loss_falls(full_run):
    run_dir, result = full_run
    losses = result.losses
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.3, losses
    recs = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 7))
    for r in recs:
        assert {"loss", "tokens", "step_time_s", "plan_wait_s", "degrees", "num_compiles"} <= set(r)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["loss_last"] == pytest.approx(losses[-1])
    assert summary["plan_wait_median_s"] < 0.05  # planning hidden behind the steps (loose)


def test_resume_equals_uninterrupted_and_plans_replay(tmp_path, executor, full_run):
    # the same data and planner as the DHP run above: its plans, so its compiled programs
    full_dir, full = full_run
    # the interrupted run replays the full run's plans.jsonl, is stopped after 3 steps, then resumed
    replay = full_dir / "plans.jsonl"
    cfg = _config(tmp_path, "cut", "steps=6", f"planner.plan_file={replay}", "checkpoint.every=2")
    first = Trainer(cfg, executor=executor).run(stop_after=3)
    assert Checkpointer(tmp_path / "cut" / "checkpoints").latest_step() == 3
    second = Trainer(cfg, executor=executor).run(resume=True)
    assert [r["step"] for r in second.records] == [4, 5, 6]
    assert first.losses + second.losses == full.losses  # bitwise: same programs, same inputs
    for a, b in zip(jax.tree.leaves(full.state), jax.tree.leaves(second.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the state (master params, both Adam moments) is sharded over the 8 ranks, restored ones too
    flat = [x for x in jax.tree.leaves(second.state) if x.shape == (executor.layout.padded,)]
    assert len(flat) == 3
    for x in flat:
        assert x.dtype == np.float32 and x.sharding == executor.sharded
        assert {s.data.shape for s in x.addressable_shards} == {(executor.layout.padded // 8,)}
    assert [r["step"] for r in read_jsonl(tmp_path / "cut" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def _torch_loss(run_dir, batch):
    """The loss of `batch` under the params of the latest checkpoint of `run_dir`, read without
    jax by the torch backend, on a world of one process (all samples in one group)."""
    import torch.distributed as dist

    from npu_backend.executor import TorchPlanExecutor
    from npu_backend.model import TorchMLLM
    from npu_backend.weights import load_flax_params, load_jax_checkpoint

    ck = load_jax_checkpoint(run_dir)
    model = TorchMLLM(MLLMConfig.preset("tiny"))
    load_flax_params(model, ck.params)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plan = Plan(1, (MicroBatch((Group((0,), 1, tuple(range(len(batch.samples)))),)),))
        loss, _, _ = TorchPlanExecutor(model).loss_and_grads(plan, batch.samples)
    finally:
        dist.destroy_process_group()
    return ck, float(loss)


def test_resume_on_other_device_counts_and_in_torch_gives_the_same_losses(tmp_path, executor, full_run, capsys,
                                                                          monkeypatch):
    """8 ranks for 3 steps, resumed on 6 ranks for 1, then on 8 again: at every step the loss of
    the uninterrupted 8-rank run, to fp32 1e-5 (a step's loss is a function of params and batch:
    the plans differ with the rank count, only the order of the sums changes). 6, not 4: the tiny
    model's 39392 parameters need no padding on 4 or 8 ranks, on 6 they do (39396), so the state
    is re-padded on the way there and back. The torch backend starts from the checkpoint the
    6-rank leg wrote, with the loss of the next JAX step."""
    from dhp_jax.sharding import PlanExecutor

    args = ("steps=6", "planner.strategy=dhp")   # the uninterrupted run of the resume test above
    full = full_run[1]
    cut = _config(tmp_path, "cut", *args)
    six = PlanExecutor(MLLMConfig.preset("tiny"), jax.devices()[:6], min_bucket=512)
    assert (six.layout.padded, executor.layout.padded) == (39396, 39392)
    legs = [Trainer(cut, executor=executor).run(stop_after=3)]
    capsys.readouterr()
    legs.append(Trainer(_config(tmp_path, "cut", *args, "num_ranks=6"), executor=six).run(resume=True, stop_after=1))
    assert "written on 8 ranks, this run has 6: the state is re-laid onto 6 ranks" in capsys.readouterr().err
    flat = [x for x in jax.tree.leaves(legs[1].state) if x.shape == (six.layout.padded,)]
    assert len(flat) == 3 and all(x.sharding == six.sharded for x in flat)

    # the torch backend from the 6-rank checkpoint (step 4): the loss of JAX's step 5, its batch 4
    ck, torch_loss = _torch_loss(tmp_path / "cut", Trainer(cut, executor=executor).pipeline.batch(4))
    assert (ck.step, ck.meta["layout"]["num_shards"], ck.meta["layout"]["padded"]) == (4, 6, 39396)
    assert abs(torch_loss - full.losses[4]) <= 1e-5 * abs(full.losses[4]), (torch_loss, full.losses[4])

    legs.append(Trainer(cut, executor=executor).run(resume=True))
    assert [[r["step"] for r in leg.records] for leg in legs] == [[1, 2, 3], [4], [5, 6]]
    plans = read_jsonl(tmp_path / "cut" / "plans.jsonl")
    assert [p["plan"]["num_ranks"] for p in plans] == [8, 8, 8, 6, 8, 8]
    resumed = [x for leg in legs for x in leg.losses]
    np.testing.assert_allclose(resumed, full.losses, rtol=1e-5, atol=0)
    params = [np.asarray(s.state.params)[:39392] for s in (legs[2], full)]
    np.testing.assert_allclose(*params, rtol=1e-4, atol=1e-6)
    with capsys.disabled():
        print("resume 8 -> 6 -> 8 ranks vs uninterrupted 8: losses", resumed, "vs", full.losses, "max rel diff",
              float(np.max(np.abs(np.subtract(resumed, full.losses)) / np.abs(full.losses))), "final params max abs diff",
              float(np.abs(params[0] - params[1]).max()), "| torch from the step-4 checkpoint:", torch_loss, "vs JAX",
              full.losses[4], "rel", abs(torch_loss - full.losses[4]) / abs(full.losses[4]))

    # the torch CLI starts from the run; a checkpoint of another model is named before anything is built
    from npu_backend import train as torch_train

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DHP_TORCH_DEVICE", "cpu")
    common = ["--init-from", str(tmp_path / "cut"), "--steps", "1", "--batch-size", "4", "--max-len", "24",
              "--optimizer", "sgd", "--strategy", "static-ring:1"]
    assert torch_train.main([*common, "--json", str(tmp_path / "torch.json")]) == 0
    rec = json.loads((tmp_path / "torch.json").read_text())
    assert rec["init_from"]["step"] == 6 and np.isfinite(rec["steps"][0]["loss"])
    assert "params from dhp train checkpoint" in capsys.readouterr().out
    assert torch_train.main([*common, "--mllm", "internvl3-2b"]) == 2
    err = capsys.readouterr().err
    assert "is of another model than 'internvl3-2b': d_ff: checkpoint 64 vs" in err and "--mllm tiny" in err, err


def _plan_lines(path):
    """plans.jsonl without the solver's timings (wall and CPU milliseconds): everything else a
    plan holds (decisions, padded tokens, estimates, solver choices) must repeat exactly."""
    out = []
    for rec in read_jsonl(path):
        solver = rec["plan"].get("solver", {})
        rec["plan"]["solver"] = {k: v for k, v in solver.items() if not k.endswith("_ms")}
        out.append(rec)
    return out


def test_live_plans_depend_on_config_and_step_only_resumed_too(tmp_path, executor):
    """Two runs of one config, and a run stopped after 3 steps and resumed, log the same plans
    (what the planner may assume compiled at a step is the programs of the earlier steps' plans,
    restored from the checkpoint, priced at the config's fixed figure) and bit-identical losses;
    every step ran the plan the planner returned. The compile price is set high so that the
    program record decides plans here (a resume without it plans differently)."""
    args = ("steps=6", "planner.strategy=dhp", "planner.compile_price_s=60")
    trainers = [Trainer(_config(tmp_path, name, *args), executor=executor) for name in ("a", "b")]
    runs = [t.run() for t in trainers]
    cut = _config(tmp_path, "cut", *args, "checkpoint.every=3")
    first = Trainer(cut, executor=executor).run(stop_after=3)
    second = Trainer(cut, executor=executor).run(resume=True)
    assert runs[0].losses == runs[1].losses == first.losses + second.losses   # bitwise
    plans = [_plan_lines(tmp_path / name / "plans.jsonl") for name in ("a", "b", "cut")]
    assert [r["step"] for r in plans[2]] == list(range(1, 7))      # numbered as metrics.jsonl
    assert plans[0] == plans[1] == plans[2]
    assert len({json.dumps(r["plan"]["micro_batches"]) for r in plans[0]}) > 1      # the plans do change
    # the price of a new program stays the config's figure (a measured one would depend on timing)
    assert [t.plan_source.programs.compile_s for t in trainers] == [60.0, 60.0]
    for summary in (runs[0].summary, runs[1].summary, second.summary):
        assert summary["steps_on_compiled_substitutes"] == 0
        assert summary["steps_waiting_for_compile_after_warmup"] >= 0
        assert set(summary["compile_wait_after_warmup_s"]) == {"median", "max", "median_all_steps"}


def test_a_used_directory_needs_resume_or_overwrite(tmp_path, executor, capsys):
    cfg = _config(tmp_path, "used", "steps=2", "planner.strategy=dhp")  # the DHP run's first plans
    first = Trainer(cfg, executor=executor).run()
    with pytest.raises(TrainError, match="holds checkpoints of an earlier run .*--resume .*--overwrite"):
        Trainer(cfg, executor=executor).run()
    second = Trainer(cfg, executor=executor).run(overwrite=True)
    assert "--overwrite: removed checkpoints [2]" in capsys.readouterr().err
    assert second.losses == first.losses
    assert [r["step"] for r in read_jsonl(tmp_path / "used" / "metrics.jsonl")] == [1, 2]


def test_a_batch_the_planner_declines_ends_the_run_naming_the_step(tmp_path, executor):
    """The planner declining a batch mid-run (here: step 2's) ends the run with one TrainError that
    names the step, the planner settings and the planner's reason, after the steps before it."""
    from dhp_jax.planner import PlanningError

    trainer = Trainer(_config(tmp_path, "declined", "steps=3", "planner.strategy=dhp",
                              "planner.num_micro_batches=1"), executor=executor)
    planned = trainer.plan_source

    class Declines:
        def __getattr__(self, name):
            return getattr(planned, name)

        def __call__(self, step, batch):
            if step == 1:
                raise PlanningError("num_micro_batches=1 is too few for this batch")
            return planned(step, batch)

    trainer.plan_source = Declines()
    with pytest.raises(TrainError, match=r"step 2: the planner cannot plan its batch \(planner.strategy='dhp', "
                       r"num_micro_batches=1, .*\): num_micro_batches=1 is too few .*1 of 3 steps were done"):
        trainer.run()
    assert [r["step"] for r in read_jsonl(tmp_path / "declined" / "metrics.jsonl")] == [1]


def test_bad_input_fails_before_any_step(tmp_path, executor):
    cfg = _config(tmp_path, "bad", "steps=2")
    with pytest.raises(TrainError, match="num_ranks=8 needs 8 devices but only 4"):
        Trainer(cfg, executor=executor, devices=jax.devices()[:4])
    with pytest.raises(TrainError, match=r"model.router_aux_loss_coef=0.01: the model 'tiny' has no "
                                         r"mixture-of-experts layer"):
        Trainer(_config(tmp_path, "bad", "model.router_aux_loss_coef=0.01"))
    with pytest.raises(TrainError, match="strategy='bogus': unknown strategy"):
        Trainer(_config(tmp_path, "bad", "planner.strategy=bogus"), executor=executor)
    with pytest.raises(PlanFileError, match="cannot read plan file"):
        Trainer(_config(tmp_path, "bad", f"planner.plan_file={tmp_path / 'nope.json'}"), executor=executor)
    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(PlanFileError, match="not valid JSON"):
        Trainer(_config(tmp_path, "bad", f"planner.plan_file={tmp_path / 'garbage.json'}"), executor=executor)
    wrong = Plan(8, (MicroBatch((Group(tuple(range(8)), 8, tuple(range(BATCH + 1))),)),))
    (tmp_path / "wrong.json").write_text(wrong.to_json())
    with pytest.raises(PlanFileError, match=r"plan 1 \(step 1\): .*sample 8 does not exist"):
        Trainer(_config(tmp_path, "bad", f"planner.plan_file={tmp_path / 'wrong.json'}"), executor=executor)
    # a checkpoint of another model config: refused before the first step writes anything
    ck = Checkpointer(tmp_path / "bad" / "checkpoints")
    trainer = Trainer(cfg, executor=executor)
    ck.save(1, trainer.init_state(), data_position=1,
            model_config={**MLLMConfig.preset("tiny").to_dict(), "d_model": 64})
    ck.close()
    with pytest.raises(CheckpointError, match="different model config .*d_model: checkpoint 64 vs run 32"):
        trainer.run(resume=True)
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_cli_reports_config_errors(capsys):
    from dhp_jax.cli import main

    assert main(["train", "stepz=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'stepz'" in err and "num_ranks" in err


def test_cli_rejects_an_unreadable_plan_file(tmp_path, monkeypatch, capsys):
    from dhp_jax.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--plan-file", str(tmp_path / "missing.json"), "steps=1"]) == 2
    err = capsys.readouterr().err
    assert f"planner.plan_file={str(tmp_path / 'missing.json')!r}: " in err and "does not exist" in err, err
    assert not (tmp_path / "runs").exists()  # nothing ran, nothing was written
    assert main(["train", "--plan-file", str(tmp_path), "steps=1"]) == 2
    assert "is a directory, expected a .jsonl file" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_tensorboard_without_tensorboardx_is_a_clear_error(tmp_path):
    from dhp_jax.train.metrics import MetricsError, MetricsWriter

    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        with pytest.raises(MetricsError, match="needs tensorboardX"):
            MetricsWriter(tmp_path, total_steps=1, progress=False, tensorboard=True)
    else:
        w = MetricsWriter(tmp_path, total_steps=1, progress=False, tensorboard=True)
        w.log_step({"step": 1, "loss": 1.0})
        w.close()
        assert (tmp_path / "tensorboard").is_dir()


def test_profiler_times_real_group_executables(tmp_path, executor):
    """The real path of `dhp profile`: one-group plans through the executor, fit, JSON that loads.

    Degree 1 on rank 0 at one bucket: one executable to compile.
    """
    from dhp_jax.model import init_params
    from dhp_jax.planner import CostModel
    from dhp_jax.train.profile import ExecutorTimer, default_points, fit_profile, measure_points, write_profile

    model = MLLMConfig.preset("tiny")
    params = executor.replicate(init_params(model, jax.random.PRNGKey(0)))
    timer = ExecutorTimer(executor, params, model, repeats=2)
    points = default_points(degrees=[1], lengths=[96, 192, 288, 384], packs=(1, 2))
    samples = timer.samples([40, 60], [0.25, 0.0])
    assert [s.num_tokens for s in samples] == [40, 60] and samples[0].vision_tokens == 20
    measurements = measure_points(points, timer)
    assert all(m["seconds"] > 0 for m in measurements)
    cost, report = fit_profile(measurements, CostModel.preset("internvl3-2b", "cpu"), holdout_every=4)
    assert report["num_held_out"] == 2 and report["held_out_mean_rel_error"] >= 0
    path, _ = write_profile(tmp_path / "p.json", cost, report, measurements)
    assert group_time(CostModel.from_profile(path), [100], 1) > 0


def test_trainer_prices_the_memory_of_its_executors_chunk(tmp_path):
    """The trainer's cost follows its executor's chunk, memory fields included (one-pass blocks here)."""
    from dhp_jax.planner.cost.model import CostModel
    from dhp_jax.sharding import PlanExecutor

    ex = PlanExecutor(MLLMConfig.preset("tiny"), jax.devices(), min_bucket=512, linear_chunk=0)
    trainer = Trainer(_config(tmp_path, "one-pass", "steps=1", "planner.full_size=false"), executor=ex)
    p, n = trainer.config.planner, trainer.config.num_ranks
    want = CostModel.preset(p.cost_model, p.hardware, ranks_per_node=p.ranks_per_node or n, state_shards=n,
                            linear_chunk=0)
    fields = ("mem_per_token", "fixed_bytes", "memory_budget")
    assert trainer.cost.geometry.linear_chunk == want.geometry.linear_chunk == 0
    assert [getattr(trainer.cost, f) for f in fields] == [getattr(want, f) for f in fields]


def test_the_trainer_calls_the_step_executor_protocol(tmp_path, executor):
    """PlanExecutor implements every member of `StepExecutor`; an executor that lacks some is
    refused up front with their names (the trainer calls members, it never probes for them)."""
    import typing

    from dhp_jax.sharding.protocol import MEMBERS, StepExecutor, check_executor

    assert sorted(MEMBERS) == sorted(typing._get_protocol_attrs(StepExecutor))
    assert isinstance(executor, StepExecutor) and check_executor(executor) is executor

    class Partial:
        min_bucket, growth, linear_chunk = 512, 1.25, 0

        def plan_keys(self, samples, plan):
            return []

    with pytest.raises(TypeError, match=r"Partial lacks layout, compile_seconds, num_compiles, .*replicate of the "
                                        r"StepExecutor protocol"):
        Trainer(_config(tmp_path, "partial", "steps=1"), executor=Partial())


def test_full_size_plans_are_logged_as_run_and_the_measured_comparison_is_opt_in(tmp_path, executor):
    """plans.jsonl has one format: every step's plan as these devices ran it (executed tokens, the
    executor's buckets, one node), also when the plans were made at full token counts for a preset;
    the measured comparison runs only when asked for."""
    from dhp_jax.train.train_config import CompareConfig

    assert CompareConfig().measured is False and load_config().compare.measured is False
    cfg = _config(tmp_path, "full", "steps=2", "planner.full_size=true", "planner.cost_model=qwen3-vl-4b",
                  "planner.hardware=ascend-910b", "planner.ranks_per_node=1", "planner.comm_overlap=false",
                  "compare.enabled=true", "compare.measured=true", "compare.batches=1", "compare.repeats=1",
                  "compare.static_strategy=static-ring:8", "compare.sim_ranks=8", "compare.sim_batch_size=16",
                  "compare.sim_model=qwen3-vl-4b")
    trainer = Trainer(cfg, executor=executor)
    result = trainer.run()
    lines = read_jsonl(tmp_path / "full" / "plans.jsonl")
    assert [(x["step"], x["step_base"]) for x in lines] == [(1, 1), (2, 1)]     # steps count from 1
    for line in lines:
        plan = Plan.from_json(line["plan"])
        batch = trainer.pipeline.batch(line["step"] - 1)
        assert plan.ranks_per_node == 8
        groups = [g for mb in plan.micro_batches for g in mb.groups]
        for g, (_, bucket, _, _) in zip(groups, executor.plan_keys(batch.samples, plan), strict=True):
            assert g.tokens == sum(batch.samples[s].num_tokens for s in g.samples) and g.padded_tokens == bucket
    measured = result.summary["compare"]["measured"]
    assert set(measured["strategies"]) == {"dhp", "static-ring:8"}
    assert measured["strategies"]["dhp"]["step_time_s"] > 0 and "measured on 8 cpu" in measured["label"]


def test_each_step_prepares_its_plan_once(tmp_path, executor, monkeypatch):
    """A step's plan is checked and packed once (`PlanExecutor.prepare`, on the planner thread) and
    every consumer takes that `PreparedStep`: the compile-ahead worker, the step's compile and run,
    and the plan log (a full-size plan is logged as executed, from the prepared step's keys)."""
    packed = []
    pack = executor.model.pack

    def counting_pack(group, *args):
        packed.append(len(group))
        return pack(group, *args)

    monkeypatch.setattr(executor.model, "pack", counting_pack)
    before = executor.preparations
    cfg = _config(tmp_path, "once", "steps=3", "planner.full_size=true", "planner.cost_model=qwen3-vl-4b",
                  "planner.hardware=ascend-910b", "planner.ranks_per_node=1", "planner.comm_overlap=false")
    trainer = Trainer(cfg, executor=executor)
    trainer.run()
    plans = [Plan.from_json(line["plan"]) for line in read_jsonl(tmp_path / "once" / "plans.jsonl")]
    assert executor.preparations - before == len(plans) == 3
    assert len(packed) == sum(len(p.groups) for p in plans) and sum(packed) == 3 * BATCH


@pytest.fixture
def fresh_compilation_cache():
    """JAX's persistent compilation cache starts anew (the test's runs set its directory) and is
    reset afterwards: a process initialises it once, at its first compile."""
    from jax._src import compilation_cache

    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    compilation_cache.reset_cache()


def test_every_checkpoint_resumes_to_the_uninterrupted_losses(tmp_path, fresh_compilation_cache):
    """A run checkpointed at every step, resumed from each checkpoint by a fresh process's trainer
    (a new executor: its programs come from the run's persistent compilation cache, and programs on
    further device sets are loaded from them or compiled): every resume finishes with the
    uninterrupted run's losses, bit for bit. A program loaded from the persistent cache serialized
    again lacks kernels; loading that copy onto other devices made a group fail, and the gradient
    reduce-scatter waited for it until XLA ended the process."""
    import shutil

    steps = 4
    args = ("steps=4", "planner.strategy=dhp", "checkpoint.every=1", f"checkpoint.keep={steps}",
            f"compilation_cache={tmp_path / 'jax-cache'}")
    full = Trainer(_config(tmp_path, "full", *args)).run()
    assert len(full.losses) == steps
    for k in range(1, steps):
        run = tmp_path / f"from-{k}"
        shutil.copytree(tmp_path / "full", run)
        for later in range(k + 1, steps + 1):
            shutil.rmtree(run / "checkpoints" / str(later))
        trainer = Trainer(_config(tmp_path, f"from-{k}", *args))
        resumed = trainer.run(resume=True)
        assert [r["step"] for r in resumed.records] == list(range(k + 1, steps + 1))
        assert resumed.losses == full.losses[k:], k          # bitwise
        if k == 1:   # the case of the failure: cache-supplied programs, others on further devices
            assert trainer.executor.num_compiles > trainer.executor.num_programs


def test_a_resumed_run_switches_compile_tiers_where_the_uninterrupted_one_did(tmp_path, executor):
    """With compile tiers (here: the second tier from a program's second step), a checkpoint stores
    each program's step count, so a run resumed from it runs each step on the tier the uninterrupted
    run used: the same losses, bit for bit (the tiers agree to fp32 1e-5 only)."""
    import shutil

    args = ("steps=3", "planner.strategy=static-ring:8", "checkpoint.every=1", "checkpoint.keep=3")
    saved = executor.compiles.tiers, executor.compiles.tier_up_runs, executor.compiles.tier_min_flops
    executor.compiles.tiers, executor.compiles.tier_up_runs, executor.compiles.tier_min_flops = True, 1, 0.0
    try:
        full = Trainer(_config(tmp_path, "full", *args), executor=executor).run()
        assert len(executor.compiles.tuned_keys) == 1             # one program: steps 2 and 3 ran its second tier
        for k in (1, 2):
            run = tmp_path / f"from-{k}"
            shutil.copytree(tmp_path / "full", run)
            for later in range(k + 1, 4):
                shutil.rmtree(run / "checkpoints" / str(later))
            resumed = Trainer(_config(tmp_path, f"from-{k}", *args), executor=executor).run(resume=True)
            assert resumed.losses == full.losses[k:], k      # bitwise
    finally:
        executor.stop_tuning()
        executor.compiles.tiers, executor.compiles.tier_up_runs, executor.compiles.tier_min_flops = saved
