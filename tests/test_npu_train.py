"""`torchrun -m npu_backend.train` replays a plan file on gloo; a plan for another world size fails cleanly;
plan logs travel between the backends (`dhp train` replays torch's, torch replays `dhp train`'s)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np

from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan


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
             _plan(2, [([1], [1, 2]), ([0], [3])], [([0, 1], [0])]),
             _plan(2, [([0, 1], [0, 1, 2, 3])])]
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
        assert f"rank {r}: error: plan file " in bad.stderr
        assert "plan 1 (step 1): plan is for 3 ranks, the run has 2" in bad.stderr


def test_plan_logs_replay_across_backends(tmp_path):
    """torch plans live and logs its plans -> `dhp train` replays that log (and logs its own) ->
    torch replays the log `dhp train` wrote. One line format, one replay rule (step t runs the plan
    logged for step t), so all three runs run the same plans. Two ranks are enough: the static
    ring of 2 puts both in one CP group, so the logs carry a group of degree 2."""
    from dhp_jax.planner.contract.planfile import load_plan_file

    common = ["--batch-size", "8", "--min-len", "10", "--max-len", "40", "--optimizer", "sgd", "--steps", "2"]
    torch_log = tmp_path / "torch_plans.jsonl"
    out = _torchrun(2, [*common, "--strategy", "static-ring:2", "--dump-plans", str(torch_log)], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    jax_run = tmp_path / "jax"
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    train = subprocess.run([sys.executable, "-m", "dhp_jax", "train", "model=tiny", "num_ranks=2", "steps=2",
                            "data.batch_size=8",
                            "data.max_tokens=48", "data.num_classes=4", "compare.enabled=false",
                            "metrics.progress=false", "min_bucket=256", f"metrics.out_dir={jax_run}",
                            f"planner.plan_file={torch_log}"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    jax_log = jax_run / "plans.jsonl"
    back = _torchrun(2, [*common, "--plan-file", str(jax_log), "--json", str(tmp_path / "m.json")], tmp_path)
    assert back.returncode == 0, back.stdout[-3000:] + back.stderr[-3000:]
    torch_plans, jax_plans = load_plan_file(torch_log), load_plan_file(jax_log)
    assert len(torch_plans) == 2 and [p.digest() for p in torch_plans] == [p.digest() for p in jax_plans]
    assert any(g.degree > 1 for p in torch_plans for g in p.groups)      # CP groups, not only single ranks
    steps = json.loads((tmp_path / "m.json").read_text())["steps"]
    assert [s["degrees"] for s in steps] == [p.degrees for p in jax_plans]
    assert all(np.isfinite(s["loss"]) and s["loss_tokens"] > 0 for s in steps)
    print("cross-backend replay: torch plans", [p.degrees for p in torch_plans], "-> dhp train losses",
          [json.loads(line)["loss"] for line in (jax_run / "metrics.jsonl").read_text().splitlines()],
          "-> torch replay losses", [s["loss"] for s in steps])


def test_sequence_parallel_flag_is_priced_and_needs_tensor_parallel(capsys):
    """`--sequence-parallel` reaches the planner's cost model (each block's input / T a device), and
    without `--tensor-parallel` > 1 the command is refused before any process group starts."""
    import pytest

    from npu_backend.train import Planner, build_parser, main

    costs = {flag: Planner(build_parser().parse_args(["--tensor-parallel", "2", *flag]), 8, 0).cost
             for flag in ((), ("--sequence-parallel",))}
    assert costs[()].tensor_parallel == costs[("--sequence-parallel",)].tensor_parallel == 2
    assert [c.sequence_parallel for c in costs.values()] == [False, True]
    with pytest.raises(SystemExit) as e:
        main(["--sequence-parallel", "--steps", "1"])
    assert e.value.code == 2
    assert "--sequence-parallel needs --tensor-parallel T > 1" in capsys.readouterr().err


def test_the_torch_backend_imports_without_ml_dtypes():
    """A torch rank imports `npu_backend.train` (and through it the safetensors reader) without
    `ml_dtypes`, about half a CPU-second per process, imported only when a file is read or written."""
    code = "import sys, npu_backend.train; assert 'ml_dtypes' not in sys.modules, 'ml_dtypes imported'"
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", DHP_TORCH_DEVICE="cpu")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
