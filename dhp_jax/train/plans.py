"""Where a step's plan comes from: a planner strategy, or a plan file replayed step by step.

Plan files make runs comparable and reproducible: a run writes `plans.jsonl` (one plan a step) and
`planner.plan_file=<that file>` replays it. The format and the replay rule are
`dhp_jax.planner.contract.planfile`'s, shared with the torch backend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from dhp_jax.geometry.layout import bucket_length
from dhp_jax.planner import CostModel, plan_batch
from dhp_jax.planner.cli_args import cost_model as load
from dhp_jax.planner.contract.plan import Plan
from dhp_jax.planner.contract.planfile import PlanFileError, load_plan_file, plan_at
from dhp_jax.planner.cost.model import check_router_phase
from dhp_jax.planner.cost.presets import ModelShape
from dhp_jax.planner.programs.cache import ProgramCache
from dhp_jax.planner.solvers.strategies import lookup

__all__ = ["PlanFileError", "PlanSource", "attach_programs", "load_plan_file", "make_cost", "run_cost"]


class PlanSource:
    """`source(step, batch) -> Plan`: deterministic, so any process computes the same plan."""

    def __init__(self, num_ranks: int, cost: Any = None, strategy: str = "dhp",
                 plans: Sequence[Plan] | None = None, num_micro_batches: int | None = None,
                 ranks_per_node: int | None = None, full_size: bool = False):
        self.num_ranks, self.cost, self.strategy, self.full_size = num_ranks, cost, strategy, full_size
        self.plans = list(plans) if plans else None
        self.num_micro_batches, self.ranks_per_node = num_micro_batches, ranks_per_node
        self.programs = None  # a planner.programs.cache.ProgramCache: reuse compiled programs, price new ones
        # (min_bucket, growth) of the executor's ladder: a full-size plan's groups run in the
        # executor's buckets of the scaled samples, and those are the programs the cache records
        self.executed_ladder: tuple[int, float] | None = None
        self.issued: dict[int, list] = {}   # step -> the executables its plan added to `programs`
        self.decided: dict[int, str] = {}   # step -> digest of the plan returned (what ran is checked against it)
        if self.plans is None and cost is None:
            raise ValueError("a PlanSource needs a cost model or a list of plans")

    @property
    def label(self) -> str:
        return "plan-file" if self.plans is not None else self.strategy

    def __call__(self, step: int, batch: Any) -> Plan:
        if self.plans is not None:
            plan = plan_at(self.plans, step)
        else:
            kwargs: dict[str, Any] = {}
            # planner.num_micro_batches fixes the count of the strategies that choose one (the
            # static baselines' count follows from their degree: they take no such option)
            if self.num_micro_batches is not None and "num_micro_batches" in lookup(self.strategy)[0].options:
                kwargs["num_micro_batches"] = self.num_micro_batches
            if self.ranks_per_node is not None:
                kwargs["ranks_per_node"] = self.ranks_per_node
            programs = self.programs if self.strategy == "dhp" else None
            if programs is not None:
                programs.executed = self._executed(batch)
                kwargs["programs"] = programs
                before = set(programs.executables)
            # full_size: plan the batch at the token counts the cost model describes (the unscaled
            # source samples, one per executed sample, same ids); the executor runs the scaled ones
            samples = batch.source_samples if self.full_size else batch.samples
            plan = plan_batch(samples, self.num_ranks, self.cost, strategy=self.strategy, **kwargs)
            if programs is not None:
                self.issued[step] = sorted(programs.executables - before)
        # (checked where it was made: `plan_batch`, or the plan file's load; the executor checks it
        # against its devices once, preparing it)
        self.decided[step] = plan.digest()
        return plan

    def _executed(self, batch: Any) -> Any:
        """`ProgramCache.executed` for this batch: the executor's bucket of a group's scaled samples
        when the plan is made at full size (None: the plan's own buckets are the executor's)."""
        if not self.full_size or self.executed_ladder is None:
            return None
        tokens = [s.num_tokens for s in batch.samples]
        min_bucket, growth = self.executed_ladder
        return lambda degree, ids: bucket_length(sum(tokens[i] for i in ids), degree, min_bucket, growth)


def attach_programs(source: PlanSource, compile_price_s: float, ladder: tuple[int, float, int],
                    ranks_per_process: int | None) -> None:
    """Give a run's `PlanSource` what its planner prices against: the executor's bucket ladder
    `(min_bucket, growth, linear_chunk)` (in the cost model unless the plans are made at full
    size) and a `ProgramCache` of the programs earlier steps' plans needed, each new one at
    `compile_price_s` (`planner.compile_price_s`: a fixed figure, so every process and a resumed
    run plan alike)."""
    min_bucket, growth, chunk = ladder
    if source.cost is not None and not source.full_size:
        # one bucket rule: the planner prices (and writes into the plan) the ladder the executor runs
        # (a plan made at full token counts prices the preset's own rule: the executor's ladder is
        # for the scaled batch it runs)
        source.cost = source.cost.replace(bucket_min=int(min_bucket), bucket_growth=float(growth),
                                          linear_chunk=int(chunk))
    source.programs = ProgramCache(ranks_per_process, compile_s=float(compile_price_s))
    source.executed_ladder = (int(min_bucket), float(growth))


DEFAULT_COST_MODEL = "internvl3-2b"   # planner.cost_model unset, stand-in model


def run_cost(config: Any, model_heads: int | None = None, router_phase: bool = False) -> Any:
    """The planning cost model of a train config (`make_cost` of its planner section). With
    `model_heads` (the executed model's query heads) its head count is the greatest common divisor
    of the preset's and the heads a device holds (`model_heads // parallel.tensor`): the attention
    kinds a plan may give a group are those the executed model runs too (a Ulysses size must split
    the heads of both). `router_phase`: the run adds a mixture of experts' load-balancing loss, so
    each group runs the router program's forward pass before its step (`CostModel.router_phase`)."""
    cost = _planner_cost(config, router_phase)
    if model_heads is not None:
        heads = math.gcd(int(cost.num_heads), int(model_heads) // config.parallel.tensor)
        if heads != cost.num_heads:
            cost = cost.replace(num_heads=heads)
    return cost


def _planner_cost(config: Any, router_phase: bool = False) -> Any:
    p = config.planner
    return make_cost(p.cost_profile, p.cost_model, p.hardware, ranks_per_node=p.ranks_per_node or config.num_ranks,
                     num_ranks=config.num_ranks, comm_overlap=p.comm_overlap, checkpoint=config.model.pretrained,
                     tensor_parallel=config.parallel.tensor, remat=config.remat, compute_dtype=config.compute_dtype,
                     sequence_parallel=config.parallel.sequence, router_phase=router_phase)


def make_cost(cost_profile: str | None, cost_model: str | None, hardware: str, ranks_per_node: int,
              num_ranks: int | None = None, comm_overlap: bool | None = None, checkpoint: str | None = None,
              tensor_parallel: int = 1, remat: str | None = None, compute_dtype: str | None = None,
              sequence_parallel: bool = False, router_phase: bool = False) -> Any:
    """The planning cost model: a `dhp profile` JSON when given, else a named preset.

    `cost_model` None: the checkpoint's shape when fine-tuning `checkpoint`, else DEFAULT_COST_MODEL.
    A preset's fp32 engine state (master params, Adam moments) is sharded over all `num_ranks` ranks
    of the run (`CostModel.state_shards`; default: `ranks_per_node`); `comm_overlap` (None: the
    hardware's) says whether ring traffic hides behind attention. `tensor_parallel` = t > 1: a rank
    is t devices (`parallel.tensor`): the preset of such a rank (`CostModel.preset(...,
    tensor_parallel=t)`; `ranks_per_node` and `num_ranks` count ranks, the state is sharded over
    their t devices each); a profile prices the ranks it was measured on, so it must say the same t
    (and, with `sequence_parallel`, have been measured so).
    `remat` and `compute_dtype` (the run's): how the checkpoint's shape is priced when the cost model
    is the fine-tuned checkpoint's own (a named preset keeps its defaults: it prices a cluster's
    model, not the run's). `router_phase`: the preset prices the router program's forward pass of
    each group (`CostModel.preset(..., router_phase=True)`); a profile whose `router_phase` differs is refused."""
    if cost_profile:
        cost = load(cost_profile, profile=True)
        if cost.tensor_parallel != tensor_parallel or cost.sequence_parallel != bool(sequence_parallel):
            raise ValueError(f"planner.cost_profile {cost_profile!r} was measured on ranks of tensor_parallel="
                             f"{cost.tensor_parallel} device(s), sequence_parallel={cost.sequence_parallel}; the run's "
                             f"parallel.tensor is {tensor_parallel}, parallel.sequence {bool(sequence_parallel)}")
        check_router_phase(cost, router_phase, f"planner.cost_profile {cost_profile!r}")
        return cost
    extra = {} if comm_overlap is None else {"comm_overlap": bool(comm_overlap)}
    if router_phase:
        extra["router_phase"] = True
    if tensor_parallel > 1:
        extra["tensor_parallel"] = tensor_parallel
    if sequence_parallel:
        extra["sequence_parallel"] = True
    shards = (num_ranks or ranks_per_node) * tensor_parallel
    if cost_model is None and checkpoint:   # the fine-tuned checkpoint's own shape (its config.json)
        run = {k: v for k, v in (("remat", remat), ("compute_dtype", compute_dtype)) if v is not None}
        return CostModel.preset(ModelShape.from_config(checkpoint), hardware, ranks_per_node=ranks_per_node,
                                state_shards=shards, **run, **extra)
    return load(cost_model or DEFAULT_COST_MODEL, hardware, ranks_per_node=ranks_per_node, state_shards=shards,
                **extra)


def describe_cost(cost: Any, profile: str | None = None, full_size: bool = False) -> str:
    """One line naming the planning cost model: the profile or preset, and on what token counts."""
    if profile:
        what = f"fitted profile {Path(profile).name}"
    else:
        what = (f"{'the checkpoint config' if cost.model == 'custom' else 'preset ' + cost.model} on {cost.hardware}, {cost.ranks_per_node} rank(s) per node, ring traffic "
                f"{'overlapped with' if cost.comm_overlap else 'not overlapped with'} attention")
    if getattr(cost, "router_phase", False):
        what += ", each group's router forward pass priced (load-balancing loss on)"
    return what + (", planned at full (unscaled) token counts" if full_size else "")
