"""Trainer parts without the executor: config loading/overrides, data pipeline, planner thread, optimizer."""

import time

import numpy as np
import pytest

from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan
from dhp_jax.train.train_config import ConfigError, DataConfig, load_config, valid_keys
from dhp_jax.train.pipeline import DataPipeline
from dhp_jax.train.planner_thread import PlannerThread


# ------------------------------------------------------------------------------------ config
def test_demo_config_loads_with_overrides():
    cfg = load_config(overrides=["steps=7", "optim.learning_rate=1e-3", "planner.strategy=static-ring:4",
                                 "planner.plan_file=null"])
    assert cfg.kind == "train" and cfg.steps == 7 and cfg.optim.learning_rate == 1e-3
    assert cfg.planner.strategy == "static-ring:4" and cfg.planner.plan_file is None


@pytest.mark.parametrize("override, names", [
    ("stepz=3", ["'stepz'", "steps", "num_ranks"]),
    ("optim.lr=3", ["'optim.lr'", "learning_rate", "warmup_steps"]),
    ("nosuch.key=1", ["'nosuch'", "planner"]),
])
def test_unknown_key_is_named_with_valid_keys(override, names):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    for n in names:
        assert n in str(e.value)


def test_bad_values_are_named(tmp_path):
    with pytest.raises(ConfigError, match="steps must be an integer"):
        load_config(overrides=["steps=abc"])
    with pytest.raises(ConfigError, match="num_ranks=16 needs 16 devices"):
        load_config(overrides=["num_ranks=16"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(overrides=["steps"])
    with pytest.raises(ConfigError, match="attention_tile must be >= 1"):
        load_config(overrides=["attention_tile=0"])
    with pytest.raises(ConfigError, match=r"model.router_aux_loss_coef must be a number >= 0 .*got -0.01"):
        load_config(overrides=["model=tiny-qwen3_vl_moe", "model.router_aux_loss_coef=-0.01"])
    with pytest.raises(ConfigError, match="compare.batches must be >= 1 when the comparison runs"):
        load_config(overrides=["compare.batches=0"])
    assert load_config(overrides=["compare.batches=0", "compare.enabled=false"]).compare.batches == 0
    p = tmp_path / "x.yaml"
    p.write_text("kind: experiment\n")
    with pytest.raises(ConfigError, match="kind: train"):
        load_config(p)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_valid_keys_cover_sections():
    keys = valid_keys()
    assert "optim.learning_rate" in keys and "planner.plan_file" in keys and "steps" in keys


# ------------------------------------------------------------------------------------ data
def test_pipeline_is_deterministic_and_fits_the_model():
    cfg = DataConfig(batch_size=12, max_tokens=96, min_text_tokens=6)
    p = DataPipeline(cfg, vocab_size=256, patch_dim=12)
    a, b = p.batch(3), p.batch(3)
    assert [s.num_tokens for s in a.samples] == [s.num_tokens for s in b.samples]
    for x, y in zip(a.samples, b.samples):
        for sx, sy in zip(x.segments, y.segments):
            if sx.pixels is not None:
                np.testing.assert_array_equal(sx.pixels, sy.pixels)
            else:
                np.testing.assert_array_equal(sx.token_ids, sy.token_ids)
    assert a.lengths.max() <= 96 and len(a.samples) == 12
    assert p.batch(4).lengths.tolist() != a.lengths.tolist()
    for s, c in zip(a.samples, a.concepts):
        assert s.segments[-1].modality == "text" and s.segments[-1].num_tokens >= 6
        cap = s.segments[-1].token_ids
        assert (cap[2:] == p.captions[c, : len(cap) - 2]).all()  # caption = cue + concept's sequence
        for seg in s.segments:
            if seg.is_vision:
                assert seg.num_tokens % seg.tokens_per_frame == 0
                # pixels carry the concept: closer to its prototype than to any other
                dist = ((seg.pixels.mean(0)[None] - p.prototypes) ** 2).sum(1)
                assert dist.argmin() == c


def test_pipeline_keeps_the_mix_heterogeneous():
    p = DataPipeline(DataConfig(batch_size=64, max_tokens=384), vocab_size=256, patch_dim=12)
    lens = np.concatenate([p.batch(s).lengths for s in range(4)])
    assert lens.max() >= 4 * np.median(lens)  # a long tail survives the scaling


# ------------------------------------------------------------------------------------ thread
def _plan(k):
    return Plan(2, (MicroBatch((Group((0, 1), 2, tuple(range(k))),)),))


def test_planner_thread_hides_planning():
    """Planning (20 ms) is shorter than a step (60 ms): after warm-up the consumer never waits."""

    def make_plan(step, batch):
        time.sleep(0.02)
        return _plan(4)

    steps = list(range(10))
    with PlannerThread(lambda s: s, make_plan, 0, len(steps), lookahead=2) as planned:
        got = []
        for item in planned:
            got.append(item.step)
            time.sleep(0.06)  # the "device step"
    assert got == steps
    steady = planned.waits[2:]
    assert max(steady) < 0.01, planned.waits   # loose: ~0 in steady state
    assert planned.waits[0] >= 0.015            # the very first plan is not hidden


def test_planner_thread_reports_the_failing_step():
    def make_plan(step, batch):
        if step == 3:
            raise ValueError("sample 5 too long")
        return _plan(1)

    with pytest.raises(RuntimeError, match="planning step 4 failed: ValueError: sample 5 too long"):
        with PlannerThread(lambda s: s, make_plan, 0, 6) as planned:
            for _ in planned:
                pass


# ------------------------------------------------------------------------------------ optimizer
def test_schedule_warmup_and_cosine():
    from dhp_jax.train.train_config import OptimConfig
    from dhp_jax.train.state import make_schedule

    cfg = OptimConfig(learning_rate=1.0, warmup_steps=4, end_lr_ratio=0.1)
    f = make_schedule(cfg, 20)
    assert float(f(0)) == 0.0 and float(f(4)) == pytest.approx(1.0)
    assert float(f(2)) == pytest.approx(0.5)
    assert float(f(20)) == pytest.approx(0.1)
    assert float(f(12)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 8 / 16)))


def test_input_paths_in_a_yaml_are_relative_to_it(tmp_path, monkeypatch):
    d = tmp_path / "cfgs"
    d.mkdir()
    (d / "run.yaml").write_text("kind: train\nplanner:\n  cost_profile: profiles/p.json\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(d / "run.yaml", overrides=["planner.plan_file=plans.jsonl"])
    assert cfg.planner.cost_profile == str(d / "profiles" / "p.json")
    assert cfg.planner.plan_file == "plans.jsonl"  # overrides stay relative to the cwd


def test_plan_source_fixes_the_count_only_of_strategies_that_choose_one():
    """planner.num_micro_batches (the demo sets 1) reaches dhp; a static baseline, whose count follows
    from its degree and which takes no such option, plans as it would without it."""
    from types import SimpleNamespace

    from dhp_jax.planner import CostModel, plan_batch
    from dhp_jax.train.plans import PlanSource

    cost = CostModel.preset("internvl3-2b", "cpu", ranks_per_node=8)
    batch = SimpleNamespace(samples=[4000, 3000, 200, 100, 50, 900, 30, 700])
    one = PlanSource(8, cost, "dhp", num_micro_batches=1)(0, batch)
    assert len(one.micro_batches) == 1
    static = PlanSource(8, cost, "static-ring:2", num_micro_batches=1)(0, batch)
    assert static.digest() == plan_batch(batch.samples, 8, cost, "static-ring:2").digest()


def test_a_fine_tuning_run_plans_at_its_own_remat_and_dtype(tmp_path):
    """The cost model of a run fine-tuning a checkpoint is the checkpoint's shape priced at the
    run's remat and compute dtype (a run without recompute keeps every block's values: planning
    it at the preset's remat "layer" would let groups hold more tokens than fit)."""
    import dataclasses
    import json
    import types

    from dhp_jax.data.model_configs import model_config
    from dhp_jax.train.plans import run_cost

    (tmp_path / "config.json").write_text(json.dumps(model_config("qwen3-vl-2b")))
    costs = {}
    for remat, dtype in (("none", "bfloat16"), ("layer", "bfloat16"), ("layer", "float32")):
        base = load_config(overrides=[f"remat={remat}", f"compute_dtype={dtype}", "num_ranks=8"])
        # the run's sections as run_cost reads them, its model the checkpoint (no data needed here)
        cfg = types.SimpleNamespace(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
        cfg.model = dataclasses.replace(base.model, pretrained=str(tmp_path))
        cfg.planner = dataclasses.replace(base.planner, cost_model=None)     # the checkpoint's own shape
        cost = costs[remat, dtype] = run_cost(cfg)
        assert (cost.remat, cost.compute_bytes) == (remat, 2 if dtype == "bfloat16" else 4)
    assert costs["none", "bfloat16"].mem_per_token > 2 * costs["layer", "bfloat16"].mem_per_token


def test_progress_fits_its_output(tmp_path, capsys):
    """On a file or a pipe: plain lines (the first step, every tenth of the run, the last; one line
    when a step starts compiling, however often the wait polls), no carriage return. On a
    terminal: the tqdm bar, redrawn in place."""
    from dhp_jax.train.metrics import MetricsWriter

    plain = MetricsWriter(tmp_path / "plain", total_steps=20, progress=True, terminal=False)
    for step in range(1, 21):
        if step in (1, 7):
            for done, elapsed in ((0, None), (0, 0.25), (1, 0.5)):   # the step's compile wait polls
                plain.compiling(2, done, elapsed)
        plain.log_step({"step": step, "loss": 1.0 / step, "step_time_s": 0.1})
    plain.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert [line for line in lines if "compiling" in line] == ["train: step 1/20: compiling 2 group program(s)",
                                                               "train: step 7/20: compiling 2 group program(s)"]
    assert [int(line.split()[2].split("/")[0]) for line in lines if "loss" in line] == [1, 2, 4, 6, 8, 10, 12, 14, 16,
                                                                                        18, 20]
    bar = MetricsWriter(tmp_path / "bar", total_steps=3, progress=True, terminal=True)
    for step in range(1, 4):
        bar.log_step({"step": step, "loss": 1.0, "step_time_s": 0.1})
    bar.close()
    assert "\r" in capsys.readouterr().err


def test_the_cost_model_prices_the_router_phase_exactly_when_the_loss_is_on(tmp_path):
    """The planning cost model of a run prices each group's router forward pass
    (`CostModel.router_phase`) when and only when the run adds the load-balancing loss: a weight
    set for the run, or the family's default from config.json (the tiny Qwen3-VL-MoE's: off); a
    profile measured otherwise is refused."""
    from dhp_jax.train.trainer import TrainError, prepare_run

    base = ["model=tiny-qwen3_vl_moe", "num_ranks=2", "data.batch_size=2", "data.max_tokens=48",
            "compare.enabled=false", "metrics.progress=false"]
    costs = {coef: prepare_run(load_config(overrides=base + ([f"model.router_aux_loss_coef={coef}"] if coef is not None
                                                             else []))).cost for coef in (None, 0.0, 0.01)}
    assert {k: c.router_phase for k, c in costs.items()} == {None: False, 0.0: False, 0.01: True}
    assert costs[0.01].a2 > costs[0.0].a2 and costs[0.0] == costs[None]
    costs[0.0].save(tmp_path / "cost.json")
    with pytest.raises(TrainError, match=r"cost.json' prices no router phase \(router_phase=False\); the run adds"):
        prepare_run(load_config(overrides=base + ["model.router_aux_loss_coef=0.01",
                                                  f"planner.cost_profile={tmp_path / 'cost.json'}"]))
