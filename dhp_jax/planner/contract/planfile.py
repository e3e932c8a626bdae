"""Plan files: the one format and replay rule that `dhp train` and `npu_backend.train` share.

A run logs one JSON line a step, `{"step": t, "plan": {...}}` (`PlanLog`), and either backend
replays such a log with `--plan-file` / `planner.plan_file`. Also read: `.json` holding one plan
(used for every step), a list of plans or `{"plans": [...]}`, and JSON lines holding bare plans.

Replay rule (`plan_at`): one plan serves every step; otherwise step t runs the plan logged for
step t (lines without a step number count 0, 1, 2, ...). A log appended to by a resumed run may
hold a step twice: the later line is the plan that ran last. Every plan is parsed and validated
against the run before the first step, and a file too short for the run is an error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any, Sequence

from dhp_jax.planner.contract.plan import Plan, PlanValidationError


class PlanFileError(ValueError):
    """A plan file cannot be read or does not fit the run; the message names the file and plan."""


def plan_line(step: int, plan: Plan) -> str:
    """One line of a plan log (no newline)."""
    return json.dumps({"step": int(step), "plan": plan.to_dict()})


class PlanLog:
    """Writes `plan_line`s to `path` (truncated, or appended to for a resumed run), flushed each step."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self._f: IO[str] | None = self.path.open("a" if append else "w")

    def write(self, step: int, plan: Plan) -> None:
        assert self._f is not None, "PlanLog is closed"
        self._f.write(plan_line(step, plan) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "PlanLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _raw_items(path: Path) -> list[Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {str(path)!r}: {e.strerror or e}") from None
    try:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            if path.suffix == ".json":
                raise
            return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise PlanFileError(f"plan file {str(path)!r} is not valid JSON: {e}") from None
    if isinstance(data, list):
        return data
    if isinstance(data, dict) and "plans" in data and "schema" not in data:
        return list(data["plans"]) if isinstance(data["plans"], list) else [data["plans"]]
    return [data]


def load_plan_file(path: str | Path, num_samples: int | None = None, num_ranks: int | None = None,
                   steps: int | None = None, num_heads: int | None = None, heads_note: str = "") -> list[Plan]:
    """The plans of a file, index = step (see the module docstring), each parsed and validated for a
    batch of `num_samples` on `num_ranks` ranks; with `steps`, the file must cover them all; with
    `num_heads`, every group's Ulysses size must divide it (the heads a device of the replaying run
    holds: a plan made at one tensor-parallel degree may give a group a Ulysses size another degree
    cannot split). `heads_note` says where `num_heads` comes from in that error."""
    path = Path(path)
    raw = _raw_items(path)
    if not raw:
        raise PlanFileError(f"plan file {str(path)!r} holds no plans")
    by_step: dict[int, Plan] = {}
    for i, d in enumerate(raw):
        step = i
        if isinstance(d, dict) and "plan" in d and "schema" not in d:
            step = d.get("step", i)
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise PlanFileError(f"plan file {str(path)!r}, line {i + 1}: step must be an integer >= 0, "
                                    f"got {step!r}")
            d = d["plan"]
        try:
            plan = Plan.from_json(d, num_samples=num_samples)
        except PlanValidationError as e:
            raise PlanFileError(f"plan file {str(path)!r}, plan {i} (step {step}): {e}") from None
        if num_heads is not None:
            try:
                plan.validate(num_heads=num_heads)
            except PlanValidationError as e:
                raise PlanFileError(f"plan file {str(path)!r}, plan {i} (step {step}): {e}{heads_note}; "
                                    f"this run cannot replay it") from None
        if num_ranks is not None and plan.num_ranks != num_ranks:
            raise PlanFileError(f"plan file {str(path)!r}, plan {i} (step {step}): plan is for {plan.num_ranks} "
                                f"ranks, the run has {num_ranks}")
        by_step[step] = plan               # a later line for the same step wins (a resumed run's log)
    missing = sorted(set(range(max(by_step) + 1)) - set(by_step))
    if missing:
        raise PlanFileError(f"plan file {str(path)!r} has no plan for steps {missing[:10]}")
    plans = [by_step[t] for t in range(len(by_step))]
    if steps is not None and 1 < len(plans) < steps:
        raise PlanFileError(f"plan file {str(path)!r} holds {len(plans)} plans but the run has {steps} steps "
                            f"(give one plan, to reuse every step, or one per step)")
    return plans


def plan_at(plans: Sequence[Plan], step: int) -> Plan:
    """The replayed plan of `step`: the only plan, or the plan of that step."""
    if len(plans) == 1:
        return plans[0]
    if not 0 <= step < len(plans):
        raise PlanFileError(f"the plan file holds plans for steps 0..{len(plans) - 1}, not step {step}")
    return plans[step]
