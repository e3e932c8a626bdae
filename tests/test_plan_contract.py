"""The Plan JSON contract: round trip and validation errors that name the problem."""

import json

import pytest

from dhp_jax.planner import Plan, PlanValidationError

GOOD = {"schema": "dhp.plan/v1", "num_ranks": 8, "ranks_per_node": 8,
        "micro_batches": [{"groups": [{"ranks": [0, 1, 2], "degree": 3, "samples": [4, 7], "est_time_s": 0.12},
                                      {"ranks": [3, 4, 5, 6, 7], "degree": 5, "samples": [0, 1, 2, 3, 5, 6],
                                       "est_time_s": 0.11}],
                           "est_makespan_s": 0.12}],
        "est_step_time_s": 0.13, "solver": {"strategy": "dhp", "solve_ms": 0.9}}


def test_round_trip_from_string_and_dict():
    plan = Plan.from_json(json.dumps(GOOD), num_samples=8)
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json(GOOD) == plan
    assert plan.degrees == [[3, 5]]
    assert plan.num_samples == 8


def _bad(**edit):
    d = json.loads(json.dumps(GOOD))
    g = d["micro_batches"][0]["groups"]
    for k, v in edit.items():
        if k == "schema":
            d["schema"] = v
        else:
            g[0][k] = v
    return d


@pytest.mark.parametrize("edit, msg", [
    ({"schema": "dhp.plan/v0"}, "schema"),
    ({"ranks": [0, 1, 3]}, "rank 3 is also used"),
    ({"ranks": [0, 1, 9]}, "outside 0..7"),
    ({"degree": 2}, "degree 2 != number of ranks 3"),
    ({"samples": [4, 7, 0]}, "sample 0 is also in"),
    ({"samples": [4]}, "missing from every group: [7]"),
    ({"samples": [4, 7, 8]}, "sample 8 does not exist"),
])
def test_bad_plans_are_named(edit, msg):
    with pytest.raises(PlanValidationError, match=__import__("re").escape(msg)):
        Plan.from_json(_bad(**edit), num_samples=8)


def test_malformed_json():
    with pytest.raises(PlanValidationError, match="does not parse"):
        Plan.from_json("{not json")
    with pytest.raises(PlanValidationError, match="missing field 'micro_batches'"):
        Plan.from_json({"schema": "dhp.plan/v1", "num_ranks": 2})


def test_lazy_package_names_are_listed_and_resolve():
    import dhp_jax.planner as planner

    names = dir(planner)
    assert {"Plan", "plan_batch", "CostModel"} <= set(names)
    assert "importlib" not in names  # the helper's own globals are not the package's
    assert planner.plan_batch.__module__ == "dhp_jax.planner.api"


def test_plan_hash_is_the_decisions_only():
    """Planning the same batch again gives the same hash although the solver's timings differ;
    changing a decision (a sample moved to another group) changes it."""
    from dhp_jax.data import make_dataset
    from dhp_jax.planner import CostModel, plan_batch
    from dhp_jax.train.trainer import plan_hash

    samples = make_dataset("openvid", 64, seed=0)
    cost = CostModel.preset("internvl3-8b", "ascend-910b")
    plans = [plan_batch(samples, 16, cost) for _ in range(3)]
    assert len({plan_hash(p) for p in plans}) == 1
    solved = {p.solver["solve_cpu_ms"] for p in plans} | {p.solver["solve_ms"] for p in plans}
    assert len(solved) > 1            # the metadata did differ between the calls
    d = plans[0].to_dict()
    d["solver"] = {"strategy": "somebody else", "solve_cpu_ms": 1e9}
    d["est_step_time_s"] = 123.0
    assert plan_hash(Plan.from_json(d)) == plan_hash(plans[0])
    groups = [g for mb in d["micro_batches"] for g in mb["groups"]]
    big = max(groups, key=lambda g: len(g["samples"]))
    other = next(g for g in groups if g is not big)
    other["samples"].append(big["samples"].pop())
    assert plan_hash(Plan.from_json(d)) != plan_hash(plans[0])
