"""`StepExecutor`: what the trainer and `dhp profile` call on an executor, as a `typing.Protocol`.

The trainer drives any object with these members (`PlanExecutor` is the one in this package; a
test may pass its own): it calls them, it never probes for them. `check_executor` turns a missing
member into one error that names it, before anything is compiled.

Key: an executable's (degree, padded tokens, device ids, attention kind), the executor's order.
The torch backend's `npu_backend.TorchPlanExecutor` is driven by its own loop (`npu_backend.train`,
one process per rank, eager torch: nothing to compile ahead), not by this trainer, so it does not
take part in this protocol.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

Key = tuple[int, int, tuple[int, ...], str]


@runtime_checkable
class StepExecutor(Protocol):
    """An executor of DHP plans over a train state sharded on its mesh (see `PlanExecutor`)."""

    min_bucket: int        # the padding ladder the groups run in (the planner prices the same one)
    growth: float
    linear_chunk: int      # tokens per linear-layer chunk of a pad-skipping step (0: no skipping)
    layout: Any            # the flat params layout of the sharded state (`sharding.flat.FlatLayout`)
    compile_seconds: list[float]   # wall seconds of every executable built, in build order

    @property
    def num_compiles(self) -> int:
        """Executables built so far."""

    @property
    def executable_keys(self) -> list[Key]:
        """The keys of every executable built so far."""

    def plan_keys(self, samples: Sequence[Any], plan: Any) -> list[Key]:
        """The executable keys a plan needs (one per group, plan order), without compiling."""

    def compile_plan(self, samples: Sequence[Any], plan: Any, params: Any) -> int:
        """Build what the plan needs on this process's devices; how many executables were new."""

    def loss_and_grad_shards(self, master: Any, samples: Sequence[Any], plan: Any) -> tuple[Any, Any]:
        """One step: sharded master params in, (loss, gradient sharded like the params) out."""

    def prepare(self, samples: Sequence[Any], plan: Any) -> Any:
        """The plan checked and laid out for these devices, once per step (`sharding.prepared.PreparedStep`:
        its `id_keys` are `plan_keys`)."""

    def compile_step(self, prepared: Any, params: Any) -> int:
        """`compile_plan` of a prepared step."""

    def run_step(self, master: Any, prepared: Any) -> tuple[Any, Any]:
        """`loss_and_grad_shards` of a prepared step."""

    def state_sharding(self, leaf: Any) -> Any:
        """Where a train-state leaf lives on the mesh."""

    def replicate(self, params: Any) -> Any:
        """A params tree replicated on the executor's mesh."""


MEMBERS = ("min_bucket", "growth", "linear_chunk", "layout", "compile_seconds", "num_compiles", "executable_keys",
           "plan_keys", "compile_plan", "loss_and_grad_shards", "prepare", "compile_step", "run_step", "state_sharding",
           "replicate")


def check_executor(executor: Any) -> StepExecutor:
    """`executor` if it has every member of `StepExecutor` (checked once, where it is handed to
    the trainer); TypeError naming the missing ones."""
    if not isinstance(executor, StepExecutor):
        missing = [n for n in MEMBERS if not hasattr(executor, n)]
        raise TypeError(f"executor {type(executor).__name__} lacks {', '.join(missing)} of the StepExecutor "
                        f"protocol (dhp_jax.sharding.protocol)")
    return executor
