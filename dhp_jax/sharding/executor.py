"""`PlanExecutor`: one DHP step (all micro-batches of a `Plan`) as per-group executables.

The state is sharded over the full mesh (`dhp_jax.sharding.flat`): master params (fp32) and the
optimizer state are flat vectors x[P_pad] sharded P("dp"), each rank owning P_pad/N elements.
Data flow of `loss_and_grad_shards(master, samples, plan)` (the training step's path):
1. Check the plan and lay out every group's samples (`dhp_jax.geometry.layout.pack_group`) before any
   device work, so bad input fails fast, naming the group or the sample; compile what is missing.
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

Compiles: XLA binds an executable to its device assignment, so the cache key is (degree, bucket,
device tuple, attention kind); `num_programs` counts distinct (degree, bucket, attention) programs, `num_compiles` the XLA
executables built. On CPU devices (`reuse_compiled`) only a program's first executable is compiled:
its executables for other device sets are that compiled program loaded with their device assignment
(`dhp_jax.sharding.rebind`: the same machine code, about a second instead of a compile;
`rebound_keys` lists them), unless JAX's persistent compilation cache supplied the compile. Heavy
programs get a second build with XLA's default options after a few steps (`tiers`). One thread
launches device work, in plan order; compile threads only build. Multi-process JAX: a process launches the groups that touch its
addressable devices and contributes only its addressable rows (`_local`); groups may span processes
(tests/test_multiprocess_jax.py: 2 processes x 4 CPU devices, gloo).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import queue
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dhp_jax.checks import positive_int
from dhp_jax.data.sample import Sample
from dhp_jax.geometry.layout import (ARRAY_NAMES, FLOAT_ARRAYS, GROWTH, LINEAR_CHUNK, MIN_BUCKET, MODEL_INPUTS, GroupLayout,
                                  ladder,
                                  pack_group, planned_bucket)
from dhp_jax.model.config import MLLMConfig
from dhp_jax.model.mllm import block_stack, chunked_loss_sum, init_params
from dhp_jax.planner.contract.kinds import RING, check_attention
from dhp_jax.planner.contract.plan import Plan, PlanValidationError
from dhp_jax.planner.cost.memory import reduce_pieces
from dhp_jax.sharding.flat import FlatLayout
from dhp_jax.sharding import rebind, tensor
from dhp_jax.sharding.mesh import CP_AXIS, DP_AXIS, SP_AXIS, TP_AXIS, RankLayout
from dhp_jax.sharding.ring import ring_attention_fn
from dhp_jax.sharding.tiles import DEFAULT_TILE
from dhp_jax.sharding.ulysses import group_attention_fn


@dataclasses.dataclass
class _GroupWork:
    """One group of one micro-batch, ready to dispatch."""

    micro_batch: int
    index: int
    devices: tuple[jax.Device, ...]
    layout: GroupLayout
    attention: str = RING


# Host -> device traffic per group is two arrays: every int column in one int32[S, 8] and the
# float columns in one float32[S, patch_dim + 1] (pixels, then loss_weights).
COMPUTE_DTYPES = ("float32", "bfloat16")
INT_COLUMNS = tuple(k for k in ARRAY_NAMES if k not in FLOAT_ARRAYS)


def pack_inputs(layout: GroupLayout) -> tuple[np.ndarray, np.ndarray]:
    """(ints int32[S, 8], floats float32[S, patch_dim + 1]) of a group layout."""
    ints = np.stack([getattr(layout, k).astype(np.int32) for k in INT_COLUMNS], axis=1)
    floats = np.concatenate([layout.pixels, layout.loss_weights[:, None]], axis=1)
    return ints, floats


def stacks_of(config: MLLMConfig) -> tuple[tuple[str, int, bool], ...]:
    """(params prefix, block count, vision) of the model's scanned block stacks."""
    return (("vision_layers_", config.vision_layers, True), ("layers_", config.num_layers, False))


def group_program(config: MLLMConfig, degree: int, layout: FlatLayout | tensor.TensorLayout,
                  attn: Callable[..., jax.Array] | None = None, tensor_parallel: int = 1,
                  sequence_parallel: bool = False):
    """The per-device body: (params flat[P_pad] in the compute dtype, ints, floats) ->
    (stats f32[1, 2] = (loss sum, loss-token count), grads[1, P_pad] in the compute dtype, a
    2-byte dtype bit-cast to its unsigned integer (`row_dtype`)).

    `attn` is the model's attention function (default: the tiled ring of `degree` over `cp`).
    `tensor_parallel` t > 1 (`layout` a `tensor.TensorLayout`): the body runs on a sub-mesh with
    a `tp` axis of size t and takes this device's share flat[1, L_pad] (`TensorLayout.local`),
    returns its share's gradient row [1, L_pad] (the copies' gradients summed over their holders,
    `tensor.tie_block`), and a rank's loss and token count are reported (and differentiated)
    once, by its device tp = 0. `sequence_parallel`: the block stacks run sequence-parallel over the
    tp devices (`dhp_jax.model.mllm.split_block`)."""
    attn = ring_attention_fn(CP_AXIS, degree) if attn is None else attn
    t = tensor_parallel
    tp = tensor.hooks(t, sequence_parallel) if t > 1 else None
    if tp is not None:
        table, layout = layout.table, layout.local      # the split table, built once per layout
    cuts = layout.cuts([(prefix, count) for prefix, count, _ in stacks_of(config)])

    def stack(pieces, prefix, count, vision):
        rows, tree = layout.piece_rows(pieces, cuts, prefix, count)
        if tp is not None:
            tree = (lambda local: lambda row: tensor.tie_block(local(row), table, vision, tp))(tree)
        return block_stack(config, rows, tree, vision, attn, tp)

    def body(flat, ints, floats):
        s_l = ints.shape[0]
        assert ints.shape == (s_l, len(INT_COLUMNS)) and floats.shape == (s_l, config.patch_dim + 1)
        if tp is not None:
            flat = flat[0]                  # this device's share, flat[1, L_pad] on the sub-mesh
        assert flat.shape == (layout.padded,), flat.shape
        cols = {k: ints[:, i] for i, k in enumerate(INT_COLUMNS)}
        batch = {k: cols[k] for k in MODEL_INPUTS if k in cols}
        batch["vision_mask"] = cols["vision_mask"] > 0
        batch["pixels"] = floats[:, :config.patch_dim]
        weights = floats[:, config.patch_dim]

        # with tensor parallelism a rank's loss counts once: on its device tp = 0
        lead = 1.0 if tp is None else (tp.index() == 0).astype(jnp.float32)

        def loss_sum(pieces):
            # the block stacks run as scans over rows of their pieces (no copy of the params)
            stacks = tuple(stack(pieces, prefix, count, vision) for prefix, count, vision in stacks_of(config))
            params = layout.unravel_pieces(pieces, cuts)
            if tp is not None:
                params = tensor.tie_top(params, table, tp)
            return lead * chunked_loss_sum(config, params, batch, cols["targets"], weights, attn, stacks=stacks, tp=tp)

        # Gradients stay per device (check_vma=False: no implicit psum over cp); the only
        # reduction is the reduce-scatter over the full mesh after the group program. The
        # gradient is taken piece by piece (the stacks' pieces get their stacked gradients as
        # they are) and the row is their concatenation: no zero-padded parts summed.
        value, grads = jax.value_and_grad(loss_sum)(layout.split(flat, cuts))
        row = jnp.concatenate(grads)
        if row_dtype(row.dtype) != row.dtype:
            # the reduction reads the row piece by piece: as uint16 no compiler widens it whole
            # (XLA:CPU has no bf16 slicing, it would copy the whole row to fp32 first)
            row = lax.bitcast_convert_type(row, row_dtype(row.dtype))
        return jnp.stack([value, lead * jnp.sum(weights)])[None], row[None]

    return body


def row_dtype(compute_dtype: Any) -> Any:
    """How a group program returns its gradient row and the gather moves the params: a 2-byte
    compute dtype bit-cast to uint16 (XLA:CPU computes bf16 in fp32 and would widen a whole bf16
    vector before slicing or moving it), fp32 as itself."""
    return jnp.dtype(jnp.uint16) if jnp.dtype(compute_dtype).itemsize == 2 else jnp.dtype(compute_dtype)


def require_float32(params: Any) -> None:
    """Raise TypeError unless every leaf of `params` is float32 (the master weights)."""
    bad = sorted({str(x.dtype) for x in jax.tree.leaves(params) if x.dtype != jnp.float32})
    if bad:
        raise TypeError(f"PlanExecutor expects float32 params (the master weights), got dtypes {bad}")


# XLA:CPU compile options of the executor on CPU (fake) devices, which are for correctness runs:
# most of a CPU run is compiling group programs. LLVM optimisation (backend level 0: about 4x less
# compile time) and the MLIR fusion emitters (off: XLA:CPU's older emitters compile the same program
# in about 0.55x the CPU time; the demo's 14 compiles 141 -> 68 s, its steps about 1.2x slower)
# buy little there. Memory measurements compile with XLA's default emitters
# (`memory_bench.CPU_MEMORY_OPTIONS`), the programs the memory model was validated on.
CPU_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
# The second tier on CPU devices: XLA's default options (LLVM optimisation, the fusion emitters). The
# first `TIER_UP_RUNS` steps that run a program use its `CPU_FAST_COMPILE` build; its second-tier
# build is queued on a background thread `TIER_LEAD` steps before that, and every later step runs it
# (waiting for it if it is not built yet). The switch is a function of the step count alone, so a
# run's numbers do not depend on how fast the builds are (`PlanExecutor.tiers`).
CPU_TUNED: dict[str, Any] = {}
TIER_UP_RUNS = 4
TIER_LEAD = 3
# Only a program whose run is heavy enough for a faster build to pay back its compile within a few
# steps gets a second tier: at least this many flops a run over all its devices (XLA's cost
# analysis of the lowered program, the same on every run). A faster build of a light program saves
# less CPU over a run than its compile costs.
TIER_MIN_FLOPS = 1.5e9
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


class _CacheHits(threading.local):
    count = 0


_CACHE_HITS = _CacheHits()
_LISTENING = threading.Lock()
_listener_on = False


def _count_cache_hit(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _CACHE_HITS.count += 1


def _flops(lowered: Any) -> float:
    """Flops of one device's run of a lowered program (XLA's cost analysis; 0 if there is none)."""
    try:
        cost = lowered.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis: no second tier
        return 0.0
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def compile_counting_cache_hits(lowered: Any, options: Mapping[str, Any]) -> tuple[Any, bool]:
    """(executable, built here): `built here` is False when JAX's persistent compilation cache
    supplied the executable instead of XLA building it in this process. Such an executable runs, but
    serialized again it lacks kernels (XLA:CPU: "Function ... not found" when the copy runs), so it
    is never the source `dhp_jax.sharding.rebind` loads onto other devices."""
    global _listener_on
    with _LISTENING:
        if not _listener_on:
            jax.monitoring.register_event_listener(_count_cache_hit)
            _listener_on = True
    before = _CACHE_HITS.count
    exe = lowered.compile(compiler_options=dict(options))
    return exe, _CACHE_HITS.count == before


@dataclasses.dataclass
class _FirstCompile:
    """A program's first compiled executable and its devices: what further device sets load
    (`dhp_jax.sharding.rebind`), serialized once, on the first such load."""
    devices: tuple
    executable: Any
    _serialized: Any = None

    def serialized(self) -> Any:
        if self._serialized is None:
            self._serialized = rebind.serialize(self.executable)
        return self._serialized


_WORKERS: dict[threading.Thread, "queue.Queue"] = {}    # second-tier workers and their queues


def _drain(jobs: "queue.Queue") -> list:
    """Take the jobs still queued (second-tier keys) off `jobs`."""
    out = []
    while True:
        try:
            out.append(jobs.get_nowait())
        except queue.Empty:
            return out


@atexit.register
def _join_workers() -> None:
    """At exit: drop the queued second-tier builds and wait for the one in progress."""
    for worker, jobs in list(_WORKERS.items()):
        _drain(jobs)
        jobs.put(None)
        worker.join()


class PlanExecutor:
    """Runs a `Plan` on device sub-meshes with ring attention; exact token-mean loss and grads.

    `executor.mesh` is the full 1-D mesh, `executor.replicated` the P() sharding on it and
    `executor.sharded` the P("dp") sharding of the train state's flat vectors (`executor.layout`).
    `compute_dtype` is the dtype the groups compute in ("float32": exact; "bfloat16": params cast
    once per step, fp32 softmax statistics, loss and reductions). `attention_tile` is the ring's
    largest tile (tokens, `dhp_jax.sharding.tiles`); `attention`, if given, builds the attention
    function from (axis name, degree) instead of the tiled ring. `linear_chunk` (tokens, default
    `dhp_jax.geometry.layout.LINEAR_CHUNK`; 0: off) cuts every block's linear work into chunks and skips the chunks
    of a shard's padding tail (`MLLMConfig.linear_chunk`): a rank computes ceil(real / chunk)
    chunks, what `CostModel.geometry.linear_chunk` prices. `tensor_parallel` = t: a rank is t
    consecutive devices (`devices[r t:(r+1) t]`, inside one node) running one model replica split
    Megatron-style (`dhp_jax.sharding.tensor`); plans name ranks (devices / t), as at t = 1.
    `reuse_compiled` (None: on where every device is a CPU): a program compiled for one device set
    is loaded onto another set of the same mesh shape instead of compiled again (`rebind`).
    `tiers` (None: on where every device is a CPU and `compiler_options` is not given): a program is
    first built with `compiler_options` (`CPU_FAST_COMPILE`); one whose run costs at least
    `tier_min_flops` (`TIER_MIN_FLOPS`) runs that build for its first `tier_up_runs` steps and then
    its rebuild with `tuned_options` (XLA's defaults), made on a background thread from `TIER_LEAD`
    steps ahead (a step waits for it if it is not ready: the switch depends on the step count
    only). `stall_timeout_s`
    ("auto": `CPU_STALL_TIMEOUT_S` on CPU devices, else None): how long a micro-batch waits for its
    groups' gradient rows before the groups not finished are reported by name (`on_stall(text)`,
    default: a line on stderr); after `stall_abort_s` (None: never) the wait ends with
    `GroupProgramError(stalled=True)`.
    """

    def __new__(cls, config: Any = None, *args: Any, **kwargs: Any) -> "PlanExecutor":
        # A Hugging Face family's config (`dhp_jax.model.hf.HFConfig`) gets the family executor
        # (`dhp_jax.sharding.family`): same public names, same state, same step.
        if cls is PlanExecutor and not isinstance(config, MLLMConfig) and hasattr(config, "family"):
            from dhp_jax.sharding.family import FamilyExecutor
            cls = FamilyExecutor
        return super().__new__(cls)

    def __init__(self, config: MLLMConfig, devices: Sequence[jax.Device] | None = None, *,
                 compute_dtype: str = "float32", min_bucket: int = MIN_BUCKET, growth: float = GROWTH,
                 compiler_options: Mapping[str, Any] | None = None, attention_tile: int = DEFAULT_TILE,
                 attention: Callable[[str, int], Callable[..., jax.Array]] | None = None,
                 linear_chunk: int = LINEAR_CHUNK, tensor_parallel: int = 1, sequence_parallel: bool = False,
                 reuse_compiled: bool | None = None, tiers: bool | None = None, tier_up_runs: int = TIER_UP_RUNS,
                 stall_timeout_s: float | None | str = "auto") -> None:
        self._check_config(config)
        self.tensor_parallel = positive_int(tensor_parallel, "tensor_parallel")
        if sequence_parallel and tensor_parallel == 1:
            raise ValueError("sequence_parallel needs tensor_parallel > 1 (it splits a rank's rows over its devices)")
        self.sequence_parallel = bool(sequence_parallel)
        if tensor_parallel > 1:
            self._check_tensor_parallel(config, tensor_parallel)
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
        self.config = config
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.ranks = RankLayout(jax.devices() if devices is None else devices, tensor_parallel)
        self.mesh = self.ranks.full_mesh
        self.replicated = NamedSharding(self.mesh, P())
        self.sharded = NamedSharding(self.mesh, P(DP_AXIS))
        ladder(1, min_bucket, growth)                 # rejects a bad ladder now, not mid-step
        self.min_bucket, self.growth = min_bucket, growth
        self.attention_tile, self._attention = positive_int(attention_tile, "attention_tile"), attention
        if isinstance(linear_chunk, bool) or not isinstance(linear_chunk, int) or linear_chunk < 0:
            raise ValueError(f"linear_chunk must be an integer >= 0 (0: no pad skipping), got {linear_chunk!r}")
        self.linear_chunk = linear_chunk
        self._program_config = self._chunked_config(config, linear_chunk)
        cpu = all(d.platform == "cpu" for d in self.ranks.devices)
        # CPU devices, default options: tiers (a fast build first, XLA's defaults once a program has
        # run `tier_up_runs` times); other backends keep XLA's defaults, one build per program
        # (DHP_COMPILE_TIERS=0 turns the default off: the test suite, which runs programs a few times
        # each and would pay for every second build)
        self.tiers = (cpu and compiler_options is None and os.environ.get("DHP_COMPILE_TIERS", "1") != "0"
                      if tiers is None else bool(tiers))
        if compiler_options is None:
            compiler_options = CPU_FAST_COMPILE if cpu else {}
        self.compiler_options = dict(compiler_options)
        self.tuned_options = dict(CPU_TUNED)
        self.tier_up_runs = positive_int(tier_up_runs, "tier_up_runs")
        self.tier_min_flops = TIER_MIN_FLOPS
        # a step waiting this long for its groups' rows is reported (`on_stall`: a line on stderr by
        # default), and ended with `GroupProgramError(stalled=True)` after `stall_abort_s` (None: never)
        self.stall_timeout_s = (CPU_STALL_TIMEOUT_S if cpu else None) if stall_timeout_s == "auto" else stall_timeout_s
        self.stall_abort_s: float | None = None
        self.on_stall: Callable[[str], None] | None = None
        # a program's executable for a further device set is loaded from its first compile
        # (`dhp_jax.sharding.rebind`); None: on CPU devices, where that is tested, off elsewhere
        self.reuse_compiled = cpu if reuse_compiled is None else bool(reuse_compiled)
        abstract = self._abstract_params(config)
        t = tensor_parallel
        # with tensor parallelism the master vector holds each device's share (`tensor.TensorLayout`)
        self.layout = (None if abstract is None else FlatLayout.of(abstract, len(self.ranks.devices)) if t == 1
                       else tensor.TensorLayout(config, abstract, t, self.ranks.num_ranks))
        # the (rank, tp) view of the full mesh: the tp-sharded state's gather and reduction
        self.tp_mesh = Mesh(np.array(self.ranks.devices).reshape(-1, t), (DP_AXIS, TP_AXIS)) if t > 1 else None
        self._executables: dict[tuple[int, int, tuple[jax.Device, ...], str], Any] = {}
        self._building: dict[Any, threading.Lock] = {}   # one build per program; other programs build concurrently
        # (degree, bucket, attention) -> its first compile, what further device sets load
        self._compiled: dict[tuple[int, int, str], _FirstCompile] = {}
        self.rebound_keys: list[tuple[int, int, tuple[jax.Device, ...], str]] = []   # executables loaded, not compiled
        self._building_lock = threading.Lock()
        self.compile_seconds: list[float] = []           # wall time of every executable built
        self._jits: dict[str, Any] = {}
        self._count_once: jax.Array | None = None
        self._zeros: dict[jax.Device, tuple[jax.Array, Any]] = {}   # (stats row, zero-row maker)
        # the second tier: launches per program, the programs being rebuilt, and the rebuilt
        # executables, which a launch takes from the dispatching thread once they are there
        self._runs: dict[tuple[int, int, str], int] = {}
        self._tuned_source: dict[tuple[int, int, str], _FirstCompile] = {}
        self._tuned: dict[tuple[int, int, tuple[jax.Device, ...], str], Any] = {}
        self.tune_seconds: list[float] = []              # wall time of every second-tier build
        self._flops: dict[tuple[int, int, str], float] = {}   # flops of a run of each program (all devices)
        self._tuner: Any = None                          # the background worker's queue (one thread)
        self._tuning: dict[Any, threading.Event] = {}    # keys queued or built: set once done

    # ------------------------------------------------------------------ model hooks (`family.py` overrides)
    config_type: type = MLLMConfig           # the config this executor runs (`family.py`: HFConfig)

    def _check_config(self, config: Any) -> None:
        if not isinstance(config, self.config_type):
            raise TypeError(f"config must be a {self.config_type.__module__}.{self.config_type.__name__}, "
                            f"got {type(config).__name__}")

    @staticmethod
    def _check_tensor_parallel(config: Any, t: int) -> None:
        """ValueError unless the model splits evenly over t devices (`dhp_jax.sharding.tensor.check`)."""
        tensor.check(config, t)

    @staticmethod
    def _chunked_config(config: Any, linear_chunk: int) -> Any:
        return dataclasses.replace(config, linear_chunk=linear_chunk)

    @staticmethod
    def _abstract_params(config: Any) -> Any:
        """The params tree as `jax.ShapeDtypeStruct`s (None: taken from the first params bound)."""
        return jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))

    def _pack(self, group: Sequence[Sample], degree: int, bucket: int | None) -> Any:
        """One group's layout (`GroupLayout` here)."""
        return pack_group(group, degree, self.config, bucket=bucket, min_bucket=self.min_bucket, growth=self.growth)

    def _inputs(self, layout: Any) -> tuple[np.ndarray, ...]:
        """The host arrays of a group layout that its program takes after the params."""
        return pack_inputs(layout)

    # ------------------------------------------------------------------ counters
    @property
    def num_compiles(self) -> int:
        """XLA executables built for groups so far (one per (degree, bucket, devices, attention))."""
        return len(self._executables)

    @property
    def num_programs(self) -> int:
        """Distinct (degree, bucket, attention) group programs so far."""
        return len({(d, b, a) for d, b, _, a in self._executables})

    @property
    def executable_keys(self) -> list[tuple[int, int, tuple[int, ...], str]]:
        """(degree, bucket, device ids, attention kind) of every executable built."""
        return [(d, b, tuple(x.id for x in devs), a) for d, b, devs, a in self._executables]

    # ------------------------------------------------------------------ planning-side work
    def prepare(self, samples: Sequence[Sample], plan: Plan) -> list[_GroupWork]:
        """Check the plan against devices and samples and lay out every group (no device work)."""
        samples = list(samples)
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise TypeError(f"sample {i} is a {type(s).__name__}, not a Sample")
        self.ranks.check_plan(plan, len(samples))
        for m, mb in enumerate(plan.micro_batches):
            for gi, g in enumerate(mb.groups):
                try:
                    check_attention(g.attention, g.degree, self._local_heads())
                except ValueError as e:
                    raise PlanValidationError(f"micro-batch {m} group {gi} (ranks {list(g.ranks)}): {e}") from None
        work = []
        for m, mb in enumerate(plan.micro_batches):
            for gi, g in enumerate(mb.groups):
                try:
                    group = [samples[s] for s in g.samples]
                    lay = self._pack(group, g.degree, planned_bucket(g, group))
                except ValueError as e:
                    raise ValueError(f"micro-batch {m} group {gi} (ranks {list(g.ranks)}): {e}") from None
                work.append(_GroupWork(m, gi, self.ranks.group_devices(g.ranks), lay, g.attention))
        if sum(w.layout.num_loss_tokens for w in work) == 0:
            raise ValueError("the batch has no text token followed by a text token: the loss is undefined")
        return work

    def plan_keys(self, samples: Sequence[Sample], plan: Plan) -> list[tuple[int, int, tuple[int, ...], str]]:
        """The executable keys (degree, bucket, device ids, attention) a plan needs, without compiling."""
        return [(w.layout.degree, w.layout.bucket, tuple(d.id for d in w.devices), w.attention)
                for w in self.prepare(samples, plan)]

    def _bind(self, params: Any) -> None:
        """Check that a params tree is this model's (tree, shapes, float32 leaves)."""
        if params is None:
            return
        if not self.layout.matches(params):
            if FlatLayout.of(params, 1).shapes == self.layout.shapes:
                require_float32(params)
            raise ValueError("params do not have the structure (tree, shapes, dtypes) of this executor's "
                             f"model {self.config.name!r}")

    def _mesh(self, devices: tuple[jax.Device, ...], attention: str):
        """(sub-mesh, stream spec) of a group: the `cp` ring mesh, or the 2-D (cp, sp) view of a
        Ulysses or hybrid group with the stream split over both axes in rank order; with tensor
        parallelism a last `tp` axis, over which the stream is replicated."""
        u = check_attention(attention, len(devices) // self.tensor_parallel, self._local_heads())[0]
        return self.ranks.submesh(devices, u), P(CP_AXIS) if u == 1 else P((CP_AXIS, SP_AXIS))

    def layout_for(self, record: Mapping[str, Any]) -> FlatLayout | tensor.TensorLayout:
        """This model's layout for a layout record's t and device count (`record["tensor_parallel"]`,
        1 if absent, and `record["num_shards"]` devices): this executor's own when they are its,
        else the layout a run there has (a checkpoint written there converts through it,
        `dhp_jax.train.checkpoint`)."""
        self._bind(None)
        t, n = int(record.get("tensor_parallel", 1)), int(record["num_shards"])
        if (t, n) == (self.tensor_parallel, self.layout.num_shards):
            return self.layout
        if t < 1 or n % t:
            raise ValueError(f"a layout record of tensor_parallel={t} on {n} devices (not a multiple of t)")
        abstract = jax.tree.unflatten(self.layout.treedef, [jax.ShapeDtypeStruct(s, d) for s, d in
                                                            zip(self.layout.shapes, self.layout.dtypes)])
        if t == 1:
            return FlatLayout.of(abstract, n)
        self._check_tensor_parallel(self.config, t)
        return tensor.TensorLayout(self.config, abstract, t, n // t)

    @property
    def row_size(self) -> int:
        """Length of a device's params and gradient row: P_pad, or its share L_pad with tensor
        parallelism (`tensor.TensorLayout.row`)."""
        return self.layout.padded if self.tensor_parallel == 1 else self.layout.row

    def _params_spec(self) -> P:
        """How a group program takes the params: replicated, or with tensor parallelism one share
        per tp index ([t, L_pad] split over `tp`)."""
        return P() if self.tensor_parallel == 1 else P(TP_AXIS)

    def _params_shape(self) -> tuple[int, ...]:
        t = self.tensor_parallel
        return (self.layout.padded,) if t == 1 else (t, self.layout.row)

    def norm_weights(self) -> jax.Array | None:
        """With tensor parallelism, the bool master-shaped vector marking one copy of every
        parameter (`tensor.TensorLayout.count_once`), sharded like the master: the gradient's
        global norm counts those elements only. None at t = 1 (every element counts)."""
        if self.tensor_parallel == 1:
            return None
        if self._count_once is None:
            self._count_once = jax.jit(self.layout.count_once, out_shardings=self.sharded)()
        return self._count_once

    def _row_spec(self, spec: P) -> P:
        """The spec of a group program's per-device outputs (stats and gradient rows): the stream's
        axes, and `tp` when a rank has several devices (each returns its own row)."""
        if self.tensor_parallel == 1:
            return spec
        axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
        return P((*axes, TP_AXIS))

    def _local_heads(self) -> int:
        """Query heads of the decoder on one device (its share with tensor parallelism): what a
        Ulysses all-to-all splits."""
        return self.config.num_heads // self.tensor_parallel

    def _attention_fn(self, degree: int, attention: str):
        """The model's attention for a group: the tiled ring (or the executor's own function) for
        "ring", the all-to-all layouts of `dhp_jax.sharding.ulysses` for the other kinds."""
        u, r = check_attention(attention, degree, self._local_heads())
        if u > 1:
            return group_attention_fn(u, r, tile=self.attention_tile)
        if self._attention is not None:
            return self._attention(CP_AXIS, degree)
        return ring_attention_fn(CP_AXIS, degree, tile=self.attention_tile)

    def executable(self, params: Any, degree: int, bucket: int, devices: tuple[jax.Device, ...],
                   attention: str = RING):
        """The compiled group program for (degree, bucket, attention kind) on `devices`, built once
        (thread-safe: a background thread may build the next plan's programs while a step runs).
        `params` (a tree of arrays or `jax.ShapeDtypeStruct`s, or None) is only checked against the model."""
        key = (degree, bucket, devices, attention)
        exe = self._executables.get(key)
        if exe is not None:
            return exe
        with self._building_lock:
            # one build of a program at a time: its executable for a second device set waits for
            # the first and is loaded from it (`_build`); other programs build concurrently
            lock = self._building.setdefault((degree, bucket, attention), threading.Lock())
        with lock:
            return self._build(params, key)

    def _build(self, params: Any, key: tuple[int, int, tuple[jax.Device, ...], str]):
        """Build the executable of `key`: the program's first executable is compiled; one for
        another device set of the same mesh shape is that compiled program loaded onto those
        devices (`dhp_jax.sharding.rebind`: the same machine code, about a second instead of a
        compile), or compiled where it cannot be (`reuse_compiled` off, several processes)."""
        degree, bucket, devices, attention = key
        exe = self._executables.get(key)
        if exe is None:
            if degree < 1 or bucket < 2 * degree or bucket % (2 * degree) or \
                    len(devices) != degree * self.tensor_parallel:
                raise ValueError(f"executable: bucket {bucket} must be a positive multiple of 2*degree "
                                 f"(degree {degree}, {len(devices)} devices, {self.tensor_parallel} per rank)")
            t0 = time.perf_counter()
            self._bind(params)
            exe = self._rebound(key)
            if exe is None:
                lowered = self.lower(degree, bucket, devices, attention)
                if self.tiers and (degree, bucket, attention) not in self._flops:
                    self._flops[(degree, bucket, attention)] = _flops(lowered) * len(devices)
                exe, built = compile_counting_cache_hits(lowered, self.compiler_options)
                if built:   # a persistent-cache hit is never loaded onto other devices
                    self._compiled.setdefault((degree, bucket, attention), _FirstCompile(devices, exe))
            else:
                self.rebound_keys.append(key)
            self._executables[key] = exe
            self.compile_seconds.append(time.perf_counter() - t0)
        return exe

    def _rebound(self, key: tuple[int, int, tuple[jax.Device, ...], str], source: _FirstCompile | None = None,
                 options: Mapping[str, Any] | None = None) -> Any:
        """The executable of `key` loaded from the program's compiled one on other devices (`source`,
        default: its first compile, built with `options`, default `compiler_options`); None when
        there is none, rebinding is off, or it cannot be loaded (then it is compiled)."""
        degree, bucket, devices, attention = key
        if source is None:
            source = self._compiled.get((degree, bucket, attention))
        if source is None or not self.reuse_compiled:
            return None
        mesh, target = self._mesh(source.devices, attention)[0], self._mesh(devices, attention)[0]
        if not rebind.supported(mesh, target):
            return None
        try:
            return rebind.rebind(source.serialized(), mesh, target,
                                 self.compiler_options if options is None else options)
        except rebind.RebindError:
            return None

    # ------------------------------------------------------------------ the second tier
    def _count_step(self, work: Sequence[_GroupWork]) -> None:
        """Count a step for each program it runs (once, whatever its groups) and queue second-tier
        builds: a program's first `tier_up_runs` steps run its first build, later ones its second,
        queued `TIER_LEAD` steps ahead (called by the dispatching thread, before the step's launches)."""
        if not self.tiers:
            return
        keys = [(w.layout.degree, w.layout.bucket, w.devices, w.attention) for w in self._local(work)]
        for program in {(d, b, a) for d, b, _, a in keys}:
            self._runs[program] = self._runs.get(program, 0) + 1
        for d, b, devs, a in keys:
            if self._flops.get((d, b, a), 0.0) >= self.tier_min_flops and \
                    self._runs[(d, b, a)] >= self.tier_up_runs - TIER_LEAD:
                self._tune_later((d, b, devs, a))

    def _launching(self, key: tuple[int, int, tuple[jax.Device, ...], str]) -> Any:
        """The executable a launch of `key` uses (called by the dispatching thread only): with tiers,
        once its program has run more than `tier_up_runs` steps (`_count_step`, counted over the
        run: `launch_counts`), its second-tier build, waited for if it is not built yet."""
        degree, bucket, devices, attention = key
        program = (degree, bucket, attention)
        if self.tiers and self._flops.get(program, 0.0) >= self.tier_min_flops and \
                self._runs.get(program, 0) > self.tier_up_runs:
            self._tune_later(key)
            self._tuning[key].wait()
            # a failed second-tier build leaves the first (the same numbers to fp32 1e-5)
            tuned = self._tuned.get(key)
            if tuned is not None:
                return tuned
        return self.executable(None, degree, bucket, devices, attention)

    def _tune_later(self, key: tuple[int, int, tuple[jax.Device, ...], str]) -> None:
        """Queue the second-tier build of `key` on the worker thread (once per key)."""
        if key in self._tuning:
            return
        self._tuning[key] = threading.Event()
        if self._tuner is None:
            self._tuner = queue.Queue()
            worker = threading.Thread(target=self._tune_loop, args=(self._tuner,), name="dhp-tier", daemon=True)
            worker.start()
            _WORKERS[worker] = self._tuner
        self._tuner.put(key)

    def _tune_loop(self, jobs: "queue.Queue") -> None:
        # a daemon thread that the interpreter's exit stops and joins (`_join_workers`): XLA ends the
        # process if a thread is torn down inside a compile
        while True:
            key = jobs.get()
            if key is None:
                _WORKERS.pop(threading.current_thread(), None)
                return
            try:
                self._tune(key)
            finally:
                self._tuning[key].set()

    def _tune(self, key: tuple[int, int, tuple[jax.Device, ...], str]) -> None:
        """Build `key` with `tuned_options` (on the worker, in queue order): loaded from the
        program's second-tier build on other devices where there is one, else compiled (then the
        source of its other device sets, unless the persistent cache supplied it)."""
        degree, bucket, devices, attention = key
        program = (degree, bucket, attention)
        t0 = time.perf_counter()
        try:
            source = self._tuned_source.get(program)
            exe = self._rebound(key, source, self.tuned_options) if source is not None else None
            if exe is None:
                exe, built = compile_counting_cache_hits(self.lower(degree, bucket, devices, attention),
                                                         self.tuned_options)
                if built:
                    self._tuned_source.setdefault(program, _FirstCompile(devices, exe))
        except Exception:   # noqa: BLE001 - the first tier keeps running this program
            return
        self._tuned[key] = exe
        self.tune_seconds.append(time.perf_counter() - t0)

    def launch_counts(self) -> dict[str, int]:
        """Steps per program ("degree,bucket,attention": count): what decides its tier, stored in a
        checkpoint so that a resumed run switches where the uninterrupted one does."""
        return {f"{d},{b},{a}": n for (d, b, a), n in sorted(self._runs.items())}

    def set_launch_counts(self, counts: Mapping[str, int]) -> None:
        """Continue from `launch_counts()` of a checkpoint (empty: a fresh run)."""
        runs = {}
        for k, n in counts.items():
            d, b, a = str(k).split(",")
            runs[(int(d), int(b), a)] = int(n)
        self._runs = runs

    @property
    def tuned_keys(self) -> list[tuple[int, int, tuple[int, ...], str]]:
        """(degree, bucket, device ids, attention) of every executable of the second tier built."""
        return [(d, b, tuple(x.id for x in devs), a) for d, b, devs, a in list(self._tuned)]

    def stop_tuning(self) -> None:
        """Drop the queued second-tier builds (a build in progress ends on its own thread, which a
        finished run does not wait for); later launches queue builds again."""
        if self._tuner is not None:
            for key in _drain(self._tuner):
                if key is not None:
                    self._tuning.pop(key).set()
            self._tuner.put(None)
            self._tuner = None

    def lower(self, degree: int, bucket: int, devices: tuple[jax.Device, ...], attention: str = RING):
        """The lowered (not compiled) group program: abstract arguments, nothing allocated."""
        mesh, spec = self._mesh(devices, attention)
        body = group_program(self._program_config, degree, self.layout, self._attention_fn(degree, attention),
                             self.tensor_parallel, self.sequence_parallel)
        row = self._row_spec(spec)
        fn = jax.shard_map(body, mesh=mesh, in_specs=(self._params_spec(), spec, spec), out_specs=(row, row),
                           check_vma=False)
        rep, cp = NamedSharding(mesh, self._params_spec()), NamedSharding(mesh, spec)
        args = (jax.ShapeDtypeStruct(self._params_shape(), self.compute_dtype, sharding=rep),
                jax.ShapeDtypeStruct((bucket, len(INT_COLUMNS)), jnp.int32, sharding=cp),
                jax.ShapeDtypeStruct((bucket, self.config.patch_dim + 1), jnp.float32, sharding=cp))
        return jax.jit(fn).lower(*args)

    def compile_plan(self, samples: Sequence[Sample], plan: Plan, params: Any) -> int:
        """Build (without running) every executable the plan needs on this process's devices;
        returns how many were new. `params` may be a params tree, master shards or None."""
        before = self.num_compiles
        tree = None if isinstance(params, jax.Array) and params.ndim == 1 else params
        for w in self._local(self.prepare(samples, plan)):
            self.executable(tree, w.layout.degree, w.layout.bucket, w.devices, w.attention)
        return self.num_compiles - before

    # ------------------------------------------------------------------ the sharded state
    def _jit(self, name: str):
        """The small full-mesh programs of a step, built once: shard, gather, unshard, accumulate
        (one micro-batch's rows reduce-scattered into the donated accumulator), finish."""
        if not self._jits:
            lay, cd, n = self.layout, self.compute_dtype, len(self.ranks.devices)
            # t = 1: every device's row is the whole vector, reduced over all N devices; t > 1: a
            # device's row is its share, reduced over the R devices of its tp index (the (dp, tp)
            # view of the mesh), the state's spec being the same per-device parts either way
            t = self.tensor_parallel
            mesh, state = (self.mesh, P(DP_AXIS)) if t == 1 else (self.tp_mesh, P((DP_AXIS, TP_AXIS)))
            holders = n // t
            c, k = reduce_pieces(self.row_size, holders)
            shard = lay.shard_size

            def add_row(acc, row):
                # acc f32[shard] (this device's accumulator), row [1, row_size] (its gradient row):
                # the row as [holders, shard] (column block j of row r is device r's part of piece
                # j) is reduce-scattered one column block at a time, each cast to fp32 alone, so no
                # device ever holds its row, or the sum, whole in fp32.
                grid = row.reshape(holders, shard)

                def piece(start, width, acc):
                    part = lax.dynamic_slice_in_dim(grid, start, width, axis=1)
                    part = lax.bitcast_convert_type(part, cd).astype(jnp.float32)
                    got = lax.psum_scatter(part, DP_AXIS, scatter_dimension=0, tiled=True)[0]
                    return lax.dynamic_update_slice_in_dim(acc, lax.dynamic_slice_in_dim(acc, start, width) + got,
                                                           start, 0)

                acc = lax.fori_loop(0, k, lambda j, a: piece(j * c, c, a), acc)
                return piece(k * c, shard - k * c, acc) if shard > k * c else acc

            def accumulate(acc, sacc, rows, stats):
                acc = jax.shard_map(add_row, mesh=mesh, in_specs=(state, state), out_specs=state)(acc, rows)
                return acc, sacc + stats

            def gather(shard):
                # cast the shard, then all-gather it (bf16 as uint16, `row_dtype`): no fp32 copy of
                # the whole vector; with tensor parallelism over the devices of this tp index only
                got = lax.all_gather(lax.bitcast_convert_type(shard.astype(cd), row_dtype(cd)), DP_AXIS, tiled=True)
                got = lax.bitcast_convert_type(got, cd)
                return got if t == 1 else got[None]

            def finish(acc, stats):
                total = jnp.sum(stats, axis=0)                  # [loss sum, count]: 2N floats all-reduced
                return total[0] / total[1], acc / total[1]

            rep, shd = self.replicated, self.sharded
            self._jits.update(
                shard=jax.jit(lambda p: lay.ravel(p), out_shardings=shd),
                gather=jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=state, out_specs=self._params_spec(),
                                             check_vma=False),
                               out_shardings=NamedSharding(mesh, self._params_spec())),
                # one all-gather of the whole vector, then slices: unravelling the sharded vector
                # directly makes the partitioner gather every leaf on its own (a compile ~10x longer)
                unshard=jax.jit(lambda g: lay.unravel(lax.with_sharding_constraint(g, rep)), out_shardings=rep),
                zeros=jax.jit(lambda: (jnp.zeros((lay.padded,), jnp.float32), jnp.zeros((n, 2), jnp.float32)),
                              out_shardings=(shd, shd)),
                accumulate=jax.jit(accumulate, out_shardings=(shd, shd), donate_argnums=(0, 1)),
                finish=jax.jit(finish, out_shardings=(rep, shd)))
        return self._jits[name]

    def state_sharding(self, leaf: Any) -> NamedSharding:
        """Where a train-state leaf lives: flat vectors of the layout (master params, optimizer
        moments, grads) sharded over the full mesh, everything else (step, counts, keys) replicated."""
        return self.sharded if tuple(getattr(leaf, "shape", ())) == (self.layout.padded,) else self.replicated

    def replicate(self, params: Any) -> Any:
        """Params replicated on the full mesh (a no-op for params already there)."""
        return jax.tree.map(lambda x: x if getattr(x, "sharding", None) == self.replicated
                            else jax.device_put(x, self.replicated), params)

    def shard(self, params: Any) -> jax.Array:
        """A float32 params tree as the master vector fp32[P_pad], sharded over the full mesh."""
        self._bind(params)
        return self._jit("shard")(self.replicate(params))

    def unshard(self, flat: jax.Array) -> Any:
        """A sharded flat vector (params or grads) as a params-shaped tree replicated on the mesh."""
        return self._jit("unshard")(flat)

    def gather(self, master: jax.Array) -> jax.Array:
        """The step's one all-gather: master shards -> params flat[P_pad] in the compute dtype,
        replicated on the full mesh (with tensor parallelism: [t, L_pad], each device its share)."""
        if not isinstance(master, jax.Array) or master.shape != (self.layout.padded,):
            raise ValueError(f"master params must be a flat array of {self.layout.padded} elements "
                             f"(PlanExecutor.shard), got {getattr(master, 'shape', type(master).__name__)}")
        return self._jit("gather")(master)

    def flat_params(self, params: Any) -> jax.Array:
        """A params tree as the gathered compute-dtype flat vector the group programs take."""
        return self.gather(self.shard(params))

    # ------------------------------------------------------------------ device-side work
    def _views(self, flat: jax.Array, groups: Sequence[tuple[tuple[jax.Device, ...], str]]) -> dict:
        """The flat params seen on each (devices, attention) sub-mesh: the same per-device buffers, no copy."""
        by_dev = {s.device: s.data for s in flat.addressable_shards}
        return {(devs, kind): jax.make_array_from_single_device_arrays(
                    flat.shape, NamedSharding(self._mesh(devs, kind)[0], self._params_spec()),
                    [by_dev[d] for d in devs if d in by_dev])
                for devs, kind in groups}

    def _local(self, work: Sequence[_GroupWork]) -> list[_GroupWork]:
        """The groups this process takes part in (all of them in a single-process run)."""
        me = jax.process_index()
        return [w for w in work if any(d.process_index == me for d in w.devices)]

    def _zero_rows(self, device: jax.Device) -> tuple[jax.Array, jax.Array]:
        """(stats, grads) rows of zeros for a device idle in a micro-batch. The stats row is cached;
        the gradient row is made for this reduction only (a cached P_pad row would stay on the
        device through every later group program it runs)."""
        z = self._zeros.get(device)
        if z is None:
            z = self._zeros[device] = (jax.device_put(np.zeros((1, 2), np.float32), device),
                                       jax.jit(lambda: jnp.zeros((1, self.row_size), row_dtype(self.compute_dtype)),
                                               out_shardings=jax.sharding.SingleDeviceSharding(device)))
        return z[0], z[1]()

    def dispatch(self, flat: jax.Array, work: Sequence[_GroupWork]) -> list[dict[jax.Device, tuple]]:
        """Launch the given groups (asynchronously); per micro-batch, each device's (stats, grads)
        rows. The step dispatches one micro-batch at a time (`loss_and_grad_shards`)."""
        rows: dict[int, dict[jax.Device, tuple]] = {m: {} for m in sorted({w.micro_batch for w in work})}
        work = self._local(work)
        views = self._views(flat, {(w.devices, w.attention) for w in work})
        for w in work:
            lay = w.layout
            exe = self._launching((lay.degree, lay.bucket, w.devices, w.attention))
            cp = NamedSharding(*self._mesh(w.devices, w.attention))
            stats, grads = exe(views[(w.devices, w.attention)], *(jax.device_put(a, cp) for a in self._inputs(lay)))
            gby = {s.device: s.data for s in grads.addressable_shards}
            rows[w.micro_batch].update((s.device, (s.data, gby[s.device])) for s in stats.addressable_shards)
        return [rows[m] for m in sorted(rows)]

    def accumulate(self, acc: tuple[jax.Array, jax.Array] | None, rows: Mapping[jax.Device, tuple]
                   ) -> tuple[jax.Array, jax.Array]:
        """Enqueue one micro-batch's reduction: the devices' (stats, grads) rows reduce-scattered in
        pieces into the fp32 accumulator shards `acc` (None: zeros), which are donated."""
        n = len(self.ranks.devices)
        me = jax.process_index()
        mine = [rows[d] if d in rows else self._zero_rows(d) for d in self.ranks.devices if d.process_index == me]
        stats = jax.make_array_from_single_device_arrays((n, 2), self.sharded, [r[0] for r in mine])
        grads = jax.make_array_from_single_device_arrays((n, self.row_size), self.sharded,
                                                         [r[1] for r in mine])
        return self._jit("accumulate")(*(self._jit("zeros")() if acc is None else acc), grads, stats)

    def reduce(self, partials: Sequence[Mapping[jax.Device, tuple]]) -> tuple[jax.Array, jax.Array]:
        """Every micro-batch's rows (`dispatch`) accumulated, then / the token count. Returns (loss
        replicated, grads fp32[P_pad] sharded like the master params)."""
        acc = None
        for mb in partials:
            acc = self.accumulate(acc, mb)
        return self._jit("finish")(*acc)

    def loss_and_grad_shards(self, master: jax.Array, samples: Sequence[Sample], plan: Plan
                             ) -> tuple[jax.Array, jax.Array]:
        """The training step's path: master params fp32[P_pad] sharded over the mesh in, batch
        token-mean loss (replicated) and its gradient fp32[P_pad] (sharded the same way) out.
        Each micro-batch's reduction is enqueued before the next micro-batch's groups, so a device
        holds one gradient row at a time (module docstring, step 3)."""
        work = self.prepare(samples, plan)
        for w in self._local(work):             # compile (or wait for a background compile of) what is missing
            self.executable(None, w.layout.degree, w.layout.bucket, w.devices, w.attention)
        self._count_step(work)
        flat, acc = self.gather(master), None
        for m in sorted({w.micro_batch for w in work}):
            group = [w for w in work if w.micro_batch == m]
            (rows,) = self.dispatch(flat, group)
            self.await_rows(rows, group)        # no reduction launched on rows that are not there
            acc = self.accumulate(acc, rows)
            del rows                            # the rows' buffers go when their reduction is done
        del flat
        return self._jit("finish")(*acc)

    def await_rows(self, rows: Mapping[jax.Device, tuple], work: Sequence[_GroupWork]) -> None:
        """Wait until the groups' gradient rows are computed, before their reduction is launched.

        The reduction is a collective over every device: launched on a row that a failed group
        program never writes, the other devices would wait in it until XLA:CPU ends the process.
        Here a failed group raises `GroupProgramError` naming it; groups not done within
        `stall_timeout_s` are reported by name (`on_stall`), and after `stall_abort_s` the wait ends
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
        if not done.wait(self.stall_timeout_s):
            def late() -> str:
                names = [self._describe(w) for w in self._local(work)
                         if not all(rows[d][1].is_ready() for d in w.devices if d in rows)]
                return "; ".join(names) or "groups that finished meanwhile"

            report = self.on_stall or (lambda text: print(f"dhp_jax: {text}", file=sys.stderr, flush=True))
            report(f"waited {self.stall_timeout_s:g} s for the gradient rows of {late()}: a group program may "
                   f"be stalled (still waiting)")
            left = None if self.stall_abort_s is None else max(0.0, self.stall_abort_s - self.stall_timeout_s)
            if not done.wait(left):
                raise GroupProgramError(f"waited {self.stall_abort_s:g} s for the gradient rows of {late()}: a "
                                        f"group program stalled", stalled=True)
        if failure:
            for w in self._local(work):
                for d in w.devices:
                    try:
                        rows[d][1].block_until_ready()
                    except Exception as e:  # noqa: BLE001
                        raise GroupProgramError(f"{self._describe(w)} failed: "
                                                f"{str(e).strip().splitlines()[0][:300]}") from None
            raise GroupProgramError(f"a group program failed: {str(failure[0]).strip().splitlines()[0][:300]}")

    def _describe(self, w: _GroupWork) -> str:
        """A group as errors name it: micro-batch, index, program and devices."""
        return (f"micro-batch {w.micro_batch} group {w.index} (program degree {w.layout.degree}, bucket "
                f"{w.layout.bucket}, {w.attention}; devices {[d.id for d in w.devices]})")

    def loss_and_grads(self, params: Any, samples: Sequence[Sample], plan: Plan) -> tuple[jax.Array, Any]:
        """Batch token-mean loss and its gradients (shaped like params, replicated on the mesh)."""
        self._bind(params)
        self.prepare(samples, plan)             # bad input fails before any device work
        loss, grads = self.loss_and_grad_shards(self.shard(params), samples, plan)
        return loss, self.unshard(grads)
