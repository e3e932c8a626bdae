"""Multi-process JAX, live planning: `dhp train` as 2 processes x 4 fake CPU devices (gloo) from
scratch, each process planning every step itself, against the single-process run (its own file
so that the test-suite's workers can run it beside tests/test_multiprocess_jax.py's resume)."""

from __future__ import annotations

import subprocess

import numpy as np

from npu_backend.launch import free_port
from test_multiprocess_jax import OVERRIDES, _env, _outputs, _train_cmd


# The live test plans like the demo (8 ranks priced as 910B nodes, the batch at full token counts)
# with programs free (compile_price_s=0): at the default 3 s a program, the search's plans need 3
# new programs a step and two groups of 4 (one program, each inside a process) are priced lower
# over these 2 steps; free, the search's mixed plans are the fastest: data.seed=21's first batch
# gets a 5-group on ranks 0-4, across the process boundary, the second [[4, 1, 2, 1]]
LIVE = ["steps=2", "data.seed=21", "planner.cost_model=qwen3-vl-4b", "planner.hardware=ascend-910b",
        "planner.ranks_per_node=1", "planner.comm_overlap=false", "planner.full_size=true",
        "planner.compile_price_s=0"]


def test_two_processes_plan_live_and_match_single_process(tmp_path):
    """Each process runs the planner, the program cache and compile-ahead itself every step (no
    plan file; the single-process path): the solver's timings differ between the processes, its
    decisions do not, so the plan check passes at every step, a group spans both processes, and
    the losses are the single-process run's. Two steps: each step's plan needs new group programs,
    and two steps already check agreement after a step has run."""
    from dhp_jax.train.train_config import load_config
    from dhp_jax.train.metrics import read_jsonl
    from dhp_jax.train.trainer import Trainer

    port = free_port()
    multi = tmp_path / "multi"
    procs = [subprocess.Popen(_train_cmd(pid, port, multi, None, *LIVE), cwd=tmp_path, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for pid in (0, 1)]
    try:
        single = Trainer(load_config(overrides=[*OVERRIDES, *LIVE, f"metrics.out_dir={tmp_path / 'single'}",
                                                "planner.strategy=dhp"]))
        # the program cache places groups per process (4 ranks each in the pair): the same rule here
        single.plan_source.programs.ranks_per_process = 4
        ref = single.run()
    finally:
        texts = _outputs(procs)
    for p, text in zip(procs, texts):
        assert p.returncode == 0, text[-4000:]
    assert "dhp train: process 1 of 2, coordinator 127.0.0.1" in texts[1]     # the CLI's set-up line
    steps = len(ref.records)
    per_process = [read_jsonl(multi / "metrics.jsonl"), read_jsonl(multi / "process-1" / "metrics.jsonl")]
    for recs in per_process:
        assert [r["step"] for r in recs] == list(range(1, steps + 1))
        assert [r["strategy"] for r in recs] == ["dhp"] * steps
        assert [r["plan_hash"] for r in recs] == [r["plan_hash"] for r in ref.records]
        assert len({r["plan_hash"] for r in recs}) == steps       # a new plan every step
        assert not any(r["ran_on_compiled_substitute"] for r in recs)
    plans = [rec["plan"] for rec in read_jsonl(multi / "plans.jsonl")]
    spanning = [g["ranks"] for p in plans for mb in p["micro_batches"] for g in mb["groups"]
                if min(g["ranks"]) < 4 <= max(g["ranks"])]        # process 0 holds ranks 0-3
    assert any(len(r) > 4 for r in spanning), plans
    losses0, losses1 = ([r["loss"] for r in recs] for recs in per_process)
    assert losses0 == losses1 and len(set(ref.losses)) == steps and all(np.isfinite(ref.losses))
    np.testing.assert_allclose(losses0, ref.losses, rtol=1e-5, atol=0)
    print("two processes, live planner: steps", [r["step"] for r in per_process[0]], "losses", losses0,
          "single process", ref.losses, "degrees", [r["degrees"] for r in per_process[0]], "spanning", spanning)
