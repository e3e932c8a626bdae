"""The torch executor on XLA devices (`--device xla`, `npu_backend.xla`).

The XLA run needs torch_xla, whose release pairs with an older torch than this environment's: it
runs from the xla venv (`python -m npu_backend.xla_env`, in the user cache) through a subprocess
and is skipped, with the reason, where that venv is not built. The host-copy process group that
carries an XLA run's traffic also takes CPU tensors, so its exactness against gloo is tested here
in every environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan
from npu_backend import xla_env

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5   # fp32, relative


def irregular_plan() -> Plan:
    """4 ranks: ring 3 + 1; ring 2 + Ulysses 2; hybrid 2x2 (Ulysses 2 x ring 2); 8 samples."""
    return Plan(4, (MicroBatch((Group((0, 1, 2), 3, (0, 1, 2)), Group((3,), 1, (3,)))),
                    MicroBatch((Group((1, 0), 2, (4,)), Group((2, 3), 2, (5,), "ulysses"))),
                    MicroBatch((Group((0, 1, 2, 3), 4, (6, 7), "hybrid:2x2"),))))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_xla_extra_pins_the_env_script_pair():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["xla"] == list(xla_env.PINS)
    torch_pin = next(p for p in xla_env.PINS if p.startswith("torch=="))
    assert torch_pin not in extras["torch"]     # why it is a venv of its own


def test_xla_refusals_are_one_line(capsys):
    from npu_backend.train import main

    with pytest.raises(SystemExit) as e:
        main(["--device", "xla", "--tensor-parallel", "2", "--steps", "1"])
    assert e.value.code == 2
    assert "--tensor-parallel > 1 does not run on --device xla" in capsys.readouterr().err

    import importlib.util

    if importlib.util.find_spec("torch_xla") is None:
        from npu_backend.device import DeviceError, select_device

        with pytest.raises(DeviceError, match=r"DHP_TORCH_DEVICE=xla but torch_xla is not installed .* "
                                              r"python -m npu_backend\.xla_env"):
            select_device({"DHP_TORCH_DEVICE": "xla"})


def _host_group_worker(rank: int, world: int, plan: Plan, seed: int) -> dict:
    import torch
    import torch.distributed as dist

    from dhp_jax.data.synthetic import random_samples
    from dhp_jax.model.mllm_config import MLLMConfig
    from npu_backend.executor import TorchPlanExecutor
    from npu_backend.model import TorchMLLM

    config = MLLMConfig.preset("tiny")
    model = TorchMLLM(config)
    model.reset_parameters(torch.Generator().manual_seed(seed))
    ex = TorchPlanExecutor(model)
    samples = random_samples(config, [12, 20, 30, 16, 25, 14, 18, 22], seed=seed)
    loss, total, _ = ex.loss_and_grads(plan, samples)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
    group = dist.distributed_c10d._get_default_group()
    return {"loss": loss, "total": total, "grads": grads, "group": type(group).__name__,
            "messages": getattr(group, "messages", None), "sent": ex.tensors_sent}


def test_host_copy_group_gives_the_gloo_step():
    """The XLA run's process group (`XlaHostGroup`: gloo on host copies) on CPU tensors: the same loss
    and gradients as plain gloo on the irregular plan, every message through it."""
    from npu_backend.launch import run_world

    plan = irregular_plan()
    ref = run_world(_host_group_worker, 4, (plan, 5), timeout=240)
    got = run_world(_host_group_worker, 4, (plan, 5), timeout=240, backend="xlahost")
    for r, (a, b) in enumerate(zip(ref, got)):
        assert b["group"] == "XlaHostGroup" and a["group"] != "XlaHostGroup"
        # ring, Ulysses and hybrid traffic, the status and the gradient all-reduce all went through it
        assert b["sent"] == a["sent"] > 0 and b["messages"] >= b["sent"] + 2
        assert b["total"] == a["total"]
        assert abs(b["loss"] - a["loss"]) <= TOL * abs(a["loss"]), (r, a["loss"], b["loss"])
        scale = np.abs(a["grads"]).max()
        assert np.abs(b["grads"] - a["grads"]).max() <= TOL * scale, r


def _venv_torchrun(python: Path, nproc: int, args: list[str], cwd: Path, timeout: float = 420):
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1",
               PJRT_DEVICE="CPU")
    env.pop("DHP_TORCH_DEVICE", None)
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "npu_backend.train", *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun did not finish in {timeout:.0f} s:\n{out[-2000:]}\n{err[-2000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


_READY = xla_env.ready()


@pytest.mark.skipif(_READY is None, reason=f"no xla venv at {xla_env.default_venv()} "
                                           f"(build it: python -m npu_backend.xla_env)")
def test_xla_run_gives_the_gloo_losses(tmp_path):
    """2 steps of the irregular plan on 4 PJRT CPU ranks: the losses of the gloo run of the same
    environment (same seed, so the same host-initialised weights), and the compiled programs per step."""
    python = xla_env.venv_python(xla_env.default_venv())
    (tmp_path / "plan.json").write_text(json.dumps(irregular_plan().to_dict()))
    common = ["--plan-file", str(tmp_path / "plan.json"), "--steps", "2", "--batch-size", "8", "--min-len", "12",
              "--max-len", "12", "--optimizer", "adamw", "--seed", "3"]
    runs = {}
    for dev in ("cpu", "xla"):
        out = _venv_torchrun(python, 4, [*common, "--device", dev, "--json", str(tmp_path / f"{dev}.json")], tmp_path)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        runs[dev] = json.loads((tmp_path / f"{dev}.json").read_text())
        runs[dev]["stdout"] = out.stdout
    gloo, xla = runs["cpu"], runs["xla"]
    assert len(gloo["steps"]) == len(xla["steps"]) == 2
    assert gloo["measured_on"].startswith("cpu (gloo)") and xla["measured_on"].startswith("xla (xlahost)")
    for a, b in zip(gloo["steps"], xla["steps"], strict=True):
        assert a["degrees"] == b["degrees"] == [[3, 1], [2, 2], [4]]
        assert a["loss_tokens"] == b["loss_tokens"]
        assert abs(b["loss"] - a["loss"]) <= TOL * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
    # every step's new programs are counted; the second step (same buckets) reuses most of the first's
    compiles = [s["xla_compiles"] for s in xla["steps"]]
    assert compiles[0] > 0 and all(c >= 0 for c in compiles) and sum(compiles[1:]) < compiles[0]
    assert xla["xla"]["compiles"] >= sum(compiles)
    assert f"XLA programs compiled: {sum(compiles)}" in xla["stdout"]
