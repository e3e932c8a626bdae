"""Run one training step of a `Plan` on this rank with torch.distributed: one process, one rank.

For every micro-batch the rank finds its CP group, packs the group's samples with
`dhp_jax.geometry.layout` (the same packing, bucket padding and zigzag as the JAX side; a Hugging Face
family model: the two streams of `dhp_jax.model.hf.packed`, as `dhp_jax.sharding.family_adapter`), runs its
shard forward and backward with ring attention over the group (point-to-point on the world
group), and accumulates gradients. Then one all-reduce over the world sums every rank's partial
gradient: each group's gradient is the sum over its ranks, each token counted once, and the loss
was already divided by the batch's loss-token count, so the sum is the token-weighted mean.

A mixture of experts whose config turns the load-balancing loss on (`npu_backend.moe.aux_loss_coef`):
that loss is a product of two sums over the whole batch, the experts' counts C and the router
probabilities P. The counts carry no gradient, so the step runs in two phases, as the JAX engine's
(`dhp_jax.sharding.router_phase`): (1) per micro-batch, a router pass without gradients
(`TorchFamilyModel.router_pass`: the vision encoder and the LLM layers up to the last sparse one,
no LM head) gives the counts, summed over the world in one all-reduce (`moe.batch_totals`); (2) with
w_e = E C_e / R^2 fixed (`moe.aux_weights`) the loss is linear in P, so each micro-batch's forward
adds its own share coef sum_e w_e P_e (`moe.aux_share`) to its loss / the batch's loss tokens and
runs its backward at once. A rank thus holds one micro-batch's activations at a time, which is what
the planner's memory model prices; the router pass costs one more forward pass of those layers,
which its cost model prices (`CostModel.preset(..., router_phase=True)`, `npu_backend.train`).

Errors never leave a rank hanging in a collective: everything every rank can check alike (plan vs.
world size, every rank used, sample ids, payloads) is checked before the first collective, and a
local failure while packing is announced through the step's first, tiny all-reduce.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from dhp_jax.data.sample import Sample
from dhp_jax.geometry.layout import MODEL_INPUTS, pack_group, planned_bucket
from dhp_jax.model.hf.config import HFConfig
from dhp_jax.model.hf.packed import pack_family_group
from dhp_jax.planner.contract.kinds import resolve
from dhp_jax.planner.contract.plan import Group, Plan, PlanValidationError
from npu_backend.attention import group_attention
from npu_backend import moe
from npu_backend.hf import TorchFamilyModel, stream_tensors
from npu_backend.model import TorchMLLM, token_loss_sum
from npu_backend.ring import RingComm
from npu_backend.tensor_parallel import TensorParallel
from npu_backend.ulysses import UlyssesComm


class StepError(RuntimeError):
    """A step cannot run; raised on every rank with the same message (no rank is left waiting)."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    loss: float               # token-mean loss of the whole batch
    num_loss_tokens: int      # tokens the mean is over
    seconds: float            # wall time of fwd + bwd + all-reduce (+ optimizer step) on this rank
    local_tokens: int         # stream tokens (padding included) this rank ran, all micro-batches
    expert_tokens: list[float] | None = None   # MoE: tokens per expert of the batch, per sparse layer


def check_plan(plan: Plan, samples: Sequence[Sample], world_size: int, config: Any,
               tensor_parallel: int = 1) -> None:
    """Every check that needs no communication; identical on every rank, so all fail together.

    `world_size` counts ranks: processes / `tensor_parallel`."""
    t = tensor_parallel
    if not isinstance(plan, Plan):
        raise StepError(f"expected a Plan, got {type(plan).__name__}")
    if plan.num_ranks != world_size:
        if t == 1:
            raise StepError(f"the plan is for num_ranks={plan.num_ranks} but the world has {world_size} "
                            f"processes; re-plan for {world_size} ranks or launch {plan.num_ranks} processes")
        raise StepError(f"the plan is for num_ranks={plan.num_ranks} but the world has {world_size * t} "
                        f"processes = {world_size} ranks of tensor_parallel {t}; re-plan for {world_size} ranks "
                        f"or launch {plan.num_ranks * t} processes")
    try:
        plan.validate(num_samples=len(samples))
    except PlanValidationError as e:
        raise StepError(f"invalid plan: {e}") from None
    for m, mb in enumerate(plan.micro_batches):
        for gi, g in enumerate(mb.groups):
            try:
                resolve(g.attention, g.degree, config.num_heads // t)
            except ValueError as e:
                raise StepError(f"micro-batch {m} group {gi} (ranks {list(g.ranks)}): {e}"
                                + (f" (the heads of one process of a rank of tensor_parallel {t})" if t > 1 else "")) from None
    used = {r for g in plan.groups for r in g.ranks}
    idle = sorted(set(range(world_size)) - used)
    if idle:
        raise StepError(f"ranks {idle} are in no group of any micro-batch; a plan must use every rank (plan_batch(..., every_rank=True))")
    check_payloads(samples, config)


def check_payloads(samples: Sequence[Sample], config: Any) -> None:
    """The stand-in model's payload checks (a family config: `check_family_payloads`)."""
    if isinstance(config, HFConfig):
        return check_family_payloads(samples, config)
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise StepError(f"sample {i} is a {type(s).__name__}, not a Sample")
        for j, sg in enumerate(s.segments):
            if sg.is_vision and sg.num_tokens and sg.pixels is None:
                raise StepError(f"sample {i} segment {j} ({sg.modality}) has no pixels")
            if sg.is_vision and sg.pixels is not None and sg.pixels.shape[1:] != (config.patch_dim,):
                raise StepError(f"sample {i} segment {j}: pixels have shape {tuple(sg.pixels.shape)}, "
                                f"the model needs ({sg.num_tokens}, {config.patch_dim})")
            if not sg.is_vision and sg.num_tokens and sg.token_ids is None:
                raise StepError(f"sample {i} segment {j} (text) has no token_ids")


def check_family_payloads(samples: Sequence[Sample], config: HFConfig) -> None:
    """What every rank can check of Hugging Face family samples (`hf.sample_from_inputs`) before any
    collective; packing checks the rest (grids, label and position shapes) on the group's ranks."""
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise StepError(f"sample {i} is a {type(s).__name__}, not a Sample")
        for j, sg in enumerate(s.segments):
            if sg.meta.get("positions") is None:
                raise StepError(f"sample {i} segment {j}: no meta['positions'] (a Sample made by "
                                f"hf.sample_from_inputs for {config.family})")
            if sg.is_vision and sg.num_tokens and (sg.pixels is None or sg.meta.get("grid_thw") is None):
                raise StepError(f"sample {i} segment {j} ({sg.modality}) needs pixels and meta['grid_thw']")
            if not sg.is_vision and sg.num_tokens and sg.token_ids is None:
                raise StepError(f"sample {i} segment {j} (text) has no token_ids")


def my_group(plan_groups: Sequence[Group], rank: int) -> Group | None:
    for g in plan_groups:
        if rank in g.ranks:
            return g
    return None


class TorchPlanExecutor:
    """Executes plans for one process of the world; the model's parameters are replicated on every rank.

    `tensor_parallel` = t > 1: a rank is t consecutive processes of one node holding a Megatron split
    of the model (`npu_backend.tensor_parallel`; a family: its LLM and its vision encoder's blocks; `model` is
    passed whole and split in place), a plan's ranks are processes / t, and `self.tp.gather(model)`
    gives the whole weights. `sequence_parallel` (with t > 1; Megatron's sequence parallelism, arXiv
    2205.05198): between the split matrices each process holds 1/t of its rank's rows (the norms
    and residuals of the blocks; all-gathers before the column-split matrices, reduce-scatters
    after the row-split ones, `npu_backend.tensor_parallel`).

    `model` is the stand-in `TorchMLLM` or a Hugging Face family model (`npu_backend.hf.
    TorchFamilyModel`, e.g. `load_family(checkpoint_dir)`): a group then runs the family's two packed
    streams (`dhp_jax.model.hf.packed`) and the loss is transformers' (labels shifted inside each
    sample, -100 ignored, token-weighted mean over the batch)."""

    def __init__(self, model: TorchMLLM | TorchFamilyModel, device: torch.device | None = None,
                 optimizer: torch.optim.Optimizer | None = None, tensor_parallel: int = 1,
                 sequence_parallel: bool = False):
        if not dist.is_initialized():
            raise StepError("torch.distributed is not initialised: call init_process_group first")
        self.model = model
        self.config = model.config
        self.family = isinstance(model, TorchFamilyModel)
        self.device = device or torch.device("cpu")
        self.optimizer = optimizer
        try:
            self.tp = TensorParallel.create(dist.get_world_size(), tensor_parallel, sequence_parallel)
            self.tp.shard(model)
        except ValueError as e:        # the same on every process: the config, t and the world
            raise StepError(str(e)) from None
        self.rank = self.tp.rank                  # plan rank
        self.world_size = self.tp.num_ranks       # plan ranks
        self.tensors_sent = 0  # ring traffic of this rank, for tests and logs
        # a mixture of experts: tokens routed to each expert in the last step, the batch's, per sparse layer
        self.expert_tokens: list[float] | None = None
        # the load-balancing loss's weight (0: off), from the family's config (`moe.aux_loss_coef`)
        self.aux_coef = moe.aux_loss_coef(self.config) if self.family else 0.0

    # ------------------------------------------------------------------ pieces
    def _shard(self, group: Group, samples: Sequence[Sample]) -> tuple[Any, int]:
        members = [samples[i] for i in group.samples]
        i = group.ranks.index(self.rank)
        # Only the group's first rank (its tp index 0) reports the group's count: each group counts once.
        counts = i == 0 and self.tp.index == 0
        if self.family:     # the two streams of dhp_jax.model.hf.packed, as the JAX engine shards them
            flayout = pack_family_group(members, group.degree, self.config, bucket=planned_bucket(group, members))
            return stream_tensors(flayout, i, self.device), (flayout.num_loss_tokens if counts else 0)
        layout = pack_group(members, group.degree, self.config, bucket=planned_bucket(group, members))
        n = layout.bucket // group.degree
        arrays = layout.arrays()
        shard = {k: torch.from_numpy(np.ascontiguousarray(v[i * n:(i + 1) * n])).to(self.device)
                 for k, v in arrays.items()}
        return shard, (layout.num_loss_tokens if counts else 0)

    def _attention(self, group: Group) -> tuple[Any, RingComm | UlyssesComm | None]:
        """The group's attention callable (dense, ring, Ulysses or hybrid) and its communicator."""
        shape = resolve(group.attention, group.degree, self.config.num_heads // self.tp.size)
        # the processes of the group's ranks that hold this process's shard (tensor parallelism)
        return group_attention(shape, [self.tp.process_of(r) for r in group.ranks], self.tp.process)

    def _forward_loss(self, group: Group, shard: Any) -> tuple[torch.Tensor, RingComm | UlyssesComm | None]:
        attn, comm = self._attention(group)
        if self.family:
            return self.model.loss_sum(*shard, attn), comm
        logits = self.model({k: shard[k] for k in MODEL_INPUTS}, attn)
        loss = token_loss_sum if self.tp.size == 1 else self.tp.token_loss_sum
        return loss(logits, shard["targets"], shard["loss_weights"]), comm

    # ------------------------------------------------------------------ the step
    def loss_and_grads(self, plan: Plan, samples: Sequence[Sample]) -> tuple[float, int, int]:
        """Leave the batch's token-mean gradient in every parameter's `.grad` (same on all ranks).

        Returns (loss, num_loss_tokens, local stream tokens).
        """
        check_plan(plan, samples, self.world_size, self.config, self.tp.size)
        # Pack first: a failure here is local, so it is shared before any heavy collective.
        shards: list[tuple[Group, dict[str, torch.Tensor]] | None] = []
        counted, err = 0, ""
        for m, mb in enumerate(plan.micro_batches):
            g = my_group(mb.groups, self.rank)
            if g is None:
                shards.append(None)
                continue
            try:
                shard, c = self._shard(g, samples)
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                err = f"rank {self.rank}, micro-batch {m}, group ranks {list(g.ranks)}: {e}"
                shards.append(None)
                continue
            counted += c
            shards.append((g, shard))
        # status[p] = 1 if process p failed; status[-1] = loss tokens of the whole batch.
        procs = self.tp.world
        status = torch.zeros(procs + 1, dtype=torch.int64, device=self.device)
        status[self.tp.process] = 1 if err else 0
        status[-1] = counted
        dist.all_reduce(status)
        failed = sorted({p // self.tp.size for p in range(procs) if status[p] > 0})
        if failed:
            raise StepError(err or f"ranks {failed} could not pack their group (their error names the sample)")
        total = int(status[-1])
        if total == 0:
            raise StepError("the batch has no text token followed by a text token: the loss is undefined")

        for p in self.model.parameters():
            p.grad = None
        local_loss = torch.zeros((), dtype=torch.float32, device=self.device)
        local_tokens = 0
        # the load-balancing loss of a mixture of experts couples the whole batch (`npu_backend.moe`):
        # phase 1, the router passes of every micro-batch (no gradient) give the batch's counts
        aux = self.aux_coef
        spec = self.config.text.moe if self.family else None
        stats: list = []
        mine = [item for item in shards if item is not None]
        if aux:
            for g, shard in mine:
                attn, comm = self._attention(g)
                stats += self.model.router_pass(*shard, attn)
                self.tensors_sent += comm.tensors_sent if comm is not None else 0
            totals = moe.batch_totals(stats, spec.num_experts, device=self.device)   # every process calls it
            weights = moe.aux_weights(totals)
        # phase 2: each micro-batch's forward, its loss / total and its share of the load-balancing
        # loss, and its backward at once (its graph is freed before the next micro-batch runs)
        share = torch.zeros((), dtype=torch.float32, device=self.device)
        for g, shard in mine:
            loss_sum, comm = self._forward_loss(g, shard)
            objective = loss_sum / total
            if aux:
                mb_share = aux * moe.aux_share(self.model.router_stats, weights)
                objective = objective + mb_share
                share += mb_share.detach()
            elif spec is not None:     # the counts alone: no probability keeps its graph alive
                stats += [moe.RouterStats(st.counts, st.probs.detach(), st.rows) for st in self.model.router_stats]
            objective.backward()
            self.tensors_sent += comm.tensors_sent if comm is not None else 0
            local_loss += loss_sum.detach().float()
            local_tokens += int(shard[0].shape[0] if self.family else shard["targets"].shape[0])
        if spec is not None and not aux:   # tokens routed to each expert (every process calls this all-reduce)
            totals = moe.batch_totals(stats, spec.num_experts, device=self.device)
        if spec is not None:
            self.expert_tokens = (totals[:-1] / max(1, sum(spec.sparse))).tolist()
        if aux:
            # the loss reported: the shares of the rank's processes (each its own rows), once per rank
            local_loss += total * (self.tp.sum(share) if self.tp.size > 1 else share)
        # one flat all-reduce over the world (over the processes of this tp index under tensor
        # parallelism): every gradient, and the loss sum riding in the same buffer
        loss_sum = self.tp.reduce_grads(self.model, local_loss)
        return loss_sum / total, total, local_tokens

    def step(self, plan: Plan, samples: Sequence[Sample]) -> StepResult:
        """Forward, backward, gradient all-reduce and (with an optimizer) the parameter update."""
        t0 = time.perf_counter()
        loss, total, local_tokens = self.loss_and_grads(plan, samples)
        if self.optimizer is not None:
            self.optimizer.step()
        return StepResult(loss, total, time.perf_counter() - t0, local_tokens, self.expert_tokens)
