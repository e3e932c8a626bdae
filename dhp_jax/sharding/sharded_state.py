"""`ShardedState`: a `PlanExecutor`'s train state on the full mesh, and the small programs over it.

The master params (fp32) and the optimizer state are flat vectors x[P_pad] sharded P("dp"), each
device owning P_pad/N elements (`dhp_jax.sharding.flat`; with tensor parallelism each device's share,
`dhp_jax.sharding.tensor_parallel.TensorLayout`). The programs, built once on the full mesh: `shard` (a
params tree into the master vector), `gather` (the step's one all-gather into the compute dtype),
`unshard` (a flat vector back into a replicated tree), `accumulate` (one micro-batch's gradient rows
reduce-scattered piece by piece into the donated fp32 accumulator) and `finish` (the token mean).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dhp_jax.planner.cost.memory import reduce_pieces
from dhp_jax.sharding.mesh import DP_AXIS, TP_AXIS, RankLayout


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


class ShardedState:
    """The state's layout (`layout`, None until a family executor binds its first tree) and shardings
    over `ranks`' full mesh, and the programs that move it (see the module docstring)."""

    def __init__(self, ranks: RankLayout, compute_dtype: Any, layout: Any = None, stats_width: int = 2) -> None:
        self.ranks, self.compute_dtype, self.layout = ranks, jnp.dtype(compute_dtype), layout
        # a stats row: (loss sum, counted labels) and the model's other per-step sums
        self.stats_width = int(stats_width)
        self.last_stats: jax.Array | None = None        # the last step's stats summed over the devices
        self.tensor_parallel = t = ranks.devices_per_rank
        self.mesh = ranks.full_mesh
        self.replicated = NamedSharding(self.mesh, P())
        self.sharded = NamedSharding(self.mesh, P(DP_AXIS))
        # the (rank, tp) view of the full mesh: the tp-sharded state's gather and reduction
        self.tp_mesh = Mesh(np.array(ranks.devices).reshape(-1, t), (DP_AXIS, TP_AXIS)) if t > 1 else None
        self._programs: dict[str, Any] = {}
        self._zeros: dict[jax.Device, tuple[jax.Array, Any]] = {}   # (stats row, zero-row maker)
        self._count_once: jax.Array | None = None

    # ------------------------------------------------------------------ shapes
    @property
    def row_size(self) -> int:
        """Length of a device's params and gradient row: P_pad, or its share L_pad with tensor
        parallelism (`tensor.TensorLayout.row`)."""
        return self.layout.padded if self.tensor_parallel == 1 else self.layout.row

    @property
    def params_spec(self) -> P:
        """How a group program takes the params: replicated, or with tensor parallelism one share
        per tp index ([t, L_pad] split over `tp`)."""
        return P() if self.tensor_parallel == 1 else P(TP_AXIS)

    @property
    def params_shape(self) -> tuple[int, ...]:
        t = self.tensor_parallel
        return (self.layout.padded,) if t == 1 else (t, self.layout.row)

    def row_spec(self, spec: P) -> P:
        """The spec of a group program's per-device outputs (stats and gradient rows): the stream's
        axes, and `tp` when a rank has several devices (each returns its own row)."""
        if self.tensor_parallel == 1:
            return spec
        axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
        return P((*axes, TP_AXIS))

    def state_sharding(self, leaf: Any) -> NamedSharding:
        """Where a train-state leaf lives: flat vectors of the layout (master params, optimizer
        moments, grads) sharded over the full mesh, everything else (step, counts, keys) replicated."""
        return self.sharded if tuple(getattr(leaf, "shape", ())) == (self.layout.padded,) else self.replicated

    # ------------------------------------------------------------------ the programs
    def program(self, name: str) -> Any:
        """One of the state's full-mesh programs, all built on first use: shard, gather, unshard,
        zeros, accumulate, finish."""
        if not self._programs:
            self._programs.update(self._build())
        return self._programs[name]

    def _build(self) -> dict[str, Any]:
        lay, cd, n, w = self.layout, self.compute_dtype, len(self.ranks.devices), self.stats_width
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
            total = jnp.sum(stats, axis=0)                  # [loss sum, count, ...]: a few floats per device
            return total[0] / total[1], acc / total[1], total

        rep, shd = self.replicated, self.sharded
        return dict(
            shard=jax.jit(lambda p: lay.ravel(p), out_shardings=shd),
            gather=jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=state, out_specs=self.params_spec,
                                         check_vma=False),
                           out_shardings=NamedSharding(mesh, self.params_spec)),
            # one all-gather of the whole vector, then slices: unravelling the sharded vector
            # directly makes the partitioner gather every leaf on its own (a compile ~10x longer)
            unshard=jax.jit(lambda g: lay.unravel(lax.with_sharding_constraint(g, rep)), out_shardings=rep),
            zeros=jax.jit(lambda: (jnp.zeros((lay.padded,), jnp.float32), jnp.zeros((n, w), jnp.float32)),
                          out_shardings=(shd, shd)),
            accumulate=jax.jit(accumulate, out_shardings=(shd, shd), donate_argnums=(0, 1)),
            finish=jax.jit(finish, out_shardings=(rep, shd, rep)))

    # ------------------------------------------------------------------ moving the state
    def replicate(self, params: Any) -> Any:
        """Params replicated on the full mesh (a no-op for params already there)."""
        return jax.tree.map(lambda x: x if getattr(x, "sharding", None) == self.replicated
                            else jax.device_put(x, self.replicated), params)

    def shard(self, params: Any) -> jax.Array:
        """A float32 params tree as the master vector fp32[P_pad], sharded over the full mesh."""
        return self.program("shard")(self.replicate(params))

    def unshard(self, flat: jax.Array) -> Any:
        """A sharded flat vector (params or grads) as a params-shaped tree replicated on the mesh."""
        return self.program("unshard")(flat)

    def gather(self, master: jax.Array) -> jax.Array:
        """The step's one all-gather: master shards -> params flat[P_pad] in the compute dtype,
        replicated on the full mesh (with tensor parallelism: [t, L_pad], each device its share)."""
        if not isinstance(master, jax.Array) or master.shape != (self.layout.padded,):
            raise ValueError(f"master params must be a flat array of {self.layout.padded} elements "
                             f"(PlanExecutor.shard), got {getattr(master, 'shape', type(master).__name__)}")
        return self.program("gather")(master)

    def norm_weights(self) -> jax.Array | None:
        """With tensor parallelism, the bool master-shaped vector marking one copy of every
        parameter (`tensor.TensorLayout.count_once`), sharded like the master: the gradient's
        global norm counts those elements only. None at t = 1 (every element counts)."""
        if self.tensor_parallel == 1:
            return None
        if self._count_once is None:
            self._count_once = jax.jit(self.layout.count_once, out_shardings=self.sharded)()
        return self._count_once

    # ------------------------------------------------------------------ the reduction
    def _zero_rows(self, device: jax.Device) -> tuple[jax.Array, jax.Array]:
        """(stats, grads) rows of zeros for a device idle in a micro-batch. The stats row is cached;
        the gradient row is made for this reduction only (a cached P_pad row would stay on the
        device through every later group program it runs)."""
        z = self._zeros.get(device)
        if z is None:
            z = self._zeros[device] = (jax.device_put(np.zeros((1, self.stats_width), np.float32), device),
                                       jax.jit(lambda: jnp.zeros((1, self.row_size), row_dtype(self.compute_dtype)),
                                               out_shardings=jax.sharding.SingleDeviceSharding(device)))
        return z[0], z[1]()

    def accumulate(self, acc: tuple[jax.Array, jax.Array] | None, rows: Mapping[jax.Device, tuple]
                   ) -> tuple[jax.Array, jax.Array]:
        """Enqueue one micro-batch's reduction: the devices' (stats, grads) rows reduce-scattered in
        pieces into the fp32 accumulator shards `acc` (None: zeros), which are donated."""
        n = len(self.ranks.devices)
        me = jax.process_index()
        mine = [rows[d] if d in rows else self._zero_rows(d) for d in self.ranks.devices if d.process_index == me]
        stats = jax.make_array_from_single_device_arrays((n, self.stats_width), self.sharded, [r[0] for r in mine])
        grads = jax.make_array_from_single_device_arrays((n, self.row_size), self.sharded, [r[1] for r in mine])
        return self.program("accumulate")(*(self.program("zeros")() if acc is None else acc), grads, stats)

    def step_sums(self) -> jax.Array | None:
        """The last step's sums beyond (loss sum, counted labels), summed over the devices
        (`ModelAdapter.stats_width`; a MoE family: `family_adapter.router_stats`), or None."""
        st = self.last_stats
        return None if st is None or st.shape[0] <= 2 else st[2:]

    def finish(self, acc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """(loss replicated, grads fp32[P_pad] sharded like the master): the sums / the token count;
        the summed stats row kept as `last_stats`."""
        loss, grads, self.last_stats = self.program("finish")(*acc)
        return loss, grads
