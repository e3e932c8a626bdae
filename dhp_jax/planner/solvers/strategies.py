"""The strategy table: every strategy `plan_batch` knows, each with its own options.

A strategy is one `Strategy` entry: a name, what may follow the name after a colon (the static
baselines take a degree or "best"), a one-line summary, and a solve function
`solve(prob, arg, programs, **options) -> (micro_batches, solver_info, attention_mode)`. Its
options are the keyword-only parameters of `solve`, with their defaults: the signature is the one
place they are written, and `bind` checks a call's options against it. `plan_batch` does the rest
(input checks, timing, `build_plan`, `every_rank`, program reuse, validation) for every strategy.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from dhp_jax.planner.contract.plan import PlanningError
from dhp_jax.planner.programs.cache import ProgramCache
from dhp_jax.planner.solvers.baselines import solve_static
from dhp_jax.planner.solvers.dhp import solve_dhp
from dhp_jax.planner.solvers.problem import Problem

__all__ = ["Strategy", "STRATEGY_TABLE", "strategy_names", "lookup", "register"]

Solve = Callable[..., tuple[list, dict[str, Any], str]]


@dataclass(frozen=True)
class Strategy:
    """One planning strategy: `name`, `arg` (None, or what follows "name:", e.g. "<d>|best"),
    `solve` (see the module docstring) and a one-line `summary`. `arg` lists the argument's forms
    separated by "|", e.g. "<d>|best" for "static-ring:<d>" and "static-ring:best"."""

    name: str
    solve: Solve
    summary: str
    arg: str | None = None
    options: Mapping[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        params = inspect.signature(self.solve).parameters.values()
        opts = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
        object.__setattr__(self, "options", opts)

    def bind(self, options: Mapping[str, Any], spelled: str | None = None) -> dict[str, Any]:
        """`options` checked against this strategy's; PlanningError naming the strategy (as
        `spelled` in the call) and its valid options when one is not among them."""
        wrong = sorted(set(options) - set(self.options))
        if wrong:
            valid = ", ".join(self.options) or "none"
            raise PlanningError(f"strategy {spelled or self.name!r} takes no option {', '.join(map(repr, wrong))}; "
                                f"its options: {valid}")
        return {**self.options, **options}

    def spellings(self) -> tuple[str, ...]:
        """How the strategy is written in `strategy=`: "dhp", or "static-ring:<d>", "static-ring:best"."""
        if self.arg is None:
            return (self.name,)
        return tuple(f"{self.name}:{a}" for a in self.arg.split("|"))


STRATEGY_TABLE: dict[str, Strategy] = {}


def register(name: str, summary: str, arg: str | None = None) -> Callable[[Solve], Solve]:
    """Decorator: enter `solve` in the table as strategy `name` (see `Strategy`)."""
    def add(solve: Solve) -> Solve:
        if name in STRATEGY_TABLE:
            raise ValueError(f"strategy {name!r} is registered twice")
        STRATEGY_TABLE[name] = Strategy(name, solve, summary, arg)
        return solve
    return add


def strategy_names() -> tuple[str, ...]:
    """Every spelling `plan_batch` accepts, in table order (a degree shown as "<d>")."""
    return tuple(s for strat in STRATEGY_TABLE.values() for s in strat.spellings())


def lookup(strategy: str) -> tuple[Strategy, str | None]:
    """The table entry for `strategy` and its argument (the text after the colon, or None)."""
    if not isinstance(strategy, str):
        raise PlanningError(f"strategy must be a string, got {strategy!r}")
    name, colon, arg = strategy.partition(":")
    strat = STRATEGY_TABLE.get(name)
    if strat is None or (strat.arg is None) != (not colon):
        raise PlanningError(f"unknown strategy {strategy!r}; known strategies: {', '.join(strategy_names())}")
    return strat, (arg if colon else None)


@register("dhp", "DHP: any-degree groups per micro-batch, packed, placed node-aware, each with its attention kind")
def _dhp(prob: Problem, arg: str | None, programs: ProgramCache | None, *, num_micro_batches: int | None = None,
         packing: bool = True, degrees: Any = "any", node_aware: bool = True, refine: bool = True,
         attention: str = "best") -> tuple[list, dict[str, Any], str]:
    # attention "best": each group gets the kind the cost model says is fastest; "ring": the ablation
    if attention not in ("best", "ring"):
        raise PlanningError(f"attention must be 'best' (per-group choice) or 'ring', got {attention!r}")
    return solve_dhp(prob, num_micro_batches, packing, degrees, node_aware, refine, programs, attention)


@register("static-ring", "one ring CP degree for every sequence (Megatron CP); 'best' tries every divisor",
          arg="<d>|best")
def _static_ring(prob: Problem, arg: str | None, programs: ProgramCache | None) -> tuple[list, dict[str, Any], str]:
    mbs, info = solve_static(prob, "ring", arg, f"static-ring:{arg}")
    return mbs, info, "ring"


@register("static-ulysses", "one Ulysses degree for every sequence (DeepSpeed-Ulysses); 'best' tries every divisor",
          arg="<d>|best")
def _static_ulysses(prob: Problem, arg: str | None, programs: ProgramCache | None
                    ) -> tuple[list, dict[str, Any], str]:
    mbs, info = solve_static(prob, "ulysses", arg, f"static-ulysses:{arg}")
    return mbs, info, "ulysses"


@register("flexsp", "FlexSP's planner: power-of-two degrees, one MILP per length-sorted micro-batch count")
def _flexsp(prob: Problem, arg: str | None, programs: ProgramCache | None, *, num_micro_batches: int | None = None,
            time_limit_s: float | None = None) -> tuple[list, dict[str, Any], str]:
    from dhp_jax.planner.solvers.flexsp import solve_flexsp  # lazy: scipy's MILP loads only when used

    mbs, info = solve_flexsp(prob, num_micro_batches, time_limit_s)
    return mbs, info, "auto"


@register("milp", "exact any-degree MILP per micro-batch: the reference for small instances")
def _milp(prob: Problem, arg: str | None, programs: ProgramCache | None, *, num_micro_batches: int | None = None,
          degrees: Any = "any", node_aware: bool = True, time_limit_s: float | None = None,
          node_limit: int | None = None) -> tuple[list, dict[str, Any], str]:
    from dhp_jax.planner.solvers.milp import solve_milp  # lazy: scipy's MILP loads only when used

    mbs, info = solve_milp(prob, num_micro_batches, degrees, node_aware, time_limit_s, node_limit)
    return mbs, info, "ring"
