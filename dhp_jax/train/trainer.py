"""The training loop: planned batches in, executor loss/grads, donated optax update, metrics, checkpoints.

`Trainer.run` reads as `train_step` plus per-step hooks (metrics, plan log, checkpoint). Everything
that can be wrong with a run (too few devices, a bad plan file, a checkpoint of another model, a run
directory that holds an earlier run) is checked in `prepare_run` / `Trainer.run` before the first
step runs; `prepare_run` is shared with `dry_run`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from dhp_jax.model import MLLMConfig, init_params
from dhp_jax.planner.contract.plan import PlanningError
from dhp_jax.planner.contract.planfile import PlanLog, logged_step
from dhp_jax.planner.programs.cache import ProgramCache, executed_view
from dhp_jax.sharding import PlanExecutor
from dhp_jax.sharding.executor import GroupProgramError
from dhp_jax.sharding.protocol import check_executor
from dhp_jax.train.checkpoint import CheckpointError, Checkpointer
from dhp_jax.train.compare import compare_plans
from dhp_jax.train.train_config import OptimConfig, TrainConfig, checkpoint_path, compilation_cache_path
from dhp_jax.train.distributed import StepSync
from dhp_jax.train.demo_models import demo_models
from dhp_jax.train.interrupt import RunInterrupted, SigintGuard, wait_polling
from dhp_jax.train.metrics import MetricsWriter, tensorboard_writer, truncate_jsonl
from dhp_jax.train.pipeline import DataPipeline
from dhp_jax.train.planner_thread import PlannerThread, StepPlanningFailed
from dhp_jax.train.plans import PlanSource, attach_programs, describe_cost, load_plan_file, run_cost
from dhp_jax.train.rundir import LOCK_NAME, RunDir, RunLockedError, checkpoint_lock, held_here
from dhp_jax.train.state import TrainState, make_init, make_optimizer, make_schedule, make_update, state_shardings
from dhp_jax.train.summary import plot_simulated_step, run_summary, stored_summary


@functools.lru_cache(maxsize=8)
def _state_functions(model_config: Any, optim: tuple, steps: int, executor: Any) -> tuple[Any, Any]:
    """Jitted state init and update, shared by every run with the same model, optimizer and executor
    (a resumed run, or the runs of one test module, compile them once). The state is sharded over
    the executor's full mesh: params are its fp32 master vector, AdamW's moments follow it."""
    optimizer = make_optimizer(OptimConfig(*optim), steps)
    layout, sharding = executor.layout, executor.state_sharding
    init = make_init(lambda k: layout.ravel(init_params(model_config, k)), optimizer, sharding)
    update = make_update(optimizer, sharding, jax.eval_shape(init, jax.random.PRNGKey(0)), executor.norm_weights())
    return init, update


def _pretrained_state(executor: Any, params: Any, optim: tuple, steps: int, seed: int) -> tuple[Any, Any]:
    """(first state, jitted update) of a fine-tuning run: the checkpoint's params as the fp32
    master vector, sharded over the executor's full mesh like the stand-in's (AdamW's moments
    follow it)."""
    optimizer = make_optimizer(OptimConfig(*optim), steps)
    flat = executor.shard(params)          # binds the layout; fp32[P_pad] sharded over the mesh

    def init(flat: Any, key: Any) -> Any:
        _, k_train = jax.random.split(key)
        return TrainState(step=jnp.zeros((), jnp.int32), params=flat, opt_state=optimizer.init(flat), rng=k_train)

    key = jax.random.PRNGKey(seed)
    abstract = jax.eval_shape(init, flat, key)
    state = jax.jit(init, out_shardings=state_shardings(abstract, executor.state_sharding))(flat, key)
    return state, make_update(optimizer, executor.state_sharding, abstract, executor.norm_weights())


def plan_hash(plan: Any) -> str:
    """Short digest of a plan's decisions (`Plan.digest`): equal on every process that planned the
    same batch the same way; solver timings and flags never enter it."""
    return plan.digest()


def ranks_per_process(devices: Sequence[Any]) -> int | None:
    """Ranks one process drives when each process holds a contiguous block of equal size (what
    the program cache's per-process placement assumes); None for one process (or another layout)."""
    procs = [d.process_index for d in devices]
    n = len(set(procs))
    if n == 1 or len(devices) % n:
        return None
    per = len(devices) // n
    return per if all(procs[r] == procs[r - r % per] for r in range(len(devices))) \
        and len({procs[r] for r in range(0, len(devices), per)}) == n else None


def enable_compilation_cache(setting: str | None, out_dir: Path) -> Path | None:
    """Turn on JAX's persistent compilation cache ("auto": <out_dir>/jax-cache; None: off), so a
    rerun or a resumed run loads its programs instead of compiling them. JAX reads the directory
    when it first compiles: the first setting in a process holds."""
    path = compilation_cache_path(setting, out_dir)
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


_RUNS = itertools.count()     # the runs of this process (`Trainer.run`), numbering their StepSync keys


class TrainError(RuntimeError):
    """The run cannot start; the message says what is missing or wrong."""


class StepStalled(TrainError):
    """A step's group programs did not finish in time (`PlanExecutor.stall_timeout_s`): the device
    work cannot be cancelled, so the command line ends the process after saying so."""


def checkpoint_dir(config: TrainConfig) -> Path:
    return checkpoint_path(config)


def check_resumable(config: TrainConfig) -> None:
    """`--resume` of a run that has no checkpoint directory: a `CheckpointError`, raised before
    anything (the checkpoint or compilation-cache directory) is created."""
    path = checkpoint_dir(config)
    if not path.is_dir() or all(p.name == LOCK_NAME for p in path.iterdir()):   # a lock is no checkpoint
        raise CheckpointError(f"--resume: no checkpoint in {str(path.resolve())!r} (no run was saved there; "
                              f"drop --resume to start one)")


@dataclasses.dataclass
class RunResult:
    losses: list[float]
    records: list[dict]
    summary: dict
    state: Any
    finished_before: bool = False   # --resume found the run already finished and changed nothing


@dataclasses.dataclass
class RunSetup:
    """What a run and a dry run both check and build before anything is compiled."""

    config: TrainConfig
    model_config: Any
    devices: list
    plans: list | None
    cost: Any
    plan_source: PlanSource
    pipeline: DataPipeline
    first_batch: Any
    first_plan: Any
    hf_config: Any = None          # a family model: its config and params (the checkpoint's, or the demo's random ones)
    hf_params: Any = None


def prepare_run(config: TrainConfig, devices: Sequence[Any] | None = None) -> RunSetup:
    """Config, devices >= ranks, the plan file (every plan), the planning cost model, the model
    preset, the first batch and its plan (validated against the devices); `TrainError` otherwise."""
    config.validate()
    t = config.parallel.tensor
    hf_config = hf_params = None
    if config.model.family_module:      # a family registered outside the package
        from dhp_jax import models
        try:
            models.load(config.model.family_module)
        except ValueError as e:
            raise TrainError(f"model.family_module: {e}") from None
    demo = demo_models()
    if config.model.pretrained:
        from dhp_jax.model import hf  # lazy, with the fine-tuning imports below: only a fine-tuning run needs them

        try:
            hf_config, hf_params = hf.load_pretrained(config.model.pretrained)
            hf_config = dataclasses.replace(hf_config, remat=config.remat)     # the blocks' recompute
            # the engine-side shape of the checkpoint: what the summary, the checkpoints' model check
            # and the planner's cost model (`planner.cost_model` unset) describe
            model_config = MLLMConfig.from_hf(config.model.pretrained, remat=config.remat)
        except (OSError, ValueError, KeyError) as e:
            raise TrainError(f"model.pretrained={config.model.pretrained!r}: {e}") from None
    elif config.model.preset in demo:   # a tiny random model of a family, on synthetic family samples
        from dhp_jax.model import hf
        from dhp_jax.model.hf.init import random_params
        from dhp_jax.train.demo_models import demo_config

        raw = demo_config(demo[config.model.preset])
        hf_config = hf.parse_config(raw)
        hf_params = random_params(hf_config, config.seed)
        model_config = MLLMConfig.from_hf(raw, name=config.model.preset, remat=config.remat)
    else:
        try:
            model_config = MLLMConfig.preset(config.model.preset, remat=config.remat)
        except ValueError as e:
            raise TrainError(f"model.preset: {e}; or a family model of the demo: {sorted(demo)}") from None
    coef = config.model.router_aux_loss_coef
    moe_spec = getattr(getattr(hf_config, "text", None), "moe", None)
    if coef and (moe_spec is None or not any(moe_spec.sparse)):   # the load-balancing loss needs a router
        raise TrainError(f"model.router_aux_loss_coef={coef}: the model "
                         f"{config.model.pretrained or config.model.preset!r} has no mixture-of-experts layer "
                         f"(no router to balance)")
    aux = 0.0       # the load-balancing loss's weight in this run's steps (0: off), as the executor decides it
    if moe_spec is not None and any(moe_spec.sparse):
        from dhp_jax.model.hf import moe

        try:
            aux = moe.aux_loss_coef(hf_config, coef)
        except ValueError as e:
            raise TrainError(f"model.{e}") from None
    available = list(devices) if devices is not None else jax.devices()
    if len(available) < config.num_ranks * t:
        raise TrainError(f"num_ranks={config.num_ranks} needs {config.num_ranks * t} devices"
                         f"{f' ({t} per rank, parallel.tensor)' if t > 1 else ''} but only "
                         f"{len(available)} {available[0].platform if available else ''} device(s) are visible"
                         + (" (for fake CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count="
                            f"{config.num_ranks * t} before jax is imported)" if available and
                            available[0].platform == "cpu" else ""))
    p = config.planner
    plans = None
    if p.plan_file:  # an unreadable plan file fails before anything is compiled
        # a plan made at another parallel.tensor may split heads this run's devices do not hold
        plans = load_plan_file(p.plan_file, num_samples=config.data.batch_size, num_ranks=config.num_ranks,
                               steps=config.steps, num_heads=model_config.num_heads // t,
                               heads_note=f" (the model's {model_config.num_heads} query heads over "
                                          f"parallel.tensor={t} device(s) a rank: {model_config.num_heads // t} a device)")
    if config.metrics.tensorboard:
        tensorboard_writer()  # a missing tensorboardX fails here, before anything is compiled
    try:
        # Ulysses sizes the executed model splits too; with the load-balancing loss on, every group
        # runs the router program's forward pass before its step (`dhp_jax.sharding.router_phase`)
        cost = run_cost(config, model_config.num_heads, router_phase=aux > 0)
    except ValueError as e:
        raise TrainError(f"planning cost model: {e}") from None
    source = PlanSource(config.num_ranks, cost=cost, strategy=p.strategy, plans=plans,
                        num_micro_batches=p.num_micro_batches, full_size=p.full_size)
    if config.model.pretrained:
        from dhp_jax.data.finetune import DataError
        from dhp_jax.train.finetune import FinetunePipeline, source_spec

        spec = "data.{}={!r}".format(*{"jsonl": ("manifest", config.data.manifest),
                                       "webdataset": ("webdataset", config.data.webdataset),
                                       "hf": ("hf_dataset", config.data.hf_dataset)}[source_spec(config.data)[1]])
        try:   # every record planned from its headers; with on_error=fail the first bad one stops here
            pipeline = FinetunePipeline(config.data, config.model.pretrained, hf_config, config.data.seed)
            batch = pipeline.batch(0)
        except (DataError, ValueError, OSError) as e:
            raise TrainError(f"{spec}: {e}") from None
    else:
        if hf_config is not None:
            from dhp_jax.train.demo_models import FamilyDemoPipeline

            pipeline = FamilyDemoPipeline(config.data, hf_config)
        else:
            pipeline = DataPipeline(config.data, model_config.vocab_size, model_config.patch_dim)
        try:  # an unknown mix, a manifest path that is not there or a bad manifest line: one line, no traceback
            batch = pipeline.batch(0)
        except (ValueError, OSError) as e:
            raise TrainError(f"data.dataset={config.data.dataset!r}: {e}") from None
    try:  # one plan now: a bad strategy or data setting is an error before anything is compiled
        plan = source(0, batch).validate(num_samples=len(batch.samples), num_devices=len(available) // t)
    except (ValueError, TypeError) as e:
        raise TrainError(f"cannot plan the first batch with planner.strategy={p.strategy!r}"
                         f"{' (plan file)' if plans else ''}: {e}") from None
    return RunSetup(config, model_config, available[: config.num_ranks * t], plans, cost, source, pipeline, batch, plan,
                    hf_config, hf_params)


def dry_run(config: TrainConfig) -> dict:
    """Check everything a run needs without compiling or running a step; return what was checked."""
    s = prepare_run(config)
    return {"name": config.name, "num_ranks": config.num_ranks,
            "devices": f"{len(s.devices)} x {s.devices[0].platform}", "batch_samples": len(s.first_batch.samples),
            "batch_tokens": s.first_batch.num_tokens, "max_sample_tokens": int(s.first_batch.lengths.max()),
            "strategy": s.plan_source.label, "degrees": s.first_plan.degrees,
            "cost_model": describe_cost(s.cost, config.planner.cost_profile, config.planner.full_size)}


class Trainer:
    """One run of `dhp train`. `executor` may be passed in (tests share one to reuse compiles)."""

    def __init__(self, config: TrainConfig, executor: Any = None, devices: Sequence[Any] | None = None,
                 step_timeout_s: float = 300.0):
        self.process_index = jax.process_index()
        self.multi_process = jax.process_count() > 1
        setup = prepare_run(config, devices)
        self.config, self.model_config, self.devices = setup.config, setup.model_config, setup.devices
        self.cost, self.plan_source, self.pipeline = setup.cost, setup.plan_source, setup.pipeline
        self.hf_config, self._hf_params = setup.hf_config, setup.hf_params
        self.family = setup.hf_config is not None          # a family model (fine-tuned, or the demo's tiny one)
        self.finetune = bool(config.model.pretrained)       # a checkpoint fine-tuned on a user's records
        enable_compilation_cache(config.compilation_cache, Path(config.metrics.out_dir))
        if executor is None:
            kwargs = {"min_bucket": config.min_bucket} if config.min_bucket else {}
            if config.attention_tile:
                kwargs["attention_tile"] = config.attention_tile
            if config.parallel.tensor > 1:
                kwargs["tensor_parallel"] = config.parallel.tensor
            if config.parallel.sequence:
                kwargs["sequence_parallel"] = True
            if config.model.router_aux_loss_coef is not None:
                kwargs["router_aux_loss_coef"] = config.model.router_aux_loss_coef
            try:
                executor = PlanExecutor(self.hf_config if self.family else self.model_config, self.devices,
                                        compute_dtype=config.compute_dtype, **kwargs)
            except ValueError as e:
                if "router_aux_loss_coef" not in str(e):
                    raise
                raise TrainError(f"model.{e}") from None
        self.executor = check_executor(executor)
        if config.model.router_aux_loss_coef is not None and \
                getattr(executor, "aux_coef", 0.0) != float(config.model.router_aux_loss_coef):
            raise TrainError(f"the executor adds the load-balancing loss with weight {getattr(executor, 'aux_coef', 0.0)}, "
                             f"the config model.router_aux_loss_coef={config.model.router_aux_loss_coef}")
        if (getattr(executor, "aux_coef", 0.0) > 0) != self.cost.router_phase:
            raise TrainError(f"the executor adds the load-balancing loss with weight {getattr(executor, 'aux_coef', 0.0)}, "
                             f"the planning cost model prices {'a' if self.cost.router_phase else 'no'} router phase")
        if getattr(executor, "sequence_parallel", False) != config.parallel.sequence:
            raise TrainError(f"the executor runs sequence_parallel={getattr(executor, 'sequence_parallel', False)}, "
                             f"the config parallel.sequence={config.parallel.sequence}")
        if getattr(executor, "tensor_parallel", 1) != config.parallel.tensor:
            raise TrainError(f"the executor runs tensor_parallel={getattr(executor, 'tensor_parallel', 1)}, the config "
                             f"parallel.tensor={config.parallel.tensor}")
        # What the planner may assume compiled at step t: the programs of the plans of steps < t
        # (never what has finished compiling: that depends on timing); a plan needing a new one
        # pays the config's fixed price. The same on every process, so processes plan alike.
        attach_programs(self.plan_source, config.planner.compile_price_s,
                        (executor.min_bucket, executor.growth, executor.linear_chunk),
                        ranks_per_process(self.devices[::config.parallel.tensor]))
        self.cost = self.plan_source.cost
        self._ran = ProgramCache()  # the executables of the plans of the steps run (what a checkpoint stores)
        self._local_ids = {d.id for d in self.devices if d.process_index == self.process_index}
        self.out_dir = Path(config.metrics.out_dir)
        self.ckpt_dir = checkpoint_dir(config)
        self._state = None
        self._update = None
        # Multi-process (jax.distributed): each step the processes agree on the plan hash and a
        # watchdog bounds the wait for a dead peer (see dhp_jax.train.distributed).
        self.step_timeout_s = float(step_timeout_s)
        self._sync = None
        self._guard = None  # the Ctrl-C guard while run() runs (dhp_jax.train.interrupt)

    # ------------------------------------------------------------------ state
    def init_state(self) -> Any:
        if self.family:
            state, self._update = _pretrained_state(self.executor, self._hf_params, dataclasses.astuple(self.config.optim),
                                                    self.config.steps, self.config.seed)
            return state
        init, update = _state_functions(self.model_config, dataclasses.astuple(self.config.optim),
                                        self.config.steps, self.executor)
        state = init(jax.random.PRNGKey(self.config.seed))
        self._update = update
        return state

    def checkpointer(self):
        return Checkpointer(self.ckpt_dir, every=self.config.checkpoint.every, keep=self.config.checkpoint.keep)

    @property
    def metrics_dir(self) -> Path:
        # process 0 writes where a single-process run would
        return self.out_dir / f"process-{self.process_index}" if self.multi_process and self.process_index \
            else self.out_dir

    def _say(self, text: str) -> None:
        if self.process_index == 0:
            print(f"dhp train: {text}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ one step
    def prepared(self, item: Any) -> Any:
        """The step's `PreparedStep`: the planner thread's (`PlannedBatch.prepared`), else made here
        (where the thread's attempt raised, this raises the same error, at the step)."""
        if item.prepared is None:
            item.prepared = self.executor.prepare(item.batch.samples, item.plan)
        return item.prepared

    def train_step(self, state: Any, item: Any, on_compile: Any = None) -> tuple[Any, dict]:
        """Compile what the step's plan needs (timed apart), run it, update; returns the step's record."""
        done = item.step + 1
        digest = plan_hash(item.plan)   # of the plan handed to the executor below: the plan that runs
        if self._sync is not None:
            self._sync.agree(done, digest)
        # compile outside the step's timing (and outside the multi-process watchdog)
        t0 = time.perf_counter()
        new, missing = self._compile_waiting(item, state.params, on_compile)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if hasattr(self.executor, "on_stall"):   # groups slow to finish: named, with the step
            self.executor.on_stall = lambda text: self._say(f"step {done}: {text}")
            self.executor.stall_abort_s = self.step_timeout_s
        with self._sync.watch(done) if self._sync is not None else contextlib.nullcontext():
            try:
                loss, grads = self.executor.run_step(state.params, self.prepared(item))
            except GroupProgramError as e:     # named before any collective waits on the group
                raise (StepStalled if e.stalled else TrainError)(f"step {done}: {e}") from None
            state, grad_norm = self._update(state, grads)
            jax.block_until_ready((loss, grad_norm, state.params))
        step_time = time.perf_counter() - t0
        rec = {"step": done, "loss": float(loss), "grad_norm": float(grad_norm), "lr": float(self._lr(item.step)),
               "tokens": item.batch.num_tokens, "samples": len(item.batch.samples), "step_time_s": step_time,
               "compile_s": compile_s, "new_compiles": new,
               # the plan that ran is not the one the planner returned (never, by construction: counted
               # from the digests, so that a change that substitutes plans shows in every summary)
               "ran_on_compiled_substitute": digest != self.plan_source.decided.pop(item.step, None),
               # measured: the step waited for a compile (its own or one in flight in the background)
               "compile_wait_s": compile_s if missing else 0.0,
               "plan_wait_s": item.wait_s, "plan_solve_s": item.plan_s, "batch_build_s": item.build_s,
               "data_wait_s": float(getattr(item.batch, "data_wait_s", 0.0)),
               "strategy": self.plan_source.label, "degrees": item.plan.degrees, "plan_hash": digest,
               "num_compiles": self.executor.num_compiles}
        step_sums = getattr(getattr(self.executor, "state", None), "step_sums", None)
        sums = step_sums() if step_sums is not None else None
        if sums is not None:                    # a MoE LLM: tokens per expert, none dropped (else an error)
            from dhp_jax.sharding.family_adapter import router_stats
            try:
                rec.update(router_stats(sums, self.hf_config))
            except ValueError as e:
                raise TrainError(f"step {done}: {e}") from None
        if hasattr(item.batch, "sample_ids"):   # fine-tuning: the records the step trained on
            rec["sample_ids"] = list(item.batch.sample_ids)
        return state, rec

    def _compile_waiting(self, item: Any, params: Any, on_compile: Any) -> tuple[int, int]:
        """`_compile` on a helper thread while the main thread waits: `on_compile(missing, done,
        elapsed_s)` shows the progress every quarter second, and Ctrl-C ends the wait at once
        (`interrupt.SigintGuard`), leaving the compile to finish on its own."""
        first = self.executor.num_compiles
        missing = [0]

        def said(count: int) -> None:
            missing[0] = count
            if on_compile is not None:
                on_compile(count)

        def poll(elapsed_s: float) -> None:
            if on_compile is not None and missing[0]:
                on_compile(missing[0], self.executor.num_compiles - first, elapsed_s)

        with self._guard.allowed() if self._guard is not None else contextlib.nullcontext():
            return wait_polling(self._compile, (item, params, said), poll)

    def _compile(self, item: Any, params: Any, on_compile: Any) -> tuple[int, int]:
        """Build what the plan needs: (executables this call built, executables missing when the
        step started, built here or by the compile-ahead worker while this step waited)."""
        # (this process builds the groups touching its devices only)
        prepared = self.prepared(item)
        need = {k for k in prepared.id_keys if self._local_ids.intersection(k[2])}
        missing = len(need - set(self.executor.executable_keys))
        if missing and on_compile is not None:
            on_compile(missing)
        return int(self.executor.compile_step(prepared, params)), missing

    # ------------------------------------------------------------------ the loop
    def run(self, resume: bool = False, stop_after: int | None = None, overwrite: bool = False) -> RunResult:
        """Train to `config.steps` (or stop after `stop_after` steps, checkpointing, as an interrupted run).

        A directory holding an earlier run's checkpoints is refused unless `resume` (continue it) or
        `overwrite` (replace it); resuming a finished run changes nothing. The run holds the run
        directory's lock (`dhp_jax.train.rundir`; `dhp train` takes it before jax is imported), and
        the lock of a `checkpoint.dir` outside it: a directory another live run holds is refused.
        """
        lock = None
        if not held_here(self.out_dir, self.process_index):
            try:
                lock = RunDir(self.out_dir, self.process_index).acquire()
                lock.attach(checkpoint_lock(self.out_dir, self.ckpt_dir, self.process_index))
            except RunLockedError as e:
                if lock is not None:
                    lock.release()
                raise TrainError(str(e)) from None
        try:
            return self._run(resume, stop_after, overwrite)
        finally:
            if lock is not None:
                lock.release()

    def _run(self, resume: bool, stop_after: int | None, overwrite: bool) -> RunResult:
        cfg = self.config
        ckpt, state, start = self._begin(resume, overwrite)
        if ckpt is None:   # a finished run resumed: nothing to do
            return RunResult([], [], stored_summary(self.metrics_dir), state, finished_before=True)
        stop = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
        if cfg.metrics.progress:
            self._say(f"run {cfg.name!r}: steps {start + 1}-{stop} of {cfg.steps} on {len(self.devices)} "
                      f"{self.devices[0].platform} devices into {str(self.out_dir)!r}; plans: {self.plan_source.label}, "
                      + describe_cost(self.cost, cfg.planner.cost_profile, cfg.planner.full_size))
        if self.multi_process:
            # keys of this run only: every process runs the same runs in the same order, so the
            # n-th run of each process shares the n-th namespace (a later run reuses no step key)
            self._sync = StepSync(self.step_timeout_s, prefix=f"dhp/run{next(_RUNS)}")
        metrics, plan_log, earlier = self._open_logs(resume, start)
        # after each step, in order: the step's programs recorded (the checkpoint stores them),
        # its metrics, its plan as executed, a checkpoint when due
        hooks = [self._programs_hook(), lambda rec, item, state: metrics.log_step(rec),
                 self._plan_log_hook(plan_log), self._checkpoint_hook(ckpt, stop)]
        if self.finetune:   # skipped records said as they are met, not only at the end
            self._said_issues = 0
            self._say_data_issues()
            hooks.append(lambda rec, item, state: self._say_data_issues())
        t_run = time.perf_counter()
        records: list[dict] = []
        compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dhp-compile")
        # Ctrl-C: stop within seconds at a point where the state is whole, checkpoint the last
        # finished step, raise RunInterrupted (dhp_jax.train.interrupt)
        guard = self._guard = SigintGuard().__enter__()
        interrupted = False
        try:
            with PlannerThread(self.pipeline.batch, self.plan_source, start, stop, lookahead=cfg.planner.lookahead,
                               prepare=lambda batch, plan: self.executor.prepare(batch.samples, plan),
                               after_plan=self._compile_ahead(compiler)) as planned:
                for item in planned:
                    with guard.deferred():  # a Ctrl-C here stops after this step
                        state, rec = self.train_step(state, item, on_compile=metrics.compiling)
                        records.append(rec)
                        for hook in hooks:
                            hook(rec, item, state)
                    guard.check()
            metrics.close()
            summary = self._summary(state, earlier + records, t_run, start,
                                    compare=cfg.compare.enabled and stop == cfg.steps and stop_after is None)
            if records or earlier:  # never a summary without real figures
                metrics.write_json("summary.json", summary)
        except StepPlanningFailed as e:
            if not isinstance(e.__cause__, PlanningError):
                raise   # not the planner declining a batch: a bug, with its traceback
            done = start + len(records)
            p = cfg.planner
            raise TrainError(
                f"step {e.step + 1}: the planner cannot plan its batch (planner.strategy={p.strategy!r}"
                f"{f', num_micro_batches={p.num_micro_batches}' if p.num_micro_batches is not None else ''}"
                f", cost_model={p.cost_model!r} on {p.hardware!r}): {e.__cause__}. {done} of {cfg.steps} steps "
                f"were done; --resume continues from the last checkpoint") from e.__cause__
        except KeyboardInterrupt:
            interrupted = True
            raise self._interrupted(ckpt, state, start + len(records), guard.forced,
                                    [metrics.path] + ([plan_log.path] if plan_log is not None else []),
                                    fresh=not (records or earlier)) from None
        finally:
            guard.__exit__()
            self._guard = None
            # at most one compile in flight; after Ctrl-C it is left to finish on its own
            compiler.shutdown(wait=not interrupted, cancel_futures=True)
            stop = getattr(self.executor, "stop_tuning", None)
            if stop is not None:    # no second-tier build queued for a run that has ended
                stop()
            metrics.close()
            if plan_log is not None:
                plan_log.close()
            ckpt.close()
            if self.finetune:
                self.pipeline.close()
        self._state = state
        return RunResult(losses=[r["loss"] for r in records], records=records, summary=summary, state=state)

    def _begin(self, resume: bool, overwrite: bool) -> tuple[Any, Any, int]:
        """The run's checkpointer, first state and first step: a fresh state, the restored one
        (`resume`), or an earlier run's checkpoints cleared (`overwrite`); refused otherwise.
        (None, state, start) when a resumed run is already finished."""
        cfg = self.config
        if resume:
            check_resumable(cfg)   # before the checkpointer creates its directory
        ckpt = self.checkpointer()
        try:
            latest = ckpt.latest_step()
            if resume and latest is None:
                raise CheckpointError(f"--resume: no checkpoint in {str(ckpt.directory)!r}")
            if not resume and latest is not None and not overwrite:
                raise TrainError(f"{str(ckpt.directory)!r} holds checkpoints of an earlier run (latest step {latest}); "
                                 f"use --resume to continue it or --overwrite to replace it")
            state = self.init_state()
            start = 0
            if hasattr(self.executor, "set_launch_counts"):   # a fresh run counts launches from 0
                self.executor.set_launch_counts({})
            if resume:
                restored = ckpt.restore(state, self.model_config.to_dict(), layout=self.executor.layout,
                                        layouts=self.executor.layout_for)
                state, start = restored.state, restored.data_position
                if start >= cfg.steps:
                    self._say(f"run {cfg.name!r} is already finished (step {start} of {cfg.steps}, checkpoint "
                              f"{ckpt.directory / str(restored.step)}); nothing to do")
                    self._state = state
                    ckpt.close()
                    return None, state, start
                self._restore_programs(restored.meta, start)
                self._restore_loader(restored.meta, start)
                self._say(f"resumed from step {restored.step} (checkpoint {ckpt.directory / str(restored.step)})")
            elif latest is not None:
                old = ckpt.clear()
                self._say(f"--overwrite: removed checkpoints {old} of an earlier run in {str(ckpt.directory)!r}")
        except BaseException:
            ckpt.close()
            raise
        return ckpt, state, start

    def _open_logs(self, resume: bool, start: int) -> tuple[Any, PlanLog | None, list[dict]]:
        """The run's metrics writer, its plan log (None when `metrics.log_plans` is off) and, when
        resuming, the metrics records up to `start` (later ones were never checkpointed: they are
        cut from the files and redone)."""
        cfg, mdir = self.config, self.metrics_dir
        earlier: list[dict] = []
        if resume:
            earlier = truncate_jsonl(mdir / "metrics.jsonl", lambda r: r.get("step", 0) <= start)
            # (an older version's lines count steps from 0: `logged_step` reads either)
            truncate_jsonl(mdir / "plans.jsonl", lambda r: (logged_step(r) or 0) <= start)
        metrics = MetricsWriter(mdir, total_steps=cfg.steps, start_step=start, progress=cfg.metrics.progress,
                                tensorboard=cfg.metrics.tensorboard, append=resume)
        plan_log = PlanLog(mdir / "plans.jsonl", append=resume) if cfg.metrics.log_plans else None
        return metrics, plan_log, earlier

    def _summary(self, state: Any, records: list[dict], t_run: float, start: int, compare: bool) -> dict:
        """`summary.run_summary` of `records`, with the end comparison of strategies on the trained
        params when `compare` (`dhp_jax.train.compare`) and the wall time since `t_run`."""
        cfg = self.config
        summary = run_summary(self, records, time.perf_counter() - t_run, start)
        if summary and self.finetune:
            summary["data"] = self._data_summary(records)
        if summary and compare:
            t0 = time.perf_counter()
            summary["compare"] = compare_plans(self, state.params, first_step=cfg.steps,
                                               progress=cfg.metrics.progress and self.process_index == 0)
            summary["time_s"]["comparison"] = time.perf_counter() - t0
            png = plot_simulated_step(summary["compare"], self.metrics_dir, self.process_index)
            if png:
                summary["plan_png"] = str(png)
        if summary:
            summary["time_s"]["wall"] = summary["wall_time_s"] = time.perf_counter() - t_run
        return summary

    def _data_summary(self, records: list[dict]) -> dict:
        """Fine-tuning data: records used and skipped (listed in data_issues.tsv), epochs, and the
        measured wait for decoded data per step (median)."""

        from dhp_jax.data.finetune import write_issues

        p = self.pipeline
        issues = p.issues
        path = self.metrics_dir / "data_issues.tsv"
        if self.process_index == 0:
            write_issues(str(path), issues)
        waits = [r.get("data_wait_s", 0.0) for r in records]
        steady = waits[2:] if len(waits) > 3 else waits[1:]
        return {"samples": len(p.planned), "skipped": len(issues),
                "skipped_by_kind": dict(collections.Counter(e.kind for e in issues)),
                "issues_file": str(path), "batches_per_epoch": p.loader.batches_per_epoch(),
                "epochs": self.config.steps / p.loader.batches_per_epoch(),
                "data_wait_median_s": statistics.median(waits) if waits else 0.0,
                "data_wait_median_steady_s": statistics.median(steady) if steady else 0.0,
                "data_wait_max_s": max(waits, default=0.0)}

    def _say_data_issues(self) -> None:
        """When records were skipped since the last report: one line with the running count by kind,
        and data_issues.tsv rewritten to list them all (process 0)."""
        from dhp_jax.data.finetune import write_issues

        issues = list(self.pipeline.issues)
        if len(issues) <= self._said_issues or self.process_index:
            return
        self._said_issues = len(issues)
        path = self.metrics_dir / "data_issues.tsv"
        write_issues(str(path), issues)
        kinds = collections.Counter(e.kind for e in issues)
        self._say(f"{len(issues)} record(s) skipped so far: "
                  + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
                  + f"; see {path}")

    def _interrupted(self, ckpt: Any, state: Any, done: int, forced: bool, logs: list[Path],
                     fresh: bool) -> RunInterrupted:
        """After Ctrl-C: checkpoint the last finished step `done` (unless it has one, or a second
        Ctrl-C cut an update short, or peers would have to join the save), drop the run's logs
        when they hold nothing, and say where the run can resume from."""
        latest = ckpt.latest_step()
        detail = ""
        if done and latest != done and not forced and not self.multi_process:
            ckpt.save(done, state, data_position=done, model_config=self.model_config.to_dict(),
                      run_config=self.config.to_dict(), extra=self._checkpoint_extra(done))
            latest = done
        elif done and latest != done:
            detail = f"step {done} has no checkpoint (" + ("stopped mid-update" if forced else "multi-process run") + ")"
        if fresh:
            for path in logs:   # nothing was written: leave no empty files behind
                with contextlib.suppress(OSError):
                    if path.stat().st_size == 0:
                        path.unlink()
        return RunInterrupted(done, self.config.steps, str(ckpt.directory / str(latest)) if latest else None, detail)

    # ------------------------------------------------------------------ hooks
    def _programs_hook(self):
        def record(rec: dict, item: Any, state: Any) -> None:
            self._ran.add_keys(self.plan_source.issued.pop(item.step, ()))
        return record

    def _plan_log_hook(self, plan_log: Any):
        def log_plan(rec: dict, item: Any, state: Any) -> None:
            if plan_log is not None:
                plan_log.write(item.step + 1, self.as_executed(item.plan, item.batch, item.prepared))
        return log_plan

    def as_executed(self, plan: Any, batch: Any, prepared: Any = None) -> Any:
        """The plan as these devices ran it, the one format of plans.jsonl: a plan made at full token
        counts (`planner.full_size`) gets the executed batch's tokens, the executor's buckets and one
        node (`planner.programs.cache.executed_view`); the decisions and estimates stay the planner's.
        Other plans, and a replayed plan file's, are logged as they are (so a log replays to the
        same log, across backends too). `prepared`: the step's `PreparedStep` (None: prepared here)."""
        if not self.plan_source.full_size or self.plan_source.plans is not None:
            return plan
        t = self.config.parallel.tensor     # a rank's devices are consecutive: its first one names it
        rank_of = {d.id: r // t for r, d in enumerate(self.devices)}
        ids_keys = (prepared or self.executor.prepare(batch.samples, plan)).id_keys
        keys = [(d, b, tuple(rank_of[i] for i in ids[::t]), a) for d, b, ids, a in ids_keys]
        return executed_view(plan, keys, [s.num_tokens for s in batch.samples])

    def _checkpoint_hook(self, ckpt: Any, stop: int):
        def save(rec: dict, item: Any, state: Any) -> None:
            done = rec["step"]
            if ckpt.should_save(done) or done == stop:
                # with the executables of the plans run so far: a resumed run plans as this one does
                ckpt.save(done, state, data_position=done, model_config=self.model_config.to_dict(),
                          run_config=self.config.to_dict(), extra=self._checkpoint_extra(done))
        return save

    def _checkpoint_extra(self, done: int) -> dict:
        """The trainer's part of a checkpoint's meta: the executables of the plans run so far (a
        resumed run plans as this one does), the flat layout (a run on another rank count re-pads
        the state, a reader without jax unflattens it) and, fine-tuning, the loader state whose
        next batch is step `done`'s (a resumed run takes exactly that batch)."""
        extra: dict[str, Any] = {"programs": self._ran.to_json(), "layout": self.executor.layout.record()}
        if hasattr(self.executor, "launch_counts"):    # what decides each program's compile tier
            extra["launches"] = self.executor.launch_counts()
        if self.finetune:
            extra["loader"] = self.pipeline.loader_state(done)
        return extra

    def _restore_loader(self, meta: dict, start: int) -> None:
        if not self.finetune:
            return
        if "loader" not in meta:
            raise CheckpointError(f"checkpoint step {meta.get('step')} holds no loader state: it is not a "
                                  "fine-tuning run's checkpoint")
        try:
            self.pipeline.check_state(meta["loader"], start)
        except ValueError as e:
            raise CheckpointError(f"checkpoint step {meta.get('step')}: {e}") from None

    def _restore_programs(self, meta: dict, start: int) -> None:
        """The program knowledge of the uninterrupted run at step `start`: the executables of the
        plans of steps < start, stored in the checkpoint (a checkpoint without them, of a live
        DHP run, is refused: its plans would differ from the uninterrupted run's)."""
        keys = meta.get("programs")
        if hasattr(self.executor, "set_launch_counts"):  # each program's tier switches where it did
            self.executor.set_launch_counts(meta.get("launches") or {})
        saved = meta.get("layout") or {}
        # ranks: a record's num_shards counts devices, t of them per rank
        saved_ranks = int(saved["num_shards"]) // int(saved.get("tensor_parallel", 1)) if saved else None
        if saved_ranks is not None and saved_ranks != len(self.devices) // self.executor.tensor_parallel:
            # the record names groups of another rank count: no uninterrupted run on this count
            # exists to plan like, so this run plans as a fresh one on its ranks would
            self._say(f"the checkpoint was written on {saved_ranks} ranks, this run has {self.config.num_ranks}: "
                      f"the state is re-laid onto {self.config.num_ranks} ranks and plans are made for them "
                      f"from step {start + 1}, assuming no group program compiled")
            return
        if keys is None:
            if self.plan_source.plans is None and self.plan_source.strategy == "dhp" and start:
                raise CheckpointError(f"checkpoint step {meta.get('step')} holds no program record (written by an "
                                      "older dhp_jax): a resumed DHP run would plan differently from the "
                                      "uninterrupted one; start the run again or replay its plans.jsonl "
                                      "(planner.plan_file=...)")
            keys = []
        self._ran.add_keys(keys)
        self.plan_source.programs.add_keys(keys)

    def _compile_ahead(self, compiler: concurrent.futures.Executor):
        """`after_plan` for the planner thread: as soon as a plan is made and prepared (up to
        `planner.lookahead` steps ahead of the step that runs), its programs compile on the
        `compiler` worker (ahead of time: the executor knows the params' layout), so that the step
        finds them built. The plan runs as planned: a step whose programs are still compiling waits
        for them (its record says how long, `compile_wait_s`). One worker: compiles run in plan
        order, one at a time."""
        executor = self.executor

        def compile_step(prepared: Any) -> None:
            try:
                executor.compile_step(prepared, None)
            except Exception:  # the step that runs the plan compiles in place and raises there
                pass

        def after_plan(item: Any) -> None:
            if item.prepared is not None:   # a plan that did not prepare is prepared (and fails) at its step
                compiler.submit(compile_step, item.prepared)

        return after_plan

    def _lr(self, step: int) -> float:
        return float(make_schedule(self.config.optim, self.config.steps)(step))
