"""A plan runs as planned: each group carries its attention kind and its token counts.

Strategies that plan all-to-all groups (static-ulysses, flexsp) record "ulysses" on those groups;
the simulator prices every group under its own kind; the padded length a plan records is the
stream the executor builds (`pack_group`, the one bucket rule); both executors refuse a kind the
model's heads do not allow before any device work, naming the group.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dhp_jax.data import make_dataset, sample_etas, sample_lengths
from dhp_jax.geometry.layout import bucket_length, pack_group
from dhp_jax.planner import CostModel, Group, MicroBatch, Plan, PlanValidationError, plan_batch
from dhp_jax.planner.cost.pricing import allreduce_time, group_time, makespan
from dhp_jax.sim import step_time

COST = CostModel.preset("internvl3-8b", "ascend-910b", ranks_per_node=8)   # 28 heads: Ulysses at 2, 4, 7
COST32 = dataclasses.replace(COST, num_heads=32)                            # Ulysses at every power of two


def _reference(plan: Plan, lengths, etas, cost: CostModel) -> float:
    """One `pricing.group_time` per group under the kind written on that group (no vectorised path)."""
    total = 0.0
    for mb in plan.micro_batches:
        total += makespan(cost, [group_time(cost, [lengths[s] for s in g.samples], g.degree, [etas[s] for s in g.samples],
                                          inter_node=len({r // plan.ranks_per_node for r in g.ranks}) > 1,
                                          attention=g.attention) for g in mb.groups],
                               [g.degree for g in mb.groups])
    return total + allreduce_time(cost, plan.num_ranks)


def _limit(strategy):
    """A wall-clock bound for the strategies that take one (the static ones take no options)."""
    return {"time_limit_s": 20} if strategy in ("flexsp", "milp") else {}


@pytest.mark.parametrize("strategy", ["static-ulysses:best", "static-ulysses:4", "flexsp"])
def test_ulysses_strategies_record_the_kind_per_group_and_the_simulator_prices_it(strategy):
    samples = make_dataset("openvid", 48, seed=3)
    lengths, etas = sample_lengths(samples), sample_etas(samples)
    cost = COST32 if strategy == "flexsp" else COST
    plan = plan_batch(samples, 16, cost, strategy=strategy, **_limit(strategy))
    kinds = {g.attention for g in plan.groups if g.degree > 1}
    assert "ulysses" in kinds, [(g.degree, g.attention) for g in plan.groups]
    for g in plan.groups:
        want = "ulysses" if g.degree > 1 and cost.num_heads % g.degree == 0 else "ring"
        assert g.attention == want, (g.degree, g.attention)
    assert "attention" not in plan.solver          # the kind is a field of the groups, not metadata
    again = Plan.from_json(plan.to_json())
    assert [g.attention for g in again.groups] == [g.attention for g in plan.groups]
    t = step_time(again, lengths, cost, etas)
    assert t == pytest.approx(_reference(plan, lengths, etas, cost), rel=1e-9)
    assert t == pytest.approx(plan.est_step_time_s, rel=1e-9)
    # the same groups as ring: the simulator reads each group's own field, so the price moves
    as_ring = dataclasses.replace(plan, micro_batches=tuple(
        MicroBatch(tuple(dataclasses.replace(g, attention="ring") for g in mb.groups)) for mb in plan.micro_batches))
    assert step_time(as_ring, lengths, cost, etas) == pytest.approx(_reference(as_ring, lengths, etas, cost),
                                                                   rel=1e-9)
    # ... and the kind moves it: the largest Ulysses group alone, as ring, costs another time (the
    # whole plan's step need not move: its slowest groups may not be the Ulysses ones)
    big = max((g for g in plan.groups if g.attention == "ulysses"), key=lambda g: sum(lengths[s] for s in g.samples))
    alone = [Plan(plan.num_ranks, (MicroBatch((dataclasses.replace(big, attention=kind),)),),
                  ranks_per_node=plan.ranks_per_node) for kind in ("ulysses", "ring")]
    assert step_time(alone[1], lengths, cost, etas) != pytest.approx(step_time(alone[0], lengths, cost, etas), rel=1e-6)


def test_mixed_kinds_in_one_micro_batch_are_priced_each_by_its_own():
    lengths = [9000, 7000, 3000, 2000, 500]
    etas = [0.0] * 5
    plan = Plan(16, (MicroBatch((Group((0, 1, 2, 3), 4, (0,), attention="ulysses"),
                                 Group((4, 5, 6, 7), 4, (1,), attention="ring"),
                                 Group((8, 9), 2, (2, 3), attention="ulysses"),
                                 Group((10,), 1, (4,)))),), ranks_per_node=8)
    plan.validate(num_samples=5, cost=COST)
    assert step_time(plan, lengths, COST, etas) == pytest.approx(_reference(plan, lengths, etas, COST), rel=1e-9)


@pytest.mark.parametrize("strategy", ["dhp", "static-ring:2", "flexsp"])
def test_token_counts_are_the_executor_stream(strategy):
    """`tokens` is the group's packed stream and `padded_tokens` its bucket under the executor's
    default ladder (the cost model here prices no padding), checked against `pack_group` itself."""
    from dhp_jax.data import random_samples
    from dhp_jax.model import MLLMConfig

    cfg = MLLMConfig.preset("tiny")
    rng = np.random.default_rng(0)
    samples = random_samples(cfg, rng.integers(1, 300, size=12).tolist(), seed=0)
    cost = CostModel.preset("internvl3-2b", "cpu", ranks_per_node=8)
    plan = plan_batch(samples, 8, cost, strategy=strategy, **_limit(strategy))
    for g in plan.groups:
        lay = pack_group([samples[s] for s in g.samples], g.degree, cfg)
        assert (g.tokens, g.padded_tokens) == (lay.num_tokens, lay.bucket), g
    # with a padding ladder in the cost model, the plan pads on that ladder (the same function)
    padded = cost.replace(bucket_min=64, bucket_growth=1.5)
    for g in plan_batch(samples, 8, padded, strategy=strategy, **_limit(strategy)).groups:
        assert g.padded_tokens == bucket_length(g.tokens, g.degree, 64, 1.5)
        assert g.padded_tokens == pack_group([samples[s] for s in g.samples], g.degree, cfg,
                                             min_bucket=64, growth=1.5).bucket


def _ulysses_plan(n: int) -> Plan:
    return Plan(n, (MicroBatch((Group((0, 1), 2, (0, 1), attention="ring"),
                                Group(tuple(range(2, n)), n - 2, (2, 3), attention="ulysses"))),))


def test_jax_executor_refuses_a_kind_the_heads_do_not_allow_before_device_work():
    import jax

    from dhp_jax.data import random_samples
    from dhp_jax.model import MLLMConfig, init_params
    from dhp_jax.sharding import PlanExecutor

    cfg = MLLMConfig.preset("tiny")
    ex = PlanExecutor(cfg, jax.devices()[:5])
    samples = random_samples(cfg, [20, 11, 7, 30], seed=0)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))    # no arrays: nothing may run
    # the tiny model's 4 query heads do not split over 3 Ulysses ranks
    msg = (r"micro-batch 0 group 1 \(ranks \[2, 3, 4\]\): attention 'ulysses' on degree 3: the 4 query "
           r"heads do not split over 3 Ulysses ranks")
    with pytest.raises(PlanValidationError, match=msg):
        ex.loss_and_grads(params, samples, _ulysses_plan(5))
    with pytest.raises(PlanValidationError, match=msg):
        ex.compile_plan(samples, _ulysses_plan(5), params)
    assert ex.num_compiles == 0


def test_torch_backend_refuses_a_kind_the_heads_do_not_allow_before_communicating():
    pytest.importorskip("torch")
    from dhp_jax.data import random_samples
    from dhp_jax.model import MLLMConfig
    from npu_backend.executor import StepError, check_plan

    cfg = MLLMConfig.preset("tiny")
    samples = random_samples(cfg, [20, 11, 7, 30], seed=0)
    with pytest.raises(StepError, match=r"micro-batch 0 group 1 \(ranks \[2, 3, 4\]\): attention 'ulysses' "
                                        r"on degree 3: the 4 query heads do not split"):
        check_plan(_ulysses_plan(5), samples, 5, cfg)   # the pure check every rank runs before any send
    check_plan(dataclasses.replace(_ulysses_plan(5), micro_batches=(MicroBatch((
        Group((0, 1), 2, (0, 1)), Group((2, 3, 4), 3, (2, 3)))),)), samples, 5, cfg)
