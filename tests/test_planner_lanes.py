"""Shared compute lanes (fake CPU devices on a few cores): the micro-batch makespan is
max(max_g T_g, sum_g T_g min(d_g, p) / p) in the planner, in `build_plan` and in `sim.step_time`;
presets without lanes keep their plans exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dhp_jax
from dhp_jax.planner import CostModel, plan_batch
from dhp_jax.planner.cost.plan_check import check_plan
from dhp_jax.planner.cost.pricing import allreduce_time, makespan
from dhp_jax.planner.solvers.build import build_plan
from dhp_jax.sim import step_time

PROFILE = Path(dhp_jax.__file__).parent / "train" / "profiles" / "tiny-cpu8.json"


def _simple(lanes: int | None) -> CostModel:
    # round numbers so that every group time is easy to write down by hand
    return CostModel(a1=0.0, a2=1e-3, b1=0.01, kv_bytes_per_token=0.0, bw_intra=1.0, bw_inter=1.0,
                     lat_intra=0.0, lat_inter=0.0, mem_per_token=1.0, memory_budget=1e9,
                     ranks_per_node=8, compute_lanes=lanes)


def test_shared_term_by_hand():
    cost = _simple(2)
    lengths = np.array([1000, 1000, 1000, 400])
    # micro-batch 0: four degree-1 groups (1.01 s, 1.01, 1.01, 0.41): max 1.01, lanes (3.44)/2 = 1.72
    # micro-batch 1: one degree-4 group of samples 0+1: work 2.0 s over min(4, 2) = 2 cores
    #   T = 2.0/2 + b1 * 4/2 = 1.02; lanes term 1.02 * 2/2 = 1.02 -> the max rules
    mbs = [[((0,), [0]), ((1,), [1]), ((2,), [2]), ((3,), [3])], [((0, 1, 2, 3), [0, 1])]]
    plan = build_plan(mbs, lengths, np.zeros(4), cost, 4, {"strategy": "hand"})
    t = [g.est_time_s for g in plan.micro_batches[0].groups]
    assert t == pytest.approx([1.01, 1.01, 1.01, 0.41], rel=1e-12)
    assert plan.micro_batches[0].est_makespan_s == pytest.approx(3.44 / 2, rel=1e-12)
    assert plan.micro_batches[1].est_makespan_s == pytest.approx(1.02, rel=1e-12)
    assert plan.est_step_time_s == pytest.approx(1.72 + 1.02, rel=1e-12)
    assert step_time(plan, lengths, cost) == pytest.approx(plan.est_step_time_s, rel=1e-12)
    # the same plan without lanes: max only (1.01 + 2.0/4 + 0.01)
    free = _simple(None)
    plan_free = build_plan(mbs, lengths, np.zeros(4), free, 4, {"strategy": "hand"})
    assert plan_free.est_step_time_s == pytest.approx(1.01 + 0.51, rel=1e-12)
    assert step_time(plan_free, lengths, free) == pytest.approx(plan_free.est_step_time_s, rel=1e-12)
    assert makespan(free, [1.0, 3.0], [1, 1]) == 3.0
    assert makespan(cost, [1.0, 3.0], [1, 1]) == pytest.approx(3.0)
    assert makespan(cost, [2.0, 3.0], [1, 4]) == pytest.approx(max(3.0, (2.0 + 3.0 * 2) / 2))


def _lanes_cost() -> CostModel:
    cost = CostModel.from_profile(PROFILE)
    assert cost.compute_lanes == 2
    return cost


@pytest.mark.parametrize("seed", range(4))
def test_dhp_no_worse_than_static_on_shared_lanes(seed):
    cost = _lanes_cost()
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 1024, size=16)
    dhp = plan_batch(lengths, 8, cost, strategy="dhp")
    t_dhp = step_time(dhp, lengths, cost)
    assert dhp.est_step_time_s == pytest.approx(t_dhp, rel=1e-12)
    for d in (1, 2, 4, 8):
        st = plan_batch(lengths, 8, cost, strategy=f"static-ring:{d}")
        assert t_dhp <= step_time(st, lengths, cost) * (1 + 1e-12), d


def test_short_equal_samples_take_degree_one():
    # eight short, equal samples on 8 ranks sharing 2 cores: more degree only adds ring work
    cost = _lanes_cost()
    lengths = np.full(8, 256)
    dhp = plan_batch(lengths, 8, cost, strategy="dhp")
    st1 = plan_batch(lengths, 8, cost, strategy="static-ring:1")
    assert max(max(mb) for mb in dhp.degrees) == 1
    assert step_time(dhp, lengths, cost) <= step_time(st1, lengths, cost) * (1 + 1e-12)


# computed with the planner before shared lanes were modelled (no-lanes preset: must not change)
_L = [30000, 21000, 9000, 4000, 2500, 1200, 800, 16000, 500, 7000]
_E = [0.5, 0.1, 0.0, 0.3, 0.2, 0.0, 0.6, 0.25, 0.0, 0.4]
# "dhp": its search's own plan ([[0, 2, 5, 6], [1, 3], [4, 7, 8, 9]] on 8 + 4 + 4 ranks) is priced
# as then (solver "dhp_search_makespan_sum_s"); a FlexSP-style packing (two groups of 8) beats it
_SEARCH = 1.2748526373357725
_GOLDEN = {
    "dhp": (1.2725536184077055, [[[0, 4, 6, 9], [1, 2, 3, 5, 7, 8]]],
            [[[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]]),
    "static-ring:best": (1.3016365060229496, [[[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]],
                         [[[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]]),
}


@pytest.mark.parametrize("strategy", sorted(_GOLDEN))
def test_no_lanes_plans_unchanged(strategy):
    # the memory and gradient figures of the preset the goldens were computed with (before the
    # engine's memory model; the goldens pin planning for fixed coefficients), and its vision
    # coefficient (before the encoder's patch embedding was priced)
    cost = CostModel.preset("internvl3-8b", "h100", ranks_per_node=8, mem_per_token=518144.0,
                            memory_budget=59561037824.0, grad_bytes=15884005376.0,
                            a2_vision=2.5827412901921132e-05, bucket_min=0)  # unpadded, as then
    assert cost.compute_lanes is None
    plan = plan_batch(_L, 16, cost, strategy=strategy, etas=_E)
    est, samples, ranks = _GOLDEN[strategy]
    assert plan.est_step_time_s == est  # bit for bit
    if strategy == "dhp":
        assert plan.solver["chosen"] == "flexsp-packing"
        assert plan.solver["dhp_search_makespan_sum_s"] + allreduce_time(cost, 16) == _SEARCH
    assert [[list(g.samples) for g in mb.groups] for mb in plan.micro_batches] == samples
    assert [[list(g.ranks) for g in mb.groups] for mb in plan.micro_batches] == ranks
    # and the estimate is the max-only formula
    mx = sum(max(g.est_time_s for g in mb.groups) for mb in plan.micro_batches) + allreduce_time(cost, 16)
    assert plan.est_step_time_s == mx


@pytest.mark.parametrize("lengths", [[40, 50, 60, 70], [100, 100, 100, 5], [900, 10, 10], [7]])
def test_every_rank_leaves_no_rank_idle(lengths):
    """Executors with one process per rank need every rank in some group; `every_rank=True` gives
    ranks the plan would leave idle (shared lanes prefer few small groups) to the slowest group."""
    cost = CostModel.preset("internvl3-8b", "cpu")
    free = plan_batch(lengths, 5, cost)
    plan = plan_batch(lengths, 5, cost, every_rank=True)
    check_plan(plan, cost, lengths)
    assert sorted({r for g in plan.groups for r in g.ranks}) == list(range(5))
    idle = sorted(set(range(5)) - {r for g in free.groups for r in g.ranks})
    assert plan.solver.get("every_rank_added", []) == idle
    assert [sorted(g.samples) for g in plan.groups] == [sorted(g.samples) for g in free.groups]
