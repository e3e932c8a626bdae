"""The sparse mixture-of-experts block of the torch backend (Qwen3-MoE, Qwen3-VL-MoE), dropless,
with its experts split over a rank's tensor-parallel processes (expert parallelism inside a rank).

The block, as transformers defines it (`Qwen3MoeSparseMoeBlock`, `Qwen3VLMoeTextSparseMoeBlock`):
the router is one matrix `gate.weight` [E, d] whose logits go through a softmax over the E experts
(fp32); each token keeps its k most probable experts, their probabilities renormalised to sum to 1
when `norm_topk_prob`; expert e is a SwiGLU MLP on the fused `gate_up_proj[e]` [2 I, d] (gate rows
first, then up) and `down_proj[e]` [d, I]; the block's output is the weighted sum of the token's k
expert outputs. Every token reaches its k experts (no capacity, nothing dropped).

The expert computation sorts the token-expert pairs by expert and runs each expert once on its
contiguous rows (a grouped GEMM). Under tensor parallelism (`TensorParallel`, t processes a rank)
process j of a rank holds experts [j E/t, (j+1) E/t) (`npu_backend.tensor_parallel.shard_slices`) and 1/t of the rank's rows
(the stream's rows as sequence parallelism splits them, `TensorParallel.rows`); it routes its rows,
exchanges with every process of the rank how many pairs it sends to each expert (one
`all_to_all_single` of E counts), sends each pair's row to the process holding its expert (a second
`all_to_all_single`), runs its experts on the rows it received, and sends the results back the
same way (the backward pass runs the two exchanges in reverse). The router's weight then sees this
process's rows only, so its gradient is summed over the rank (`TensorParallel.reduce_grads`).

The load-balancing loss (Switch Transformer, arXiv 2101.03961, eqs. 4-6, as transformers'
`load_balancing_loss_func` adds it with `output_router_logits`): over the live tokens of the batch
and the sparse layers, f_e = (pairs routed to e) / rows and P_e = (sum of e's router probability) /
rows, rows = live tokens x sparse layers; loss = E sum_e f_e P_e. Each block returns its live rows'
counts (no gradient) and probability sums (`RouterStats`); `aux_loss_terms` makes of them the share
of one process, whose sum over every process is the batch's loss and whose gradient is exact once
the counts are summed over the world (`batch_totals`, which also gives a step's tokens per expert).
With the counts known, w_e = E C_e / R^2 (`aux_weights`) makes the loss linear in the probability
sums, so a step adds it micro-batch by micro-batch (`aux_share`; `npu_backend.executor`).

Checkpoints: `fused_experts` reads the experts of any published layout into transformers' fused
one; both engines' savers write them in the family's published layout
(`dhp_jax.model.hf.checkpoint.saved_weights`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dhp_jax.model.hf import expert_layouts as xl
from dhp_jax.model.hf.spec import default_router_aux_loss_coef

GATE = "mlp.gate.weight"
GATE_UP, DOWN = xl.GATE_UP, xl.DOWN


@dataclasses.dataclass
class RouterStats:
    """One sparse block's routing of this process's live rows: `counts` [E] pairs per expert (float,
    no gradient), `probs` [E] the sum of each expert's router probability (with gradient), `rows`."""

    counts: torch.Tensor
    probs: torch.Tensor
    rows: int


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probabilities [n, E] fp32, weights [n, k] in x's dtype, experts [n, k]) of rows x [n, d]."""
    probs = torch.softmax(F.linear(x, weight), dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return probs, top.to(x.dtype), experts


def run_experts(x: torch.Tensor, sizes: list[int], gate_up: torch.Tensor, down: torch.Tensor,
                act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Rows x [m, d] grouped by expert, `sizes[e]` rows for local expert e: each expert's SwiGLU MLP
    on its rows (gate_up [e_local, 2 I, d], down [e_local, d, I])."""
    out, lo = [], 0
    for e, n in enumerate(sizes):
        if n:
            gate, up = F.linear(x[lo:lo + n], gate_up[e]).chunk(2, dim=-1)
            out.append(F.linear(act(gate) * up, down[e]))
        lo += n
    return torch.cat(out) if out else x.new_zeros((0, down.shape[1]))


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows over a group, `send[p]` rows to process p, `recv[p]` from it;
    backward sends the gradient back along the same pairs (the splits swapped)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):  # type: ignore[override]
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        out = g.new_empty((sum(ctx.send), *g.shape[1:]))
        dist.all_to_all_single(out, g.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def exchange_counts(per_expert: torch.Tensor, t: int, group: Any) -> torch.Tensor:
    """[t, E/t]: row p holds how many pairs process p sends to each of this process's experts
    (`per_expert` [E]: this process's pairs per expert, in expert order; one all-to-all)."""
    got = torch.empty_like(per_expert)
    dist.all_to_all_single(got, per_expert.contiguous(), group=group)
    return got.view(t, -1)


def dispatch_compute_combine(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                             gate_up: torch.Tensor, down: torch.Tensor, num_experts: int,
                             act: Callable[[torch.Tensor], torch.Tensor], tp: Any = None) -> torch.Tensor:
    """sum_j weights[:, j] * expert_{experts[:, j]}(x) for rows x [n, d]. Without `tp` every expert
    is local; with it the experts are split over the rank's t processes (gate_up/down: this
    process's E/t) and the pairs travel by all-to-all."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)              # pairs sorted by expert (then token, slot)
    per_expert = torch.bincount(flat, minlength=num_experts)
    rows = x[order // k]
    if tp is None or tp.size == 1:
        y = run_experts(rows, per_expert.tolist(), gate_up, down, act)
    else:
        t = tp.size
        local = num_experts // t
        got = exchange_counts(per_expert, t, tp.group)      # [source process, local expert]
        send = per_expert.view(t, local).sum(1).tolist()
        recv = got.sum(1).tolist()
        arrived = _AllToAll.apply(rows, send, recv, tp.group)  # by source process, then by expert
        # regroup the arrived rows by local expert (then source), run, and put them back
        src = torch.repeat_interleave(torch.arange(t * local, device=got.device), got.reshape(-1))
        by_expert = torch.argsort(src % local * t + src // local, stable=True)
        out = run_experts(arrived[by_expert], got.sum(0).tolist(), gate_up, down, act)
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
        y = _AllToAll.apply(out[back], recv, send, tp.group)
    unsorted = torch.empty_like(order)
    unsorted[order] = torch.arange(order.numel(), device=order.device)
    y = y[unsorted].view(n, k, -1) * weights[:, :, None]
    return y.sum(dim=1)


def sparse_block(x: torch.Tensor, gate: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                 norm_topk_prob: bool, act: Callable[[torch.Tensor], torch.Tensor], tp: Any = None,
                 live: torch.Tensor | None = None) -> tuple[torch.Tensor, RouterStats]:
    """The sparse MoE block on rows x [n, d] (this process's rows under tensor parallelism): its
    output [n, d] and the routing statistics of the rows `live` marks (all when None)."""
    num_experts = gate.shape[0]
    probs, weights, experts = route(x, gate, top_k, norm_topk_prob)
    y = dispatch_compute_combine(x, weights, experts, gate_up, down, num_experts, act, tp)
    mask = torch.ones(x.shape[0], dtype=probs.dtype, device=x.device) if live is None else live.to(probs.dtype)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=x.device).index_add_(
        0, experts.reshape(-1), mask.repeat_interleave(top_k)).detach()
    stats = RouterStats(counts, (probs * mask[:, None]).sum(0), int(mask.sum()))
    return y, stats


def aux_loss_terms(stats: list[RouterStats], total_counts: torch.Tensor, total_rows: int) -> torch.Tensor:
    """This process's share of the load-balancing loss E sum_e f_e P_e: E sum_e (C_e / R)(p_e / R),
    C the pairs per expert of the whole batch and every sparse layer (`total_counts`, summed over
    the world), R = `total_rows` (live tokens x sparse layers), p_e this process's probability sums.
    The shares of every process add up to the loss, and each share's gradient is the loss's
    gradient through this process's rows."""
    if not stats:
        return total_counts.new_zeros(())
    probs = torch.stack([s.probs for s in stats]).sum(0)
    return total_counts.numel() * torch.sum(total_counts / total_rows * probs / total_rows)


def aux_weights(totals: torch.Tensor) -> torch.Tensor:
    """[E]: the weights w_e = E C_e / R^2 of the batch's `batch_totals` (C the pairs per expert,
    R the live rows; no gradient), with which the load-balancing loss is sum_e w_e P_e: linear in
    the probability sums, so each micro-batch's share is `aux_share` of its own blocks (zeros for a
    batch without a live row; `dhp_jax.model.hf.moe.aux_weights`, the JAX engine's)."""
    counts, rows = totals[:-1].detach(), float(totals[-1])
    return counts * 0 if rows <= 0 else counts.numel() * counts / (rows * rows)


def aux_share(stats: list[RouterStats], weights: torch.Tensor) -> torch.Tensor:
    """sum_e w_e p_e over the `RouterStats` of the blocks of one forward pass (this process's rows):
    that pass's share of the load-balancing loss and of its gradient, given the batch's `aux_weights`."""
    if not stats:
        return weights.new_zeros(())
    return torch.sum(weights * torch.stack([s.probs for s in stats]).sum(0))


def aux_loss_coef(config: Any) -> float:
    """The load-balancing loss's weight of a family's `HFConfig` when the run sets none: transformers'
    rule, shared with the JAX engine (`dhp_jax.model.hf.spec.default_router_aux_loss_coef`)."""
    return default_router_aux_loss_coef(config)


def batch_totals(stats: list[RouterStats], num_experts: int, group: Any = None,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """[E + 1]: the pairs routed to each expert and the live rows, over every sparse block of
    `stats` (the `RouterStats` of the blocks this process ran this step), summed over `group` (one
    all-reduce that every process of `group` calls; None: the world; none when torch.distributed
    is not initialised; `device`: where the sums live when `stats` is empty)."""
    totals = torch.zeros(num_experts + 1, device=stats[0].counts.device if stats else device)
    for s in stats:
        totals[:-1] += s.counts
        totals[-1] += s.rows
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals, group=group)
    return totals


def batch_aux_loss(stats: list[RouterStats], num_experts: int, group: Any = None,
                   totals: torch.Tensor | None = None) -> torch.Tensor:
    """This process's share of the batch's load-balancing loss (`aux_loss_terms`) from the
    `RouterStats` of every sparse block it ran this step and their `batch_totals` over `group`
    (computed here when not given)."""
    totals = batch_totals(stats, num_experts, group) if totals is None else totals
    if not stats or float(totals[-1]) == 0:
        return totals.new_zeros(())
    return aux_loss_terms(stats, totals[:-1], float(totals[-1]))


# ---------------------------------------------------------------------------------------- checkpoints
def fused_experts(named: Any, config: Any, where: str) -> Any:
    """The (name, array) pairs of a checkpoint with every sparse layer's experts fused as
    transformers holds them (`GATE_UP` [E, 2 I, d], `DOWN` [E, d, I]), whatever layout
    (`dhp_jax.model.hf.expert_layouts`) they are stored in: per-expert matrices stacked (gate rows, then up rows); a fused weight whose
    shape is not transformers' transposed (dims 1 and 2, as transformers' loader does). A missing
    expert matrix is an error naming it and `where`."""
    spec = getattr(config.text, "moe", None)
    pending: dict[str, dict[tuple[int, str], Any]] = {}
    for name, w in named:
        key = xl.per_expert_name(name) if spec is not None else None
        if key is not None:
            pending.setdefault(key[0], {})[key[1], key[2]] = w
            continue
        if spec is not None and name.endswith((GATE_UP, DOWN)):
            e, i, d = spec.num_experts, spec.intermediate_size, config.text.hidden_size
            want = (e, 2 * i, d) if name.endswith(GATE_UP) else (e, d, i)
            if tuple(w.shape) != want:
                if tuple(w.shape) != (want[0], want[2], want[1]):
                    raise ValueError(f"{where}: {name} has shape {tuple(w.shape)}, the config needs {want}")
                w = w.swapaxes(1, 2)
        yield name, w
    for prefix, mats in sorted(pending.items()):
        yield from xl.fuse(prefix, mats, spec.num_experts, where)
