"""Plan files: the one format and replay rule that `dhp train` and `npu_backend.train` share.

A run logs one JSON line a step, `{"step": s, "step_base": 1, "plan": {...}}` (`PlanLog`), with
`s` the step as the run's messages, metrics.jsonl and checkpoints number it: 1 for the first.
Either backend replays such a log with `--plan-file` / `planner.plan_file`. Also read: `.json`
holding one plan (used for every step), a list of plans or `{"plans": [...]}`, JSON lines holding
bare plans, and logs of older versions, whose lines have no `step_base` and count steps from 0
(the rule is per line: a line without `step_base` is 0-based).

Replay rule (`plan_at`): one plan serves every step; otherwise step s runs the plan logged for
step s (lines without a step number are steps 1, 2, 3, ... in order). A log appended to by a
resumed run may hold a step twice: the later line is the plan that ran last. Every plan is parsed
and validated against the run before the first step, and a file too short for the run is an
error. Each line is written whole (`dhp_jax.data.jsonl.JsonlAppender`); a line that is not JSON is
an error naming the file and that line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from dhp_jax.data.jsonl import JsonFileError, JsonlAppender, jsonl_lines
from dhp_jax.planner.contract.plan import Plan, PlanValidationError

STEP_BASE = 1   # a plan log's `step` numbers steps from 1 (lines without `step_base`: from 0)


class PlanFileError(ValueError):
    """A plan file cannot be read or does not fit the run; the message names the file and plan."""


def plan_line(step: int, plan: Plan) -> str:
    """One line of a plan log (no newline); `step` counts from 1."""
    return json.dumps({"step": int(step), "step_base": STEP_BASE, "plan": plan.to_dict()})


def logged_step(record: Any) -> int | None:
    """The 1-based step of a plan-log record (an older 0-based line is read as such); None when
    the record names no step."""
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record["step"] + 1 - int(record.get("step_base", 0))


class PlanLog:
    """Writes `plan_line`s to `path` (truncated, or appended to for a resumed run), each line in
    one write call."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self._f: JsonlAppender | None = JsonlAppender(self.path, append=append)

    def write(self, step: int, plan: Plan) -> None:
        """The plan of step `step` (1 for the first step)."""
        assert self._f is not None, "PlanLog is closed"
        self._f.write_line(plan_line(step, plan))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "PlanLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _raw_items(path: Path) -> list[tuple[int | None, Any]]:
    """(line number, item) of each plan in the file (no line number: an item of one JSON document)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlanFileError(f"cannot read plan file {str(path)!r}: it does not exist") from None
    except IsADirectoryError:
        raise PlanFileError(f"cannot read plan file {str(path)!r}: it is a directory, expected a .jsonl file (a run's "
                            f"plans.jsonl) or a .json plan") from None
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {str(path)!r}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if path.suffix == ".json":
            raise PlanFileError(f"plan file {str(path)!r} is not valid JSON at line {e.lineno} (the file may be "
                                f"cut short)") from None
        try:
            return list(jsonl_lines(text, path))
        except JsonFileError as bad:
            raise PlanFileError(f"plan file {str(path)!r}, line {bad.line}: not valid JSON"
                                + (" (the last line: the file is cut short, e.g. by a run killed while writing it "
                                   "or two runs writing at once; delete that line to replay the others)"
                                   if bad.last else "")) from None
    if isinstance(data, dict) and "plans" in data and "schema" not in data:
        data = data["plans"]
    if isinstance(data, list):
        return [(None, d) for d in data]
    return [(None if path.suffix == ".json" else 1, data)]     # a one-line log is line 1


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
    by_step: dict[int, Plan] = {}          # 0-based index (step - 1) -> plan
    for i, (line, d) in enumerate(raw):
        index = i
        where = f"plan file {str(path)!r}, " + (f"line {line}" if line else f"plan {i + 1}")
        if isinstance(d, dict) and "plan" in d and "schema" not in d:
            base = d.get("step_base", 0)
            if base not in (0, 1) or isinstance(base, bool):
                raise PlanFileError(f"{where}: step_base must be 1 (or absent, in an older log counting from 0), "
                                    f"got {base!r}")
            step = d.get("step", i + base)
            if not isinstance(step, int) or isinstance(step, bool) or step < base:
                raise PlanFileError(f"{where}: step must be an integer >= {base}"
                                    + ("" if base else " (a line without step_base counts steps from 0)")
                                    + f", got {step!r}")
            index = step - base
            d = d["plan"]
        where += f" (step {index + 1})"
        try:
            plan = Plan.from_json(d, num_samples=num_samples)
        except PlanValidationError as e:
            raise PlanFileError(f"{where}: {e}") from None
        if num_heads is not None:
            try:
                plan.validate(num_heads=num_heads)
            except PlanValidationError as e:
                raise PlanFileError(f"{where}: {e}{heads_note}; "
                                    f"this run cannot replay it") from None
        if num_ranks is not None and plan.num_ranks != num_ranks:
            raise PlanFileError(f"{where}: plan is for {plan.num_ranks} ranks, the run has {num_ranks}")
        by_step[index] = plan               # a later line for the same step wins (a resumed run's log)
    missing = sorted(set(range(max(by_step) + 1)) - set(by_step))
    if missing:
        raise PlanFileError(f"plan file {str(path)!r} has no plan for steps {[t + 1 for t in missing[:10]]}")
    plans = [by_step[t] for t in range(len(by_step))]
    if steps is not None and 1 < len(plans) < steps:
        raise PlanFileError(f"plan file {str(path)!r} holds {len(plans)} plans but the run has {steps} steps "
                            f"(give one plan, to reuse every step, or one per step)")
    return plans


def plan_at(plans: Sequence[Plan], index: int) -> Plan:
    """The replayed plan of the step at 0-based `index` (step index + 1): the only plan, or that
    step's plan."""
    if len(plans) == 1:
        return plans[0]
    if not 0 <= index < len(plans):
        raise PlanFileError(f"the plan file holds plans for steps 1..{len(plans)}, not step {index + 1}")
    return plans[index]
