"""The simulator: cluster description, step evaluation vs an independent per-group reference, the
lower bound vs brute-force optima, speed at 4096 ranks, and `dhp simulate`."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest

from dhp_jax.planner import CostModel, Group, MicroBatch, Plan, plan_batch
from dhp_jax.planner.cost.memory import group_activation_bytes, max_tokens_per_rank
from dhp_jax.planner.cost.pricing import allreduce_time, group_time
from dhp_jax.sim import step_time
from dhp_jax.sim.bounds import _set_partitions, lower_bound
from dhp_jax.data.vision import family_for_model
from dhp_jax.sim.cluster import Cluster
from dhp_jax.sim.simulate import evaluate, make_batches, simulate


@pytest.fixture(scope="module")
def cost8() -> CostModel:
    return CostModel.preset("internvl3-8b", "ascend-910b", ranks_per_node=8)


def reference_step(plan: Plan, lengths, cost: CostModel, etas) -> float:
    """Independent of the vectorised path: one cost.time call per group, nodes from the rank ids."""
    total = 0.0
    for mb in plan.micro_batches:
        worst = 0.0
        for g in mb.groups:
            inter = len({r // plan.ranks_per_node for r in g.ranks}) > 1
            t = group_time(cost, [lengths[s] for s in g.samples], g.degree, etas=[etas[s] for s in g.samples],
                          inter_node=inter, attention=g.attention)
            worst = max(worst, t)
        total += worst
    return total + allreduce_time(cost, plan.num_ranks)


# ------------------------------------------------------------------------------------ cluster
def test_cluster_shape_and_errors():
    c = Cluster(nodes=4, ranks_per_node=8)
    assert c.num_ranks == 32 and c.vision.name == "internvl3-8b" and c.vision.family == "internvl"
    assert Cluster.with_ranks(4096).nodes == 512
    assert Cluster.with_ranks(4).ranks_per_node == 4  # less than a node: one partial node
    assert family_for_model("qwen3-vl-8b") == "qwen3-vl"
    assert Cluster(nodes=1, model="qwen3-vl-8b", video_sampling=(("fps", 1.0),)).vision.video(10, 640, 480, 30).frames == 10
    with pytest.raises(ValueError, match="nodes"):
        Cluster(nodes=0)
    with pytest.raises(ValueError, match="ranks_per_node"):
        Cluster(nodes=1, ranks_per_node=2.5)
    with pytest.raises(ValueError, match="inter_node_gbps"):
        Cluster(nodes=1, inter_node_gbps=-1)
    with pytest.raises(ValueError, match="whole number"):
        Cluster.with_ranks(20, 8)
    with pytest.raises(ValueError, match="unknown model"):
        Cluster(nodes=1, model="gpt-5").cost_model()


def test_cluster_bandwidth_overrides_reach_the_cost_model():
    base = Cluster(nodes=2).cost_model()
    slow = Cluster(nodes=2, inter_node_gbps=1.0, intra_node_gbps=10.0).cost_model()
    assert slow.bw_inter == 1e9 and slow.bw_intra == 1e9 * 10
    assert base.bw_inter != slow.bw_inter
    # a 16-rank group spans both nodes: slower network, slower group, slower all-reduce
    assert group_time(slow, [200_000], 16, inter_node=True) > group_time(base, [200_000], 16, inter_node=True)
    assert allreduce_time(slow, 16) > allreduce_time(base, 16)
    assert Cluster(nodes=1, freeze_vision=True).cost_model().freeze_vision


# ------------------------------------------------------------------------------------ evaluate
@pytest.mark.parametrize("strategy", ["dhp", "static-ring:best", "static-ulysses:best", "static-ring:4"])
def test_evaluate_matches_step_time_and_per_group_reference(cost8, strategy):
    samples = make_batches("openvid", 96, 1, 3, "internvl")[0]
    from dhp_jax.data import sample_etas, sample_lengths
    L, E = sample_lengths(samples), sample_etas(samples)
    plan = plan_batch(samples, 16, cost8, strategy, ranks_per_node=8)
    br = evaluate(plan, L, cost8, E)
    ref = reference_step(plan, L, cost8, E)
    assert br.step_s == pytest.approx(ref, rel=1e-12)
    assert br.step_s == pytest.approx(step_time(plan, L, cost8, E), rel=1e-12)
    assert 0 < br.utilisation <= 1 + 1e-12
    assert len(br.makespans_s) == len(plan.micro_batches)


def test_evaluate_inter_node_group_is_priced_on_the_network(cost8):
    # Same samples, same degree 4: ranks 0-3 (one node) vs ranks 6-9 (two nodes).
    # short sequences: little attention to hide the ring traffic behind, so the link shows
    L, E = [2_000] * 8, [0.0] * 8
    def plan(ranks):
        return Plan(num_ranks=16, ranks_per_node=8, micro_batches=(MicroBatch((Group(ranks, 4, tuple(range(8))),)),))
    t_in = evaluate(plan((0, 1, 2, 3)), L, cost8, E).step_s
    t_out = evaluate(plan((6, 7, 8, 9)), L, cost8, E).step_s
    assert t_out > t_in
    assert t_out - allreduce_time(cost8, 16) == pytest.approx(group_time(cost8, L, 4, etas=E, inter_node=True), rel=1e-12)


def test_evaluate_names_a_missing_sample(cost8):
    plan = Plan(num_ranks=2, micro_batches=(MicroBatch((Group((0,), 1, (0,)), Group((1,), 1, (5,)))),))
    with pytest.raises(ValueError, match="sample 5 is outside the batch of 3"):
        evaluate(plan, [10, 20, 30], cost8)


def test_simulate_records_every_step_on_shared_batches(cost8):
    cluster = Cluster(nodes=2)
    batches = make_batches("msrvtt", 64, 2, 0, cluster.vision)
    run = simulate(cluster, batches, "dhp", cost=cost8)
    assert run.step_s.shape == (2,) and np.all(run.step_s > 0)
    assert run.tokens.sum() == sum(s.num_tokens for b in batches for s in b)
    assert run.tokens_per_s_per_rank == pytest.approx(run.tokens.sum() / run.step_s.sum() / 16)
    s = run.summary()
    assert s["ranks"] == 16 and s["steps"] == 2
    # determinism: the same draw and cost model give the same step times
    again = simulate(cluster, make_batches("msrvtt", 64, 2, 0, cluster.vision), "dhp", cost=cost8)
    np.testing.assert_array_equal(run.step_s, again.step_s)


def test_4096_ranks_x_100_steps_evaluate_in_seconds(cost8):
    cluster = Cluster.with_ranks(4096)
    cost = cluster.cost_model()
    from dhp_jax.data import sample_etas, sample_lengths
    samples = make_batches("openvid", 4096 * 8, 1, 0, cluster.vision)[0]
    L, E = sample_lengths(samples), sample_etas(samples)
    plan = plan_batch(samples, 4096, cost, "dhp")
    t0 = time.perf_counter()
    times = [evaluate(plan, L, cost, E).step_s for _ in range(100)]
    elapsed = time.perf_counter() - t0
    assert len(set(times)) == 1
    assert elapsed < 10.0, f"100 evaluations of a 4096-rank plan took {elapsed:.1f} s"


# ------------------------------------------------------------------------------------ lower bound
def _brute_force_optimum(L, E, N, cost):
    """Least step time over every plan: micro-batch split x group split x degrees (one node)."""
    best_mb: dict[tuple, float] = {}

    def mb_time(mb):
        key = tuple(sorted(mb))
        if key in best_mb:
            return best_mb[key]
        best = np.inf
        for groups in _set_partitions(list(mb)):
            if len(groups) > N:
                continue
            for degs in itertools.product(range(1, N + 1), repeat=len(groups)):
                if sum(degs) > N:
                    continue
                ok, worst = True, 0.0
                for g, d in zip(groups, degs):
                    ls = [L[i] for i in g]
                    if group_activation_bytes(cost, ls, d) > cost.memory_budget:
                        ok = False
                        break
                    worst = max(worst, group_time(cost, ls, d, etas=[E[i] for i in g], inter_node=False))
                if ok:
                    best = min(best, worst)
        best_mb[key] = best
        return best

    opt = min(sum(mb_time(mb) for mb in split) for split in _set_partitions(list(range(len(L)))))
    return opt + allreduce_time(cost, N)


@pytest.mark.parametrize("seed", range(6))
def test_lower_bound_never_exceeds_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    # Small budget so that memory forces several micro-batches / degrees in some instances.
    cost = CostModel.preset("qwen3-vl-2b", "ascend-910b", ranks_per_node=8)
    cost = cost.replace(memory_budget=cost.mem_per_token * 60_000)
    k, N = int(rng.integers(2, 5)), int(rng.integers(1, 4))
    L = [int(x) for x in rng.integers(1_000, 60_000 * N, k)]
    E = [float(x) for x in rng.uniform(0, 1, k)]
    lb = lower_bound(L, N, cost, E)
    opt = _brute_force_optimum(L, E, N, cost)
    assert np.isfinite(opt)
    assert lb.step_s <= opt * (1 + 1e-12)
    assert lb.step_s >= 0.5 * opt  # not vacuous on these instances


def test_lower_bound_below_every_strategy_at_scale(cost8):
    from dhp_jax.data import sample_etas, sample_lengths
    samples = make_batches("openvid", 512, 1, 1, "internvl")[0]
    L, E = sample_lengths(samples), sample_etas(samples)
    lb = lower_bound(L, 64, cost8, E)
    for s in ("dhp", "static-ring:best", "static-ulysses:best"):
        assert lb.step_s <= step_time(plan_batch(samples, 64, cost8, s), L, cost8, E)


def test_lower_bound_errors(cost8):
    with pytest.raises(ValueError, match="num_ranks"):
        lower_bound([10], 0, cost8)
    with pytest.raises(ValueError, match="empty batch"):
        lower_bound([], 4, cost8)
    with pytest.raises(ValueError, match="sample 1"):
        lower_bound([10, int(max_tokens_per_rank(cost8) * 5)], 4, cost8)


# ------------------------------------------------------------------------------------ CLI
def test_dhp_simulate_cli(capsys, tmp_path):
    from dhp_jax.cli import main
    # one node of 8 ranks: a model whose state, sharded over them, fits (the default internvl3-8b's does not)
    small = ["--model", "qwen3-vl-2b"]
    assert main(["simulate", "--nodes", "1", "--batch", "24", "--steps", "1", "--json",
                 "--strategies", "dhp,static-ring:best", *small]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["label"].startswith("simulated") and [r["strategy"] for r in out["runs"]] == ["dhp", "static-ring:best"]
    assert main(["simulate", "--nodes", "1", "--batch", "24", "--steps", "1", *small]) == 0
    assert "step s" in capsys.readouterr().out
    prof = tmp_path / "cost.json"
    Cluster(nodes=1, model="qwen3-vl-2b").cost_model().replace(a1=0.0).save(prof)
    assert main(["simulate", "--nodes", "1", "--batch", "24", "--steps", "1", "--json",
                 "--cost-profile", str(prof)]) == 0
    assert "profile" in json.loads(capsys.readouterr().out)["label"]
    assert main(["simulate", "--cost-profile", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert main(["simulate", "--nodes", "0"]) == 2
    assert "nodes" in capsys.readouterr().err
    assert main(["simulate", "--nodes", "1", "--batch", "8", "--strategies", "bogus", *small]) == 2
    assert "bogus" in capsys.readouterr().err


def test_evaluate_agrees_with_step_time_on_shared_lanes():
    """With shared compute lanes (fake CPU devices) the simulator's breakdown and step_time agree."""
    from dhp_jax.planner import CostModel, plan_batch
    from dhp_jax.sim import evaluate, step_time

    cost = CostModel.preset("internvl3-2b", "cpu", ranks_per_node=8)
    assert cost.compute_lanes is not None
    lengths = [300, 40, 40, 40, 40, 40, 900, 12]
    for strategy in ("dhp", "static-ring:2", "static-ring:1"):
        plan = plan_batch(lengths, 8, cost, strategy)
        br = evaluate(plan, lengths, cost)
        assert sum(br.makespans_s) + br.allreduce_s == pytest.approx(step_time(plan, lengths, cost), rel=1e-12)
