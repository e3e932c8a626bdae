"""The planner: Plan invariants for every strategy, exactness of the allocation, 3+5, determinism,
node-aware placement, ablation options and the planner's bad-input errors."""

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dhp_jax.data import Sample, make_dataset, sample_etas, sample_lengths
from dhp_jax.planner import CostModel, Plan, PlanningError, PlanValidationError, STRATEGIES, plan_batch
from dhp_jax.planner.contract.plan import Group, MicroBatch, spans_nodes
from dhp_jax.planner.cost.memory import max_tokens_per_rank, min_degree
from dhp_jax.planner.cost.plan_check import check_plan
from dhp_jax.planner.cost.pricing import group_time, group_times, sample_terms
from dhp_jax.planner.solvers.allocate import allocate, allowed_degrees, brute_force
from dhp_jax.planner.solvers import dhp as dhp_solver
from dhp_jax.planner.solvers.placement import place
from dhp_jax.sim import step_time

COST = CostModel.preset("internvl3-8b", "ascend-910b", bucket_min=0)  # the paper's unpadded form (padding: test_compiles.py)
CAP = int(max_tokens_per_rank(COST))
CAP_F = max_tokens_per_rank(COST)


def _check(plan, lengths, cost=COST, etas=None):
    check_plan(plan, cost, lengths)
    assert Plan.from_json(plan.to_json(), num_samples=len(lengths)) == plan
    assert step_time(plan, lengths, cost, etas) == pytest.approx(plan.est_step_time_s, rel=1e-9)
    assert plan.solver["strategy"] and plan.solver["solve_ms"] >= 0


batches = st.integers(1, 4).flatmap(lambda n: st.tuples(
    st.just(n * 4),
    st.lists(st.integers(0, 3 * CAP), min_size=1, max_size=20),
    st.sampled_from([2, 4, 8])))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches, st.sampled_from(["dhp", "static-ring:best", "static-ulysses:best", "static-ring:4", "flexsp"]))
def test_plan_invariants_for_every_strategy(batch, strategy):
    num_ranks, lengths, rpn = batch
    lengths = np.minimum(np.asarray(lengths), num_ranks * CAP)
    try:
        limit = {"time_limit_s": 2.0} if strategy == "flexsp" else {}   # the static ones take no options
        plan = plan_batch(lengths, num_ranks, COST, strategy, ranks_per_node=rpn, **limit)
    except PlanningError as e:
        # only the static/power-of-two strategies may be unable to hold a sample
        assert strategy != "dhp", e
        assert re.search(r"sample \d+|head count|no degree|no power-of-two", str(e)), e
        return
    _check(plan, lengths, COST.replace(ranks_per_node=rpn))
    assert plan.ranks_per_node == rpn
    if strategy == "flexsp":
        assert all(d & (d - 1) == 0 for ds in plan.degrees for d in ds)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 8), st.lists(st.integers(1, 2 * CAP), min_size=1, max_size=8))
def test_milp_plans_are_valid(num_ranks, lengths):
    lengths = np.minimum(np.asarray(lengths), num_ranks * CAP)
    plan = plan_batch(lengths, num_ranks, COST, "milp", node_limit=20_000)   # work, not wall-clock, limit
    _check(plan, lengths)
    assert isinstance(plan.solver["optimal"], bool)


def test_samples_carry_their_etas():
    samples = [Sample.from_lengths(text=200, vision=5000, modality="video"), Sample.from_lengths(text=900),
               Sample.from_lengths(text=100, vision=60000, modality="video")]
    etas = [s.bidirectional_share for s in samples]
    plan = plan_batch(samples, 8, COST)
    lengths = [s.num_tokens for s in samples]
    _check(plan, lengths, etas=etas)
    assert plan.est_step_time_s == pytest.approx(step_time(plan, lengths, COST, etas))
    assert plan.est_step_time_s > step_time(plan, lengths, COST)  # vision costs more than text


# ------------------------------------------------------------------------------ exact allocation
@pytest.mark.parametrize("seed", range(12))
def test_allocation_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    cost = COST.replace(ranks_per_node=int(rng.choice([2, 4, 16])))
    N = int(rng.integers(2, 11))
    K = int(rng.integers(1, min(N, 5) + 1))
    L = rng.integers(100, 3 * CAP, size=K) if seed % 2 else rng.integers(100, 20000, size=K)
    attn, lin, tok = sample_terms(cost, L, rng.uniform(0, 1, K))
    dmin = min_degree(cost, L)
    for allowed in (None, allowed_degrees(N, "pow2")):
        got = allocate(attn, lin, tok, dmin, N, cost, allowed)
        ref = brute_force(attn, lin, tok, dmin, N, cost, allowed)
        if ref is None:
            assert got is None
            continue
        deg, mk = got
        assert deg.sum() <= N and np.all(deg >= dmin)
        assert mk == pytest.approx(ref, rel=1e-12)
        times = group_times(cost, attn, lin, tok, deg)
        assert times.max() == pytest.approx(mk, rel=1e-12)


def _table_dp(A, B, S, dmin, N, cost, allowed):
    """The paper's 2-D programme: best[j] = least makespan of the groups so far on <= j ranks."""
    inf = float("inf")
    best = [0.0] * (N + 1)
    for a, b, s_, lo in zip(A, B, S, dmin):
        times = {int(d): float(group_times(cost, a, b, s_, int(d))) for d in allowed if lo <= d <= N}
        best = [min((max(best[j - d], t) for d, t in times.items() if d <= j), default=inf) for j in range(N + 1)]
    return best[N]


@pytest.mark.parametrize("seed", range(4))
def test_warm_started_allocation_equals_the_table_dp(seed):
    # >= 24 groups takes the vectorised warm start; the paper's O(K' N^2) DP is the reference
    rng = np.random.default_rng(100 + seed)
    cost = COST.replace(ranks_per_node=8)
    N = int(rng.integers(40, 81))
    K = int(rng.integers(24, 36))
    L = np.exp(rng.uniform(np.log(300), np.log(2.5 * CAP), K)).astype(np.int64)
    attn, lin, tok = sample_terms(cost, L, rng.uniform(0, 1, K))
    dmin = min_degree(cost, L)
    for allowed in (allowed_degrees(N, "any"), allowed_degrees(N, "pow2")):
        got = allocate(attn, lin, tok, dmin, N, cost, allowed)
        ref = _table_dp(attn, lin, tok, dmin, N, cost, allowed)
        if not np.isfinite(ref):
            assert got is None
            continue
        assert got[1] == pytest.approx(ref, rel=1e-12)
        assert got[0].sum() <= N


@pytest.mark.parametrize("seed", range(8))
def test_allocation_under_a_limit_is_the_same_or_says_it_cannot_beat_it(seed):
    # the limit only skips degrees whose work bound is above it: below the limit the degrees and the
    # makespan are those of the unlimited search (ties of padded groups included), at or above it inf
    rng = np.random.default_rng(300 + seed)
    cost = CostModel.preset("internvl3-8b", "ascend-910b") if seed % 2 else COST.replace(ranks_per_node=8)
    N = 64
    K = int(rng.integers(1, 12)) if seed < 4 else int(rng.integers(24, 40))
    L = np.exp(rng.uniform(np.log(300), np.log(2.5 * CAP), K)).astype(np.int64)
    attn, lin, tok = sample_terms(cost, L, rng.uniform(0, 1, K))
    dmin = min_degree(cost, L)
    for allowed in (allowed_degrees(N, "any"), allowed_degrees(N, "pow2")):
        ref = allocate(attn, lin, tok, dmin, N, cost, allowed)
        if ref is None:
            assert allocate(attn, lin, tok, dmin, N, cost, allowed, limit=1.0) is None
            continue
        for f in (1.0 + 1e-12, 1.001, 1.05, 2.0, 1e6):
            got = allocate(attn, lin, tok, dmin, N, cost, allowed, limit=ref[1] * f)
            assert got[1] == ref[1] and np.array_equal(got[0], ref[0])
        for f in (1.0, 0.99, 0.5, 0.0):
            assert allocate(attn, lin, tok, dmin, N, cost, allowed, limit=ref[1] * f)[1] == np.inf


@pytest.mark.parametrize("seed", range(6))
def test_one_group_allocation_is_the_least_degree_of_its_least_time(seed):
    # one group walks its degrees from the largest down and stops by the work bound: the result must
    # be the argmin over every allowed degree of the model's vectorised times (least degree on ties),
    # with and without a limit, on padded presets and an unpadded profile
    rng = np.random.default_rng(500 + seed)
    cost = (CostModel.preset("internvl3-8b", "ascend-910b"), CostModel.preset("qwen3-vl-8b", "h100"),
            COST.replace(ranks_per_node=8))[seed % 3]
    for _ in range(40):
        N = int(rng.choice([8, 17, 64]))
        L = np.asarray([int(np.exp(rng.uniform(np.log(50), np.log(max(60, 0.9 * N * max_tokens_per_rank(cost))))))])
        attn, lin, tok = sample_terms(cost, L, rng.uniform(0, 1, 1))
        dmin = min_degree(cost, L)
        for allowed in (allowed_degrees(N, "any"), allowed_degrees(N, "pow2")):
            cand = allowed[allowed >= dmin[0]]
            got = allocate(attn, lin, tok, dmin, N, cost, allowed)
            if cand.size == 0:
                assert got is None
                continue
            times = group_times(cost, attn[0], lin[0], tok[0], cand)
            j = int(np.argmin(times))
            assert got[1] == float(times[j]) and got[0].tolist() == [int(cand[j])]
            for f in (1.0 + 1e-12, 1.3):
                lim = allocate(attn, lin, tok, dmin, N, cost, allowed, limit=got[1] * f)
                assert lim[1] == got[1] and np.array_equal(lim[0], got[0])
            assert allocate(attn, lin, tok, dmin, N, cost, allowed, limit=got[1])[1] == np.inf


def test_scalar_chunked_tokens_match_the_layout_rule():
    from dhp_jax.geometry.layout import linear_tokens
    from dhp_jax.planner.solvers.allocate import _linear_whole

    rng = np.random.default_rng(7)
    for _ in range(3000):
        d = int(rng.integers(1, 65))
        P = float(2 * d * int(rng.integers(1, 4000)))
        S = float(rng.integers(0, int(P) + 1))
        chunk = int(rng.choice([1, 7, 64, 256, 1000]))
        assert _linear_whole(S, P, d, chunk) == d * linear_tokens(S, P, d, chunk)


def test_packing_opens_a_bin_for_every_long_sequence():
    # long = needs more ranks than a bin has, or carries a bin's share of work; found by bisection
    # when they are the heaviest, by a mask when a light sequence needs many ranks: both must agree
    from dhp_jax.planner.solvers.packing import Packer

    rng = np.random.default_rng(11)
    for trial in range(300):
        K, N = int(rng.integers(1, 120)), int(rng.choice([8, 64]))
        work = rng.exponential(1.0, K) * (rng.random(K) < 0.95)
        tokens = rng.integers(1, 4000, K).astype(np.float64)
        dmin = np.ones(K, dtype=np.int64)
        wide = rng.random(K) < (0.1 if trial % 2 else 0.0)
        dmin[wide] = rng.integers(2, N + 1, int(wide.sum()))  # light or heavy, many ranks
        packer = Packer(work, tokens, dmin, N, 2000.0)
        order = np.lexsort((np.arange(K), -work))
        for f in (1.0, 2.0, 4.0, float(N)):
            W, slots = work.sum() / N * f, max(1, int(f))
            is_long = (dmin[order] > slots) | ((work[order] >= W) & (W > 0))
            assign = packer(f)
            assert np.all(assign >= 0)
            if slots >= N and not is_long.any() and tokens.sum() <= 2000.0 * slots * (1 - 1e-12):
                assert np.all(assign == 0)
                continue
            assert assign[order[is_long]].tolist() == list(range(int(is_long.sum())))
            assert np.unique(assign).tolist() == list(range(int(assign.max()) + 1))  # dense bin ids


def test_non_power_of_two_split_beats_every_power_of_two_plan():
    lengths = [1000, 1607]
    plan = plan_batch(lengths, 8, COST)
    assert sorted(plan.degrees[0]) == [3, 5]
    best_pow2 = min([group_time(COST, lengths, d) for d in (1, 2, 4, 8)]
                    + [max(group_time(COST, [lengths[0]], a), group_time(COST, [lengths[1]], b))
                       for a in (1, 2, 4) for b in (1, 2, 4) if a + b <= 8])
    assert plan.micro_batches[0].est_makespan_s < best_pow2 / 1.05
    pow2 = plan_batch(lengths, 8, COST, degrees="pow2", attention="ring")    # best_pow2 is ring-only
    assert pow2.micro_batches[0].est_makespan_s == pytest.approx(best_pow2, rel=1e-12)
    # the per-group attention choice never prices a group above its ring time
    assert plan_batch(lengths, 8, COST, degrees="pow2").micro_batches[0].est_makespan_s <= best_pow2
    # 3 + 5 share one node of 8: nobody spans nodes
    assert not any(spans_nodes(g.ranks, 8) for g in plan.groups)


# ------------------------------------------------------------------------------ placement, options
def test_node_aware_placement_keeps_small_groups_in_a_node():
    ranks = place([5, 3, 5, 3], 16, 8, node_aware=True)
    assert not any(spans_nodes(r, 8) for r in ranks)
    assert sorted(x for r in ranks for x in r) == list(range(16))
    naive = place([5, 5, 3, 3], 16, 8, node_aware=False)
    assert spans_nodes(naive[1], 8)
    big = place([12, 4], 16, 8)
    assert set(big[0]) >= set(range(8)) and len(big[0]) == 12


def test_spanning_a_node_costs_time_in_step_time():
    lengths = [3000] * 6
    a = Plan.from_json({"schema": "dhp.plan/v1", "num_ranks": 8, "ranks_per_node": 4,
                        "micro_batches": [{"groups": [{"ranks": [0, 1, 2, 3], "degree": 4, "samples": list(range(6))}]}]})
    b = Plan.from_json({"schema": "dhp.plan/v1", "num_ranks": 8, "ranks_per_node": 4,
                        "micro_batches": [{"groups": [{"ranks": [2, 3, 4, 5], "degree": 4, "samples": list(range(6))}]}]})
    assert step_time(b, lengths, COST) > step_time(a, lengths, COST)


def test_ablation_options():
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(500, 8000, 60), [150000, 90000, 40000]])
    # Pinned to the memory figures this case was written for (about 85k tokens per rank). With the
    # engine's memory model (about 20k tokens per rank) the last micro-batch of the full plan
    # packs [6, 2, 2, 2, 2, 2] and is 0.23 % slower than pow2's [8, 4, 4]: a known gap of the
    # packing heuristic under tight memory, not a property this test can claim.
    cost = COST.replace(mem_per_token=518144.0, memory_budget=44099155558.4)
    full = plan_batch(lengths, 16, cost)
    for kw in ({"packing": False}, {"degrees": "pow2"}, {"node_aware": False}, {"refine": False},
               {"num_micro_batches": 3}, {"degrees": [1, 2, 3, 6, 12]}):
        plan = plan_batch(lengths, 16, cost, **kw)
        _check(plan, lengths, cost)
        assert plan.est_step_time_s >= full.est_step_time_s * (1 - 1e-9) or "num_micro_batches" in kw, kw
    assert all(d & (d - 1) == 0 for ds in plan_batch(lengths, 16, cost, degrees="pow2").degrees for d in ds)
    assert len(plan_batch(lengths, 16, cost, num_micro_batches=3).micro_batches) == 3
    assert plan_batch(lengths, 16, cost, packing=False).solver["num_micro_batches"] >= 63 / 16


def test_static_baselines():
    lengths = list(range(1000, 31000, 1000))
    ring = plan_batch(lengths, 8, COST, "static-ring:2")
    assert all(d == 2 for ds in ring.degrees for d in ds)
    # a distributed sampler deal: sample i on replica i mod 4
    for g in ring.groups:
        assert len({s % 4 for s in g.samples}) == 1
    best = plan_batch(lengths, 8, COST, "static-ring:best")
    assert best.est_step_time_s <= ring.est_step_time_s
    uly = plan_batch(lengths, 8, COST, "static-ulysses:best")
    assert COST.num_heads % uly.solver["degree"] == 0 and uly.solver["degree"] > 1
    assert {g.attention for g in uly.groups} == {"ulysses"}      # the kind is each group's field
    with pytest.raises(PlanningError, match="head count 28 is not divisible by 8"):
        plan_batch(lengths, 8, COST, "static-ulysses:8")
    dhp = plan_batch(lengths, 8, COST)
    assert dhp.est_step_time_s <= min(best.est_step_time_s, uly.est_step_time_s)


PADDED = CostModel.preset("internvl3-8b", "ascend-910b")  # the default: padded streams, bucketed programs


def _statics(num_ranks, cost, attention):
    """Every static baseline `plan_batch` offers on `num_ranks` that DHP in `attention` mode may run."""
    ds = [d for d in range(1, num_ranks + 1) if num_ranks % d == 0]
    return [f"static-ring:{d}" for d in ds] + [f"static-ulysses:{d}" for d in ds
                                                if attention == "best" and cost.ulysses_ok(d)]


def _layout(plan):
    return [[(g.ranks, g.samples, g.attention) for g in mb.groups] for mb in plan.micro_batches]


def _ranks(plan):
    return [[g.ranks for g in mb.groups] for mb in plan.micro_batches]


@pytest.mark.parametrize("seed,chosen", [(3, "dhp"), (0, "flexsp-packing")])
def test_dhp_repacks_its_plan_at_its_own_groups(monkeypatch, seed, chosen):
    """Where a finished plan's ranks idle while its slowest group finishes, DHP deals the sequences
    again over the same groups, heaviest first (`solvers.dhp.repack_plan`), and keeps the result when
    it prices lower: on long-tailed text batches (32 ranks, 128 samples) the plan is faster than the
    same search's without the repack, by `sim.step_time`, with the same micro-batches of the same
    ranks, every sample once and memory checked (`check_plan`); the plan that won (DHP's search, a
    FlexSP-style packing) keeps its name."""
    cost = CostModel.preset("internvl3-8b", "ascend-910b", ranks_per_node=8)
    samples = make_dataset("text-longtail", 128, seed)
    lengths, etas = sample_lengths(samples), sample_etas(samples)
    plan = plan_batch(lengths, 32, cost, etas=etas)
    monkeypatch.setattr(dhp_solver, "_REPACK", False)
    plain = plan_batch(lengths, 32, cost, etas=etas)
    assert plan.solver.get("repacked") and "repacked" not in plain.solver
    assert plan.solver["chosen"] == plain.solver["chosen"] == chosen
    _check(plan, lengths, cost, etas)
    assert _ranks(plan) == _ranks(plain)
    assert _layout(plan) != _layout(plain)
    assert step_time(plan, lengths, cost, etas) < step_time(plain, lengths, cost, etas) * (1 - 5e-3)


@pytest.mark.parametrize("attention", ["best", "ring"])
def test_dhp_is_never_slower_than_a_static_plan(attention):
    """A static plan is a DHP plan, so DHP takes the static plans as candidates
    (`solvers.static_candidates`): on random long-tailed batches (padded and unpadded pricing, groups
    inside and over nodes) its step time is at most every static baseline's, both priced by
    `sim.step_time`; a plan a static candidate won says which and is that baseline's plan."""
    rng = np.random.default_rng(11)
    chosen = {}
    for num_ranks, rpn, trials in ((3, 2, 12), (5, 4, 12), (6, 4, 12), (7, 4, 16), (8, 8, 16), (8, 4, 10),
                                   (12, 8, 8), (14, 8, 8), (64, 8, 4)):
        for trial in range(trials):
            cost = (COST if trial % 2 else PADDED).replace(ranks_per_node=rpn)
            k = int(rng.integers(1, 4 * num_ranks + 1))
            lengths = np.minimum(rng.pareto(1.3, k) * CAP * rng.uniform(0.05, 0.6), num_ranks * CAP).astype(np.int64)
            etas = rng.uniform(0, 1, k) * (rng.random(k) < 0.4)
            dhp = plan_batch(lengths, num_ranks, cost, etas=etas, attention=attention)
            t = step_time(dhp, lengths, cost, etas)
            where = (num_ranks, rpn, trial, dhp.solver["chosen"])
            for s in _statics(num_ranks, cost, attention):
                try:
                    base = plan_batch(lengths, num_ranks, cost, s, etas=etas)
                except PlanningError:
                    continue  # a sample longer than this degree holds
                assert t <= step_time(base, lengths, cost, etas) * (1 + 1e-9), (s, *where)
                if s == dhp.solver["chosen"]:  # that baseline's plan, or its groups dealt again (`dhp.repack_plan`)
                    if dhp.solver.get("repacked"):
                        assert _ranks(dhp) == _ranks(base), where
                    else:
                        assert _layout(dhp) == _layout(base), where
            name = dhp.solver["chosen"]
            chosen[name.partition(":")[0]] = chosen.get(name.partition(":")[0], 0) + 1
            if name.startswith("static"):
                assert {g.degree for g in dhp.groups} == {int(name.partition(":")[2])}, where
            elif name == "flexsp-packing":  # FlexSP's groups: powers of two (mixed, as its MILP may)
                assert all(d & (d - 1) == 0 for ds in dhp.degrees for d in ds), where
            if name != "dhp":  # it was priced as the plan is
                spans = sum(mb.est_makespan_s for mb in dhp.micro_batches)
                assert spans == pytest.approx(dhp.solver["est_makespan_sum_s"], rel=1e-9), where
                assert spans < dhp.solver["dhp_search_makespan_sum_s"], where
    # both happen on these batches: the search's plan, and a static plan it did not reach
    assert chosen["dhp"] and len(chosen) > 1, chosen


@pytest.mark.parametrize("rule,static", [("group", "static-best:8"), ("program", "static-ring:8")])
def test_static_candidates_honour_the_options(rule, static):
    """A batch on which the static degree-8 plan (every micro-batch on all 8 ranks, next fit) beats
    DHP's search; the candidates are only those the options allow. With kinds chosen per group the
    static plan on each group's fastest kind wins; under one kind per program (the presets' rule)
    the kind of program (8, 16384) is a hybrid that the ring beats on this batch's short group, and
    the all-ring static plan wins, the baseline itself."""
    lengths = [15700, 5700, 15400, 3600, 3700, 400, 11600, 16000, 11100, 1000, 200, 35800, 6000, 5600]
    cost = PADDED.replace(kind_rule=rule)
    plan = plan_batch(lengths, 8, cost)
    assert plan.solver["chosen"] == static and plan.degrees == [[8], [8]]
    if rule == "program":
        assert _layout(plan) == _layout(plan_batch(lengths, 8, cost, "static-ring:8"))
    ring = plan_batch(lengths, 8, cost, attention="ring")
    assert ring.solver["chosen"] == "static-ring:8"
    assert _layout(ring) == _layout(plan_batch(lengths, 8, cost, "static-ring:8"))
    no8 = plan_batch(lengths, 8, cost, degrees=list(range(1, 8)))
    assert no8.solver["chosen"] == "dhp" and 8 not in {g.degree for g in no8.groups}
    assert plan_batch(lengths, 8, cost, num_micro_batches=2).solver["chosen"] == static
    three = plan_batch(lengths, 8, cost, num_micro_batches=3)
    assert three.solver["chosen"] == "dhp" and len(three.micro_batches) == 3
    single = plan_batch(lengths, 8, cost, packing=False)
    assert single.solver["chosen"] == "dhp" and all(len(g.samples) == 1 for g in single.groups)


def test_static_groups_deal_and_fill_by_next_fit():
    """The vectorised static grouping (`baselines.static_assignments`, all degrees at once) against
    the rule written as a loop: replica i mod P, next fit within d ranks' tokens."""
    from dhp_jax.planner.solvers.baselines import static_groups

    rng = np.random.default_rng(5)
    for _ in range(60):
        n = int(rng.choice([1, 2, 3, 6, 8, 12]))
        lengths = (rng.pareto(1.2, int(rng.integers(1, 40))) * CAP * rng.uniform(0.05, 1)).astype(np.int64)
        for d in [d for d in range(1, n + 1) if n % d == 0]:
            cap, P = d * CAP_F, n // d
            if lengths.max() > cap:
                with pytest.raises(PlanningError, match=f"static degree {d}: sample"):
                    static_groups(lengths, n, COST, d, "ring")
                continue
            want = []
            for g in range(P):
                chunks, used = [], 0
                for k in range(g, len(lengths), P):
                    if not chunks or used + lengths[k] > cap:
                        chunks.append([])
                        used = 0
                    chunks[-1].append(k)
                    used += int(lengths[k])
                want.append(chunks)
            mbs = [[(tuple(range(g * d, g * d + d)), c[m]) for g, c in enumerate(want) if m < len(c)]
                   for m in range(max(len(c) for c in want))]
            assert static_groups(lengths, n, COST, d, "ring") == mbs, (n, d)


def test_best_kind_times_is_the_fastest_allowed_kind_of_each_group():
    """Every group's kind is the first fastest (ring first, then the smaller Ulysses size) of the
    kinds `group_kind_times` lists for its ranks (kinds chosen per group), or its program's kind
    (kind_rule "program"), and its time is that kind's."""
    from dhp_jax.planner.contract.plan import attention_split
    from dhp_jax.planner.cost.pricing import best_kind_times, group_kind_times

    from dhp_jax.planner.cost.geometry import padded_length
    from dhp_jax.planner.cost.pricing import program_kind, runs_on

    rng = np.random.default_rng(9)
    for rpn, rule in ((2, "group"), (4, "group"), (8, "group"), (4, "program"), (8, "program")):
        cost = PADDED.replace(ranks_per_node=rpn, kind_rule=rule)
        n, k = 16, 40
        lengths = rng.integers(100, 3 * CAP, k)
        terms = sample_terms(cost, lengths, None)
        groups = []
        for _ in range(30):
            d = int(rng.integers(1, n + 1))
            start = int(rng.integers(0, n - d + 1))
            ranks = tuple(range(start, start + d)) if rng.random() < 0.5 else \
                tuple(sorted(rng.choice(n, d, replace=False).tolist()))
            groups.append((ranks, sorted(rng.choice(k, int(rng.integers(1, 4)), replace=False).tolist())))
        kinds, times = best_kind_times(cost, groups, terms)
        plan = Plan(num_ranks=n, micro_batches=tuple(MicroBatch((Group(r, len(r), tuple(s)),), 0.0) for r, s in groups))
        for (ranks, samples), kind, t, menu in zip(groups, kinds, times, group_kind_times(cost, plan, lengths)):
            if rule == "group":
                order = sorted(menu, key=lambda x: (menu[x], attention_split(x, len(ranks))[0]))
                assert kind == order[0] and t == menu[kind], (ranks, kind, menu)
            else:  # the program's kind (`program_kind`), the ring where the ranks cannot run it
                p = int(padded_length(cost, float(lengths[samples].sum()), len(ranks)))
                want = program_kind(cost, len(ranks), p) if len(ranks) > 1 else "ring"
                assert kind == (want if runs_on(want, ranks, cost) else "ring") and t == menu[kind], (ranks, kind)


def test_dhp_beats_static_on_openvid():
    from dhp_jax.data import make_dataset

    samples = make_dataset("openvid", 256, 0)
    lengths = [s.num_tokens for s in samples]
    etas = [s.bidirectional_share for s in samples]
    dhp = plan_batch(samples, 32, COST)
    ring = plan_batch(samples, 32, COST, "static-ring:best")
    _check(dhp, lengths, etas=etas)
    _check(ring, lengths, etas=etas)
    assert dhp.est_step_time_s < ring.est_step_time_s


def test_determinism_and_round_trip():
    rng = np.random.default_rng(7)
    lengths = rng.integers(100, 2 * CAP, 200)
    a = plan_batch(lengths, 32, COST)
    b = plan_batch(lengths.tolist(), 32, COST)

    def strip(p):
        d = p.to_dict()
        d["solver"].pop("solve_ms")
        d["solver"].pop("solve_cpu_ms")
        return json.dumps(d)

    assert strip(a) == strip(b)
    assert Plan.from_json(a.to_json()) == a
    assert Plan.from_json(json.loads(a.to_json())) == a


# ------------------------------------------------------------------------------ bad input
def test_bad_input_errors_name_the_problem():
    with pytest.raises(PlanningError, match=r"sample 1 has 9000000 tokens but all 4 ranks hold at most \d+ tokens"):
        plan_batch([10, 9_000_000, 20], 4, COST)
    with pytest.raises(PlanningError, match="empty batch"):
        plan_batch([], 4, COST)
    with pytest.raises(PlanningError, match="num_ranks must be a positive integer, got 0"):
        plan_batch([10], 0, COST)
    with pytest.raises(ValueError, match="sample 2: length must be >= 0, got -3"):
        plan_batch([10, 20, -3], 4, COST)
    with pytest.raises(PlanningError, match="unknown strategy 'greedy'; known strategies: dhp"):
        plan_batch([10], 4, COST, "greedy")
    with pytest.raises(PlanningError, match="the degree must be an integer or 'best'"):
        plan_batch([10], 4, COST, "static-ring:x")
    with pytest.raises(PlanningError, match="etas has 1 entries for a batch of 2"):
        plan_batch([10, 20], 4, COST, etas=[0.5])
    with pytest.raises(PlanningError, match="num_micro_batches must be an integer in 1..2"):
        plan_batch([10, 20], 4, COST, num_micro_batches=5)
    from dhp_jax.planner.cost.memory import max_tokens_per_rank
    cap = int(max_tokens_per_rank(COST))    # five samples of 0.9 of a rank's room: 4.5 ranks' worth
    with pytest.raises(PlanningError, match=r"num_micro_batches=1 is too few .*needs at least 2 micro-batches"):
        plan_batch([cap * 9 // 10] * 5, 4, COST, num_micro_batches=1)
    assert len(plan_batch([cap * 9 // 10] * 5, 4, COST, num_micro_batches=2).micro_batches) == 2
    with pytest.raises(ValueError, match="degrees must be 'any', 'pow2'"):
        plan_batch([10, 20], 4, COST, degrees="odd")


def test_malformed_plan_json_is_named():
    good = plan_batch([5000, 7000, 300, 900], 4, COST, num_micro_batches=1).to_dict()
    with pytest.raises(PlanValidationError, match="schema"):
        Plan.from_json({**good, "schema": "dhp.plan/v9"})
    twice = json.loads(json.dumps(good))
    g0 = twice["micro_batches"][0]["groups"][0]
    twice["micro_batches"][0]["groups"].append({"ranks": [g0["ranks"][0]], "degree": 1, "samples": [g0["samples"][0]],
                                                "attention": "ring"})
    with pytest.raises(PlanValidationError, match="is also used by group|is also in"):
        Plan.from_json(twice)
    missing = json.loads(json.dumps(good))
    missing["micro_batches"][0]["groups"][0]["samples"] = missing["micro_batches"][0]["groups"][0]["samples"][1:] or [0]
    with pytest.raises(PlanValidationError, match="missing from every group|is also in"):
        Plan.from_json(missing, num_samples=4)
    with pytest.raises(PlanValidationError, match="does not parse"):
        Plan.from_json("{")


@pytest.mark.parametrize("strategy", ["dhp", "static-ring:best", "flexsp", "milp"])
def test_empty_sequences_are_planned(strategy):
    for lengths in ([0, 0, 0], [0, 5, 0, 7]):
        plan = plan_batch(lengths, 2, COST, strategy)
        _check(plan, lengths)


def test_strategies_listed():
    assert {"dhp", "flexsp", "milp", "static-ring:best", "static-ulysses:best"} <= set(STRATEGIES)


def test_each_strategy_takes_only_its_own_options():
    """The table: STRATEGIES lists its spellings; an option another strategy takes is refused with
    the strategy's name and its valid options; an unknown strategy lists the known ones."""
    from dhp_jax.planner.solvers.strategies import STRATEGY_TABLE

    assert STRATEGIES == tuple(s for strat in STRATEGY_TABLE.values() for s in strat.spellings())
    assert STRATEGY_TABLE["static-ring"].options == {}
    assert set(STRATEGY_TABLE["milp"].options) >= {"time_limit_s", "node_limit", "num_micro_batches"}
    with pytest.raises(PlanningError, match=r"'static-ring:4' takes no option 'num_micro_batches'; its options: none"):
        plan_batch([10, 20], 4, COST, "static-ring:4", num_micro_batches=1)
    with pytest.raises(PlanningError, match=r"'dhp' takes no option 'time_limit_s'; its options: num_micro_batches, "
                                            r"packing, degrees, node_aware, refine, attention"):
        plan_batch([10, 20], 4, COST, "dhp", time_limit_s=1.0)
    for bad in ("ring", "static-ring", "dhp:2"):
        with pytest.raises(PlanningError, match=r"unknown strategy .*known strategies: dhp, static-ring:<d>"):
            plan_batch([10, 20], 4, COST, bad)
    # options common to every strategy are still taken by a strategy without options of its own
    assert plan_batch([10, 20], 4, COST, "static-ring:2", ranks_per_node=2, every_rank=True).num_ranks == 4


def test_plan_guard_fails_only_on_a_plan_slower_than_its_tolerance(capsys):
    """`experiments.planner_speed compare`: changed plans are listed with their step-time ratios;
    it fails (1) when one is slower than `SLOWER_TOLERANCE` (0.1 %) or no longer plans, else 0."""
    from experiments.planner_speed import SLOWER_TOLERANCE, compare

    def dump(*steps):
        return [{"batch": [i], "decisions": f"plan {i}" if s is None else f"plan {i} at {s}",
                 "step_s": 1.0 if s is None else s, "solve_cpu_ms": 1.0} for i, s in enumerate(steps)]

    before = dump(None, None, None)
    assert compare(before, dump(None, 0.99, 1 + SLOWER_TOLERANCE / 2)) == 0
    out = capsys.readouterr().out
    assert "ratio 0.99000" in out and "1 of 3 plans identical" in out and "0 slower" in out
    assert compare(before, dump(None, 0.99, 1 + 2 * SLOWER_TOLERANCE)) == 1
    assert "1 slower by more than 0.1%" in capsys.readouterr().out
    assert compare(before, dump(None, float("nan"), None)) == 1  # a batch that no longer plans
    with pytest.raises(ValueError, match="other batches"):
        compare(before, dump(None, None, None)[::-1])
