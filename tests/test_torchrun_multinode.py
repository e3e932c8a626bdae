"""`npu_backend.train` as 2 "nodes" of 2 and 1 processes through torchrun's c10d rendezvous on localhost.

Two torchrun agents (`--nnodes 2 --node-rank 0/1`, the second told it does not host the
rendezvous store, each with its own `--nproc-per-node`) form one world of 3 ranks: ranks 0-1 on
one agent, 2 on the other. They replay plans whose CP groups span the two "nodes" (2+1 with the 2
across the boundary, in either order, and a ring 0 -> 1 -> 2 with one hop inside a node and one
across) and must give the same losses and final weights as the 3-process single-node run of the
same plans. A rank killed mid-run must not leave the other node hanging: both agents end
within a bound, and torchrun names the killed rank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan
from npu_backend.launch import free_port

ARGS = ["--batch-size", "6", "--min-len", "10", "--max-len", "40", "--optimizer", "sgd", "--lr", "0.1"]
TIMEOUT_S = 150


def _cmd(*torchrun_args: str) -> list[str]:
    exe = shutil.which("torchrun")
    return ([exe] if exe else [sys.executable, "-m", "torch.distributed.run"]) + list(torchrun_args)


def _start(cmd: list[str], cwd, log_name: str) -> subprocess.Popen:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", DHP_TORCH_DEVICE="cpu", OMP_NUM_THREADS="1")
    log = open(cwd / log_name, "w")
    # Own session: on a timeout the whole tree (agent and its ranks) is killed.
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_all(procs: dict[str, subprocess.Popen], cwd, timeout: float = TIMEOUT_S) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    codes = {}
    try:
        for name, p in procs.items():
            codes[name] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        logs = {n: (cwd / f"{n}.log").read_text()[-1500:] for n in procs}
        raise AssertionError(f"torchrun runs still going after {timeout} s: "
                             f"{[n for n, p in procs.items() if p.poll() is None]}\n{logs}") from None
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return codes


def _node(node_rank: int, port: int, run_id: str, extra: list[str], nproc: int) -> list[str]:
    conf = [] if node_rank == 0 else ["--rdzv-conf", "is_host=0"]   # both "nodes" are 127.0.0.1
    return _cmd("--nnodes", "2", "--nproc-per-node", str(nproc), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--max-restarts", "0", *conf,
                "-m", "npu_backend.train", *ARGS, *extra)


def _plans() -> list[dict]:
    def plan(*mbs):
        return Plan(3, tuple(MicroBatch(tuple(Group(tuple(r), len(r), tuple(s)) for r, s in mb)) for mb in mbs),
                    solver={"strategy": "hand"}).to_dict()

    # node 0 holds ranks 0-1, node 1 rank 2
    return [plan([((1, 2), (0, 2, 4, 5)), ((0,), (1, 3))]),                # 2 across the node boundary + 1
            plan([((2, 0), (0, 1, 5)), ((1,), (2, 3, 4))]),                 # 2 across (node 1 first) + 1
            plan([((1, 0), (0, 1, 2))], [((0, 1, 2), (3, 4, 5))])]          # inside node 0, then a ring of all 3


def _kill_a_rank_when_running(agent: subprocess.Popen, log, timeout: float = TIMEOUT_S) -> int:
    """Once the run has logged step 2, SIGKILL one rank (a child of this torchrun agent); its pid."""
    import psutil

    deadline = time.monotonic() + timeout
    while "step    2" not in log.read_text():
        if time.monotonic() > deadline or agent.poll() is not None:
            raise AssertionError(f"the doomed run never reached step 2:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    victim = sorted(psutil.Process(agent.pid).children(), key=lambda c: c.pid)[0]
    victim.kill()
    return victim.pid


def test_two_nodes_match_single_node_and_a_dead_rank_ends_both_nodes(tmp_path):
    (tmp_path / "plans.json").write_text(json.dumps(_plans()))
    common = ["--plan-file", "plans.json", "--steps", "3"]
    single = _cmd("--standalone", "--nproc-per-node", "3", "-m", "npu_backend.train", *ARGS, *common,
                  "--json", "single.json", "--save-weights", "single.npz")
    port, doomed_port = free_port(), free_port()
    multi = [*common, "--json", "multi.json", "--save-weights", "multi.npz"]
    # the doomed run: 2 nodes x 1 rank, a 2-group across the nodes every step (a file of one plan
    # serves every step; a longer file must cover the run's steps)
    (tmp_path / "plans2.json").write_text(Plan(2, (MicroBatch((Group((1, 0), 2, tuple(range(6))),)),)).to_json())
    endless = ["--plan-file", "plans2.json", "--steps", "100000"]
    # All at once (the CPU is shared; wall time matters more than their speed): the single-node
    # reference, the 2-node run, and a 2-node run that will lose a rank mid-run.
    procs = {"single": _start(single, tmp_path, "single.log"),
             "node0": _start(_node(0, port, "mn", multi, nproc=2), tmp_path, "node0.log"),
             "node1": _start(_node(1, port, "mn", multi, nproc=1), tmp_path, "node1.log"),
             "doomed0": _start(_node(0, doomed_port, "dd", endless, nproc=1), tmp_path, "doomed0.log"),
             "doomed1": _start(_node(1, doomed_port, "dd", endless, nproc=1), tmp_path, "doomed1.log")}
    try:
        victim = _kill_a_rank_when_running(procs["doomed1"], tmp_path / "doomed0.log")
        killed_at = time.monotonic()
    finally:
        codes = _wait_all(procs, tmp_path)
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in procs}
    assert codes == {"single": 0, "node0": 0, "node1": 0, "doomed0": 1, "doomed1": 1}, \
        {n: logs[n][-2000:] for n in procs}

    one, two = (json.loads((tmp_path / f).read_text()) for f in ("single.json", "multi.json"))
    assert one["world_size"] == two["world_size"] == 3
    assert [s["degrees"] for s in two["steps"]] == [[[2, 1]], [[2, 1]], [[2], [3]]]
    single_losses = [s["loss"] for s in one["steps"]]
    multi_losses = [s["loss"] for s in two["steps"]]
    assert all(np.isfinite(single_losses)) and len(set(single_losses)) == 3
    # Same ranks, same plans, same gloo reductions: the multi-node run is the single-node run.
    assert multi_losses == single_losses
    with np.load(tmp_path / "single.npz") as a, np.load(tmp_path / "multi.npz") as b:
        assert a.files == b.files
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)

    # The dead rank: its agent names it as the root cause; the other node's rank sees the closed
    # connection and fails; both agents end well within the bound instead of hanging.
    assert time.monotonic() - killed_at < 60
    assert f"exitcode  : -9 (pid: {victim})" in logs["doomed1"], logs["doomed1"][-2000:]
    assert re.search(r"Connection (closed|reset) by peer", logs["doomed0"]), logs["doomed0"][-2000:]
