"""The shared plan-file module: one line format, one replay rule, checks that name file, plan and step."""

from __future__ import annotations

import json

import pytest

from dhp_jax.planner import Group, MicroBatch, Plan
from dhp_jax.planner.contract.planfile import PlanFileError, PlanLog, load_plan_file, logged_step, plan_at, \
    plan_line


def _plan(first: int) -> Plan:
    return Plan(2, (MicroBatch((Group((0,), 1, (first,)), Group((1,), 1, (1 - first,)))),))


def test_log_round_trip_and_replay_rule(tmp_path):
    with PlanLog(tmp_path / "p.jsonl") as log:
        for step in range(1, 4):                                  # steps count from 1
            log.write(step, _plan(step % 2))
    with PlanLog(tmp_path / "p.jsonl", append=True) as log:   # a resumed run re-logs steps 2 and 3
        log.write(2, _plan(1))
        log.write(3, _plan(1))
    plans = load_plan_file(tmp_path / "p.jsonl", num_samples=2, num_ranks=2, steps=3)
    assert [plan_at(plans, t).groups[0].samples for t in range(3)] == [(1,), (1,), (1,)]   # later line wins
    assert json.loads(plan_line(4, _plan(1))) == {"step": 4, "step_base": 1, "plan": _plan(1).to_dict()}
    assert [logged_step(json.loads(line)) for line in (tmp_path / "p.jsonl").read_text().splitlines()] == [1, 2, 3, 2, 3]
    with pytest.raises(PlanFileError, match="holds plans for steps 1..3, not step 4"):
        plan_at(plans, 3)
    one = tmp_path / "one.json"
    one.write_text(_plan(1).to_json())
    assert plan_at(load_plan_file(one, steps=50), 49) == _plan(1)          # one plan serves every step
    bare = tmp_path / "bare.jsonl"                                          # bare plans are steps 1, 2, ...
    bare.write_text("\n".join(_plan(i % 2).to_json() for i in range(2)) + "\n")
    assert [p.groups[0].samples for p in load_plan_file(bare)] == [(0,), (1,)]
    lst = tmp_path / "list.json"
    lst.write_text(json.dumps({"plans": [_plan(0).to_dict(), _plan(1).to_dict()]}))
    assert len(load_plan_file(lst)) == 2


def test_older_logs_counting_from_zero_still_replay(tmp_path):
    """A log of an older version (no step_base: steps from 0) replays as it ran; so does a log that
    such a run began and a resumed run of this version continued (the rule is per line)."""
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({"step": t, "plan": _plan(t % 2).to_dict()}) + "\n" for t in range(3)))
    assert [p.groups[0].samples for p in load_plan_file(old, steps=3)] == [(0,), (1,), (0,)]
    assert [logged_step(r) for r in map(json.loads, old.read_text().splitlines())] == [1, 2, 3]
    with PlanLog(old, append=True) as log:       # resumed after step 2: step 3 (old line "step": 2) again
        log.write(3, _plan(1))
        log.write(4, _plan(1))
    plans = load_plan_file(old, steps=4)
    assert [p.groups[0].samples for p in plans] == [(0,), (1,), (1,), (1,)]


def test_torn_last_line_is_named(tmp_path):
    """Two runs appending to one log left a stray `}` as its last line: the reader names the file
    and that line (not line 1 of the line it parsed)."""
    path = tmp_path / "plans.jsonl"
    with PlanLog(path) as log:
        for step in range(1, 21):
            log.write(step, _plan(step % 2))
    path.write_text(path.read_text() + "}\n")
    with pytest.raises(PlanFileError, match=r"plans.jsonl', line 21: not valid JSON \(the last line: the file is cut "
                                            r"short"):
        load_plan_file(path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:5] + [lines[5][:40]] + lines[6:20]) + "\n")   # cut inside line 6
    with pytest.raises(PlanFileError, match=r"line 6: not valid JSON$"):
        load_plan_file(path)


@pytest.mark.parametrize("text, kw, msg", [
    ('{"step": 1, "step_base": 1, "plan": PLAN}\n{"step": 3, "step_base": 1, "plan": PLAN}', {},
     "has no plan for steps [2]"),
    ('{"step": 0, "plan": PLAN}\n{"step": 2, "plan": PLAN}', {}, "has no plan for steps [2]"),
    ('{"step": 0, "plan": PLAN}\n{"step": 1, "plan": PLAN}', {"steps": 3}, "holds 2 plans but the run has 3 steps"),
    ('{"step": -1, "plan": PLAN}', {}, "line 1: step must be an integer >= 0"),
    ('{"step": 0, "step_base": 1, "plan": PLAN}', {}, "line 1: step must be an integer >= 1"),
    ('{"step": 1, "step_base": 2, "plan": PLAN}', {}, "line 1: step_base must be 1"),
    ('{"step": 0, "plan": PLAN}', {"num_ranks": 4}, "line 1 (step 1): plan is for 2 ranks, the run has 4"),
    ('{"step": 1, "step_base": 1, "plan": PLAN}\n{"step": 2, "step_base": 1, "plan": PLAN}', {"num_samples": 3},
     "line 1 (step 1): samples missing from every group: [2]"),
    ("{oops", {}, "line 1: not valid JSON"),
    ("", {}, "holds no plans"),
])
def test_bad_files_are_named(tmp_path, text, kw, msg):
    path = tmp_path / "bad.jsonl"
    path.write_text(text.replace("PLAN", _plan(0).to_json()))
    with pytest.raises(PlanFileError, match=__import__("re").escape(msg)):
        load_plan_file(path, **kw)
    with pytest.raises(PlanFileError, match="cannot read plan file .*: it does not exist"):
        load_plan_file(tmp_path / "missing.jsonl")
    with pytest.raises(PlanFileError, match="is a directory, expected a .jsonl file"):
        load_plan_file(tmp_path)
