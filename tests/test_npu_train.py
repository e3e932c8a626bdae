"""`torchrun -m npu_backend.train` replays a plan file on gloo; a plan for another world size fails cleanly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np

from dhp_jax.planner.plan import Group, MicroBatch, Plan


def _torchrun(nproc: int, args: list[str], cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", DHP_TORCH_DEVICE="cpu", OMP_NUM_THREADS="1")
    exe = shutil.which("torchrun")
    cmd = ([exe] if exe else [sys.executable, "-m", "torch.distributed.run"])
    cmd += ["--standalone", "--nproc-per-node", str(nproc), "-m", "npu_backend.train", *args]
    # Own session, so that on a timeout the whole tree (torchrun and its ranks) is killed.
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun did not finish in 240 s:\n{out[-2000:]}\n{err[-2000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _plan(num_ranks: int, *mbs) -> dict:
    return Plan(num_ranks, tuple(MicroBatch(tuple(Group(tuple(r), len(r), tuple(s)) for r, s in mb))
                                 for mb in mbs)).to_dict()


def test_torchrun_replays_plan_file_and_rejects_wrong_world(tmp_path):
    plans = [_plan(2, [([1, 0], [0, 1, 2, 3])]),
             _plan(2, [([1], [1, 2]), ([0], [3])], [([0, 1], [0])])]
    (tmp_path / "plans.json").write_text(json.dumps(plans))
    common = ["--batch-size", "4", "--min-len", "10", "--max-len", "40", "--optimizer", "sgd", "--lr", "0.1"]
    out = _torchrun(2, [*common, "--plan-file", str(tmp_path / "plans.json"), "--steps", "3",
                        "--json", str(tmp_path / "m.json"), "--save-weights", str(tmp_path / "w.npz")], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rec = json.loads((tmp_path / "m.json").read_text())
    assert rec["world_size"] == 2 and rec["measured_on"].startswith("cpu (gloo)")
    steps = rec["steps"]
    assert [s["degrees"] for s in steps] == [[[2]], [[1, 1], [2]], [[2]]]
    assert all(np.isfinite(s["loss"]) and s["loss_tokens"] > 0 for s in steps)
    with np.load(tmp_path / "w.npz") as z:
        assert "layers_0/attn/q/kernel" in z.files

    # A plan for 3 ranks on a world of 2: every rank reports the mismatch and the run ends (no hang).
    (tmp_path / "plan3.json").write_text(json.dumps(_plan(3, [([0, 1, 2], [0, 1, 2, 3])])))
    bad = _torchrun(2, [*common, "--plan-file", str(tmp_path / "plan3.json"), "--steps", "1"], tmp_path)
    assert bad.returncode != 0
    for r in (0, 1):
        assert f"rank {r}: error: the plan is for num_ranks=3 but the world has 2 processes" in bad.stderr
