"""The Plan JSON contract (`dhp.plan/v2`, v1 still read): round trip, the per-group attention kind
and token counts, and validation errors that name the problem."""

import json
import re

import pytest

from dhp_jax.planner import Plan, PlanValidationError

GOOD = {"schema": "dhp.plan/v2", "num_ranks": 8, "ranks_per_node": 8,     # docs/DESIGN.md's example (section 5)
        "micro_batches": [{"groups": [{"ranks": [0, 1, 2], "degree": 3, "samples": [4, 7], "attention": "ring",
                                       "tokens": 5000, "padded_tokens": 5184, "est_time_s": 0.12},
                                      {"ranks": [3, 4, 5, 6, 7], "degree": 5, "samples": [0, 1, 2, 3, 5, 6],
                                       "attention": "ring", "tokens": 9100, "padded_tokens": 9280,
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
    ({"attention": "ringg"}, "micro-batch 0 group 0 (ranks [0, 1, 2]): attention kind 'ringg' is not one of"),
    ({"attention": "hybrid:2x2"}, "micro-batch 0 group 0 (ranks [0, 1, 2]): attention 'hybrid:2x2': 2 x 2 != degree 3"),
    ({"attention": "hybrid:3"}, "attention kind 'hybrid:3' is not one of"),
    ({"attention": 1}, "micro-batch 0 group 0: attention must be a string"),
    ({"attention": None}, "micro-batch 0 group 0: attention must be a string"),
    ({"padded_tokens": 5185}, "padded_tokens 5185 must hold tokens 5000 and be a multiple of 2*degree = 6"),
    ({"padded_tokens": 4998}, "padded_tokens 4998 must hold tokens 5000"),
    ({"tokens": -1}, "tokens / padded_tokens must be integers >= 0"),
])
def test_bad_plans_are_named(edit, msg):
    with pytest.raises(PlanValidationError, match=__import__("re").escape(msg)):
        Plan.from_json(_bad(**edit), num_samples=8)


def test_malformed_json():
    with pytest.raises(PlanValidationError, match="does not parse"):
        Plan.from_json("{not json")
    with pytest.raises(PlanValidationError, match="missing field 'micro_batches'"):
        Plan.from_json({"schema": "dhp.plan/v1", "num_ranks": 2})
    d = json.loads(json.dumps(GOOD))
    del d["micro_batches"][0]["groups"][1]["attention"]
    with pytest.raises(PlanValidationError, match="micro-batch 0 group 1: missing field 'attention'"):
        Plan.from_json(d)


def test_v2_fields_round_trip_and_v1_reads_as_ring():
    from dhp_jax.planner import Group

    plan = Plan.from_json(GOOD, num_samples=8)
    g = plan.micro_batches[0].groups[0]
    assert (g.attention, g.tokens, g.padded_tokens) == ("ring", 5000, 5184)
    assert plan.to_dict()["schema"] == "dhp.plan/v2" and plan.to_dict() == GOOD
    assert Group((0, 1), 2, (0,)) == Group(ranks=(0, 1), degree=2, samples=(0,), attention="ring")
    v1 = json.loads(json.dumps(GOOD))
    v1["schema"] = "dhp.plan/v1"
    for gd in v1["micro_batches"][0]["groups"]:
        for k in ("attention", "tokens", "padded_tokens"):
            del gd[k]
    old = Plan.from_json(v1, num_samples=8)
    assert [(g.attention, g.tokens, g.padded_tokens) for g in old.groups] == [("ring", 0, 0)] * 2
    assert old.to_dict()["schema"] == "dhp.plan/v2"            # written back as v2, ring, no token figures
    assert Plan.from_json(old.to_json()) == old
    # a v1 file that still says "attention" is read as ring: v1 executors ran every group as ring
    v1["micro_batches"][0]["groups"][0]["attention"] = "ulysses"
    assert Plan.from_json(v1).groups[0].attention == "ring"


@pytest.mark.parametrize("degree, kind, heads, ok", [
    (4, "ulysses", 8, True), (4, "ulysses", 6, False), (3, "ulysses", 28, False), (7, "ulysses", 28, True),
    (8, "hybrid:4x2", 28, True), (8, "hybrid:8x1", 28, False), (8, "hybrid:1x8", 28, True),
    (6, "hybrid:2x3", 4, True), (6, "hybrid:3x2", 4, False), (5, "ring", 4, True),
])
def test_attention_kind_against_degree_and_heads(degree, kind, heads, ok):
    from dhp_jax.planner import CostModel, Group, MicroBatch

    plan = Plan(8, (MicroBatch((Group(tuple(range(degree)), degree, (0,), attention=kind),)),))
    plan.validate(num_samples=1)                     # without a head count only the factors are checked
    cost = CostModel.preset("internvl3-8b", "ascend-910b")
    checks = [lambda: plan.validate(num_heads=heads), lambda: plan.validate(cost=dataclasses_replace(cost, heads))]
    for check in checks:
        if ok:
            check()
        else:
            with pytest.raises(PlanValidationError, match=rf"micro-batch 0 group 0 \(ranks .*\): attention '{kind}' "
                                                          rf"splits {heads} heads over"):
                check()


def dataclasses_replace(cost, heads):
    import dataclasses

    return dataclasses.replace(cost, num_heads=heads)


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


def test_plan_hash_covers_the_program_each_group_runs():
    """`padded_tokens` fixes the program shape the executors run: two plans with equal groups but
    another bucket for one group hash differently (processes must agree on the programs, not only on
    the groups). A v1 plan (no padded tokens) still hashes, and so does a v2 group without the field;
    the real token count follows from the samples and is left out."""
    plan = Plan.from_json(GOOD)
    moved = json.loads(json.dumps(GOOD))
    moved["micro_batches"][0]["groups"][0]["padded_tokens"] = 5376       # a larger bucket, still 2*3 | it
    assert Plan.from_json(moved).digest() != plan.digest()
    assert Plan.from_json(moved).decisions()["micro_batches"][0][0]["padded_tokens"] == 5376
    counted = json.loads(json.dumps(GOOD))
    counted["micro_batches"][0]["groups"][0]["tokens"] = 4990            # real tokens are not a decision
    assert Plan.from_json(counted).digest() == plan.digest()
    v1 = json.loads(json.dumps(GOOD))
    v1["schema"] = "dhp.plan/v1"
    bare = json.loads(json.dumps(GOOD))
    for d in (v1, bare):
        for gd in d["micro_batches"][0]["groups"]:
            del gd["tokens"], gd["padded_tokens"]
    old = Plan.from_json(v1)
    assert len(old.digest()) == 16 and old.digest() == Plan.from_json(bare).digest() != plan.digest()
    assert "padded_tokens" not in old.decisions()["micro_batches"][0][0]


def test_attention_kinds_are_objects_that_parse_price_and_shape_a_group():
    """Each kind of `kinds.KINDS` parses its own text into a shape (u, r), names it back, gives the
    group's mesh shape and its traffic (the figures `pricing.traffic` prices); a shape has one
    running kind (Ulysses on one rank runs as the ring); bad texts are named."""
    import numpy as np

    from dhp_jax.planner.contract.kinds import (HYBRID_KIND, KINDS, RING_KIND, ULYSSES_KIND, attention_kinds,
                                                resolve)
    from dhp_jax.planner.cost.pricing import traffic

    assert [k.pattern for k in KINDS] == ["ring", "ulysses", "hybrid:<u>x<r>"]
    for degree in range(1, 9):
        for text in attention_kinds(degree, 8 * 7 * 5 * 3):
            g = resolve(text, degree)
            assert g.degree == degree and g.kind.text(g.ulysses, g.ring) == text
            assert g.mesh_shape == ((degree,) if g.kind is RING_KIND else (g.ring, g.ulysses))
            u = g.ulysses
            want = traffic(1000.0, degree, "hybrid", u) if g.kind is HYBRID_KIND else traffic(1000.0, degree, text)
            assert np.allclose(g.traffic(1000.0), [float(w) for w in want[:3]], rtol=1e-12), (text, degree)
    assert resolve("ulysses", 1).kind is RING_KIND and resolve("hybrid:1x4", 4).kind is RING_KIND
    assert resolve("hybrid:4x1", 4).kind is ULYSSES_KIND and resolve("ulysses", 4).mesh_shape == (1, 4)
    for bad, msg in (("mesh", "is not one of ring, ulysses, hybrid:<u>x<r>"), ("hybrid:2x3", "2 x 3 != degree 4"),
                     (3, "attention kind 3 is not one of")):
        with pytest.raises(PlanValidationError, match=re.escape(msg)):
            resolve(bad, 4)
    with pytest.raises(ValueError, match="6 query heads do not split over 4 Ulysses ranks"):
        resolve("ulysses", 4, num_heads=6)


def test_the_memory_check_of_a_plan_is_the_cost_models():
    """`Plan.validate` checks the contract alone; `planner.cost.plan_check.check_plan` adds each
    group's per-rank memory against the cost model's budget, naming the group that does not fit."""
    from dhp_jax.planner import CostModel, Group, MicroBatch
    from dhp_jax.planner.cost.memory import max_tokens_per_rank
    from dhp_jax.planner.cost.plan_check import check_plan

    cost = CostModel.preset("internvl3-8b", "ascend-910b", bucket_min=0)
    cap = int(max_tokens_per_rank(cost))
    plan = Plan(4, (MicroBatch((Group((0,), 1, (0,)), Group((1, 2, 3), 3, (1,)))),))
    assert check_plan(plan, cost, [cap // 2, 2 * cap]) is plan          # 2 cap tokens over 3 ranks fit
    plan.validate(num_samples=2, cost=cost)                              # the contract alone: no lengths
    with pytest.raises(PlanValidationError, match=r"micro-batch 0 group 0 \(ranks \[0\]\): needs .* GiB per rank "
                                                  r"for samples \[0\], budget is"):
        check_plan(plan, cost, [2 * cap, cap])
    with pytest.raises(TypeError):
        plan.validate(num_samples=2, cost=cost, lengths=[2 * cap, cap])  # not the contract's question


def test_a_group_the_planner_fills_to_its_budget_passes_the_memory_check():
    """The planner counts a group feasible when its real tokens fit the budget; the bucket rule then
    rounds them up to whole zigzag chunks (a multiple of 2 x degree), which may take the padded
    stream a token or two a rank over it. `check_plan` holds the planner's criterion, so a plan the
    planner builds at the edge is run, not refused at its step."""
    from dhp_jax.planner import CostModel, plan_batch
    from dhp_jax.planner.cost.geometry import padded_length
    from dhp_jax.planner.cost.memory import max_tokens_per_rank
    from dhp_jax.planner.cost.plan_check import check_plan

    cost = CostModel.preset("qwen3-vl-8b", "ascend-910b")
    cap = max_tokens_per_rank(cost) * 4
    total = next(t for t in range(int(cap), int(cap) - 64, -1) if padded_length(cost, float(t), 4) > cap)
    lengths = [total // 3, total // 3, total - 2 * (total // 3)]
    for strategy in ("static-ring:4", "dhp"):
        plan = plan_batch(lengths, 4, cost, strategy)
        assert plan.degrees == [[4]], (strategy, plan.degrees)     # one group of 4 at the edge
        assert check_plan(plan, cost, lengths) is plan
    with pytest.raises(PlanValidationError, match=r"needs .* GiB per rank for samples \[0, 1, 2\]"):
        check_plan(plan, cost, [lengths[0], lengths[1], lengths[2] + 8])
