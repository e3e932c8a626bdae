"""`PlanExecutor`: one DHP step (all micro-batches of a `Plan`) as per-group executables.

Data flow of `loss_and_grads(params, samples, plan)`:
1. Check the plan and lay out every group's samples (`dhp_jax.data.layout.pack_group`) before any
   device work, so bad input fails fast, naming the group or the sample.
2. For each group: the sub-mesh over its devices (cached), a view of the replicated parameters on
   that sub-mesh made from the same device buffers (no copy), the layout arrays put on the
   sub-mesh sharded over `cp`, and the executable for (degree, bucket, devices) from the cache.
   The group program (shard_map + ring attention) returns, per device, the partial loss sum, the
   partial loss-token count and the partial gradient of the loss sum: grads[d, ...] over `cp`.
3. Every group of every micro-batch is dispatched before anything is awaited.
4. Per micro-batch, the devices' partial results (zeros for idle devices) are assembled into
   global [N, ...] arrays over the full `dp` mesh with `jax.make_array_from_single_device_arrays`
   (no copy, no host round trip); one jit sums them over devices and micro-batches and divides by
   the total token count: the token-weighted all-reduce, output replicated on the full mesh.

Compiles: XLA binds an executable to its device assignment, so the cache key is (degree, bucket,
device tuple); `num_programs` counts distinct (degree, bucket) programs, `num_compiles` the XLA
executables built. Under multi-process JAX each process would run only the groups whose devices
it can address (see `_owned`); today every device must be addressable.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dhp_jax.data.layout import MIN_BUCKET, GROWTH, GroupLayout, pack_group
from dhp_jax.data.sample import Sample
from dhp_jax.model.config import MLLMConfig
from dhp_jax.model.mllm import MODEL_INPUTS, apply_model, token_loss_sum
from dhp_jax.planner.plan import Plan
from dhp_jax.sharding.mesh import CP_AXIS, DP_AXIS, RankLayout
from dhp_jax.sharding.ring import ring_attention_fn


@dataclasses.dataclass
class _GroupWork:
    """One group of one micro-batch, ready to dispatch."""

    micro_batch: int
    index: int
    devices: tuple[jax.Device, ...]
    layout: GroupLayout


def group_program(config: MLLMConfig, degree: int):
    """The per-device body: (params, local arrays) -> (loss_sum[1], count[1], grads[1, ...])."""
    attn = ring_attention_fn(CP_AXIS, degree)

    def body(params, arrays):
        batch = {k: arrays[k] for k in MODEL_INPUTS}

        def loss_sum(p):
            return token_loss_sum(apply_model(config, p, batch, attn), arrays["targets"], arrays["loss_weights"])

        # check_vma=False below keeps these gradients per device (no implicit psum over cp):
        # the only reduction is the one over the full mesh at the end of the step.
        value, grads = jax.value_and_grad(loss_sum)(params)
        count = jnp.sum(arrays["loss_weights"])
        return value[None], count[None], jax.tree.map(lambda g: g[None], grads)

    return body


class PlanExecutor:
    """Runs a `Plan` on device sub-meshes with ring attention; exact token-mean loss and grads.

    `executor.mesh` is the full 1-D mesh, `executor.replicated` the P() sharding on it (params
    and returned grads live there), `executor.num_compiles` the group executables built.
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
        self.min_bucket, self.growth = min_bucket, growth
        self._executables: dict[tuple[int, int, tuple[jax.Device, ...]], Any] = {}
        self._reducers: dict[int, Any] = {}
        self._zeros: dict[jax.Device, tuple] = {}
        if compiler_options is None:
            # CPU (fake) devices are for correctness runs, where XLA:CPU's LLVM optimisation is
            # most of the compile time (about 4x here) and buys little; other backends keep defaults.
            cpu = all(d.platform == "cpu" for d in self.ranks.devices)
            compiler_options = {"xla_backend_optimization_level": 0} if cpu else {}
        self.compiler_options = dict(compiler_options)

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
        return [(d, b, tuple(x.id for x in devs)) for d, b, devs in self._executables]

    # ------------------------------------------------------------------ planning-side work
    def prepare(self, samples: Sequence[Sample], plan: Plan) -> list[_GroupWork]:
        """Check the plan against devices and samples and lay out every group (no device work)."""
        samples = list(samples)
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise TypeError(f"sample {i} is a {type(s).__name__}, not a Sample")
        self.ranks.check_plan(plan, len(samples))
        work = []
        for m, mb in enumerate(plan.micro_batches):
            for gi, g in enumerate(mb.groups):
                try:
                    lay = pack_group([samples[s] for s in g.samples], g.degree, self.config,
                                     min_bucket=self.min_bucket, growth=self.growth)
                except ValueError as e:
                    raise ValueError(f"micro-batch {m} group {gi} (ranks {list(g.ranks)}): {e}") from None
                work.append(_GroupWork(m, gi, self.ranks.group_devices(g.ranks), lay))
        if sum(w.layout.num_loss_tokens for w in work) == 0:
            raise ValueError("the batch has no text token followed by a text token: the loss is undefined")
        return work

    def executable(self, params: Any, degree: int, bucket: int, devices: tuple[jax.Device, ...]):
        """The compiled group program for (degree, bucket) on `devices`, built once."""
        key = (degree, bucket, devices)
        exe = self._executables.get(key)
        if exe is None:
            mesh = self.ranks.submesh(devices)
            fn = jax.shard_map(group_program(self.config, degree), mesh=mesh,
                               in_specs=(P(), P(CP_AXIS)), out_specs=P(CP_AXIS), check_vma=False)
            rep, cp = NamedSharding(mesh, P()), NamedSharding(mesh, P(CP_AXIS))
            p_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), params)
            a_abs = {k: jax.ShapeDtypeStruct((bucket,) + shape, dtype, sharding=cp)
                     for k, (shape, dtype) in self._array_specs().items()}
            lowered = jax.jit(fn).lower(p_abs, a_abs)
            exe = self._executables[key] = lowered.compile(compiler_options=self.compiler_options)
        return exe

    def _array_specs(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        i32 = np.dtype(np.int32)
        specs = {k: ((), i32) for k in ("token_ids", "segment_ids", "positions", "span_ids", "frame_ids",
                                         "frame_positions", "targets")}
        specs.update(pixels=((self.config.patch_dim,), np.dtype(np.float32)), vision_mask=((), np.dtype(bool)),
                     loss_weights=((), np.dtype(np.float32)))
        return specs

    def plan_keys(self, samples: Sequence[Sample], plan: Plan) -> list[tuple[int, int, tuple[int, ...]]]:
        """The executable keys (degree, bucket, device ids) a plan needs, without compiling."""
        return [(w.layout.degree, w.layout.bucket, tuple(d.id for d in w.devices))
                for w in self.prepare(samples, plan)]

    def compile_plan(self, samples: Sequence[Sample], plan: Plan, params: Any) -> int:
        """Build (without running) every executable the plan needs; returns how many were new."""
        before = self.num_compiles
        for w in self.prepare(samples, plan):
            self.executable(params, w.layout.degree, w.layout.bucket, w.devices)
        return self.num_compiles - before

    # ------------------------------------------------------------------ device-side work
    def replicate(self, params: Any) -> Any:
        """Params replicated on the full mesh (a no-op for params already there)."""
        return jax.tree.map(lambda x: x if getattr(x, "sharding", None) == self.replicated
                            else jax.device_put(x, self.replicated), params)

    def _view(self, params: Any, devices: tuple[jax.Device, ...]) -> Any:
        """The replicated params seen on a sub-mesh: the same per-device buffers, no copy."""
        rep = NamedSharding(self.ranks.submesh(devices), P())

        def one(x):
            by_dev = {s.device: s.data for s in x.addressable_shards}
            return jax.make_array_from_single_device_arrays(x.shape, rep, [by_dev[d] for d in devices])

        return jax.tree.map(one, params)

    def _zero_shards(self, device: jax.Device, params: Any) -> tuple:
        """(loss, count, grads) zeros on one idle device, shaped like one device's partials."""
        z = self._zeros.get(device)
        if z is None:
            put = lambda shape: jax.device_put(np.zeros((1,) + tuple(shape), np.float32), device)
            z = self._zeros[device] = (put(()), put(()), jax.tree.map(lambda x: put(x.shape), params))
        return z

    def _reducer(self, num_micro_batches: int):
        fn = self._reducers.get(num_micro_batches)
        if fn is None:
            def reduce(parts):
                count = sum(jnp.sum(c) for _, c, _ in parts)
                loss = sum(jnp.sum(l) for l, _, _ in parts) / count
                grads = jax.tree.map(lambda *gs: sum(jnp.sum(g, axis=0) for g in gs) / count,
                                     *[g for _, _, g in parts])
                return loss, grads
            fn = self._reducers[num_micro_batches] = jax.jit(reduce, out_shardings=self.replicated)
        return fn

    def dispatch(self, params: Any, work: Sequence[_GroupWork]) -> list[list[tuple[jax.Device, tuple]]]:
        """Launch every group (asynchronously); per micro-batch, (device, partials) pairs."""
        out: dict[int, list] = {}
        for w in work:
            lay = w.layout
            exe = self.executable(params, lay.degree, lay.bucket, w.devices)
            cp = NamedSharding(self.ranks.submesh(w.devices), P(CP_AXIS))
            arrays = {k: jax.device_put(v, cp) for k, v in lay.arrays().items()}
            loss, count, grads = exe(self._view(params, w.devices), arrays)
            per_dev = _by_device((loss, count, grads))
            out.setdefault(w.micro_batch, []).extend((d, per_dev[d]) for d in w.devices)
        return [out[m] for m in sorted(out)]

    def reduce(self, params: Any, partials: list[list[tuple[jax.Device, tuple]]]) -> tuple[jax.Array, Any]:
        """Token-weighted sum over all devices and micro-batches, replicated on the full mesh."""
        treedef = jax.tree.structure(params)
        parts = []
        for mb in partials:
            have = dict(mb)
            rows = [have[d] if d in have else self._zero_shards(d, params) for d in self.ranks.devices]
            leaves = [jax.tree.leaves(r) for r in rows]       # per device: [loss, count, *grads]
            glob = []
            for j, ref in enumerate(leaves[0]):
                glob.append(jax.make_array_from_single_device_arrays(
                    (len(rows),) + ref.shape[1:], self._stacked, [lv[j] for lv in leaves]))
            parts.append((glob[0], glob[1], jax.tree.unflatten(treedef, glob[2:])))
        return self._reducer(len(parts))(parts)

    def loss_and_grads(self, params: Any, samples: Sequence[Sample], plan: Plan) -> tuple[jax.Array, Any]:
        """Batch token-mean loss and its gradients (shaped like params, replicated on the mesh)."""
        work = self.prepare(samples, plan)
        params = self.replicate(params)
        return self.reduce(params, self.dispatch(params, work))


def _by_device(tree: Any) -> dict[jax.Device, Any]:
    """Split a tree of [d, ...] arrays sharded over cp into per-device trees of [1, ...] shards."""
    leaves, treedef = jax.tree.flatten(tree)
    per: dict[jax.Device, list] = {}
    for x in leaves:
        for s in x.addressable_shards:
            per.setdefault(s.device, []).append(s.data)
    return {d: jax.tree.unflatten(treedef, v) for d, v in per.items()}
