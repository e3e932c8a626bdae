"""The shared plan-file module: one line format, one replay rule, checks that name file, plan and step."""

from __future__ import annotations

import json

import pytest

from dhp_jax.planner import Group, MicroBatch, Plan
from dhp_jax.planner.contract.planfile import PlanFileError, PlanLog, load_plan_file, plan_at, plan_line


def _plan(first: int) -> Plan:
    return Plan(2, (MicroBatch((Group((0,), 1, (first,)), Group((1,), 1, (1 - first,)))),))


def test_log_round_trip_and_replay_rule(tmp_path):
    with PlanLog(tmp_path / "p.jsonl") as log:
        for step in range(3):
            log.write(step, _plan(step % 2))
    with PlanLog(tmp_path / "p.jsonl", append=True) as log:   # a resumed run re-logs steps 1 and 2
        log.write(1, _plan(0))
        log.write(2, _plan(0))
    plans = load_plan_file(tmp_path / "p.jsonl", num_samples=2, num_ranks=2, steps=3)
    assert [plan_at(plans, t).groups[0].samples for t in range(3)] == [(0,), (0,), (0,)]   # later line wins
    assert json.loads(plan_line(4, _plan(1))) == {"step": 4, "plan": _plan(1).to_dict()}
    with pytest.raises(PlanFileError, match="holds plans for steps 0..2, not step 3"):
        plan_at(plans, 3)
    one = tmp_path / "one.json"
    one.write_text(_plan(1).to_json())
    assert plan_at(load_plan_file(one, steps=50), 49) == _plan(1)          # one plan serves every step
    bare = tmp_path / "bare.jsonl"                                          # bare plans count 0, 1, ...
    bare.write_text("\n".join(_plan(i % 2).to_json() for i in range(2)) + "\n")
    assert [p.groups[0].samples for p in load_plan_file(bare)] == [(0,), (1,)]
    lst = tmp_path / "list.json"
    lst.write_text(json.dumps({"plans": [_plan(0).to_dict(), _plan(1).to_dict()]}))
    assert len(load_plan_file(lst)) == 2


@pytest.mark.parametrize("text, kw, msg", [
    ('{"step": 0, "plan": PLAN}\n{"step": 2, "plan": PLAN}', {}, "has no plan for steps [1]"),
    ('{"step": 0, "plan": PLAN}\n{"step": 1, "plan": PLAN}', {"steps": 3}, "holds 2 plans but the run has 3 steps"),
    ('{"step": -1, "plan": PLAN}', {}, "line 1: step must be an integer >= 0"),
    ('{"step": 0, "plan": PLAN}', {"num_ranks": 4}, "plan 0 (step 0): plan is for 2 ranks, the run has 4"),
    ('{"step": 0, "plan": PLAN}', {"num_samples": 3}, "plan 0 (step 0): samples missing from every group: [2]"),
    ("{oops", {}, "is not valid JSON"),
    ("", {}, "holds no plans"),
])
def test_bad_files_are_named(tmp_path, text, kw, msg):
    path = tmp_path / "bad.jsonl"
    path.write_text(text.replace("PLAN", _plan(0).to_json()))
    with pytest.raises(PlanFileError, match=__import__("re").escape(msg)):
        load_plan_file(path, **kw)
    with pytest.raises(PlanFileError, match="cannot read plan file"):
        load_plan_file(tmp_path / "missing.jsonl")
