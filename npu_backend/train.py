"""`torchrun --nproc-per-node N -m npu_backend.train ...`: DHP training with torch, one process per rank.

Every step: a deterministic synthetic batch (or, started `--init-from` a fine-tuning run's checkpoint,
that run's family model and its next batches of its own data: `npu_backend.finetune`), a plan (computed identically on every rank with
`dhp_jax.planner.plan_batch`, broadcast from rank 0, or replayed from `--plan-file`), then
`TorchPlanExecutor.step` (ring attention per CP group, one gradient all-reduce, optimizer step).
Device and backend come from `npu_backend.device` (NPU + HCCL, CUDA + NCCL, CPU + gloo) or `--device`;
`--device xla` runs on torch_xla's device with the traffic on gloo over host copies (`npu_backend.xla`;
torchrun from the xla environment, `python -m npu_backend.xla_env`).

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

from npu_backend.device import DeviceError, select_device, set_current_device  # sets the torch_npu import guard

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dhp_jax.data.sample import sample_etas, sample_lengths  # noqa: E402
from dhp_jax.data.synthetic import random_samples  # noqa: E402
from dhp_jax.model.mllm_config import MLLMConfig  # noqa: E402  (dataclass only: no jax)
from dhp_jax.planner import plan_batch  # noqa: E402
from dhp_jax.planner.cli_args import (add_cost_args, add_mllm_arg, add_tensor_parallel_arg, cost_from_args,  # noqa: E402
                                      is_profile, mllm_preset)
from dhp_jax.planner.contract.plan import Plan, PlanValidationError  # noqa: E402
from dhp_jax.planner.cost.model import check_router_phase  # noqa: E402
from dhp_jax.planner.contract.planfile import PlanLog, load_plan_file, plan_at  # noqa: E402
from npu_backend.executor import StepError, TorchPlanExecutor  # noqa: E402
from npu_backend.finetune import FamilyRun, describe, pretrained_source  # noqa: E402
from npu_backend.hf import TorchFamilyModel, save_family  # noqa: E402
from npu_backend.model import TorchMLLM  # noqa: E402
from npu_backend.weights import (WeightsError, check_model_config, export_flax_params, load_flax_params,  # noqa: E402
                                 load_jax_checkpoint, load_npz, save_npz)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m npu_backend.train", description=__doc__.split("\n\n")[0])
    add_mllm_arg(p)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16, help="samples per global batch")
    p.add_argument("--min-len", type=int, default=8, help="shortest synthetic sample (tokens)")
    p.add_argument("--max-len", type=int, default=96, help="longest synthetic sample (tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("npu", "cuda", "cpu", "xla"),
                   help="force the device (default: $DHP_TORCH_DEVICE, else NPU, CUDA or CPU, the first usable); "
                        "xla: torch_xla's device (PJRT_DEVICE), collectives on gloo over host copies")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weights", help="initial weights: .npz in the flax layout ('a/b/c' keys)")
    p.add_argument("--init-from", metavar="RUN_DIR",
                   help="initial weights: the params of a `dhp train` checkpoint (a run directory, its "
                        "checkpoints/ or one step's directory; the latest step unless a step directory); of a "
                        "fine-tuning run (model.pretrained): its family model, trained on the run's data from "
                        "the checkpoint's next batch on, in the run's data.batch_size (--batch-size, --min/max-len "
                        "and --mllm do not apply)")
    p.add_argument("--save-weights", help="write the final weights from rank 0 (.npz, flax layout; a family model: "
                                           "a Hugging Face checkpoint directory, config.json + safetensors)")
    p.add_argument("--plan-file", help="replay plans (dhp_jax.planner.contract.planfile): a plan log of `dhp train` "
                                       "or of --dump-plans, one plan JSON (every step) or a JSON list")
    p.add_argument("--plan-source", choices=("local", "broadcast"), default="local",
                   help="local: every rank plans the same batch deterministically; broadcast: rank 0 plans")
    p.add_argument("--strategy", default="dhp", help="planner strategy (see dhp_jax.planner.STRATEGIES)")
    add_cost_args(p, model="internvl3-8b", hardware="cpu", ranks_per_node=8)  # the cost model plans with
    add_tensor_parallel_arg(p)   # a rank is T consecutive processes (npu_backend.tensor_parallel); plans have processes / T ranks
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
    """Gives the plan of each step: replayed, planned on every rank, or planned on rank 0 and sent.

    `world` counts processes; the plans have world / --tensor-parallel ranks. `router_phase`: the
    steps add a mixture of experts' load-balancing loss, so each group also runs a router pass
    (`npu_backend.executor`), which the cost model prices (`CostModel.preset(..., router_phase=True)`);
    a profile (--cost) that prices otherwise is refused."""

    def __init__(self, args: argparse.Namespace, world: int, rank: int, router_phase: bool = False):
        self.args, self.rank = args, rank
        self.world = world // getattr(args, "tensor_parallel", 1)      # plan ranks
        self.replay = (load_plan_file(args.plan_file, num_samples=args.batch_size, num_ranks=self.world,
                                      steps=args.steps) if args.plan_file else None)
        self.cost = None
        if self.replay is None:
            extra: dict[str, Any] = {} if args.comm_overlap is None else {"comm_overlap": args.comm_overlap}
            if not is_profile(args.cost or args.model):
                # a preset's model states are ZeRO-sharded over the node, or over all ranks when a rank is a node
                extra["zero_shards"] = max(args.ranks_per_node, world)
            # with the load-balancing loss on, every group runs the router pass before its step: a
            # preset prices it, a profile must have measured it
            source = args.cost or args.model
            if router_phase and not is_profile(source):
                extra["router_phase"] = True
            self.cost = cost_from_args(args, **extra)
            check_router_phase(self.cost, router_phase, f"--cost {source!r}")

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


def planner_for(args: argparse.Namespace, world: int, rank: int, executor: TorchPlanExecutor) -> Planner:
    """The run's `Planner`: with the executor's load-balancing loss on (a mixture of experts whose
    config sets it, `TorchPlanExecutor.aux_coef`), its cost model prices the router pass."""
    return Planner(args, world, rank, router_phase=executor.aux_coef > 0)


def _init_world() -> tuple[int, int, int]:
    """Rank, world size, local rank from torchrun's environment (a lone process is a world of 1)."""
    if "RANK" not in os.environ:
        from npu_backend.launch import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sequence_parallel and args.tensor_parallel == 1:
        parser.error("--sequence-parallel needs --tensor-parallel T > 1 (it splits a rank's rows over the rank's "
                     "T processes; a rank of one process holds every row)")
    if args.device == "xla" and args.tensor_parallel > 1:
        parser.error("--tensor-parallel > 1 does not run on --device xla (its all-gathers and reduce-scatters "
                     "over a rank have no host-copy collective here); ring, Ulysses and hybrid groups do")
    rank, world, local_rank = _init_world()
    say = (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)
    env = dict(os.environ, DHP_TORCH_DEVICE=args.device) if args.device else None
    try:
        choice = select_device(env, warn=say)
    except DeviceError as e:
        print(f"rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 2
    if choice.kind == "xla" and args.tensor_parallel > 1:
        print(f"rank {rank}: error: --tensor-parallel > 1 does not run on an XLA device", file=sys.stderr, flush=True)
        return 2
    if choice.kind == "xla":
        from npu_backend import xla

        xla.register_backend()
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
    if args.weights and args.init_from:
        raise WeightsError("give --weights or --init-from, not both")
    init_from = family = None
    if args.init_from:   # read and checked before the model is built
        init_from = load_jax_checkpoint(args.init_from)
        if pretrained_source(init_from.meta):     # a fine-tuning run: its family model and its data
            if args.mllm:
                raise WeightsError(f"{str(init_from.path)!r} is of a fine-tuning run of "
                                   f"{pretrained_source(init_from.meta)!r}: its model comes from there, not --mllm")
            family = FamilyRun.of(init_from)
    if family is not None:
        model, config, name = family.model, family.config, family.config.name
        batches = family.batches()
        say(f"npu_backend: {family.config.family} params from dhp train checkpoint {str(init_from.path)!r} (step "
            f"{init_from.step}, fine-tuned from {family.source!r}); its data from batch {init_from.data_position} "
            f"on; the optimizer starts afresh")
        num_params = sum(p.numel() for p in model.parameters())
        args.batch_size = int(family.data_config.get("batch_size", args.batch_size))   # what a plan file covers
    else:
        config = MLLMConfig.preset(mllm_preset(args, "npu_backend.train"))
        if init_from is not None:
            check_model_config(init_from.meta, config, f"checkpoint {str(init_from.path)!r}")
        model, name, num_params = TorchMLLM(config), config.name, config.num_params()
        batches = ((None, make_batch(config, args, step)) for step in range(args.steps))
        if init_from is not None:
            load_flax_params(model, init_from.params)
            say(f"npu_backend: params from dhp train checkpoint {str(init_from.path)!r} (step {init_from.step}); "
                f"the optimizer starts afresh")
        elif args.weights:
            load_flax_params(model, load_npz(args.weights))
        else:
            model.reset_parameters(torch.Generator().manual_seed(args.seed))  # same draws on every rank
        model.to(device)
    if family is not None and device.type != "cpu":
        for p in model.parameters():
            p.data = p.data.to(device)
    opt_cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD
    optimizer = opt_cls(model.parameters(), lr=args.lr)
    executor = TorchPlanExecutor(model, device=device, optimizer=optimizer, tensor_parallel=args.tensor_parallel,
                                 sequence_parallel=args.sequence_parallel)
    planner = planner_for(args, world, rank, executor)
    t = args.tensor_parallel
    say(f"npu_backend: {world // t} ranks" + (f" of {t} processes (tensor parallel"
                                              + (", sequence parallel)" if args.sequence_parallel else ")") if t > 1 else "")
        + f" on {choice.kind} ({choice.backend}: {choice.reason}), model {name} ({num_params:,} params)")
    records = []
    xla = None
    if choice.kind == "xla":
        from npu_backend import xla
    compiled = xla.compile_stats()["compiles"] if xla is not None else 0
    dump = PlanLog(args.dump_plans) if (args.dump_plans and rank == 0) else None
    try:
        for step, (sample_ids, samples) in zip(range(args.steps), batches):
            t0 = time.perf_counter()
            plan = planner(step, samples)
            plan_s = time.perf_counter() - t0
            res = executor.step(plan, samples)
            rec = {"step": step + 1, "loss": res.loss, "loss_tokens": res.num_loss_tokens, "step_s": res.seconds,
                   "plan_s": plan_s, "degrees": plan.degrees}
            if xla is not None:     # run the optimizer's update now; count the programs this step compiled
                xla.sync()
                rec["step_s"] = time.perf_counter() - t0 - plan_s
                now = xla.compile_stats()["compiles"]
                rec["xla_compiles"], compiled = now - compiled, now
            if res.expert_tokens is not None:   # a mixture of experts: the routing's balance this step
                mean = float(np.mean(res.expert_tokens))
                rec["expert_tokens_max"], rec["expert_tokens_mean"] = float(max(res.expert_tokens)), mean
            if sample_ids is not None:      # a fine-tuning run's records, named as its metrics name them
                rec["sample_ids"] = sample_ids
            records.append(rec)
            if dump is not None:
                dump.write(step + 1, plan)
            say(f"step {step + 1:4d}  loss {res.loss:.4f}  tokens {res.num_loss_tokens:6d}  "
                f"step {rec['step_s'] * 1e3:8.1f} ms  plan {plan_s * 1e3:6.1f} ms  degrees {plan.degrees}"
                + (f"  compiled {rec['xla_compiles']}" if xla is not None else ""))
    finally:
        if dump is not None:
            dump.close()
        if family is not None:
            batches.close()
    say(summary_line(records, world // t, choice))
    if args.save_weights:   # whole weights, as without tensor parallelism (gathered over each rank)
        whole = executor.tp.gather(model) if t > 1 else None
        if rank == 0 and family is not None:
            save_family(model if whole is None else TorchFamilyModel(model.config, whole), args.save_weights)
        elif rank == 0:
            if whole is not None:
                model = TorchMLLM(config)
                model.load_state_dict(whole)
            save_npz(args.save_weights, export_flax_params(model))
    if rank == 0 and args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"measured_on": f"{choice.kind} ({choice.backend}), {platform.machine()} {platform.node()}",
                       "world_size": world, "tensor_parallel": t, "sequence_parallel": args.sequence_parallel,
                       "torch": torch.__version__,
                       "xla": None if xla is None else {"torch_xla": choice.reason, **xla.compile_stats()},
                       "config": dict(config.raw) if family is not None else config.to_dict(),
                       "init_from": describe(family) if family is not None else None if init_from is None
                       else {"path": str(init_from.path), "step": init_from.step},
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
            + f"; median step {float(np.median([r['step_s'] for r in records])) * 1e3:.1f} ms (measured)"
            + (f"; XLA programs compiled: {sum(r['xla_compiles'] for r in records)} "
               f"({', '.join(str(r['xla_compiles']) for r in records)} by step)" if "xla_compiles" in records[0] else ""))


if __name__ == "__main__":
    sys.exit(main())
