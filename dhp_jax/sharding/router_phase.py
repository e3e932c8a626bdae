"""`RouterPhase`: the first phase of a DHP step that adds a mixture of experts' load-balancing loss
(`PlanExecutor(router_aux_loss_coef=...)`; the weight is `moe.aux_loss_coef`'s).

The loss is transformers' `load_balancing_loss_func` over the whole global batch:
coef E sum_e (C_e / R)(P_e / R), C_e the (token, expert) pairs routed to expert e and R the live
rows, both summed over every token of every group and every sparse layer, P_e the summed router
probabilities. The counts carry no gradient, so with the weights w_e = E C_e / R^2 fixed the
term is linear in the tokens: each token adds coef sum_e w_e p_e(token), and a group's share of
the loss (and of its gradient) needs nothing of the other groups but w. DHP's groups run
independently, so the step runs in two phases:
1. each group's router program (`family_adapter.family_program(router_only=True)`: the forward
   pass up to the last router, no backward pass), built once per executable key as the step's
   programs are (`compiles`, a `CompileCache` of one tier), returns per device its C and R (a
   rank's counted once); the rows, micro-batch by micro-batch, are summed over the full mesh (one
   small jit, multi-process too) and read on the host, which makes w (`moe.aux_weights`);
2. the step's programs take f32[E + 1] = (w, coef x the batch's counted labels) as one more
   replicated input (the step's final division by the counted labels undoes that factor).
Loss and gradients are then the one-device loss's with the term over the whole batch. The first
phase repeats the forward pass; keeping the activations of every group of the step until the
counts are known would hold them all at once (the torch backend runs the same two phases,
`npu_backend.executor`). A router
program computes the vision encoder and the LLM layers up to the last sparse one: it returns the
counts alone, so the compiled program has neither the later layers nor the LM head and loss. The
planner prices that pass in each group's time (`CostModel.preset(..., router_phase=True)`, set by
the trainer when the loss is on); its memory is no term there, as the program runs before the
step's programs, frees its buffers and keeps nothing for a backward pass.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dhp_jax.model.hf import moe
from dhp_jax.sharding.compile_cache import CompileCache
from dhp_jax.sharding.prepared import PreparedStep


def aux_coef_of(model: Any, coef: float | None) -> float:
    """The load-balancing loss's weight for a model adapter (set on a family's as `aux_coef`; 0:
    off): `moe.aux_loss_coef` of its config; the stand-in model has no router (an error if asked)."""
    if hasattr(model, "router_program"):
        model.aux_coef = moe.aux_loss_coef(model.config, coef)
        return model.aux_coef
    if coef:
        raise ValueError(f"router_aux_loss_coef {coef!r}: the stand-in model {getattr(model.config, 'name', '')!r} "
                         f"has no mixture-of-experts layer")
    return 0.0


class RouterPhase:
    """The first phase of a step with the load-balancing loss, for `executor` (a `PlanExecutor`,
    whose `lower(..., router=True)`, `_mesh`, `_views`, `model`, `ranks` and state it uses);
    `wait` waits for a micro-batch's rows as the step's do (`executor.await_rows`, with the
    executor's stall settings)."""

    def __init__(self, executor: Any, wait: Callable[..., None]) -> None:
        self.executor, self.wait = executor, wait
        main = executor.compiles
        self.compiles = CompileCache(lambda *key: executor.lower(*key, router=True),
                                     lambda devices, kind: executor._mesh(devices, kind)[0], executor._check_key,
                                     main.compiler_options, main.reuse_compiled, False, main.tier_up_runs)
        self.width = executor.model.router_width
        self._zeros: dict[jax.Device, jax.Array] = {}
        self._sum = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=executor.replicated)

    @property
    def num_compiles(self) -> int:
        return self.compiles.num_compiles

    def input_shape(self, mesh: Any) -> jax.ShapeDtypeStruct:
        """The step programs' extra input (phase 2), f32[E + 1] replicated on a group's `mesh`."""
        return jax.ShapeDtypeStruct((self.width,), jnp.float32,
                                    sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    def dispatch(self, flat: jax.Array, group: Any) -> dict[jax.Device, tuple]:
        """Launch a micro-batch's router programs: each device's (stats, stats) rows."""
        ex, rows = self.executor, {}
        views = ex._views(flat, {(w.devices, w.attention) for w in group})
        for w in group:
            cp = jax.sharding.NamedSharding(*ex._mesh(w.devices, w.attention))
            stats = self.compiles.executable(w.key)(views[(w.devices, w.attention)],
                                                    *(jax.device_put(a, cp) for a in ex.model.inputs(w.layout)))
            rows.update((s.device, (s.data, s.data)) for s in stats.addressable_shards)
        return rows

    def weights(self, flat: jax.Array, prepared: PreparedStep, coef: float) -> np.ndarray:
        """f32[E + 1]: the batch's expert weights E C_e / R^2 and coef x its counted labels, from
        every group's router program on the gathered params `flat` (module docstring, phase 1)."""
        ex, total = self.executor, None
        n, me = len(ex.ranks.devices), jax.process_index()
        for group in prepared.micro_batches():
            rows = self.dispatch(flat, group)
            self.wait(rows, group, ex.stall_timeout_s, ex.stall_abort_s, ex.on_stall)
            mine = [rows[d][0] if d in rows else self._zero(d) for d in ex.ranks.devices if d.process_index == me]
            part = self._sum(jax.make_array_from_single_device_arrays((n, self.width), ex.sharded, mine))
            total = part if total is None else total + part
        sums = np.asarray(jax.device_get(total.addressable_data(0)), np.float64)
        labels = sum(w.layout.num_loss_tokens for w in prepared.work)
        return np.append(moe.aux_weights(sums[:-1], sums[-1]), np.float32(coef * labels)).astype(np.float32)

    def _zero(self, device: jax.Device) -> jax.Array:
        """A stats row of zeros for a device idle in a micro-batch (cached)."""
        z = self._zeros.get(device)
        if z is None:
            z = self._zeros[device] = jax.device_put(np.zeros((1, self.width), np.float32), device)
        return z
