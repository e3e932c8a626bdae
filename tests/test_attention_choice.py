"""dhp's per-group attention choice and the prices it rests on: a hybrid is priced from the two base
kinds' pieces, the choice never prices a group above its ring time, picks a hybrid where the cost
model says it wins, and the simulator's lower bound stays below every plan."""

import numpy as np
import pytest

from dhp_jax.data import make_dataset, sample_etas, sample_lengths
from dhp_jax.planner import CostModel, plan_batch
from dhp_jax.planner.cost.geometry import padded_length
from dhp_jax.planner.cost.pricing import (best_kind_times, best_kinds, best_times, comm_per_token, group_times,
                                         program_kind, sample_terms, step_time)
from dhp_jax.sim.bounds import lower_bound

# 28 query heads; kinds chosen per group (`StreamGeometry.kind_rule` "group"), the choice these tests are about
COST = CostModel.preset("internvl3-8b", "ascend-910b", ranks_per_node=8, kind_rule="group")


def test_hybrid_price_is_the_all_to_all_plus_a_thinner_ring():
    A, B, S = 40.0, 10.0, 60000.0
    c = COST.replace(bucket_min=0)  # the unpadded form (padding is priced the same for every kind)
    t = float(group_times(c, A, B, S, 8, False, "hybrid:2x4"))
    # Ulysses over 2 on a sub-group's S/4 tokens: a rank holds S/8 of them and sends (2-1)/2 of those
    a2a = comm_per_token(c, False, "ulysses") * (S / 8) * (2 - 1) / 2
    ring = comm_per_token(c, False, "ring") / 2 * S * (4 - 1) / 4               # half the K/V heads, ring of 4
    lat = c.lat_intra * (1 + 3)
    assert t == pytest.approx((A + B) / 8 + c.b1 + a2a + lat + max(ring - A / 8, 0.0), rel=1e-12)
    # the "hybrid" family over several degrees at once equals each named kind
    fam = group_times(c, A, B, S, np.array([4, 8, 16]), np.array([False, False, True]), "hybrid", ulysses=2)
    named = [group_times(c, A, B, S, d, d > 8, f"hybrid:2x{d // 2}") for d in (4, 8, 16)]
    np.testing.assert_allclose(fam, np.ravel(named), rtol=1e-12)
    with pytest.raises(ValueError, match="degree"):
        group_times(c, A, B, S, np.array([4, 8]), False, "hybrid:2x2")


def test_choice_never_above_ring_and_takes_a_hybrid_across_nodes():
    # short sequences on 16 ranks over 2 nodes: the ring's slow inter-node hops are not hidden
    lengths = np.array([8000, 6000, 30000, 20000, 9000, 40000, 3000, 5000, 7000, 2000, 4000, 6000], float)
    terms = sample_terms(COST, lengths)
    groups = [(tuple(range(0, 16)), (0, 1)), (tuple(range(16, 20)), (2, 3, 4)), ((20,), (5,)),
              (tuple(range(24, 32)), tuple(range(6, 12)))]
    kinds = best_kinds(COST, groups, terms)
    assert kinds[2] == "ring"                                    # one rank: nothing to exchange
    assert kinds[0].startswith("hybrid:"), kinds                 # 16 ranks over 2 nodes: all-to-all inside
    u = int(kinds[0].split(":")[1].split("x")[0])
    assert u <= 8 and 28 % u == 0
    for (ranks, samples), kind in zip(groups, kinds):
        A, B, S = (float(x[list(samples)].sum()) for x in terms)
        inter = len({r // 8 for r in ranks}) > 1
        assert group_times(COST, A, B, S, len(ranks), inter, kind) <= group_times(COST, A, B, S, len(ranks), inter, "ring")


def test_dhp_with_choice_is_never_slower_than_ring_only_and_above_the_bound():
    # ring traffic that does not overlap attention: where all-to-all kinds can win
    cost = CostModel.preset("qwen3-vl-8b", "ascend-910b", ranks_per_node=8, comm_overlap=False, kind_rule="group")
    for seed in range(2):
        samples = make_dataset("msrvtt", 128, seed=seed, vision="qwen")
        L, E = sample_lengths(samples), sample_etas(samples)
        chosen, ring = plan_batch(samples, 16, cost), plan_batch(samples, 16, cost, attention="ring")
        assert {g.attention for g in chosen.groups} - {"ring"}, "expected some all-to-all groups here"
        t, t_ring = step_time(chosen, L, cost, E), step_time(ring, L, cost, E)
        assert t <= t_ring * (1 + 1e-12)
        assert lower_bound(L, 16, cost, E).step_s <= t * (1 + 1e-9)
    with pytest.raises(Exception, match="attention must be"):
        plan_batch(samples, 16, cost, attention="ulysses")


@pytest.mark.parametrize("rule", ["group", "program"])
@pytest.mark.parametrize("model,rpn", [("internvl3-8b", 8), ("qwen3-vl-8b", 8), ("qwen3-vl-8b", 1), ("qwen3-vl-8b", 4)])
def test_the_search_price_is_the_fastest_kind_the_plan_can_give(model, rpn, rule):
    # the search prices a group at `best_times`: the least of every kind `best_kinds` may give it on
    # ranks placed as the search assumes (inside a node up to ranks_per_node, whole nodes above);
    # under the "program" rule the time of its program's kind (`program_kind`), the kind the plan gives it
    cost = CostModel.preset(model, "ascend-910b", ranks_per_node=rpn, kind_rule=rule)
    rng = np.random.default_rng(3)
    lengths = rng.integers(500, 60000, 64)
    terms = sample_terms(cost, lengths, rng.random(64))
    seen = set()
    for d in range(1, 33):
        groups = [(tuple(range(d)), tuple(rng.choice(64, int(rng.integers(1, 6)), replace=False).tolist()))
                  for _ in range(4)]
        kinds, t = best_kind_times(cost, groups, terms)
        A = np.array([terms[0][list(g)].sum() for _, g in groups])
        B = np.array([terms[1][list(g)].sum() for _, g in groups])
        S = np.array([terms[2][list(g)].sum() for _, g in groups])
        np.testing.assert_array_equal(best_times(cost, A, B, S, np.full(4, d)), t)
        if rule == "group":
            assert np.all(t <= group_times(cost, A, B, S, d, d > rpn))
        else:
            P = padded_length(cost, S, np.full(4, d))
            assert kinds == [program_kind(cost, d, int(p)) if d > 1 else "ring" for p in P]
            seen.update(kinds)
    if rule == "program" and rpn > 1:
        assert len(seen) > 1, seen                                    # the rule is not the ring everywhere


def test_a_group_over_nodes_runs_ulysses_where_that_is_fastest():
    # one rank per node, 32 heads: a ring over nodes pays every K/V hop on the slow links; Ulysses
    # over the whole group moves 1/d of that, once. DHP prices it in its search and gives it the
    # group, and so is no slower than FlexSP's plan (which runs Ulysses wherever the heads allow)
    cost = CostModel.preset("qwen3-vl-8b", "ascend-910b").replace(ranks_per_node=1, bucket_min=0)
    lengths, etas = np.array([61, 226, 565]), np.array([0.0, 0.27478026, 0.04701956])
    dhp = plan_batch(lengths, 15, cost, etas=etas)
    kinds = [(g.degree, g.attention) for mb in dhp.micro_batches for g in mb.groups]
    assert any(d > 1 and k == "ulysses" for d, k in kinds), kinds
    flex = plan_batch(lengths, 15, cost, "flexsp", etas=etas)
    assert step_time(dhp, lengths, cost, etas) <= step_time(flex, lengths, cost, etas)
    ring = plan_batch(lengths, 15, cost, etas=etas, attention="ring")
    assert step_time(dhp, lengths, cost, etas) < step_time(ring, lengths, cost, etas)


def test_few_sequences_may_each_take_their_own_group():
    # 2 sequences on 11 ranks (one per node): the long one alone on 8 ranks of Ulysses and the short
    # one alone on 1 beat both on the same 8 (the packing by work puts them together); every
    # sequence alone is among the packings the search tries when there are no more than ranks
    cost = CostModel.preset("qwen3-vl-8b", "ascend-910b").replace(ranks_per_node=1, bucket_min=0)
    lengths, etas = np.array([115, 2862]), np.array([0.61547942, 0.0])
    dhp = plan_batch(lengths, 11, cost, etas=etas)
    groups = sorted((g.samples, g.degree, g.attention) for mb in dhp.micro_batches for g in mb.groups)
    assert groups == [((0,), 1, "ring"), ((1,), 8, "ulysses")], groups
    flex = plan_batch(lengths, 11, cost, "flexsp", etas=etas)
    assert step_time(dhp, lengths, cost, etas) <= step_time(flex, lengths, cost, etas)
