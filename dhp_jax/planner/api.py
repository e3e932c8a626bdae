"""`plan_batch`: one entry point for DHP and every baseline, returning a validated `Plan`.

The strategy table (each strategy's solve function and options) lives in `strategies.py`; the input
checks in `problem.py`, the "dhp" search in `dhp.py`,
the static baselines in `baselines.py`, the exact MILP ("milp") in `milp.py`, FlexSP's planner
("flexsp") in `flexsp.py`. Only "milp" has a wall-clock limit ("flexsp" a node limit); both record
whether they proved optimality.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from dhp_jax.data.sample import Sample
from dhp_jax.planner.contract.plan import Plan
from dhp_jax.planner.cost.model import CostModel
from dhp_jax.planner.programs.cache import ProgramCache, reuse_ranks
from dhp_jax.planner.solvers.build import build_plan
from dhp_jax.planner.solvers.problem import Problem, prepare
from dhp_jax.planner.solvers.strategies import lookup, strategy_names

__all__ = ["STRATEGIES", "Problem", "plan_batch", "prepare", "reuse_placement"]

STRATEGIES = strategy_names()  # every spelling of the table's strategies, e.g. "static-ring:<d>"


def plan_batch(samples_or_lengths: Sequence[Sample] | Sequence[int] | np.ndarray, num_ranks: int, cost: CostModel,
               strategy: str = "dhp", *, ranks_per_node: int | None = None, etas: Sequence[float] | None = None,
               every_rank: bool = False, programs: ProgramCache | None = None, **options: Any) -> Plan:
    """Plan one global batch on `num_ranks` ranks with `strategy` (see STRATEGIES), passing
    `options` to that strategy (`dhp_jax.planner.solvers.strategies`: each takes only its own; another is a
    PlanningError that names the strategy and its options).

    Options of "dhp" (its ablations): `num_micro_batches` fixes the count instead of searching it;
    `packing=False` makes every sequence its own atomic group; `degrees="pow2"` (or a list)
    restricts group degrees; `node_aware=False` places groups on consecutive ranks; `refine=False`
    skips the re-balancing; `attention`: "best" gives each group the attention kind the cost model
    says is fastest (ring, Ulysses, or a Ulysses x ring hybrid the head count allows), "ring" keeps
    every group on the ring (the ablation).
    Options of "milp": `num_micro_batches`, `degrees`, `node_aware`, `time_limit_s` (its wall-clock
    bound) and `node_limit` (branch-and-bound nodes, a work limit that gives the same answer on any
    machine at any load). Options of "flexsp": `num_micro_batches`, `time_limit_s` (when given;
    otherwise it stops at its node limit only). The static baselines take none.
    For every strategy: `every_rank=True` is for executors in which every rank must run some group
    (the torch backend): a rank the plan would leave idle in every micro-batch (shared CPU lanes,
    node repairs, fewer samples than ranks) joins the slowest group instead.
    `programs` (a `ProgramCache` of the plans issued so far; the plan is recorded in it) makes the
    placement reuse compiled executables and prices new programs at `programs.compile_s` (see
    `dhp_jax.planner.programs.cache`).
    """
    strat, arg = lookup(strategy)
    options = strat.bind(options, strategy)
    prob = prepare(samples_or_lengths, num_ranks, cost, etas, ranks_per_node)
    cost, N = prob.cost, prob.num_ranks
    t0, c0 = time.perf_counter(), time.thread_time()
    mbs, extra, attention = strat.solve(prob, arg, programs, **options)
    solve_ms = (time.perf_counter() - t0) * 1e3
    cpu_ms = (time.thread_time() - c0) * 1e3  # this thread's CPU: what a loaded machine does not inflate
    solver = {"strategy": strategy, "solve_ms": round(solve_ms, 3), "solve_cpu_ms": round(cpu_ms, 3), **extra}
    plan = build_plan(mbs, prob.lengths, prob.etas, cost, N, solver, attention)  # checks memory, vectorised
    if every_rank:
        plan = _use_every_rank(plan, prob, solver, attention)
    if programs is not None:
        plan = reuse_placement(plan, prob.lengths, prob.etas, cost, programs, attention)
    plan.validate(num_samples=len(prob.lengths))
    return plan


def reuse_placement(plan: Plan, lengths: Any, etas: Any, cost: CostModel, programs: ProgramCache,
                    attention: str = "best") -> Plan:
    """The plan with equally fast rank tuples swapped so that groups land where their program
    (degree, padded tokens as the executor runs them, attention kind) is already compiled
    (`dhp_jax.planner.programs.cache.reuse_ranks`; group times unchanged); the result is recorded in `programs`. `attention` is the mode the plan
    was made with (plan_batch's; the groups' kinds are chosen again on the swapped tuples)."""
    rpn = plan.ranks_per_node or plan.num_ranks
    mbs = []
    for mb in plan.micro_batches:
        ranks = reuse_ranks([(g.degree, programs.padded(g.degree, g.samples, g.padded_tokens), g.ranks, g.attention)
                             for g in mb.groups], rpn, programs, plan.num_ranks)
        mbs.append([(r, list(g.samples)) for r, g in zip(ranks, mb.groups)])
    out = build_plan(mbs, np.asarray(lengths), np.zeros(len(lengths)) if etas is None else np.asarray(etas, float),
                     cost, plan.num_ranks, dict(plan.solver), attention)
    programs.add(out)
    return out


def _use_every_rank(plan: Plan, prob: Problem, solver: dict[str, Any], attention: str) -> Plan:
    """Give each rank that no group of any micro-batch uses to the group that is slowest at that
    moment (ring order kept, the new rank last); a larger degree never needs more memory per rank,
    so the plan stays within its budget. Estimates are rebuilt after every addition."""
    used = {r for g in plan.groups for r in g.ranks}
    idle = [r for r in range(plan.num_ranks) if r not in used]
    if not idle:
        return plan
    solver = {**solver, "every_rank_added": idle}
    for r in idle:
        m, i = max(((m, i) for m, mb in enumerate(plan.micro_batches) for i in range(len(mb.groups))),
                   key=lambda mi: (plan.micro_batches[mi[0]].groups[mi[1]].est_time_s, -mi[0], -mi[1]))
        mbs = [[(list(g.ranks) + ([r] if (k, j) == (m, i) else []), list(g.samples))
                for j, g in enumerate(mb.groups)] for k, mb in enumerate(plan.micro_batches)]
        plan = build_plan(mbs, prob.lengths, prob.etas, prob.cost, plan.num_ranks, solver, attention)
    return plan
