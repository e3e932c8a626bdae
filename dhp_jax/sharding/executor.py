"""`PlanExecutor`: one DHP step (all micro-batches of a `Plan`) as per-group executables.

The state is sharded over the full mesh (`dhp_jax.sharding.flat`): master params (fp32) and the
optimizer state are flat vectors x[P_pad] sharded P("dp"), each rank owning P_pad/N elements.
Data flow of `run_step(master, prepared)` (the training step's path; `loss_and_grad_shards(master, samples, plan)`
prepares, then runs):
1. `prepare(samples, plan)`: check the plan and lay out every group's samples before any device
   work, so bad input fails fast, naming the group or the sample (a `PreparedStep`, made once per
   step); compile what is missing.
2. One all-gather (one jit on the full mesh) turns the master shards into the params flat[P_pad]
   in the compute dtype (bf16 or fp32), replicated. For each group: the sub-mesh over its devices
   (cached), a view of that vector on the sub-mesh made from the same per-device buffers (no
   copy), the layout put on the sub-mesh sharded over `cp` as two arrays, and the executable for
   (degree, bucket, devices). The group program (shard_map + ring attention) returns, per device,
   stats f32[1, 2] (loss sum, loss-token count) and the gradient of its loss sum grads[1, P_pad]
   in the compute dtype (a bf16 row bit-cast to uint16, `row_dtype`).
3. Micro-batch by micro-batch: its groups are dispatched, the step waits until their rows are
   computed (`await_rows`: no collective is launched on a row a failed group never writes; groups
   slow to finish are named), then its reduction is enqueued before the next micro-batch's groups, so a device's gradient row is consumed before that device starts its
   next group program (a device runs what it is given in order) and the step holds at most one row
   per device, whatever the number of micro-batches.
4. The reduction: the devices' rows (a fresh zero row for an idle device, freed with the
   reduction) are assembled into one [N, P_pad] array over the full `dp` mesh with
   `jax.make_array_from_single_device_arrays` (no copy, no host round trip) and reduce-scattered
   piece by piece (`reduce_pieces`: a loop over column blocks of the row seen as [N, P_pad/N], each
   block cast to fp32 and `psum_scatter`ed, so at most one piece is ever held in fp32, never the
   whole row) into the fp32[P_pad/N] accumulator shard of each device (donated, updated in place).
   At the end the 2N stats are summed and the shards divided by the token count: the token-weighted
   mean, each group counted once. What a step holds per device is priced by
   `dhp_jax.planner.cost.memory` (`memory.device_step_bytes`) and measured by `dhp bench memory --step`.
`loss_and_grads(params, samples, plan)` wraps this for a float32 params tree: shard it, run the
step, gather the grads back into a replicated tree (the exactness tests' path).

The executor is composed of parts: the model adapter (`model_adapter`: `standin.StandInModel` for
an `MLLMConfig`, `family.FamilyModel` for a Hugging Face family's `HFConfig`: the group layout, host
inputs and group program), the compile cache (`compile_cache.CompileCache`: build, load onto other
devices, the persistent cache, the CPU compile tiers), the sharded train state
(`sharded_state.ShardedState`: shard, gather, accumulate, update) and the attention builders of the
kinds (`dhp_jax.sharding.attention`). One thread launches device work, in plan order; compile
threads only build. Multi-process JAX: a process launches the groups that touch its addressable
devices and contributes only its addressable rows (`PreparedStep.local`); groups may span
processes (tests/test_multiprocess_jax.py: 2 processes x 4 CPU devices, gloo).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from dhp_jax.checks import positive_int
from dhp_jax.data.sample import Sample
from dhp_jax.geometry.layout import GROWTH, LINEAR_CHUNK, MIN_BUCKET, ladder, planned_bucket
from dhp_jax.model.mllm_config import MLLMConfig
from dhp_jax.planner.contract.kinds import RING, resolve
from dhp_jax.planner.contract.plan import Plan, PlanValidationError
from dhp_jax.sharding import tensor_parallel as tensor_split
from dhp_jax.sharding.attention import attention_fn
from dhp_jax.sharding.compile_cache import (CPU_FAST_COMPILE, CPU_TUNED, TIER_LEAD, TIER_MIN_FLOPS,  # noqa: F401
                                            TIER_UP_RUNS, CompileCache, compile_counting_cache_hits)
from dhp_jax.sharding.family_adapter import FamilyModel
from dhp_jax.sharding.flat import FlatLayout
from dhp_jax.sharding.mesh import RankLayout
from dhp_jax.sharding.prepared import GroupWork, PreparedStep
from dhp_jax.sharding.router_phase import RouterPhase, aux_coef_of
from dhp_jax.sharding.sharded_state import ShardedState, require_float32, row_dtype  # noqa: F401
from dhp_jax.sharding.standin import INT_COLUMNS, StandInModel, group_program, pack_inputs, stacks_of  # noqa: F401
from dhp_jax.sharding.tiles import DEFAULT_TILE

# the public names of the engine, some of them at home in the executor's parts
__all__ = ["COMPUTE_DTYPES", "CPU_FAST_COMPILE", "CPU_STALL_TIMEOUT_S", "CPU_TUNED", "INT_COLUMNS", "TIER_LEAD",
           "TIER_MIN_FLOPS", "TIER_UP_RUNS", "GroupProgramError", "PlanExecutor", "PreparedStep",
           "compile_counting_cache_hits", "group_program", "model_adapter", "pack_inputs", "require_float32",
           "row_dtype", "stacks_of"]

COMPUTE_DTYPES = ("float32", "bfloat16")
# Seconds a step waits for its group programs' gradient rows before the groups not done are named
# (CPU devices): under XLA:CPU's own 40 s rendezvous termination timeout, which ends the process from
# inside a collective with no word of the step or the group.
CPU_STALL_TIMEOUT_S = 30.0


class GroupProgramError(RuntimeError):
    """A group program failed or did not finish; the message names the micro-batch, the group, its
    program (degree, bucket, attention) and its devices. `stalled`: it did not finish in time."""

    def __init__(self, message: str, stalled: bool = False) -> None:
        super().__init__(message)
        self.stalled = stalled


def model_adapter(config: Any) -> StandInModel | FamilyModel:
    """The model adapter of a config: a Hugging Face family's (`HFConfig`, which names its family)
    gets `FamilyModel`, anything else `StandInModel` (TypeError unless it is an `MLLMConfig`)."""
    if not isinstance(config, MLLMConfig) and hasattr(config, "family"):
        return FamilyModel(config)
    return StandInModel(config)


def describe(w: GroupWork) -> str:
    """A group as errors name it: micro-batch, index, program and devices."""
    return (f"micro-batch {w.micro_batch} group {w.index} (program degree {w.layout.degree}, bucket "
            f"{w.layout.bucket}, {w.attention}; devices {[d.id for d in w.devices]})")


def await_rows(rows: Mapping[jax.Device, tuple], work: Sequence[GroupWork], timeout_s: float | None,
               abort_s: float | None, on_stall: Callable[[str], None] | None) -> None:
    """Wait until the groups' gradient rows are computed, before their reduction is launched.

    The reduction is a collective over every device: launched on a row that a failed group
    program never writes, the other devices would wait in it until XLA:CPU ends the process.
    Here a failed group raises `GroupProgramError` naming it; groups not done within `timeout_s`
    are reported by name (`on_stall`, default a line on stderr), and after `abort_s` the wait ends
    with `GroupProgramError(stalled=True)` naming them."""
    if not rows:
        return
    done, failure = threading.Event(), []

    def wait() -> None:
        try:
            jax.block_until_ready([r[1] for r in rows.values()])
        except Exception as e:  # noqa: BLE001 - reported below, with the group it concerns
            failure.append(e)
        done.set()

    threading.Thread(target=wait, name="dhp-rows", daemon=True).start()
    if not done.wait(timeout_s):
        def late() -> str:
            names = [describe(w) for w in work if not all(rows[d][1].is_ready() for d in w.devices if d in rows)]
            return "; ".join(names) or "groups that finished meanwhile"

        report = on_stall or (lambda text: print(f"dhp_jax: {text}", file=sys.stderr, flush=True))
        report(f"waited {timeout_s:g} s for the gradient rows of {late()}: a group program may be stalled "
               f"(still waiting)")
        left = None if abort_s is None else max(0.0, abort_s - timeout_s)
        if not done.wait(left):
            raise GroupProgramError(f"waited {abort_s:g} s for the gradient rows of {late()}: a group program "
                                    f"stalled", stalled=True)
    if failure:
        for w in work:
            for d in w.devices:
                try:
                    rows[d][1].block_until_ready()
                except Exception as e:  # noqa: BLE001
                    raise GroupProgramError(f"{describe(w)} failed: {str(e).strip().splitlines()[0][:300]}") from None
        raise GroupProgramError(f"a group program failed: {str(failure[0]).strip().splitlines()[0][:300]}")


class PlanExecutor:
    """Runs a `Plan` on device sub-meshes; exact token-mean loss and grads (module docstring).

    `config`: an `MLLMConfig` (the stand-in) or a Hugging Face family's `HFConfig` (`model_adapter`).
    `executor.mesh` is the full 1-D mesh, `executor.replicated` the P() sharding on it and
    `executor.sharded` the P("dp") sharding of the train state's flat vectors (`executor.layout`;
    `executor.state`, a `ShardedState`). `compute_dtype` is the dtype the groups compute in
    ("float32": exact; "bfloat16": params cast once per step, fp32 softmax statistics, loss and
    reductions). `attention_tile` is the ring's largest tile (tokens, `dhp_jax.sharding.tiles`);
    `attention`, if given, builds the ring groups' attention function from (axis name, degree)
    instead of the tiled ring. `linear_chunk` (tokens, default `dhp_jax.geometry.layout.LINEAR_CHUNK`;
    0: off) cuts every block's linear work into chunks and skips the chunks of a shard's padding
    tail: a rank computes ceil(real / chunk) chunks, what `CostModel.geometry.linear_chunk` prices.
    `tensor_parallel` = t: a rank is t consecutive devices (`devices[r t:(r+1) t]`, inside one node)
    running one model replica split Megatron-style (`dhp_jax.sharding.tensor_parallel`); plans name ranks
    (devices / t), as at t = 1. `reuse_compiled`, `tiers`, `tier_up_runs`, `compiler_options`: the
    compile cache's (`executor.compiles`, a `CompileCache`; None: on where every device is a CPU, the
    tiers unless `compiler_options` is given). `stall_timeout_s` ("auto": `CPU_STALL_TIMEOUT_S` on
    CPU devices, else None), `stall_abort_s`, `on_stall`: a micro-batch's wait for its rows (`await_rows`).
    `router_aux_loss_coef`: a mixture of experts' load-balancing loss (`router_phase`; `router`: None when off).
    """

    def __init__(self, config: Any, devices: Sequence[jax.Device] | None = None, *,
                 compute_dtype: str = "float32", min_bucket: int = MIN_BUCKET, growth: float = GROWTH,
                 compiler_options: Mapping[str, Any] | None = None, attention_tile: int = DEFAULT_TILE,
                 attention: Callable[[str, int], Callable[..., jax.Array]] | None = None,
                 linear_chunk: int = LINEAR_CHUNK, tensor_parallel: int = 1, sequence_parallel: bool = False,
                 reuse_compiled: bool | None = None, tiers: bool | None = None, tier_up_runs: int = TIER_UP_RUNS,
                 stall_timeout_s: float | None | str = "auto", router_aux_loss_coef: float | None = None) -> None:
        self.model = model_adapter(config)
        self.aux_coef = aux_coef_of(self.model, router_aux_loss_coef)
        self.tensor_parallel = positive_int(tensor_parallel, "tensor_parallel")
        if sequence_parallel and tensor_parallel == 1:
            raise ValueError("sequence_parallel needs tensor_parallel > 1 (it splits a rank's rows over its devices)")
        self.sequence_parallel = bool(sequence_parallel)
        if tensor_parallel > 1:
            self.model.check_tensor_parallel(tensor_parallel)
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
        self.config = config
        self.ranks = RankLayout(jax.devices() if devices is None else devices, tensor_parallel)
        ladder(1, min_bucket, growth)                 # rejects a bad ladder now, not mid-step
        self.min_bucket, self.growth = min_bucket, growth
        self.attention_tile, self._attention = positive_int(attention_tile, "attention_tile"), attention
        if isinstance(linear_chunk, bool) or not isinstance(linear_chunk, int) or linear_chunk < 0:
            raise ValueError(f"linear_chunk must be an integer >= 0 (0: no pad skipping), got {linear_chunk!r}")
        self.linear_chunk = linear_chunk
        self._program_config = self.model.program_config(linear_chunk)
        cpu = all(d.platform == "cpu" for d in self.ranks.devices)
        # CPU devices, default options: tiers (a fast build first, XLA's defaults once a program has
        # run `tier_up_runs` times); other backends keep XLA's defaults, one build per program
        # (DHP_COMPILE_TIERS=0 turns the default off: the test suite, which runs programs a few times
        # each and would pay for every second build)
        tiers = (cpu and compiler_options is None and os.environ.get("DHP_COMPILE_TIERS", "1") != "0"
                 if tiers is None else bool(tiers))
        self.compiles = CompileCache(self.lower, lambda devices, kind: self._mesh(devices, kind)[0], self._check_key,
                                     CPU_FAST_COMPILE if cpu and compiler_options is None else compiler_options or {},
                                     cpu if reuse_compiled is None else bool(reuse_compiled), tiers,
                                     positive_int(tier_up_runs, "tier_up_runs"))
        # a step waiting this long for its groups' rows is reported (`on_stall`: a line on stderr by
        # default), and ended with `GroupProgramError(stalled=True)` after `stall_abort_s` (None: never)
        self.stall_timeout_s = (CPU_STALL_TIMEOUT_S if cpu else None) if stall_timeout_s == "auto" else stall_timeout_s
        self.stall_abort_s: float | None = None
        self.on_stall: Callable[[str], None] | None = None
        abstract = self.model.abstract_params()
        self.state = ShardedState(self.ranks, compute_dtype, None if abstract is None else self._new_layout(abstract),
                                  self.model.stats_width)
        self.mesh, self.replicated, self.sharded = self.state.mesh, self.state.replicated, self.state.sharded
        self.compute_dtype = self.state.compute_dtype
        self.preparations = 0                             # plans prepared (`prepare`): one per step
        self.router = RouterPhase(self, await_rows) if self.aux_coef else None

    def _new_layout(self, params: Any) -> FlatLayout | tensor_split.TensorLayout:
        """The flat layout of a params tree (or of its abstract shapes) on these devices: with
        tensor parallelism the master vector holds each device's share (`tensor_split.TensorLayout`)."""
        t = self.tensor_parallel
        return (FlatLayout.of(params, len(self.ranks.devices)) if t == 1
                else tensor_split.TensorLayout(self.config, params, t, self.ranks.num_ranks))

    # ------------------------------------------------------------------ the parts' figures
    layout = property(lambda self: self.state.layout, doc="The train state's flat params layout.")
    num_compiles = property(lambda self: self.compiles.num_compiles + (self.router.num_compiles if self.router else 0),
                            doc="XLA executables built for groups (one per (degree, bucket, devices, attention)), routers too.")
    num_programs = property(lambda self: self.compiles.num_programs,
                            doc="Distinct (degree, bucket, attention) group programs so far.")
    executable_keys = property(lambda self: self.compiles.executable_keys,
                               doc="(degree, bucket, device ids, attention kind) of every executable built.")
    compile_seconds = property(lambda self: self.compiles.compile_seconds, doc="Wall time of every build.")
    compiler_options = property(lambda self: self.compiles.compiler_options, doc="The first tier's XLA options.")
    rebound_keys = property(lambda self: self.compiles.rebound_keys, doc="Executables loaded, not compiled.")
    row_size = property(lambda self: self.state.row_size, doc="Length of a device's params and gradient row.")

    def launch_counts(self) -> dict[str, int]:
        return self.compiles.launch_counts()

    def set_launch_counts(self, counts: Mapping[str, int]) -> None:
        self.compiles.set_launch_counts(counts)

    def stop_tuning(self) -> None:
        self.compiles.stop_tuning()

    # ------------------------------------------------------------------ planning-side work
    def prepare(self, samples: Sequence[Sample], plan: Plan) -> PreparedStep:
        """Check the plan against devices and samples, resolve each group's attention kind and lay out
        every group (no device work): the `PreparedStep` every consumer of the step takes."""
        samples = tuple(samples)
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise TypeError(f"sample {i} is a {type(s).__name__}, not a Sample")
        self.ranks.check_plan(plan, len(samples))
        heads = self.config.num_heads // self.tensor_parallel     # what a Ulysses all-to-all splits
        shapes = {}
        for m, mb in enumerate(plan.micro_batches):
            for gi, g in enumerate(mb.groups):
                try:
                    shapes[m, gi] = resolve(g.attention, g.degree, heads)
                except ValueError as e:
                    raise PlanValidationError(f"micro-batch {m} group {gi} (ranks {list(g.ranks)}): {e}") from None
        self.preparations += 1
        work = []
        for m, mb in enumerate(plan.micro_batches):
            for gi, g in enumerate(mb.groups):
                try:
                    group = [samples[s] for s in g.samples]
                    lay = self.model.pack(group, g.degree, planned_bucket(g, group), self.min_bucket, self.growth)
                except ValueError as e:
                    raise ValueError(f"micro-batch {m} group {gi} (ranks {list(g.ranks)}): {e}") from None
                work.append(GroupWork(m, gi, self.ranks.group_devices(g.ranks), lay, shapes[m, gi]))
        if sum(w.layout.num_loss_tokens for w in work) == 0:
            raise ValueError("the batch has no text token followed by a text token: the loss is undefined")
        me = jax.process_index()
        return PreparedStep(plan, samples, tuple(work),
                            tuple(w for w in work if any(d.process_index == me for d in w.devices)))

    def plan_keys(self, samples: Sequence[Sample], plan: Plan) -> list[tuple[int, int, tuple[int, ...], str]]:
        """The executable keys (degree, bucket, device ids, attention) a plan needs, without compiling."""
        return self.prepare(samples, plan).id_keys

    def bind(self, params: Any) -> None:
        """Check a params tree against the model (a family's first tree gives the layout); None:
        only that a layout is there."""
        if params is None:
            if self.state.layout is None:
                raise self.model.unbound()
            return
        self.state.layout = self.model.bind(params, self.state.layout, self._new_layout)

    def _mesh(self, devices: tuple[jax.Device, ...], attention: str):
        """(sub-mesh, stream spec) of a group: its attention kind's mesh shape over its devices
        (`RankLayout.submesh`), the stream split over its axes in rank order."""
        shape = resolve(attention, len(devices) // self.tensor_parallel,
                        self.config.num_heads // self.tensor_parallel)
        mesh = self.ranks.submesh(devices, shape.mesh_shape)
        return mesh, self.ranks.stream_spec(mesh)

    def layout_for(self, record: Mapping[str, Any]) -> FlatLayout | tensor_split.TensorLayout:
        """This model's layout for a layout record's t and device count (`record["tensor_parallel"]`,
        1 if absent, and `record["num_shards"]` devices): this executor's own when they are its,
        else the layout a run there has (a checkpoint written there converts through it,
        `dhp_jax.train.checkpoint`)."""
        self.bind(None)
        return tensor_split.layout_for_record(self.model, self.layout, self.tensor_parallel, record)

    # ------------------------------------------------------------------ programs
    def _check_key(self, degree: int, bucket: int, devices: tuple[jax.Device, ...]) -> None:
        if degree < 1 or bucket < 2 * degree or bucket % (2 * degree) or len(devices) != degree * self.tensor_parallel:
            raise ValueError(f"executable: bucket {bucket} must be a positive multiple of 2*degree "
                             f"(degree {degree}, {len(devices)} devices, {self.tensor_parallel} per rank)")
        self.bind(None)

    def executable(self, params: Any, degree: int, bucket: int, devices: tuple[jax.Device, ...],
                   attention: str = RING):
        """The compiled group program for (degree, bucket, attention kind) on `devices`, built once
        (`CompileCache`). `params` (a tree of arrays or `jax.ShapeDtypeStruct`s, or None) is only
        checked against the model."""
        if (degree, bucket, devices, attention) not in self.compiles._executables:
            self.bind(params)
        return self.compiles.executable((degree, bucket, devices, attention))

    def lower(self, degree: int, bucket: int, devices: tuple[jax.Device, ...], attention: str = RING, router=False):
        """The lowered (not compiled) group program (`router`: `router_phase`'s): abstract arguments, nothing allocated."""
        self.bind(None)
        mesh, spec = self._mesh(devices, attention)
        shape = resolve(attention, degree)
        body = (self.model.router_program if router else self.model.program)(
            self._program_config, degree, self.layout, attention_fn(shape, self.attention_tile, self._attention),
            self.tensor_parallel, self.sequence_parallel)
        st = self.state
        row = st.row_spec(spec)
        inputs = self.model.input_shapes(bucket)
        rep, cp = NamedSharding(mesh, st.params_spec), NamedSharding(mesh, spec)
        args = [jax.ShapeDtypeStruct(st.params_shape, self.compute_dtype, sharding=rep),
                *(jax.ShapeDtypeStruct(s, d, sharding=cp) for s, d in inputs)]
        specs = (st.params_spec,) + (spec,) * len(inputs)
        if self.router and not router:      # the load-balancing loss's weights (`router_phase`)
            specs, args = specs + (PartitionSpec(),), args + [self.router.input_shape(mesh)]
        fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=row if router else (row, row), check_vma=False)
        return jax.jit(fn).lower(*args)

    def compile_step(self, prepared: PreparedStep, params: Any = None) -> int:
        """Build (without running) every executable a prepared step needs on this process's devices;
        returns how many were new. `params` may be a params tree, master shards or None."""
        before = self.num_compiles
        tree = None if isinstance(params, jax.Array) and params.ndim == 1 else params
        for w in prepared.local:
            self.executable(tree, *w.key)
            if self.router is not None:
                self.router.compiles.executable(w.key)
        return self.num_compiles - before

    def compile_plan(self, samples: Sequence[Sample], plan: Plan, params: Any) -> int:
        """`compile_step` of `prepare(samples, plan)`."""
        return self.compile_step(self.prepare(samples, plan), params)

    # ------------------------------------------------------------------ the sharded state
    def state_sharding(self, leaf: Any) -> NamedSharding:
        """Where a train-state leaf lives (`ShardedState.state_sharding`)."""
        return self.state.state_sharding(leaf)

    def replicate(self, params: Any) -> Any:
        """Params replicated on the full mesh (a no-op for params already there)."""
        return self.state.replicate(params)

    def shard(self, params: Any) -> jax.Array:
        """A float32 params tree as the master vector fp32[P_pad], sharded over the full mesh."""
        self.bind(params)
        return self.state.shard(params)

    def unshard(self, flat: jax.Array) -> Any:
        """A sharded flat vector (params or grads) as a params-shaped tree replicated on the mesh."""
        return self.state.unshard(flat)

    def gather(self, master: jax.Array) -> jax.Array:
        """The step's one all-gather (`ShardedState.gather`)."""
        return self.state.gather(master)

    def flat_params(self, params: Any) -> jax.Array:
        """A params tree as the gathered compute-dtype flat vector the group programs take."""
        return self.gather(self.shard(params))

    def norm_weights(self) -> jax.Array | None:
        """The elements the gradient's global norm counts (`ShardedState.norm_weights`)."""
        return self.state.norm_weights()

    # ------------------------------------------------------------------ device-side work
    def _views(self, flat: jax.Array, groups: Sequence[tuple[tuple[jax.Device, ...], str]]) -> dict:
        """The flat params seen on each (devices, attention) sub-mesh: the same per-device buffers, no copy."""
        by_dev = {s.device: s.data for s in flat.addressable_shards}
        return {(devs, kind): jax.make_array_from_single_device_arrays(
                    flat.shape, NamedSharding(self._mesh(devs, kind)[0], self.state.params_spec),
                    [by_dev[d] for d in devs if d in by_dev])
                for devs, kind in groups}

    def dispatch(self, flat: jax.Array, work: Sequence[GroupWork], weights: Any = None) -> dict[jax.Device, tuple]:
        """Launch the given groups of one micro-batch (asynchronously, this process's only); each
        device's (stats, grads) rows. `weights`: the load-balancing loss's input (`router_phase`)."""
        rows: dict[jax.Device, tuple] = {}
        views = self._views(flat, {(w.devices, w.attention) for w in work})
        for w in work:
            exe = self.compiles.launching(w.key)
            cp = NamedSharding(*self._mesh(w.devices, w.attention))
            extra = () if weights is None else (jax.device_put(weights, NamedSharding(cp.mesh, PartitionSpec())),)
            stats, grads = exe(views[(w.devices, w.attention)],
                               *(jax.device_put(a, cp) for a in self.model.inputs(w.layout)), *extra)
            gby = {s.device: s.data for s in grads.addressable_shards}
            rows.update((s.device, (s.data, gby[s.device])) for s in stats.addressable_shards)
        return rows

    def run_step(self, master: jax.Array, prepared: PreparedStep) -> tuple[jax.Array, jax.Array]:
        """The training step's path: master params fp32[P_pad] sharded over the mesh in, batch
        token-mean loss (replicated) and its gradient fp32[P_pad] (sharded the same way) out.
        Each micro-batch's reduction is enqueued before the next micro-batch's groups, so a device
        holds one gradient row at a time (module docstring, step 3)."""
        self.compile_step(prepared)         # compile (or wait for a background compile of) what is missing
        self.compiles.count_step(prepared.keys)
        flat, acc = self.gather(master), None
        weights = None if self.router is None else self.router.weights(flat, prepared, self.aux_coef)
        for group in prepared.micro_batches():
            rows = self.dispatch(flat, group) if weights is None else self.dispatch(flat, group, weights)
            # no reduction launched on rows that are not there
            await_rows(rows, group, self.stall_timeout_s, self.stall_abort_s, self.on_stall)
            acc = self.state.accumulate(acc, rows)
            del rows                            # the rows' buffers go when their reduction is done
        del flat
        return self.state.finish(acc)

    def loss_and_grad_shards(self, master: jax.Array, samples: Sequence[Sample], plan: Plan
                             ) -> tuple[jax.Array, jax.Array]:
        """`run_step` of `prepare(samples, plan)`."""
        return self.run_step(master, self.prepare(samples, plan))

    def loss_and_grads(self, params: Any, samples: Sequence[Sample], plan: Plan) -> tuple[jax.Array, Any]:
        """Batch token-mean loss and its gradients (shaped like params, replicated on the mesh)."""
        self.bind(params)
        prepared = self.prepare(samples, plan)             # bad input fails before any device work
        loss, grads = self.run_step(self.shard(params), prepared)
        return loss, self.unshard(grads)
