"""The step-time lower bound (`dhp_jax.sim.bounds`): its premises on the pricing, its bin-packing
count, and the bound itself below every plan the planners make (small and larger batches), tight
to within 0.5 % on some of them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dhp_jax.planner import CostModel, PlanningError, plan_batch
from dhp_jax.planner.cost.memory import max_tokens_per_rank
from dhp_jax.planner.cost.pricing import group_times, sample_terms
from dhp_jax.sim import step_time
from dhp_jax.sim.bounds import _Times, lower_bound, min_bins, traffic_floor

PROFILE = "experiments/profiles/flexsp-gpt-7b-matched.json"   # no comm overlap: traffic every plan pays


def _costs():
    small = CostModel.preset("qwen3-vl-2b", "ascend-910b", ranks_per_node=4)
    return {"ascend": small.replace(memory_budget=small.mem_per_token * 40_000),
            "cpu": CostModel.preset("internvl3-2b", "cpu", ranks_per_node=4),   # padded attention, lanes
            "no-overlap": CostModel.from_profile(PROFILE).replace(ranks_per_node=4)}


@pytest.fixture(scope="module")
def costs():
    return _costs()


def _kinds(cost, d):
    out = [("ring", None)] + ([("ulysses", None)] if cost.num_heads % d == 0 else [])
    return out + [("hybrid", u) for u in range(2, d // 2 + 1) if d % u == 0 and cost.num_heads % u == 0]


def test_premises_on_random_groups(costs):
    """(P1): d (T - b1) >= sum of w_k over the group, traffic floor included, for every kind and
    link class; (P2): f_G never exceeds the priced time and never drops when a sequence joins."""
    rng = np.random.default_rng(0)
    for name, cost in costs.items():
        N = 12
        cap = max_tokens_per_rank(cost)
        L = rng.integers(50, int(2 * cap), 9).astype(float)
        E = rng.uniform(0, 1, 9) * (rng.random(9) < 0.6)
        attn, lin, tok = sample_terms(cost, L, E)
        kappa = traffic_floor(cost, N)
        times = _Times(cost, attn, lin, tok, N)
        a_floor = cost.a1 * L * L if (cost.geometry.bucket_min and cost.padded_attention) else attn
        for size in (1, 2, 3):
            for G in itertools.combinations(range(9), size):
                idx = list(G)
                A, B, S = attn[idx].sum(), lin[idx].sum(), tok[idx].sum()
                f = times.curve(G)
                need = int(np.ceil(S / cap - 1e-12))  # the group's memory-minimal degree
                assert np.all(np.isinf(f[: max(0, need - 1)]))
                for d in range(max(1, need), N + 1):
                    for inter in (d > cost.ranks_per_node, True):
                        for kind, u in _kinds(cost, d):
                            T = float(group_times(cost, A, B, S, d, inter, kind, ulysses=u))
                            assert f[d - 1] <= T * (1 + 1e-12), (name, G, d, kind)
                            w = a_floor[idx].sum() + lin[idx].sum() + kappa[d - 1] * S
                            assert d * (T - cost.b1) >= w * (1 - 1e-12), (name, G, d, kind)
                for j in set(range(9)) - set(G):
                    more = times.curve(tuple(sorted(G + (j,))))
                    ok = np.isfinite(more)
                    assert np.all(more[ok] >= f[ok] * (1 - 1e-12)), (name, G, j)
        assert kappa[0] == 0.0 and np.all(np.diff(kappa) >= 0)
    assert traffic_floor(costs["no-overlap"], 12)[-1] > 0  # inter-node traffic is never free there
    # where one more token moves the stream to the next bucket the chunk shrinks and the priced
    # linear work drops (512 -> 513 tokens on 3 ranks: 172 -> 171 tokens a rank): f stays monotone
    cost = costs["ascend"].replace(kv_bytes_per_token=0.0, a2a_bytes_per_token=0.0, lat_intra=0.0, lat_inter=0.0)
    L = np.array([512.0, 1.0])
    attn, lin, tok = sample_terms(cost, L)
    assert group_times(cost, attn.sum(), lin.sum(), 513.0, 3) < group_times(cost, attn[0], lin[0], 512.0, 3)
    times = _Times(cost, attn, lin, tok, 6)
    assert np.all(times.curve((0, 1)) >= times.curve((0,)))


def _optimal_bins(sizes, capacity):
    for m in range(1, len(sizes) + 1):
        for assign in itertools.product(range(m), repeat=len(sizes)):
            loads = np.bincount(assign, sizes, minlength=m)
            if loads.max() <= capacity:
                return m
    return len(sizes)


def test_min_bins_below_the_bin_packing_optimum():
    rng = np.random.default_rng(1)
    tight = 0
    for _ in range(40):
        sizes = rng.integers(1, 100, int(rng.integers(1, 7))).astype(float)
        got, opt = min_bins(sizes, 100.0), _optimal_bins(sizes, 100.0)
        assert got <= opt, (sizes.tolist(), got, opt)
        tight += got == opt
    assert tight >= 30  # the L2 bound meets the optimum on most small instances
    assert min_bins([60.0, 60.0, 60.0], 100.0) == 3  # three items over half a bin: three bins, not two


def _small_instances(count, seed):
    rng = np.random.default_rng(seed)
    names = list(_costs())
    for i in range(count):
        cost = _costs()[names[i % len(names)]]
        N = int(rng.integers(3, 9))
        K = int(rng.integers(1, 11))
        cap = max_tokens_per_rank(cost)
        L = np.exp(rng.uniform(np.log(100), np.log(1.6 * N * cap if i % 4 == 0 else cap), K)).astype(np.int64)
        L = np.minimum(L, int(0.9 * N * cap))
        E = rng.uniform(0, 1, K) * (rng.random(K) < 0.6)
        yield cost, N, L, E


STRATEGIES = ("dhp", "static-ring:best", "static-ulysses:best")


def test_bound_below_every_plan_on_small_batches():
    """3-8 ranks, <= 10 sequences: the bound is below the exact MILP's plan and every other planner's;
    on some batch the best plan is within 0.5 % of it (so a bound 1 % too tight fails here)."""
    closest = np.inf
    for cost, N, L, E in _small_instances(24, seed=2):
        lb = lower_bound(L, N, cost, E).step_s
        plans = []
        for s in STRATEGIES:
            try:
                plans.append(plan_batch(L, N, cost, s, etas=E))
            except PlanningError:  # a static degree that cannot hold the longest sequence
                assert s != "dhp"
        plans.append(plan_batch(L, N, cost, "milp", etas=E, node_limit=2_000))
        best = min(step_time(p, L, cost, E) for p in plans)
        assert lb <= best * (1 + 1e-12), (N, L.tolist(), lb, best)
        closest = min(closest, best / lb)
    assert closest <= 1.005, closest


@pytest.mark.parametrize("model, mix, ranks, batch, profile", [
    ("internvl3-8b", "openvid", 32, 128, None), ("qwen3-vl-8b", "text-longtail", 16, 64, None),
    ("qwen3-vl-8b", "openvid", 24, 96, None), (None, "openvid", 32, 48, PROFILE)])
def test_bound_below_every_plan_on_larger_batches(model, mix, ranks, batch, profile):
    from dhp_jax.data import make_dataset, sample_etas, sample_lengths
    cost = CostModel.from_profile(profile) if profile else CostModel.preset(model, "ascend-910b", ranks_per_node=8)
    samples = make_dataset(mix, batch, 7)
    L, E = sample_lengths(samples), sample_etas(samples)
    lb = lower_bound(L, ranks, cost, E)
    assert lb.micro_batch_s >= max(lb.work_s, lb.longest_s)
    for s in STRATEGIES + (("flexsp",) if profile else ()):  # FlexSP's MILP once: the costly planner
        try:
            t = step_time(plan_batch(L, ranks, cost, s, etas=E), L, cost, E)
        except PlanningError:  # no static (or power-of-two) degree holds the longest sequence
            assert s != "dhp"
            continue
        assert lb.step_s <= t * (1 + 1e-12), (s, lb, t)


def test_micro_batch_structure_binds_where_long_sequences_span_nodes():
    """Four nodes of two ranks: sequences that must span nodes pay traffic that grows with
    their degree, so their micro-batch outlasts its share of the work; the structure bound is then
    above the work and longest-sequence bounds, still below the plans, and met by DHP's plan on
    the batch of two such sequences."""
    cost = CostModel.from_profile(PROFILE).replace(ranks_per_node=2)
    cap = int(max_tokens_per_rank(cost))
    batches = ([5 * cap, 5 * cap] + [500] * 4, [int(3.5 * cap)] * 3 + [300] * 3, [int(2.5 * cap)] * 2)
    for i, L in enumerate(batches):
        lb = lower_bound(L, 8, cost)
        assert lb.micro_batch_s > max(lb.work_s, lb.longest_s) * (1 + 1e-3), (i, lb)
        ts = [step_time(plan_batch(L, 8, cost, s, **opts), L, cost)
              for s, opts in (("dhp", {}), ("milp", {"node_limit": 2_000}))]
        assert lb.step_s <= min(ts) * (1 + 1e-12), (i, lb, ts)
        if i == 2:
            assert ts[0] == pytest.approx(lb.step_s, rel=1e-9)
    # with enough short work to fill the ranks the long sequence leaves, the structure term is the
    # work bound: the rest's work absorbs the long sequence's slack
    for L in ([5 * cap] * 2 + [1000] * 12, [5 * cap] * 2 + [600] * 20):
        lb = lower_bound(L, 8, cost)
        assert lb.micro_batch_s == pytest.approx(lb.work_s, rel=1e-12), lb
