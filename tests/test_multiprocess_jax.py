"""Multi-process JAX: `dhp train` as 2 processes x 4 fake CPU devices under `jax.distributed` (gloo).

The two processes resume a run that one process started (its checkpoint, written by one process
on 8 devices) and replay plans whose CP groups span both (a 3-group on ranks 2,3,4 across the
boundary between process 0's devices 0-3 and process 1's devices 4-7, and a 5-group 5,6,7,0,1),
then a group inside process 1 alone, and must give the losses of the single-process run on 8
devices, to the project's fp32 1e-5; each process compiles only the groups that touch its devices.
In the same processes, the same checkpoint resumes at tensor parallelism t = 2 (4 ranks of 2
devices, a rank's devices in one process; the t = 1 state converted to the t = 2 layout by both
processes) with a group spanning both and other plans: the same losses again (DHP is exact).
(Two processes starting a run from scratch, planning live: tests/test_multiprocess_live.py.)
A process that dies must not leave its peer hanging: the peer ends within a short timeout with
a message naming the step and the missing process, whether the death comes before the step's
plan agreement or inside the step's collective. Also the set-up from flags and cluster env.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan
from dhp_jax.train.distributed import (DistributedConfig, DistributedError, expand_nodelist, resolve, slurm_port)
from npu_backend.launch import free_port

BATCH = 8
OVERRIDES = ["model=tiny", "steps=3", f"data.batch_size={BATCH}", "data.max_tokens=48", "data.num_classes=4",
             "optim.learning_rate=0.01", "optim.warmup_steps=1", "compare.enabled=false", "metrics.progress=false",
             "min_bucket=256"]


def _plans(path):
    three, five = (2, 3, 4), (5, 6, 7, 0, 1)      # process 0 holds ranks 0-3, process 1 ranks 4-7
    plans = [Plan(8, (MicroBatch((Group(three, 3, (0, 5, 7)), Group(five, 5, (1, 2, 3, 4, 6)))),)),
             Plan(8, (MicroBatch((Group(five, 5, (0, 1, 2)), Group(three, 3, (3, 4, 5, 6, 7)))),)),
             # then a group inside process 1 alone: process 0 neither compiles nor runs it, its
             # devices contribute zero rows to that micro-batch
             Plan(8, (MicroBatch((Group(three, 3, (2, 6)), Group(five, 5, (0, 4, 7)))),
                      MicroBatch((Group((4, 5, 6), 3, (1, 3, 5)),)),))]
    path.write_text(json.dumps({"plans": [p.to_dict() for p in plans]}))
    return path


def _tp_plans(path):
    """Plans of 4 ranks of 2 devices (t = 2): process 0 holds ranks 0-1 (devices 0-3), process 1
    ranks 2-3 (devices 4-7), each rank's two devices in one process; the one group (a ring
    1, 2, 3, 0, one program) spans both."""
    ring = (1, 2, 3, 0)
    plans = [Plan(4, (MicroBatch((Group(ring, 4, tuple(range(BATCH))),)),))] * 3
    path.write_text(json.dumps({"plans": [p.to_dict() for p in plans]}))
    return path


# The pair's worker: the set-up of `dhp train` (4 fake devices per process, jax.distributed), then
# the runs given as JSON lists of overrides, each resumed from its checkpoint, in the same processes.
_PAIR = textwrap.dedent("""
    import json, sys
    pid, port, runs = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    from dhp_jax.devices import force_cpu_devices
    force_cpu_devices(4)
    from dhp_jax.train import distributed as D
    D.initialize(D.resolve(f"127.0.0.1:{port}", 2, pid), timeout_s=120)
    from dhp_jax.train.train_config import load_config
    from dhp_jax.train.trainer import Trainer
    for overrides in runs:
        Trainer(load_config(overrides=overrides), step_timeout_s=120).run(resume=True)
""")


def _env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    for k in [k for k in env if k.startswith(("SLURM_", "DHP_COORDINATOR", "DHP_NUM_PROC", "DHP_PROCESS",
                                              "JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS"))]:
        del env[k]
    return env


def _run_together(cmds: list[list[str]], cwd, timeout: float) -> list[tuple[int, str]]:
    """Start the processes together; (exit code, output) of each; never waits past `timeout`."""
    procs = [subprocess.Popen(c, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c in cmds]
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            try:
                text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                text, _ = p.communicate()
                raise AssertionError(f"process still running after {timeout} s (hang):\n{text[-3000:]}") from None
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


def _outputs(procs: list, timeout: float = 240) -> list[str]:
    """Each process's output once it ends (killed, with what it printed, if it outlives `timeout`)."""
    texts = []
    for p in procs:
        try:
            texts.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            texts.append(p.communicate()[0])
    return texts


def _train_cmd(pid: int, port: int, out_dir, plan_file=None, *extra: str) -> list[str]:
    source = f"planner.plan_file={plan_file}" if plan_file else "planner.strategy=dhp"
    return [sys.executable, "-m", "dhp_jax", "train", *OVERRIDES, *extra, f"metrics.out_dir={out_dir}",
            source, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
            "--process-id", str(pid), "--step-timeout", "120"]


def test_a_single_process_run_resumes_as_two_processes(tmp_path):
    """One process on 8 devices takes step 1 and checkpoints; two processes x 4 devices resume
    from that checkpoint (each reads only its shards of the single-process save) and take steps
    2-3, whose groups span both processes, while the single process resumes too: the same losses
    to the project's fp32 1e-5; each process compiles only the groups that touch its devices."""
    import shutil

    import jax

    from dhp_jax.train.checkpoint import Checkpointer
    from dhp_jax.train.train_config import load_config
    from dhp_jax.train.metrics import read_jsonl
    from dhp_jax.train.trainer import Trainer

    plan_file = _plans(tmp_path / "plans.json")
    single_cfg = load_config(overrides=[*OVERRIDES, f"metrics.out_dir={tmp_path / 'single'}",
                                        f"planner.plan_file={plan_file}", "compilation_cache=null"])
    single = Trainer(single_cfg)
    first = single.run(stop_after=1)
    multi, multi_tp = tmp_path / "multi", tmp_path / "multi_tp"
    for d in (multi, multi_tp):
        shutil.copytree(tmp_path / "single", d)
    tp_plans = _tp_plans(tmp_path / "tp_plans.json")
    tp = ["parallel.tensor=2", "num_ranks=4", f"planner.plan_file={tp_plans}"]
    runs = [[*OVERRIDES, f"metrics.out_dir={multi}", f"planner.plan_file={plan_file}", "compilation_cache=null"],
            [*OVERRIDES, f"metrics.out_dir={multi_tp}", *tp, "compilation_cache=null"]]
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _PAIR, str(pid), str(port), json.dumps(runs)],
                              cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for pid in (0, 1)]
    try:
        # The reference resumes here (8 fake devices, one process) while the pair compiles; its
        # executor already holds step 1's group programs.
        rest = Trainer(single_cfg, executor=single.executor).run(resume=True)
    finally:
        texts = _outputs(procs)
    for p, text in zip(procs, texts):
        assert p.returncode == 0, text[-4000:]
    assert texts[0].count("dhp train: resumed from step 1 (checkpoint ") == 2
    ref_records = first.records + rest.records
    ref_losses = [r["loss"] for r in ref_records]
    per_process = [read_jsonl(multi / "metrics.jsonl"), read_jsonl(multi / "process-1" / "metrics.jsonl")]
    assert [r["step"] for r in per_process[0]] == [1, 2, 3]     # step 1: the single process's record
    assert [r["step"] for r in per_process[1]] == [2, 3]
    for recs in per_process:
        assert [r["degrees"] for r in recs[-2:]] == [[[5, 3]], [[3, 5], [3]]]
        assert [r["plan_hash"] for r in recs[-2:]] == [r["plan_hash"] for r in rest.records]
    # executables built per process: only the groups touching its devices (the reference builds 3)
    assert [recs[-1]["num_compiles"] for recs in per_process] == [2, 3]
    losses0, losses1 = ([r["loss"] for r in recs[-2:]] for recs in per_process)
    assert losses0 == losses1                        # one replicated value, read by each process
    assert len(set(ref_losses)) == 3 and all(np.isfinite(ref_losses))
    np.testing.assert_allclose(losses0, ref_losses[1:], rtol=1e-5, atol=0)
    np.testing.assert_allclose([r["grad_norm"] for r in per_process[0][1:]], [r["grad_norm"] for r in rest.records],
                               rtol=1e-5, atol=0)
    # The final checkpoint, written by both processes through orbax, holds the single-process weights.
    restored = Checkpointer(multi / "checkpoints").restore(rest.state, rest.summary["model_config"])
    assert restored.step == 3
    for a, b in zip(jax.tree.leaves(restored.state.params), jax.tree.leaves(rest.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    print("1 -> 2 processes: losses", losses0, "vs one process", ref_losses[1:], "max rel diff",
          float(np.max(np.abs(np.subtract(losses0, ref_losses[1:])) / np.abs(ref_losses[1:]))))

    # t = 2: the pair's steps 2-3 (every group across the processes, other plans) give the
    # reference's losses and gradient norms: a step's loss is a function of the params and the batch
    tp_records = [read_jsonl(multi_tp / "metrics.jsonl")[1:], read_jsonl(multi_tp / "process-1" / "metrics.jsonl")]
    for recs in tp_records:
        assert [r["step"] for r in recs] == [2, 3] and [r["degrees"] for r in recs] == [[[4]]] * 2
        np.testing.assert_allclose([r["loss"] for r in recs], rest.losses, rtol=1e-5, atol=0)
        np.testing.assert_allclose([r["grad_norm"] for r in recs], [r["grad_norm"] for r in rest.records],
                                   rtol=1e-5, atol=0)
    assert [recs[-1]["num_compiles"] for recs in tp_records] == [1, 1]   # the group touches both processes
    # its final checkpoint, written at t = 2 by both processes and read by the torch backend's
    # reader (the t = 2 record joins the shares), holds the reference's params
    from npu_backend.weights import flatten_tree, load_jax_checkpoint
    got = load_jax_checkpoint(multi_tp)
    assert got.step == 3 and got.meta["layout"]["tensor_parallel"] == 2
    got = flatten_tree(got.params)
    want = flatten_tree(jax.device_get(single.executor.unshard(rest.state.params)))
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    print("t = 2 pair: losses", [r["loss"] for r in tp_records[0]], "vs one process at t = 1", rest.losses)


# A worker that runs the real StepSync between two processes with a real cross-process collective
# (a sum over a mesh of both processes' devices) inside each step's watch; in each mode one process
# dies at step 2 (before publishing its plan hash, or inside the step's device work), or the two
# publish different plans at step 2.
_WORKER = textwrap.dedent("""
    import os, sys, time
    pid, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    from dhp_jax.train import distributed as D
    D.initialize(D.resolve(f"127.0.0.1:{port}", 2, pid), timeout_s=60)
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("x",))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    def global_sum(step):
        x = jax.make_array_from_callback((4,), NamedSharding(mesh, P("x")), lambda i: np.full(1, step, np.float32))
        return float(total(x))
    global_sum(0)       # compile and connect before the guarded steps (a shared CPU can be slow)
    def die_after_peers_step_1():
        # the peer's step-1 collective must be over first (else its all-reduce, not the guarded
        # step 2, sees the socket close): wait for its mark, then die between steps
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{mode}.{1 - pid}.step1") and time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(9)
    sync = D.StepSync(TIMEOUT)
    try:
        for step in (1, 2, 3):
            if pid == 1 and step == 2 and mode == "before-agree":
                die_after_peers_step_1()
            if pid == 0 and step == 2 and mode == "coordinator-dies":
                die_after_peers_step_1()
            sync.agree(step, "planB" if mode == "mismatch" and pid == 1 and step == 2 else "planA")
            with sync.watch(step):
                if pid == 1 and step == 2 and mode == "in-step":
                    os._exit(9)
                print(f"process {pid} step {step} sum {global_sum(step)}", flush=True)
            if step == 1:
                open(f"{mode}.{pid}.step1", "w").close()
    except D.PlanMismatchError as e:   # every process is alive: a normal exit (jax's shutdown barrier)
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        sys.exit(3)
    except D.DistributedError as e:    # a peer is gone: the shutdown barrier would wait for it
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        os._exit(3)
""").replace("TIMEOUT", "4.0")
MODES = ("before-agree", "in-step", "mismatch", "coordinator-dies")


def test_dead_or_disagreeing_peer_ends_the_run_naming_step_and_process(tmp_path):
    t0 = time.monotonic()
    ports = {mode: free_port() for mode in MODES}
    outs = _run_together([[sys.executable, "-c", _WORKER, str(pid), str(ports[mode]), mode]   # all pairs at once
                      for mode in MODES for pid in (0, 1)], tmp_path, timeout=120)
    assert time.monotonic() - t0 < 120
    res = {mode: (outs[2 * i], outs[2 * i + 1]) for i, mode in enumerate(MODES)}

    (rc0, out0), (rc1, out1) = res["mismatch"]
    assert "process 0 step 1 sum 4.0" in out0 and "process 1 step 1 sum 4.0" in out1   # step 1 agreed
    for rc, out in ((rc0, out0), (rc1, out1)):
        assert rc == 3, out[-3000:]
        assert ("ERROR PlanMismatchError: step 2: the processes derived different plans "
                "(processes [0] planned planA; processes [1] planned planB)") in out, out[-3000:]

    # Process 0 hosts the coordination service: the survivor cannot even publish its plan. Either
    # our check reports it or jax's own error polling ends the process first (a race); never a hang.
    (rc0, out0), (rc1, out1) = res["coordinator-dies"]
    assert rc0 == 9 and rc1 != 0 and "process 1 step 1 sum 4.0" in out1, out1[-3000:]
    assert ("step 2: process 1 cannot reach the coordination service, which process 0 hosts" in out1
            or "Terminating process because the JAX distributed service detected fatal errors" in out1), out1

    for mode in ("before-agree", "in-step"):
        (rc0, out0), (rc1, out1) = res[mode]
        assert rc1 == 9, out1[-3000:]
        assert "process 0 step 1 sum 4.0" in out0 and "process 0 step 2" not in out0, out0[-3000:]
    (rc0, out0), _ = res["before-agree"]
    assert rc0 == 3, out0[-3000:]
    assert ("ERROR StepTimeoutError: step 2: process 1 did not report its plan within 4 s; "
            "processes missing at step 2: [1]") in out0, out0[-3000:]
    (rc0, out0), _ = res["in-step"]     # process 0 is blocked inside the step's collective: its watchdog ends it
    assert rc0 == 75, out0[-3000:]
    assert ("step 2: process 0 waited 4 s for the step's device work; processes that did not finish "
            "step 2: [1]") in out0, out0[-3000:]


def test_resolve_from_flags_and_environment():
    assert resolve(env={}) is None
    assert resolve(env={"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n1"}) is None
    flags = resolve("10.0.0.1:1234", 4, 3, env={"JAX_PROCESS_ID": "1"})
    assert (flags.coordinator, flags.num_processes, flags.process_id) == ("10.0.0.1:1234", 4, 3)
    env = resolve(env={"DHP_COORDINATOR": "h:9", "DHP_NUM_PROCESSES": "2", "DHP_PROCESS_ID": "1"})
    assert (env.coordinator, env.num_processes, env.process_id) == ("h:9", 2, 1)
    jax_env = resolve(env={"JAX_COORDINATOR_ADDRESS": "h:7", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "2"})
    assert (jax_env.num_processes, jax_env.process_id, jax_env.source) == (
        3, 2, "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID")
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "16", "SLURM_PROCID": "5",
             "SLURM_STEP_NODELIST": "gpu-[007-009,012],cpu1", "SLURM_JOB_NODELIST": "other"}
    s = resolve(env=slurm)
    assert (s.coordinator, s.num_processes, s.process_id) == (f"gpu-007:{4242 % 4096 + 61440}", 16, 5)
    assert slurm_port("4242") == 4242 % 4096 + 61440
    assert resolve(env={**slurm, "DHP_COORDINATOR_PORT": "5000"}).coordinator == "gpu-007:5000"
    assert resolve(env={**slurm, "DHP_COORDINATOR": "head:1"}).coordinator == "head:1"   # DHP_* wins
    assert expand_nodelist("gpu-[007-009,012],cpu1") == ["gpu-007", "gpu-008", "gpu-009", "gpu-012", "cpu1"]
    assert expand_nodelist("r[1-2]n[3-4]") == ["r1n3", "r1n4", "r2n3", "r2n4"]
    assert expand_nodelist("a") == ["a"]


@pytest.mark.parametrize("kwargs, env, match", [
    ({"num_processes": 2}, {}, "coordinator, process_id not given"),
    ({}, {"DHP_COORDINATOR": "h:1", "DHP_NUM_PROCESSES": "x", "DHP_PROCESS_ID": "0"},
     "DHP_NUM_PROCESSES='x' is not an integer"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, {}, r"process_id 2 is outside 0\.\.1"),
    ({"coordinator": "nohost", "num_processes": 2, "process_id": 0}, {}, "'nohost' is not HOST:PORT"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 0}, {"JAX_LOCAL_DEVICE_IDS": "0,a"},
     "JAX_LOCAL_DEVICE_IDS='0,a' is not a comma-separated list"),
    ({}, {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "n[1-2"}, r"unbalanced '\['"),
    ({}, {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "n[1-2]"}, "set DHP_COORDINATOR_PORT"),
    ({}, {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n[3-1]"},
     "runs backwards"),
])
def test_resolve_rejects_bad_setups(kwargs, env, match):
    with pytest.raises(DistributedError, match=match):
        resolve(**kwargs, env=env)


def test_config_is_validated():
    with pytest.raises(DistributedError, match="num_processes must be >= 1"):
        DistributedConfig("h:1", 0, 0, "test")


def test_dhp_train_stops_cleanly_on_plan_mismatch_and_missing_peer(tmp_path):
    """End to end through `dhp train`: different data on process 1 -> different plans at step 1 ->
    both processes stop with the error (before compiling any group program); a peer that never
    starts -> process 0 ends after the join timeout instead of waiting forever."""
    pair_port, alone_port = free_port(), free_port()

    def cmd(port: int, pid: int, out: str, *extra: str, timeout: str = "60") -> list[str]:
        return [sys.executable, "-m", "dhp_jax", "train", *OVERRIDES, "planner.strategy=dhp",
                f"metrics.out_dir={tmp_path / out}", *extra, "--coordinator", f"127.0.0.1:{port}",
                "--num-processes", "2", "--process-id", str(pid), "--step-timeout", timeout]

    t0 = time.monotonic()
    (rc0, out0), (rc1, out1), (rc, out) = _run_together(     # all three at once: both cases together
        [cmd(pair_port, 0, "m"), cmd(pair_port, 1, "m", "data.seed=1"), cmd(alone_port, 0, "alone", timeout="2")],
        tmp_path, timeout=120)
    for rc_, out_ in ((rc0, out0), (rc1, out1)):
        assert rc_ == 2, out_[-3000:]
        assert "dhp train: step 1: the processes derived different plans (processes [0] planned " in out_, out_[-3000:]

    # jax's runtime ends the process when registration times out (its own fatal error, not ours);
    # our line before joining says which process waited for whom.
    assert rc != 0 and time.monotonic() - t0 < 120
    assert (f"dhp train: process 0 of 2, coordinator 127.0.0.1:{alone_port} (from flag --coordinator, flag "
            "--num-processes, flag --process-id): joining, waiting up to 2 s for all 2 processes") in out, out[-3000:]
    assert "DEADLINE_EXCEEDED" in out and "RegisterTask" in out, out[-3000:]
