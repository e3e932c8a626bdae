"""`torchrun --nproc-per-node N -m npu_backend.train ...`: DHP training with torch, one process per rank.

Every step: a deterministic synthetic batch, a plan (computed identically on every rank with
`dhp_jax.planner.plan_batch`, broadcast from rank 0, or replayed from `--plan-file`), then
`TorchPlanExecutor.step` (ring attention per CP group, one gradient all-reduce, optimizer step).
Device and backend come from `npu_backend.device` (NPU + HCCL, CUDA + NCCL, CPU + gloo).

Multi-node (one process per NPU/GPU, same command on every node):
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \\
        --rdzv-backend c10d --rdzv-endpoint $MASTER_HOST:29500 -m npu_backend.train --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from dhp_jax.data.sample import sample_etas, sample_lengths
from dhp_jax.data.synthetic import random_samples
from dhp_jax.model.config import MLLMConfig
from dhp_jax.planner import plan_batch
from dhp_jax.planner.cli_args import add_cost_args, add_mllm_arg, cost_from_args, is_profile, mllm_preset
from dhp_jax.planner.contract.plan import Plan, PlanValidationError
from dhp_jax.planner.contract.planfile import PlanLog, load_plan_file, plan_at
from npu_backend.device import select_device, set_current_device
from npu_backend.executor import StepError, TorchPlanExecutor
from npu_backend.model import TorchMLLM
from npu_backend.weights import (WeightsError, check_model_config, export_flax_params, load_flax_params,
    load_jax_checkpoint, load_npz, save_npz)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m npu_backend.train", description=__doc__.split("\n\n")[0])
    add_mllm_arg(p)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16, help="samples per global batch")
    p.add_argument("--min-len", type=int, default=8, help="shortest synthetic sample (tokens)")
    p.add_argument("--max-len", type=int, default=96, help="longest synthetic sample (tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weights", help="initial weights: .npz in the flax layout ('a/b/c' keys)")
    p.add_argument("--init-from", metavar="RUN_DIR",
                   help="initial weights: the params of a `dhp train` checkpoint (a run directory, its "
                        "checkpoints/ or one step's directory; the latest step unless a step directory)")
    p.add_argument("--save-weights", help="write the final weights (.npz, flax layout) from rank 0")
    p.add_argument("--plan-file", help="replay plans (dhp_jax.planner.contract.planfile): a plan log of `dhp train` "
                                       "or of --dump-plans, one plan JSON (every step) or a JSON list")
    p.add_argument("--plan-source", choices=("local", "broadcast"), default="local",
                   help="local: every rank plans the same batch deterministically; broadcast: rank 0 plans")
    p.add_argument("--strategy", default="dhp", help="planner strategy (see dhp_jax.planner.STRATEGIES)")
    add_cost_args(p, model="internvl3-8b", hardware="cpu", ranks_per_node=8)  # the cost model plans with
    p.add_argument("--comm-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="cost model: ring traffic hides behind attention (default: the hardware's)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="plan as if every sample were this many times longer (exercise CP groups at "
                        "CPU-sized lengths)")
    p.add_argument("--dump-plans", help="write the plan of every step (a plan log, as `dhp train` writes; rank 0)")
    p.add_argument("--json", dest="json_out", help="write per-step metrics (JSON, rank 0)")
    return p


def make_batch(config: MLLMConfig, args: argparse.Namespace, step: int) -> list:
    """The step's synthetic batch: the same on every rank (seeded by seed and step)."""
    rng = np.random.default_rng([args.seed, step])
    lengths = rng.integers(args.min_len, args.max_len + 1, size=args.batch_size)
    return random_samples(config, lengths.tolist(), seed=args.seed * 1_000_003 + step)


class Planner:
    """Gives the plan of each step: replayed, planned on every rank, or planned on rank 0 and sent."""

    def __init__(self, args: argparse.Namespace, world: int, rank: int):
        self.args, self.world, self.rank = args, world, rank
        self.replay = (load_plan_file(args.plan_file, num_samples=args.batch_size, num_ranks=world, steps=args.steps)
                       if args.plan_file else None)
        self.cost = None
        if self.replay is None:
            extra: dict[str, Any] = {} if args.comm_overlap is None else {"comm_overlap": args.comm_overlap}
            if not is_profile(args.cost or args.model):
                # a preset's model states are ZeRO-sharded over the node, or over all ranks when a rank is a node
                extra["zero_shards"] = max(args.ranks_per_node, world)
            self.cost = cost_from_args(args, **extra)

    def _plan(self, samples: Sequence) -> Plan:
        lengths = np.maximum(1, np.round(sample_lengths(samples) * self.args.length_scale)).astype(np.int64)
        # this executor needs every rank in some group (an idle process would have no shard to run)
        return plan_batch(lengths, self.world, self.cost, self.args.strategy, etas=sample_etas(samples),
                          every_rank=True)

    def __call__(self, step: int, samples: Sequence) -> Plan:
        if self.replay is not None:
            return plan_at(self.replay, step)
        if self.args.plan_source == "local":
            return self._plan(samples)
        box = [self._plan(samples).to_json() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return Plan.from_json(box[0])


def _init_world() -> tuple[int, int, int]:
    """Rank, world size, local rank from torchrun's environment (a lone process is a world of 1)."""
    if "RANK" not in os.environ:
        from npu_backend.launch import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank, world, local_rank = _init_world()
    say = (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)
    choice = select_device(warn=say)
    device = set_current_device(choice, local_rank)
    # Eager NCCL init: batched point-to-point ops then reuse the world communicator instead of
    # creating one per pair of ranks. (On every backend the executor's first collective of a step
    # is a world all-reduce, so the world communicator exists before any ring send.)
    extra = {"device_id": device} if choice.kind == "cuda" else {}
    dist.init_process_group(choice.backend, **extra)
    try:
        return _train(args, rank, world, device, choice, say)
    except (StepError, WeightsError, PlanValidationError, ValueError) as e:
        # Same message on every rank (the checks are deterministic): exit cleanly, no hang.
        print(f"rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.destroy_process_group()


def _train(args, rank: int, world: int, device: torch.device, choice, say) -> int:
    config = MLLMConfig.preset(mllm_preset(args, "npu_backend.train"))
    if args.weights and args.init_from:
        raise WeightsError("give --weights or --init-from, not both")
    init_from = None
    if args.init_from:   # read and checked before the model is built
        init_from = load_jax_checkpoint(args.init_from)
        check_model_config(init_from.meta, config, f"checkpoint {str(init_from.path)!r}")
    model = TorchMLLM(config)
    if init_from is not None:
        load_flax_params(model, init_from.params)
        say(f"npu_backend: params from dhp train checkpoint {str(init_from.path)!r} (step {init_from.step}); "
            f"the optimizer starts afresh")
    elif args.weights:
        load_flax_params(model, load_npz(args.weights))
    else:
        model.reset_parameters(torch.Generator().manual_seed(args.seed))  # same draws on every rank
    model.to(device)
    opt_cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD
    optimizer = opt_cls(model.parameters(), lr=args.lr)
    executor = TorchPlanExecutor(model, device=device, optimizer=optimizer)
    planner = Planner(args, world, rank)
    say(f"npu_backend: {world} ranks on {choice.kind} ({choice.backend}: {choice.reason}), model {config.name} "
        f"({config.num_params():,} params)")
    records = []
    dump = PlanLog(args.dump_plans) if (args.dump_plans and rank == 0) else None
    try:
        for step in range(args.steps):
            samples = make_batch(config, args, step)
            t0 = time.perf_counter()
            plan = planner(step, samples)
            plan_s = time.perf_counter() - t0
            res = executor.step(plan, samples)
            rec = {"step": step, "loss": res.loss, "loss_tokens": res.num_loss_tokens, "step_s": res.seconds,
                   "plan_s": plan_s, "degrees": plan.degrees}
            records.append(rec)
            if dump is not None:
                dump.write(step, plan)
            say(f"step {step:4d}  loss {res.loss:.4f}  tokens {res.num_loss_tokens:6d}  "
                f"step {res.seconds * 1e3:8.1f} ms  plan {plan_s * 1e3:6.1f} ms  degrees {plan.degrees}")
    finally:
        if dump is not None:
            dump.close()
    say(summary_line(records, world, choice))
    if rank == 0 and args.save_weights:
        save_npz(args.save_weights, export_flax_params(model))
    if rank == 0 and args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"measured_on": f"{choice.kind} ({choice.backend}), {platform.machine()} {platform.node()}",
                       "world_size": world, "torch": torch.__version__, "config": config.to_dict(),
                       "init_from": None if init_from is None else {"path": str(init_from.path),
                                                                    "step": init_from.step},
                       "args": vars(args), "steps": records}, f, indent=1)
    return 0


def summary_line(records: list[dict], world: int, choice: Any) -> str:
    """One line: steps, loss first -> last, the groups run by degree, the median step (measured)."""
    if not records:
        return "npu_backend: no step run"
    groups: dict[int, int] = {}
    for r in records:
        for mb in r["degrees"]:
            for d in mb:
                groups[d] = groups.get(d, 0) + 1
    odd = [d for d in sorted(groups) if d & (d - 1)]
    return (f"npu_backend: {len(records)} steps on {world} ranks ({choice.kind}, {choice.backend}): loss "
            f"{records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}; groups run: "
            + ", ".join(f"{n} of degree {d}" for d, n in sorted(groups.items()))
            + (f" ({', '.join(map(str, odd))}: not powers of two)" if odd else "")
            + f"; median step {float(np.median([r['step_s'] for r in records])) * 1e3:.1f} ms (measured)")


if __name__ == "__main__":
    sys.exit(main())
