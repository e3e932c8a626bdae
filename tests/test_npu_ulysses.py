"""The torch backend runs Ulysses and hybrid groups: a real gloo world of 8 processes runs plans
that mix ring, Ulysses and hybrid groups; loss and gradients equal JAX `reference_loss`; the
all-to-all is point-to-point on the world group, so 20 steps of changing plans create no process
group. One world runs every check (process start-up dominates on the shared CPUs)."""

from __future__ import annotations

import numpy as np
import pytest

from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan
from npu_backend.launch import run_world
from test_npu_executor import _check_exact, _exactness_worker, _setup
from test_npu_model import reference_case

PLANS = {
    # ring 2 + Ulysses 2 + hybrid 2x2, then Ulysses 2 + hybrid 2x3 (other degrees)
    "ring2+ulysses2+hybrid2x2 / ulysses2+hybrid2x3": Plan(8, (
        MicroBatch((Group((0, 1), 2, (0, 1)), Group((2, 3), 2, (2, 3), attention="ulysses"),
                    Group((4, 5, 6, 7), 4, (4, 5), attention="hybrid:2x2"))),
        MicroBatch((Group((1, 0), 2, (6,), attention="ulysses"),
                    Group((2, 3, 4, 5, 6, 7), 6, (7,), attention="hybrid:2x3"))))),
    # 4 query heads on 4 ranks with 2 KV heads (repeated) and a 2-head vision encoder (padded)
    "ulysses4+hybrid2x2": Plan(8, (
        MicroBatch((Group((3, 2, 1, 0), 4, (0, 1, 2, 3), attention="ulysses"),
                    Group((4, 6, 5, 7), 4, (4, 5, 6, 7), attention="hybrid:2x2"))),)),
}
RING = Plan(8, (MicroBatch((Group((0, 1, 2), 3, (0, 1, 2)), Group((3, 4, 5, 6, 7), 5, (3, 4, 5, 6, 7)))),))


def _worker(rank: int, world: int, config, params, samples, plans) -> dict:
    import torch
    from torch.distributed import distributed_c10d as c10d

    pgs = c10d.get_pg_count()
    out = _exactness_worker(rank, world, config, params, samples, plans)
    model, ex = _setup(config, params)
    cycle = [*plans.values(), RING]
    losses = []
    for step in range(20):
        losses.append(ex.step(cycle[step % len(cycle)], samples).loss)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.05)
    out["run"] = {"pg_before": pgs, "pg_after": c10d.get_pg_count(), "losses": losses, "sent": ex.tensors_sent}
    return out


def test_world8_ulysses_and_hybrid_plans_match_reference_with_no_new_process_group():
    pytest.importorskip("torch")
    config, params, samples, ref_loss, ref_grads = reference_case()
    res = run_world(_worker, 8, (config, params, samples, PLANS), timeout=300)
    _check_exact(res, PLANS, ref_loss, ref_grads)
    for r, o in enumerate(res):
        run = o["run"]
        assert run["pg_after"] == run["pg_before"], f"rank {r} created a process group"
        assert run["losses"] == res[0]["run"]["losses"] and np.isfinite(run["losses"]).all()
        assert run["sent"] > 0, f"rank {r} exchanged nothing"
