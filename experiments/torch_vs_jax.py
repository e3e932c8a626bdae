"""`python -m experiments.torch_vs_jax`: per-step wall time of the torch executor vs. the JAX `PlanExecutor`.

Same plan, same batch, same weights on both sides; the step is loss + gradients + the cross-group
gradient reduction (no optimizer update, which the two sides do not share). torch runs N real gloo
processes (one thread each); JAX runs one process with N fake CPU devices (in a subprocess, so the
device count can be set before jax is imported). Medians over timed steps after warm-up (the JAX
warm-up includes compilation). Numbers are CPU measurements of this machine, nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from dhp_jax.devices import cpu_devices_env
from dhp_jax.planner.cli_args import add_cost_args, add_mllm_arg, cost_from_args, mllm_preset, positive


def make_case(args: argparse.Namespace) -> tuple[Any, list, Any]:
    """(config, samples, plan) from the arguments; deterministic, so every process builds the same."""
    from dhp_jax.data.sample import sample_etas, sample_lengths
    from dhp_jax.data.synthetic import random_samples
    from dhp_jax.model.mllm_config import MLLMConfig
    from dhp_jax.planner import plan_batch

    config = MLLMConfig.preset(args.mllm)
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, size=args.batch_size).tolist()
    samples = random_samples(config, lengths, seed=args.seed)
    if args.groups:
        return config, samples, fixed_plan(samples, [int(d) for d in args.groups.split(",")])
    scaled = np.maximum(1, np.round(sample_lengths(samples) * args.length_scale)).astype(np.int64)
    plan = plan_batch(scaled, args.ranks, cost_from_args(args), args.strategy,
                      etas=sample_etas(samples), every_rank=True)
    return config, samples, plan


def fixed_plan(samples: Sequence, degrees: Sequence[int]) -> Any:
    """One micro-batch with groups of the given degrees on consecutive ranks; longest samples first,
    each to the group with the least attention work (sum of length^2) per rank."""
    from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan

    load = [0.0] * len(degrees)
    members: list[list[int]] = [[] for _ in degrees]
    for i in sorted(range(len(samples)), key=lambda i: -samples[i].num_tokens):
        g = min(range(len(degrees)), key=lambda g: (load[g] + samples[i].num_tokens ** 2) / degrees[g])
        load[g] += samples[i].num_tokens ** 2
        members[g].append(i)
    starts = np.cumsum([0, *degrees])
    groups = tuple(Group(tuple(range(starts[g], starts[g + 1])), d, tuple(sorted(members[g])))
                   for g, d in enumerate(degrees))
    return Plan(int(starts[-1]), (MicroBatch(groups),), solver={"strategy": f"fixed:{degrees}"})


def _torch_worker(rank: int, world: int, args: argparse.Namespace, params: Any) -> dict:
    import torch.distributed as dist
    import torch

    from npu_backend.executor import TorchPlanExecutor
    from npu_backend.model import TorchMLLM
    from npu_backend.weights import load_flax_params

    config, samples, plan = make_case(args)
    model = TorchMLLM(config)
    load_flax_params(model, params)
    ex = TorchPlanExecutor(model)
    times, loss = [], None
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss, _, _ = ex.loss_and_grads(plan, samples)
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
        if i >= args.warmup:
            times.append(float(dt))
    return {"times": times, "loss": loss}


def run_torch(args: argparse.Namespace, params: Any) -> dict:
    from npu_backend.launch import run_world

    res = run_world(_torch_worker, args.ranks, (args, params), timeout=1800)
    return res[0]


def run_jax(args: argparse.Namespace, params_path: str) -> dict:
    """The JAX side in a fresh interpreter with `ranks` fake CPU devices."""
    env = cpu_devices_env(args.ranks)
    env["JAX_PLATFORMS"] = "cpu"
    argv = [sys.executable, "-m", "experiments.torch_vs_jax", "--jax-part", params_path, *_case_argv(args)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"JAX part failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _jax_part(args: argparse.Namespace, params_path: str) -> dict:
    import jax

    from dhp_jax.sharding import PlanExecutor
    from npu_backend.weights import load_npz

    config, samples, plan = make_case(args)
    ex = PlanExecutor(config, jax.devices()[: args.ranks])
    params = ex.replicate(jax.tree.map(np.asarray, load_npz(params_path)))
    times, loss = [], None
    t_first = time.perf_counter()
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss, grads = ex.loss_and_grads(params, samples, plan)
        jax.block_until_ready((loss, grads))
        if i == 0:
            t_first = time.perf_counter() - t_first
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return {"times": times, "loss": float(loss), "first_step_s": t_first, "compiles": ex.num_compiles}


def _case_argv(args: argparse.Namespace) -> list[str]:
    return ["--ranks", str(args.ranks), "--mllm", args.mllm, "--model", args.model, "--hardware", args.hardware,
            "--batch-size", str(args.batch_size),
            "--min-len", str(args.min_len), "--max-len", str(args.max_len), "--seed", str(args.seed),
            *(["--cost", args.cost] if args.cost else []), "--length-scale", str(args.length_scale), "--strategy", args.strategy,
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--groups", args.groups]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.torch_vs_jax", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=positive, default=5)
    add_mllm_arg(p)
    add_cost_args(p, model="internvl3-8b", hardware="cpu", ranks_per_node=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--length-scale", type=float, default=100.0,
                   help="plan as if samples were this much longer, so the plan has CP groups")
    p.add_argument("--strategy", default="dhp")
    p.add_argument("--groups", default="3,2",
                   help="fixed group degrees of a one-micro-batch plan (e.g. 3,2); '' = use the planner")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", dest="json_out", help="also write the result here")
    p.add_argument("--jax-part", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.mllm = mllm_preset(args, "experiments.torch_vs_jax")
    if args.jax_part:
        print(json.dumps(_jax_part(args, args.jax_part)))
        return 0
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    import torch

    from npu_backend.model import TorchMLLM
    from npu_backend.weights import export_flax_params, save_npz

    config, samples, plan = make_case(args)
    model = TorchMLLM(config)
    model.reset_parameters(torch.Generator().manual_seed(args.seed))
    params = export_flax_params(model)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "params.npz")
        save_npz(path, params)
        jx = run_jax(args, path)
    th = run_torch(args, params)
    t_med, j_med = statistics.median(th["times"]), statistics.median(jx["times"])
    result = {
        "what": "per-step wall time (loss + grads + cross-group reduction), same plan/batch/weights",
        "measured_on": f"CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
                       f"shared with other jobs; torch: {args.ranks} gloo processes x 1 thread; "
                       f"jax: 1 process, {args.ranks} fake CPU devices",
        "plan_degrees": plan.degrees, "num_samples": len(samples), "tokens": int(sum(s.num_tokens for s in samples)),
        "torch_median_s": t_med, "jax_median_s": j_med, "torch_over_jax": t_med / j_med,
        "torch_times_s": th["times"], "jax_times_s": jx["times"], "jax_first_step_s": jx["first_step_s"],
        "jax_compiles": jx["compiles"], "loss_torch": th["loss"], "loss_jax": jx["loss"],
        "versions": {"torch": torch.__version__}, "args": {k: v for k, v in vars(args).items() if k != "jax_part"},
    }
    print(json.dumps(result, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
