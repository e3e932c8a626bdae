"""`PlanExecutor`: one DHP step (all micro-batches of a `Plan`) as per-group executables.

Data flow of `loss_and_grads(params, samples, plan)`:
1. Check the plan and lay out every group's samples (`dhp_jax.data.layout.pack_group`) before any
   device work, so bad input fails fast, naming the group or the sample; compile what is missing.
2. The params (replicated on the full mesh) become one flat float32 vector by one jit on the full
   mesh. For each group: the sub-mesh over its devices (cached), a view of that vector on the
   sub-mesh made from the same per-device buffers (no copy), the layout put on the sub-mesh
   sharded over `cp` as two arrays, and the executable for (degree, bucket, devices). The group
   program (shard_map + ring attention) returns one row per device: [loss sum, loss-token count,
   gradient of the loss sum (flat)], a [degree, 2 + P] array sharded over `cp`.
3. Every group of every micro-batch is dispatched before anything is awaited.
4. Per micro-batch, the devices' rows (zeros for idle devices) are assembled into one [N, 2 + P]
   array over the full `dp` mesh with `jax.make_array_from_single_device_arrays` (no copy, no host
   round trip) and added to the previous micro-batches' rows on each device (no communication);
   at the end one jit sums over devices (the one all-reduce of the step), divides by the total
   token count and unflattens: loss and grads replicated on the full mesh, grads shaped like params.

Compiles: XLA binds an executable to its device assignment, so the cache key is (degree, bucket,
device tuple); `num_programs` counts distinct (degree, bucket) programs, `num_compiles` the XLA
executables built. Multi-process JAX: a process launches the groups that touch its addressable
devices and contributes only its addressable rows (`_local`); groups may span processes
(tests/test_multiprocess_jax.py: 2 processes x 4 CPU devices, gloo).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dhp_jax.data.layout import (ARRAY_NAMES, FLOAT_ARRAYS, GROWTH, MIN_BUCKET, MODEL_INPUTS, GroupLayout, ladder,
                                  pack_group, planned_bucket)
from dhp_jax.data.sample import Sample
from dhp_jax.model.config import MLLMConfig
from dhp_jax.model.mllm import apply_model, token_loss_sum
from dhp_jax.planner.plan import Plan, PlanValidationError
from dhp_jax.sharding.mesh import CP_AXIS, DP_AXIS, RankLayout
from dhp_jax.sharding.ring import ring_attention_fn


@dataclasses.dataclass
class _GroupWork:
    """One group of one micro-batch, ready to dispatch."""

    micro_batch: int
    index: int
    devices: tuple[jax.Device, ...]
    layout: GroupLayout


# Host -> device traffic per group is two arrays: every int column in one int32[S, 8] and the
# float columns in one float32[S, patch_dim + 1] (pixels, then loss_weights).
ATTENTION_KINDS = ("ring",)     # the group attention kinds this executor runs (Plan Group.attention)
INT_COLUMNS = tuple(k for k in ARRAY_NAMES if k not in FLOAT_ARRAYS)


def pack_inputs(layout: GroupLayout) -> tuple[np.ndarray, np.ndarray]:
    """(ints int32[S, 8], floats float32[S, patch_dim + 1]) of a group layout."""
    ints = np.stack([getattr(layout, k).astype(np.int32) for k in INT_COLUMNS], axis=1)
    floats = np.concatenate([layout.pixels, layout.loss_weights[:, None]], axis=1)
    return ints, floats


def group_program(config: MLLMConfig, degree: int, unravel: Callable[[jax.Array], Any]):
    """The per-device body: (flat params, ints, floats) -> [1, 2 + P] = (loss sum, count, grads)."""
    attn = ring_attention_fn(CP_AXIS, degree)

    def body(flat, ints, floats):
        s_l = ints.shape[0]
        assert ints.shape == (s_l, len(INT_COLUMNS)) and floats.shape == (s_l, config.patch_dim + 1)
        cols = {k: ints[:, i] for i, k in enumerate(INT_COLUMNS)}
        batch = {k: cols[k] for k in MODEL_INPUTS if k in cols}
        batch["vision_mask"] = cols["vision_mask"] > 0
        batch["pixels"] = floats[:, :config.patch_dim]
        weights = floats[:, config.patch_dim]

        def loss_sum(f):
            return token_loss_sum(apply_model(config, unravel(f), batch, attn), cols["targets"], weights)

        # Gradients stay per device (check_vma=False: no implicit psum over cp); the only
        # reduction is the one over the full mesh at the end of the step.
        value, grads = jax.value_and_grad(loss_sum)(flat)
        return jnp.concatenate([value[None], jnp.sum(weights)[None], grads])[None]

    return body


class PlanExecutor:
    """Runs a `Plan` on device sub-meshes with ring attention; exact token-mean loss and grads.

    `executor.mesh` is the full 1-D mesh, `executor.replicated` the P() sharding on it (params
    and returned grads live there), `executor.num_compiles` the group executables built.
    Internally the parameters travel as one flat fp32 vector (made once per step by one jit on
    the full mesh), so a group costs O(1) host work whatever the number of parameter leaves.
    """

    def __init__(self, config: MLLMConfig, devices: Sequence[jax.Device] | None = None, *,
                 min_bucket: int = MIN_BUCKET, growth: float = GROWTH,
                 compiler_options: Mapping[str, Any] | None = None) -> None:
        if not isinstance(config, MLLMConfig):
            raise TypeError(f"config must be an MLLMConfig, got {type(config).__name__}")
        self.config = config
        self.ranks = RankLayout(jax.devices() if devices is None else devices)
        self.mesh = self.ranks.full_mesh
        self.replicated = NamedSharding(self.mesh, P())
        self._stacked = NamedSharding(self.mesh, P(DP_AXIS))
        ladder(1, min_bucket, growth)                 # rejects a bad ladder now, not mid-step
        self.min_bucket, self.growth = min_bucket, growth
        if compiler_options is None:
            # CPU (fake) devices are for correctness runs, where XLA:CPU's LLVM optimisation is
            # most of the compile time (about 4x here) and buys little; other backends keep defaults.
            cpu = all(d.platform == "cpu" for d in self.ranks.devices)
            compiler_options = {"xla_backend_optimization_level": 0} if cpu else {}
        self.compiler_options = dict(compiler_options)
        self._executables: dict[tuple[int, int, tuple[jax.Device, ...]], Any] = {}
        self._building: dict[Any, threading.Lock] = {}   # one build per key; other keys build concurrently
        self._building_lock = threading.Lock()
        self.compile_seconds: list[float] = []           # wall time of every executable built
        self.last_compile_wait_s = 0.0                    # what the last loss_and_grads waited for compiles
        self._reducers: dict[str, Any] = {}
        self._zeros: dict[jax.Device, jax.Array] = {}
        self._struct: Any = None          # (treedef, shapes, dtypes) of the params tree
        self._unravel: Callable[[jax.Array], Any] | None = None
        self._num_flat = 0
        self._flatten = None

    # ------------------------------------------------------------------ counters
    @property
    def num_compiles(self) -> int:
        """XLA executables built for groups so far (one per (degree, bucket, devices))."""
        return len(self._executables)

    @property
    def num_programs(self) -> int:
        """Distinct (degree, bucket) group programs so far."""
        return len({(d, b) for d, b, _ in self._executables})

    @property
    def executable_keys(self) -> list[tuple[int, int, tuple[int, ...]]]:
        return [(d, b, tuple(x.id for x in devs)) for d, b, devs in list(self._executables)]

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
                if g.attention not in ATTENTION_KINDS:
                    raise PlanValidationError(f"micro-batch {m} group {gi} (ranks {list(g.ranks)}): attention "
                                              f"{g.attention!r} cannot run here; this executor runs "
                                              f"{', '.join(ATTENTION_KINDS)} groups")
        work = []
        for m, mb in enumerate(plan.micro_batches):
            for gi, g in enumerate(mb.groups):
                try:
                    group = [samples[s] for s in g.samples]
                    lay = pack_group(group, g.degree, self.config, bucket=planned_bucket(g, group),
                                     min_bucket=self.min_bucket, growth=self.growth)
                except ValueError as e:
                    raise ValueError(f"micro-batch {m} group {gi} (ranks {list(g.ranks)}): {e}") from None
                work.append(_GroupWork(m, gi, self.ranks.group_devices(g.ranks), lay))
        if sum(w.layout.num_loss_tokens for w in work) == 0:
            raise ValueError("the batch has no text token followed by a text token: the loss is undefined")
        return work

    def plan_keys(self, samples: Sequence[Sample], plan: Plan) -> list[tuple[int, int, tuple[int, ...]]]:
        """The executable keys (degree, bucket, device ids) a plan needs, without compiling."""
        return [(w.layout.degree, w.layout.bucket, tuple(d.id for d in w.devices))
                for w in self.prepare(samples, plan)]

    def _bind(self, params: Any) -> None:
        """Fix the params structure on first use; later params must have the same structure."""
        leaves, treedef = jax.tree.flatten(params)
        struct = (treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
        if self._struct is None:
            bad = [str(x.dtype) for x in leaves if x.dtype != jnp.float32]
            if bad:
                raise TypeError(f"PlanExecutor expects float32 params, got dtypes {sorted(set(bad))}")
            shapes = [tuple(x.shape) for x in leaves]
            sizes = [int(np.prod(sh)) for sh in shapes]
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)

            def unravel(flat):
                return jax.tree.unflatten(treedef, [flat[int(o):int(o) + n].reshape(sh)
                                                    for o, n, sh in zip(offsets, sizes, shapes)])

            self._unravel, self._num_flat, self._struct = unravel, int(offsets[-1]), struct
            self._flatten = jax.jit(lambda p: jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(p)]),
                                    out_shardings=self.replicated)
        elif struct != self._struct:
            raise ValueError("params do not have the structure (tree, shapes, dtypes) this executor was "
                             "first called with")

    def executable(self, params: Any, degree: int, bucket: int, devices: tuple[jax.Device, ...]):
        """The compiled group program for (degree, bucket) on `devices`, built once (thread-safe:
        a background thread may build the next plan's programs while a step runs)."""
        key = (degree, bucket, devices)
        exe = self._executables.get(key)
        if exe is not None:
            return exe
        with self._building_lock:
            lock = self._building.setdefault(key, threading.Lock())
        with lock:
            return self._build(params, key)

    def _build(self, params: Any, key: tuple[int, int, tuple[jax.Device, ...]]):
        degree, bucket, devices = key
        exe = self._executables.get(key)
        if exe is None:
            t0 = time.perf_counter()
            self._bind(params)
            mesh = self.ranks.submesh(devices)
            fn = jax.shard_map(group_program(self.config, degree, self._unravel), mesh=mesh,
                               in_specs=(P(), P(CP_AXIS), P(CP_AXIS)), out_specs=P(CP_AXIS), check_vma=False)
            rep, cp = NamedSharding(mesh, P()), NamedSharding(mesh, P(CP_AXIS))
            args = (jax.ShapeDtypeStruct((self._num_flat,), jnp.float32, sharding=rep),
                    jax.ShapeDtypeStruct((bucket, len(INT_COLUMNS)), jnp.int32, sharding=cp),
                    jax.ShapeDtypeStruct((bucket, self.config.patch_dim + 1), jnp.float32, sharding=cp))
            lowered = jax.jit(fn).lower(*args)
            exe = self._executables[key] = lowered.compile(compiler_options=self.compiler_options)
            self.compile_seconds.append(time.perf_counter() - t0)
        return exe

    def compile_plan(self, samples: Sequence[Sample], plan: Plan, params: Any) -> int:
        """Build (without running) every executable the plan needs on this process's devices;
        returns how many were new."""
        before = self.num_compiles
        for w in self._local(self.prepare(samples, plan)):
            self.executable(params, w.layout.degree, w.layout.bucket, w.devices)
        return self.num_compiles - before

    # ------------------------------------------------------------------ device-side work
    def replicate(self, params: Any) -> Any:
        """Params replicated on the full mesh (a no-op for params already there)."""
        return jax.tree.map(lambda x: x if getattr(x, "sharding", None) == self.replicated
                            else jax.device_put(x, self.replicated), params)

    def flat_params(self, params: Any) -> jax.Array:
        """The params as one float32 vector replicated on the full mesh (one jit, no transfer)."""
        self._bind(params)
        return self._flatten(self.replicate(params))

    def _views(self, flat: jax.Array, device_sets: Sequence[tuple[jax.Device, ...]]) -> dict:
        """The flat params seen on each sub-mesh: the same per-device buffers, no copy."""
        by_dev = {s.device: s.data for s in flat.addressable_shards}
        return {devs: jax.make_array_from_single_device_arrays(
                    flat.shape, NamedSharding(self.ranks.submesh(devs), P()),
                    [by_dev[d] for d in devs if d in by_dev])
                for devs in device_sets}

    def _local(self, work: Sequence[_GroupWork]) -> list[_GroupWork]:
        """The groups this process takes part in (all of them in a single-process run)."""
        me = jax.process_index()
        return [w for w in work if any(d.process_index == me for d in w.devices)]

    def _zero_row(self, device: jax.Device) -> jax.Array:
        """A [1, 2 + P] row of zeros on an idle device (cached)."""
        z = self._zeros.get(device)
        if z is None:
            z = self._zeros[device] = jax.device_put(np.zeros((1, 2 + self._num_flat), np.float32), device)
        return z

    def _reducer(self):
        """(accumulate, finish): rows summed micro-batch by micro-batch on each device (no
        communication), then one all-reduce over the full mesh, / token count, unflattened."""
        if not self._reducers:
            unravel = self._unravel

            def finish(acc):
                v = jnp.sum(acc, axis=0)                       # the all-reduce over every device
                return v[0] / v[1], unravel(v[2:] / v[1])

            # No donation: rows of idle devices are cached zero buffers that must survive.
            self._reducers["add"] = jax.jit(jnp.add, out_shardings=self._stacked)
            self._reducers["finish"] = jax.jit(finish, out_shardings=self.replicated)
        return self._reducers["add"], self._reducers["finish"]

    def dispatch(self, flat: jax.Array, work: Sequence[_GroupWork]) -> list[dict[jax.Device, jax.Array]]:
        """Launch every group (asynchronously); per micro-batch, the [1, 2 + P] row of each device."""
        rows: dict[int, dict[jax.Device, jax.Array]] = {m: {} for m in sorted({w.micro_batch for w in work})}
        work = self._local(work)
        views = self._views(flat, {w.devices for w in work})
        for w in work:
            lay = w.layout
            exe = self.executable(None, lay.degree, lay.bucket, w.devices)
            cp = NamedSharding(self.ranks.submesh(w.devices), P(CP_AXIS))
            ints, floats = pack_inputs(lay)
            out = exe(views[w.devices], jax.device_put(ints, cp), jax.device_put(floats, cp))
            rows[w.micro_batch].update((s.device, s.data) for s in out.addressable_shards)
        return [rows[m] for m in sorted(rows)]

    def reduce(self, partials: Sequence[Mapping[jax.Device, jax.Array]]) -> tuple[jax.Array, Any]:
        """Token-weighted sum over all devices and micro-batches, replicated on the full mesh."""
        add, finish = self._reducer()
        acc = None
        for mb in partials:
            rows = jax.make_array_from_single_device_arrays(
                (len(self.ranks.devices), 2 + self._num_flat), self._stacked,
                [mb[d] if d in mb else self._zero_row(d) for d in self.ranks.devices
                 if d.process_index == jax.process_index()])
            acc = rows if acc is None else add(acc, rows)
        return finish(acc)

    def loss_and_grads(self, params: Any, samples: Sequence[Sample], plan: Plan) -> tuple[jax.Array, Any]:
        """Batch token-mean loss and its gradients (shaped like params, replicated on the mesh)."""
        work = self.prepare(samples, plan)
        flat = self.flat_params(params)
        t0 = time.perf_counter()
        missing = [w for w in self._local(work) if (w.layout.degree, w.layout.bucket, w.devices) not in self._executables]
        for w in missing:                       # compile (or wait for a background compile of) what is missing
            self.executable(params, w.layout.degree, w.layout.bucket, w.devices)
        self.last_compile_wait_s = time.perf_counter() - t0 if missing else 0.0
        return self.reduce(self.dispatch(flat, work))
