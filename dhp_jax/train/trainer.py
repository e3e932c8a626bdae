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
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dhp_jax.planner.planfile import PlanLog
from dhp_jax.train.config import TrainConfig
from dhp_jax.train.interrupt import RunInterrupted, SigintGuard
from dhp_jax.train.pipeline import DataPipeline
from dhp_jax.train.plans import PlanSource, describe_cost, load_plan_file, make_cost


@functools.lru_cache(maxsize=8)
def _state_functions(model_config: Any, optim: tuple, steps: int, executor: Any) -> tuple[Any, Any]:
    """Jitted state init and update, shared by every run with the same model, optimizer and executor
    (a resumed run, or the runs of one test module, compile them once). The state is sharded over
    the executor's full mesh: params are its fp32 master vector, AdamW's moments follow it."""
    import jax

    from dhp_jax.model import init_params
    from dhp_jax.train.config import OptimConfig
    from dhp_jax.train.state import make_init, make_optimizer, make_update

    optimizer = make_optimizer(OptimConfig(*optim), steps)
    layout, sharding = executor.layout, executor.state_sharding
    init = make_init(lambda k: layout.ravel(init_params(model_config, k)), optimizer, sharding)
    update = make_update(optimizer, sharding, jax.eval_shape(init, jax.random.PRNGKey(0)))
    return init, update


def plan_hash(plan: Any) -> str:
    """Short digest of a plan's decisions (`Plan.digest`): equal on every process that planned the
    same batch the same way; solver timings and flags never enter it."""
    return plan.digest()


WARMUP_STEPS = 5  # steps allowed to compile in place (the summary counts later steps that waited)


def enable_compilation_cache(setting: str | None, out_dir: Path) -> Path | None:
    """Turn on JAX's persistent compilation cache ("auto": <out_dir>/jax-cache; None: off), so a
    rerun or a resumed run loads its programs instead of compiling them. JAX reads the directory
    when it first compiles: the first setting in a process holds."""
    if not setting:
        return None
    import jax

    path = out_dir / "jax-cache" if setting == "auto" else Path(setting)
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


class TrainError(RuntimeError):
    """The run cannot start; the message says what is missing or wrong."""


def checkpoint_dir(config: TrainConfig) -> Path:
    return Path(config.checkpoint.dir) if config.checkpoint.dir else Path(config.metrics.out_dir) / "checkpoints"


def check_resumable(config: TrainConfig) -> None:
    """`--resume` of a run that has no checkpoint directory: a `CheckpointError`, raised before
    anything (the checkpoint or compilation-cache directory) is created."""
    from dhp_jax.train.checkpoint import CheckpointError

    path = checkpoint_dir(config)
    if not path.is_dir():
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


def prepare_run(config: TrainConfig, devices: Sequence[Any] | None = None) -> RunSetup:
    """Config, devices >= ranks, the plan file (every plan), the planning cost model, the model
    preset, the first batch and its plan (validated against the devices); `TrainError` otherwise."""
    import jax

    from dhp_jax.model import MLLMConfig

    config.validate()
    model_config = MLLMConfig.preset(config.model, remat=config.remat)
    available = list(devices) if devices is not None else jax.devices()
    if len(available) < config.num_ranks:
        raise TrainError(f"num_ranks={config.num_ranks} needs {config.num_ranks} devices but only "
                         f"{len(available)} {available[0].platform if available else ''} device(s) are visible"
                         + (" (for fake CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count="
                            f"{config.num_ranks} before jax is imported)" if available and
                            available[0].platform == "cpu" else ""))
    p = config.planner
    plans = None
    if p.plan_file:  # an unreadable plan file fails before anything is compiled
        plans = load_plan_file(p.plan_file, num_samples=config.data.batch_size, num_ranks=config.num_ranks,
                               steps=config.steps)
    if config.metrics.tensorboard:
        from dhp_jax.train.metrics import tensorboard_writer

        tensorboard_writer()  # a missing tensorboardX fails here, before anything is compiled
    try:
        cost = make_cost(p.cost_profile, p.cost_model, p.hardware, ranks_per_node=p.ranks_per_node or config.num_ranks,
                         num_ranks=config.num_ranks, comm_overlap=p.comm_overlap)
    except ValueError as e:
        raise TrainError(f"planning cost model: {e}") from None
    source = PlanSource(config.num_ranks, cost=cost, strategy=p.strategy, plans=plans,
                        num_micro_batches=p.num_micro_batches, full_size=p.full_size)
    pipeline = DataPipeline(config.data, model_config.vocab_size, model_config.patch_dim)
    try:  # an unknown mix, a manifest path that is not there or a bad manifest line: one line, no traceback
        batch = pipeline.batch(0)
    except (ValueError, OSError) as e:
        raise TrainError(f"data.dataset={config.data.dataset!r}: {e}") from None
    try:  # one plan now: a bad strategy or data setting is an error before anything is compiled
        plan = source(0, batch).validate(num_samples=len(batch.samples), num_devices=len(available))
    except (ValueError, TypeError) as e:
        raise TrainError(f"cannot plan the first batch with planner.strategy={p.strategy!r}"
                         f"{' (plan file)' if plans else ''}: {e}") from None
    return RunSetup(config, model_config, available[: config.num_ranks], plans, cost, source, pipeline, batch, plan)


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
        import jax

        self.process_index = jax.process_index()
        self.multi_process = jax.process_count() > 1
        setup = prepare_run(config, devices)
        self.config, self.model_config, self.devices = setup.config, setup.model_config, setup.devices
        self.cost, self.plan_source, self.pipeline = setup.cost, setup.plan_source, setup.pipeline
        enable_compilation_cache(config.compilation_cache, Path(config.metrics.out_dir))
        if executor is None:
            from dhp_jax.sharding import PlanExecutor

            kwargs = {"min_bucket": config.min_bucket} if config.min_bucket else {}
            if config.attention_tile:
                kwargs["attention_tile"] = config.attention_tile
            executor = PlanExecutor(self.model_config, self.devices, compute_dtype=config.compute_dtype, **kwargs)
        self.executor = executor
        # (a plan made at full token counts prices the preset's own rule: the executor's ladder is
        # for the scaled batch it runs)
        if (getattr(executor, "min_bucket", None) and self.plan_source.cost is not None
                and not self.plan_source.full_size):
            # one bucket rule: the planner prices (and writes into the plan) the ladder the executor runs
            self.cost = self.cost.replace(bucket_min=int(executor.min_bucket), bucket_growth=float(executor.growth),
                                          linear_chunk=int(getattr(executor, "linear_chunk", 0)))
            self.plan_source.cost = self.cost
        if not self.multi_process and self.plan_source.plans is None:
            from dhp_jax.planner.programs import ProgramCache

            # the programs issued so far; a plan needing a new one pays its measured compile time
            # (single process only: a measured figure would let processes plan differently)
            self.plan_source.programs = ProgramCache()
        self.out_dir = Path(config.metrics.out_dir)
        self.ckpt_dir = checkpoint_dir(config)
        self._state = None
        self._update = None
        # Multi-process (jax.distributed): each step the processes agree on the plan hash and a
        # watchdog bounds the wait for a dead peer (see dhp_jax.train.distributed).
        self.step_timeout_s = float(step_timeout_s)
        self._sync = None

    # ------------------------------------------------------------------ state
    def init_state(self) -> Any:
        import jax

        init, update = _state_functions(self.model_config, dataclasses.astuple(self.config.optim),
                                        self.config.steps, self.executor)
        state = init(jax.random.PRNGKey(self.config.seed))
        self._update = update
        return state

    def checkpointer(self):
        from dhp_jax.train.checkpoint import Checkpointer

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
    def train_step(self, state: Any, item: Any, on_compile: Any = None) -> tuple[Any, dict]:
        """Compile what the step's plan needs (timed apart), run it, update; returns the step's record."""
        import jax

        done = item.step + 1
        digest = plan_hash(item.plan)
        if self._sync is not None:
            self._sync.agree(done, digest)
        # compile outside the step's timing (and outside the multi-process watchdog)
        t0 = time.perf_counter()
        new, missing = self._compile_waiting(item, state.params, on_compile)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with self._sync.watch(done) if self._sync is not None else contextlib.nullcontext():
            loss, grads = self.executor.loss_and_grad_shards(state.params, item.batch.samples, item.plan)
            state, grad_norm = self._update(state, grads)
            jax.block_until_ready((loss, grad_norm, state.params))
        step_time = time.perf_counter() - t0
        rec = {"step": done, "loss": float(loss), "grad_norm": float(grad_norm), "lr": float(self._lr(item.step)),
               "tokens": item.batch.num_tokens, "samples": len(item.batch.samples), "step_time_s": step_time,
               "compile_s": compile_s, "new_compiles": new,
               # the planned programs were not compiled yet: the step ran on compiled ones instead
               "ran_on_compiled_substitute": bool(item.plan.solver.get("promoted_groups")
                                                  or item.plan.solver.get("packed_on_executables")),
               # measured: the step waited for a compile (its own or one in flight in the background)
               "compile_wait_s": compile_s if missing else 0.0,
               "plan_wait_s": item.wait_s, "plan_solve_s": item.plan_s, "batch_build_s": item.build_s,
               "strategy": self.plan_source.label, "degrees": item.plan.degrees, "plan_hash": digest,
               "num_compiles": getattr(self.executor, "num_compiles", None)}
        return state, rec

    def _compile_waiting(self, item: Any, params: Any, on_compile: Any) -> tuple[int, int]:
        """`_compile` on a helper thread while the main thread waits: `on_compile(missing, done,
        elapsed_s)` shows the progress every quarter second, and Ctrl-C ends the wait at once
        (`interrupt.SigintGuard`), leaving the compile to finish on its own."""
        from dhp_jax.train.interrupt import wait_polling

        first = getattr(self.executor, "num_compiles", 0) or 0
        missing = [0]

        def said(count: int) -> None:
            missing[0] = count
            if on_compile is not None:
                on_compile(count)

        def poll(elapsed_s: float) -> None:
            if on_compile is not None and missing[0]:
                on_compile(missing[0], (getattr(self.executor, "num_compiles", 0) or 0) - first, elapsed_s)

        guard = getattr(self, "_guard", None)
        with guard.allowed() if guard is not None else contextlib.nullcontext():
            return wait_polling(self._compile, (item, params, said), poll)

    def _compile(self, item: Any, params: Any, on_compile: Any) -> tuple[int, int]:
        """Build what the plan needs: (executables this call built, executables missing when the
        step started, built here or by the compile-ahead worker while this step waited)."""
        compile_plan = getattr(self.executor, "compile_plan", None)
        if compile_plan is None:
            return 0, 0
        missing = 0
        if hasattr(self.executor, "plan_keys"):
            missing = len(set(self.executor.plan_keys(item.batch.samples, item.plan))
                          - set(self.executor.executable_keys))
            if missing and on_compile is not None:
                on_compile(missing)
        return int(compile_plan(item.batch.samples, item.plan, params)), missing

    # ------------------------------------------------------------------ the loop
    def run(self, resume: bool = False, stop_after: int | None = None, overwrite: bool = False) -> RunResult:
        """Train to `config.steps` (or stop after `stop_after` steps, checkpointing, as an interrupted run).

        A directory holding an earlier run's checkpoints is refused unless `resume` (continue it) or
        `overwrite` (replace it); resuming a finished run changes nothing.
        """
        from dhp_jax.train.checkpoint import CheckpointError
        from dhp_jax.train.metrics import MetricsWriter, truncate_jsonl
        from dhp_jax.train.planner_thread import PlannerThread

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
            if resume:
                restored = ckpt.restore(state, self.model_config.to_dict())
                state, start = restored.state, restored.data_position
                if start >= cfg.steps:
                    self._say(f"run {cfg.name!r} is already finished (step {start} of {cfg.steps}, checkpoint "
                              f"{ckpt.directory / str(restored.step)}); nothing to do")
                    self._state = state
                    return RunResult([], [], self._stored_summary(), state, finished_before=True)
                self._say(f"resumed from step {restored.step} (checkpoint {ckpt.directory / str(restored.step)})")
            elif latest is not None:
                old = ckpt.clear()
                self._say(f"--overwrite: removed checkpoints {old} of an earlier run in {str(ckpt.directory)!r}")
        except BaseException:
            ckpt.close()
            raise
        stop = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
        if cfg.metrics.progress:
            self._say(f"run {cfg.name!r}: steps {start + 1}-{stop} of {cfg.steps} on {len(self.devices)} "
                      f"{self.devices[0].platform} devices into {str(self.out_dir)!r}; plans: {self.plan_source.label}, "
                      + describe_cost(self.cost, cfg.planner.cost_profile, cfg.planner.full_size))
        if self.multi_process:
            from dhp_jax.train.distributed import StepSync

            self._sync = StepSync(self.step_timeout_s)
        mdir = self.metrics_dir
        earlier: list[dict] = []
        if resume:  # records past the restored step were never checkpointed: they are redone below
            earlier = truncate_jsonl(mdir / "metrics.jsonl", lambda r: r.get("step", 0) <= start)
            truncate_jsonl(mdir / "plans.jsonl", lambda r: r.get("step", 0) < start)
        metrics = MetricsWriter(mdir, total_steps=cfg.steps, start_step=start, progress=cfg.metrics.progress,
                                tensorboard=cfg.metrics.tensorboard, append=resume)
        plan_log = PlanLog(mdir / "plans.jsonl", append=resume) if cfg.metrics.log_plans else None
        hooks = [lambda rec, item, state: metrics.log_step(rec), self._plan_log_hook(plan_log),
                 self._checkpoint_hook(ckpt, stop)]
        t_run = time.perf_counter()
        records: list[dict] = []
        # Ctrl-C: stop within seconds at a point where the state is whole, checkpoint the last
        # finished step, raise RunInterrupted (dhp_jax.train.interrupt)
        guard = self._guard = SigintGuard().__enter__()
        interrupted = False
        try:
            ahead = None if self.multi_process else self._compile_ahead(start)
            self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dhp-compile")
            with PlannerThread(self.pipeline.batch, ahead[0] if ahead else self.plan_source, start, stop,
                               lookahead=cfg.planner.lookahead, after_plan=ahead[1] if ahead else None) as planned:
                for item in planned:
                    with guard.deferred():  # a Ctrl-C here stops after this step
                        state, rec = self.train_step(state, item, on_compile=metrics.compiling)
                        records.append(rec)
                        seconds = getattr(self.executor, "compile_seconds", None)
                        if self.plan_source.programs is not None and seconds:  # the planner's price of a new program
                            self.plan_source.programs.compile_s = float(np.median(seconds))
                        for hook in hooks:
                            hook(rec, item, state)
                    guard.check()
            metrics.close()
            loop_s = time.perf_counter() - t_run
            summary = self.summarize(earlier + records, loop_s, start)
            if summary and cfg.compare.enabled and stop == cfg.steps and stop_after is None:
                from dhp_jax.train.compare import compare_plans

                t0 = time.perf_counter()
                summary["compare"] = compare_plans(self, state.params, first_step=cfg.steps,
                                                   progress=cfg.metrics.progress and self.process_index == 0)
                summary["time_s"]["comparison"] = time.perf_counter() - t0
                png = self._plot_simulated(summary["compare"])
                if png:
                    summary["plan_png"] = str(png)
            if summary:
                summary["time_s"]["wall"] = summary["wall_time_s"] = time.perf_counter() - t_run
            if records or earlier:  # never a summary without real figures
                metrics.write_json("summary.json", summary)
        except KeyboardInterrupt:
            interrupted = True
            raise self._interrupted(ckpt, state, start + len(records), guard.forced,
                                    [metrics.path] + ([plan_log.path] if plan_log is not None else []),
                                    fresh=not (records or earlier)) from None
        finally:
            guard.__exit__()
            self._guard = None
            if getattr(self, "_compiler", None) is not None:
                # at most one compile in flight; after Ctrl-C it is left to finish on its own
                self._compiler.shutdown(wait=not interrupted, cancel_futures=True)
                self._compiler = None
            metrics.close()
            if plan_log is not None:
                plan_log.close()
            ckpt.close()
        self._state = state
        return RunResult(losses=[r["loss"] for r in records], records=records, summary=summary, state=state)

    def _interrupted(self, ckpt: Any, state: Any, done: int, forced: bool, logs: list[Path],
                     fresh: bool) -> RunInterrupted:
        """After Ctrl-C: checkpoint the last finished step `done` (unless it has one, or a second
        Ctrl-C cut an update short, or peers would have to join the save), drop the run's logs
        when they hold nothing, and say where the run can resume from."""
        latest = ckpt.latest_step()
        detail = ""
        if done and latest != done and not forced and not self.multi_process:
            ckpt.save(done, state, data_position=done, model_config=self.model_config.to_dict(),
                      run_config=self.config.to_dict())
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
    def _plan_log_hook(self, plan_log: Any):
        def log_plan(rec: dict, item: Any, state: Any) -> None:
            if plan_log is not None:
                plan_log.write(item.step, self.as_executed(item.plan, item.batch))
        return log_plan

    def as_executed(self, plan: Any, batch: Any) -> Any:
        """The plan as these devices ran it, the one format of plans.jsonl: a plan made at full token
        counts (`planner.full_size`) gets the executed batch's tokens, the executor's buckets and one
        node (`planner.programs.executed_view`), as a step that ran on compiled substitutes already
        has; the estimates stay the planner's. Other plans are logged as they are."""
        if not self.plan_source.full_size or not hasattr(self.executor, "plan_keys"):
            return plan
        from dhp_jax.planner.programs import executed_view

        rank_of = {d.id: r for r, d in enumerate(self.devices)}
        keys = [(d, b, tuple(rank_of[i] for i in ids), a) for d, b, ids, a in self.executor.plan_keys(batch.samples, plan)]
        return executed_view(plan, keys, [s.num_tokens for s in batch.samples])

    def _checkpoint_hook(self, ckpt: Any, stop: int):
        def save(rec: dict, item: Any, state: Any) -> None:
            done = rec["step"]
            if ckpt.should_save(done) or done == stop:
                ckpt.save(done, state, data_position=done, model_config=self.model_config.to_dict(),
                          run_config=self.config.to_dict())
        return save

    def _compile_ahead(self, start: int) -> tuple[Any, Any] | None:
        """(make_plan, after_plan) for the planner thread, so that no step after warm-up waits for
        a compile: the next plan's programs compile in the background (ahead of time: the executor
        knows the params' layout) while the current step runs; after the first WARMUP_STEPS steps
        a plan whose programs are not all compiled yet runs its groups in the smallest compiled
        bucket of their degree, attention kind and ranks that holds them (`planner.programs.promote`;
        if a group is larger than every compiled bucket, the batch is re-planned in up to 3 more
        micro-batches first; failing that, its samples are packed onto compiled executables,
        `planner.programs.pack_on`), while its own programs compile for later steps. A plan made at
        full token counts is promoted in the executor's view of it (`planner.programs.executed_view`:
        the scaled tokens, the executor's buckets). Single process only (plans must not depend on
        timing)."""
        from dhp_jax.planner.programs import executed_view, pack_on, promote

        executor = self.executor
        if not hasattr(executor, "compile_plan"):
            return None
        rank_of = {d.id: r for r, d in enumerate(self.devices)}
        wanted: dict[int, Any] = {}
        source = self.plan_source

        def by_rank(keys: Any) -> list:
            """Executable keys (degree, bucket, device ids, attention) with plan ranks for device ids."""
            return [(d, b, tuple(rank_of[i] for i in ids), a) for d, b, ids, a in keys]

        def executed(batch: Any, plan: Any, keys: list | None = None) -> Any:
            # a plan made at full token counts names no bucket of the scaled batch it runs: it is
            # promoted in the executor's view (the scaled tokens and the executor's buckets)
            if not source.full_size:
                return plan
            if keys is None:
                keys = by_rank(executor.plan_keys(batch.samples, plan))
            return executed_view(plan, keys, [s.num_tokens for s in batch.samples])

        def make_plan(step: int, batch: Any) -> Any:
            plan = source(step, batch)
            if step < start + WARMUP_STEPS:
                return plan
            have = set(by_rank(executor.executable_keys))
            need = by_rank(executor.plan_keys(batch.samples, plan))
            if set(need) <= have:
                return plan
            # (the memory check prices full-size tokens: the executed view is checked by its executor)
            budget = None if source.full_size else self.cost
            ready = promote(executed(batch, plan, need), have, budget)
            if ready is None and source.plans is None and source.strategy == "dhp":
                # a group larger than every compiled bucket: more micro-batches make smaller groups
                saved, first = source.num_micro_batches, len(plan.micro_batches) + 1
                try:
                    for m in range(first, min(len(batch.samples), first + 2) + 1):
                        source.num_micro_batches = m
                        ready = promote(executed(batch, source(step, batch)), have, budget)
                        if ready is not None:
                            break
                finally:
                    source.num_micro_batches = saved
            if ready is None:  # the last resort: the samples packed onto compiled executables
                ready = pack_on(plan, [s.num_tokens for s in batch.samples], have)
            if ready is None:
                return plan
            wanted[step] = plan
            return ready

        def compile_plans(batch: Any, plans: list) -> None:
            for plan in plans:
                try:
                    executor.compile_plan(batch.samples, plan, None)
                except Exception:  # the step that runs the plan compiles in place and raises there
                    pass

        def compile_plan(step: int, batch: Any, plan: Any) -> None:
            # what this step runs, then what the planner wanted; on a worker thread, so that
            # planning the steps after it never waits behind a compile
            self._compiler.submit(compile_plans, batch, [plan] + ([wanted.pop(step)] if step in wanted else []))

        return make_plan, compile_plan

    def _lr(self, step: int) -> float:
        from dhp_jax.train.state import make_schedule

        return float(make_schedule(self.config.optim, self.config.steps)(step))

    def _stored_summary(self) -> dict:
        path = self.metrics_dir / "summary.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def _plot_simulated(self, comp: dict) -> Path | None:
        """The Gantt of one simulated DHP step (ranks x time) beside the metrics; None without matplotlib."""
        plan = comp.get("simulated", {}).pop("_plan", None)
        if plan is None or self.process_index:
            return None
        try:
            from dhp_jax.planner.plot import plot_plan

            path = self.metrics_dir / "plan_simulated_step.png"
            sim = comp["simulated"]
            title = (f"DHP plan of one simulated step: {sim['model']} on {sim['hardware']}, {sim['ranks']} ranks, "
                     f"global batch {sim['batch_size']}")
            plot_plan(plan, path, title=title, allreduce_s=sim.get("allreduce_s", 0.0))
            return path
        except ImportError:
            return None

    # ------------------------------------------------------------------ summary
    def summarize(self, records: list[dict], loop_s: float, start: int) -> dict:
        cfg = self.config
        waits = [r["plan_wait_s"] for r in records]
        steady = waits[2:] if len(waits) > 3 else waits[1:]  # first steps: thread start + compiles
        losses = [r["loss"] for r in records]
        k = max(1, min(3, len(losses) // 4))
        groups = collections.Counter(d for r in records for mb in r["degrees"] for d in mb)
        return {
            "name": cfg.name, "config": cfg.to_dict(), "model_config": self.model_config.to_dict(),
            "devices": f"{len(self.devices)} x {self.devices[0].platform} ({self.devices[0].device_kind})",
            "start_step": start, "steps_run": len(records),
            # where the time went: step work, compiles, the end comparison (filled in by run), the rest
            "time_s": {"steps": sum(r["step_time_s"] for r in records),
                       "compiles": sum(r.get("compile_s", 0.0) for r in records), "loop": loop_s,
                       "first_step": records[0]["step_time_s"] if start == 0 else None},
            "loss_first": losses[0], "loss_last": losses[-1],
            "loss_first_mean": float(np.mean(losses[:k])), "loss_last_mean": float(np.mean(losses[-k:])),
            "step_time_median_s": statistics.median(r["step_time_s"] for r in records),
            "plan_wait_median_s": statistics.median(steady) if steady else 0.0,
            "plan_wait_max_steady_s": max(steady) if steady else 0.0,
            "plan_solve_median_s": statistics.median(r["plan_solve_s"] for r in records),
            "num_compiles": getattr(self.executor, "num_compiles", None),
            # measured: a step waited when a program it runs was not compiled yet when it started
            "steps_waiting_for_compile_after_warmup": sum(
                1 for r in records if r["step"] > start + WARMUP_STEPS and r.get("compile_wait_s", 0.0) > 0),
            "warmup_steps": WARMUP_STEPS,
            # steps whose own programs were still compiling: promoted to compiled buckets or packed
            "steps_on_compiled_substitutes": sum(1 for r in records if r.get("ran_on_compiled_substitute")),
            "groups_by_degree": {str(d): n for d, n in sorted(groups.items())},
            "planning": f"{self.plan_source.label}: " + describe_cost(self.cost, cfg.planner.cost_profile,
                                                                      cfg.planner.full_size),
            "labels": {"step_time": f"measured on {len(self.devices)} {self.devices[0].platform} devices of this "
                                    f"machine" + ("; they share the host's cores: a correctness and overhead run, "
                                                  "not a speed-up" if self.devices[0].platform == "cpu" else "")},
        } if records else {}
