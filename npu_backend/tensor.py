"""Tensor parallelism inside a rank for the torch backend (Megatron-LM, arXiv 1909.08053, sec. 3).

With `tensor_parallel` = t a *rank* of a plan is t consecutive processes of one node: processes
r t .. r t + t - 1 are rank r, and process r t + j is its tp index j. A plan's `num_ranks` is
world / t and its groups stay in rank units (the Plan contract does not change); the CP traffic of
a group runs, as without tensor parallelism, by point-to-point sends on the world group, between
the processes of the group's ranks that share a tp index (each carries its own heads).

Process groups, created once by `TensorParallel.create` (`new_group` is collective: every process
creates every group, in the same order): one per rank (its t processes: the all-reduces of the
split layers) and one per tp index (the world / t processes holding the same shard: the gradient
all-reduce). Plans that change every step create none.

The split of the stand-in model (`npu_backend.model.TorchMLLM`), in the decoder and the vision
encoder alike: q, k, v and the MLP's gate and up matrices by rows of the torch weight (heads and
MLP width over the t processes), the output projection and the MLP's down matrix by columns, whose
partial outputs one all-reduce over the rank sums; norms, residuals, the patch embedding and the
projector are replicated (the activations between the split layers are whole on every process:
Megatron's form without sequence parallelism). Autograd sees Megatron's two operators: `enter`
(f: identity forward, all-reduce of the gradient backward) before a column-split matrix and `exit`
(g: all-reduce forward, identity backward) after a row-split one. The embedding and the LM head
are vocab-parallel: each process holds ceil(V / t) consecutive vocabulary rows (the last fewer),
the lookup is masked and summed over the rank, and the cross entropy combines the shards' max,
sum of exponentials and target logit with all-reduces (no process holds whole logits).

KV heads: with kv % t = 0 each process holds kv / t of them; with fewer kv heads than t (t % kv = 0)
each process holds the one kv head its query heads read, replicated on t / kv processes, and the
gradients of the replicas are summed over the rank. Any other head count is refused, naming the
model, the field and t (`dhp_jax.planner.cost.tensor.check_tensor_parallel`, the planner's check).
The Hugging Face families (`npu_backend.hf`) do not run tensor parallelism yet.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dhp_jax.planner.cost.tensor import check_node, check_tensor_parallel

# (field of the model shape the planner's check reads, the MLLMConfig field behind it)
_SHAPE_FIELDS = {"heads": "num_heads", "kv_heads": "num_kv_heads", "intermediate": "d_ff",
                 "vision_heads": "vision_heads", "vision_intermediate": "vision_ff"}


def check_model(config: Any, t: int) -> None:
    """A ValueError naming the model, the `MLLMConfig` field and t unless t splits every layer evenly."""
    shape = types.SimpleNamespace(**{k: getattr(config, f) for k, f in _SHAPE_FIELDS.items()},
                                  FIELD_NAMES={k: f"MLLMConfig.{f}" for k, f in _SHAPE_FIELDS.items()})
    check_tensor_parallel(shape, t, f"model {getattr(config, 'name', '?')!r}")
    if config.vocab_size < t or -(-config.vocab_size // t) * (t - 1) >= config.vocab_size:
        raise ValueError(f"model {getattr(config, 'name', '?')!r}: tensor_parallel {t} leaves a process no "
                         f"row of the vocabulary (MLLMConfig.vocab_size = {config.vocab_size})")


def shard_slices(config: Any, t: int, j: int) -> dict[str, tuple[int, int, int]]:
    """{parameter name: (dim, start, stop)} of the slice tp index j of t holds; other parameters are whole."""
    out: dict[str, tuple[int, int, int]] = {}
    per_v = -(-config.vocab_size // t)
    for name in ("embed.weight", "lm_head.weight"):
        out[name] = (0, j * per_v, min(config.vocab_size, (j + 1) * per_v))

    def block(prefix: str, heads: int, kv: int, d: int, ff: int) -> None:
        hq = heads // t
        kv_lo = j * (kv // t) if kv % t == 0 else j // (t // kv)   # first kv head held
        kv_n = kv // t if kv % t == 0 else 1
        out[f"{prefix}.attn.q.weight"] = (0, j * hq * d, (j + 1) * hq * d)
        for m in ("k", "v"):
            out[f"{prefix}.attn.{m}.weight"] = (0, kv_lo * d, (kv_lo + kv_n) * d)
        out[f"{prefix}.attn.o.weight"] = (1, j * hq * d, (j + 1) * hq * d)
        for m in ("gate", "up"):
            out[f"{prefix}.mlp.{m}.weight"] = (0, j * ff // t, (j + 1) * ff // t)
        out[f"{prefix}.mlp.down.weight"] = (1, j * ff // t, (j + 1) * ff // t)

    c = config
    for i in range(c.num_layers):
        block(f"layers.{i}", c.num_heads, c.num_kv_heads, c.head_dim, c.d_ff)
    for i in range(c.vision_layers):
        block(f"vision_layers.{i}", c.vision_heads, c.vision_heads, c.vision_head_dim, c.vision_ff)
    return out


def _all_reduce(x: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, op=op, group=group)
    return x


class _Enter(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient over the rank backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return _all_reduce(g, ctx.group), None


class _Exit(torch.autograd.Function):
    """Megatron's g: all-reduce over the rank forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g, None


@dataclasses.dataclass
class TensorParallel:
    """One process's place in a world of ranks of `size` processes, with its two process groups.

    `rank`: its plan rank (process // size); `index`: its tp index (process % size); `group`: the
    rank's processes (None when size is 1); `replicas`: the processes of every rank at this tp
    index (None: the world, when size is 1)."""

    size: int
    world: int
    process: int
    group: Any = None
    replicas: Any = None
    vocab_range: tuple[int, int] = (0, 0)

    @property
    def rank(self) -> int:
        return self.process // self.size

    @property
    def index(self) -> int:
        return self.process % self.size

    @property
    def num_ranks(self) -> int:
        return self.world // self.size

    @classmethod
    def create(cls, world: int | None = None, t: int = 1) -> "TensorParallel":
        """Every process calls this once, after init_process_group, with the same t (collective for t > 1)."""
        world = dist.get_world_size() if world is None else int(world)
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tensor_parallel must be a positive integer, got {t!r}")
        if world % t:
            raise ValueError(f"tensor_parallel {t} does not divide the world of {world} processes")
        check_node(int(os.environ.get("LOCAL_WORLD_SIZE", world)), t)
        tp = cls(t, world, dist.get_rank())
        if t > 1:
            for r in range(world // t):          # every process creates every group, in this order
                g = dist.new_group(list(range(r * t, (r + 1) * t)))
                if r == tp.rank:
                    tp.group = g
            for j in range(t):
                g = dist.new_group(list(range(j, world, t)))
                if j == tp.index:
                    tp.replicas = g
        return tp

    def process_of(self, rank: int) -> int:
        """The process of plan rank `rank` that holds this process's shard."""
        return rank * self.size + self.index

    # ------------------------------------------------------------------ the model
    def shard(self, model: Any) -> None:
        """Keep only this process's slices of a whole `TorchMLLM` (same weights on every process), in
        place: the parameters stay the same objects (an optimizer made before still holds them)."""
        if self.size == 1:
            return
        from npu_backend.model import TorchMLLM

        if not isinstance(model, TorchMLLM):
            raise ValueError(f"tensor parallelism runs the stand-in TorchMLLM only, not {type(model).__name__} "
                             f"(the Hugging Face families: not yet)")
        c = model.config
        check_model(c, self.size)
        params = dict(model.named_parameters())
        slices = shard_slices(c, self.size, self.index)
        with torch.no_grad():
            for name, (dim, a, b) in slices.items():
                params[name].data = params[name].data.narrow(dim, a, b - a).clone()
        for blocks, heads, kv in ((model.layers, c.num_heads, c.num_kv_heads),
                                  (model.vision_layers, c.vision_heads, c.vision_heads)):
            for blk in blocks:
                blk.attn.heads, blk.attn.kv_heads = heads // self.size, max(1, kv // self.size)
                blk.attn.tp = blk.mlp.tp = self
        self.vocab_range = slices["embed.weight"][1:]
        model.tp = self

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return _Enter.apply(x, self.group)

    def exit(self, y: torch.Tensor) -> torch.Tensor:
        return _Exit.apply(y, self.group)

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The vocab-parallel lookup: this process's rows, zeros for the others', summed over the rank."""
        lo, hi = self.vocab_range
        inside = (ids >= lo) & (ids < hi)
        local = F.embedding(torch.where(inside, ids - lo, 0), weight) * inside[:, None].to(weight.dtype)
        return self.exit(local)

    def token_loss_sum(self, logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`npu_backend.model.token_loss_sum` of vocab-parallel logits[S, V/t] (the same on every process)."""
        lo, hi = self.vocab_range
        m = _all_reduce(logits.detach().amax(dim=-1), self.group, dist.ReduceOp.MAX)
        lse = m + torch.log(self.exit(torch.exp(logits - m[:, None]).sum(dim=-1)))
        targets = targets.long()
        inside = (targets >= lo) & (targets < hi)
        picked = torch.gather(logits, -1, torch.where(inside, targets - lo, 0)[:, None])[:, 0]
        picked = self.exit(picked * inside.to(logits.dtype))
        return torch.sum((lse - picked) * weights.to(logits.dtype))

    # ------------------------------------------------------------------ gradients and state
    def _replicated_kv(self, model: Any) -> list[str]:
        c = model.config
        if self.size == 1 or c.num_kv_heads % self.size == 0:
            return []
        return [f"layers.{i}.attn.{m}.weight" for i in range(c.num_layers) for m in ("k", "v")]

    def reduce_grads(self, model: Any, local_loss: torch.Tensor) -> float:
        """Sum the gradients of this process's shard over the ranks (and a replicated kv head's over its
        replicas in the rank) in place; returns the loss summed over the ranks. Two all-reduces at
        most: one over the rank (replicated kv heads only), one over the tp index's processes."""
        params = dict(model.named_parameters())
        for p in params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        kv = self._replicated_kv(model)
        if kv:   # each replica puts its gradient at its head's rows of the whole weight; sum over the rank
            c, d = model.config, model.config.head_dim
            head = self.index // (self.size // c.num_kv_heads)
            g0 = params[kv[0]].grad
            full = g0.new_zeros(len(kv), c.num_kv_heads * d, c.d_model)
            for n, name in enumerate(kv):
                full[n, head * d:(head + 1) * d] = params[name].grad
            dist.all_reduce(full, group=self.group)
            for n, name in enumerate(kv):
                params[name].grad = full[n, head * d:(head + 1) * d].clone()
        dtype = next(iter(params.values())).dtype
        flat = torch.cat([p.grad.reshape(-1) for p in params.values()] + [local_loss.to(dtype).reshape(1)])
        dist.all_reduce(flat, group=self.replicas)
        off = 0
        for p in params.values():
            n = p.numel()
            p.grad = flat[off:off + n].view_as(p).clone()
            off += n
        return float(flat[-1])

    def gather(self, model: Any, grads: bool = False) -> dict[str, torch.Tensor]:
        """{name: whole tensor} of the parameters (or their gradients) on every process of the rank
        (collective over the rank): what one process without tensor parallelism holds."""
        def value(p):
            t = p.grad if grads else p
            return (torch.zeros_like(p) if t is None else t).detach()

        params = dict(model.named_parameters())
        if self.size == 1:
            return {n: value(p).clone() for n, p in params.items()}
        c = model.config
        every = [shard_slices(c, self.size, j) for j in range(self.size)]
        out = {}
        for name, p in params.items():
            local = value(p)
            if name not in every[0]:
                out[name] = local.clone()
                continue
            dim = every[0][name][0]
            size = max(b - a for _, a, b in (s[name] for s in every))
            pad = list(local.shape)
            pad[dim] = size - local.shape[dim]
            buf = torch.cat([local, local.new_zeros(pad)], dim=dim) if pad[dim] else local.contiguous()
            parts = [torch.empty_like(buf) for _ in range(self.size)]
            dist.all_gather(parts, buf, group=self.group)
            shape = list(local.shape)
            shape[dim] = max(s[name][2] for s in every)
            whole = local.new_zeros(shape)
            for j, s in enumerate(every):
                _, a, b = s[name]
                whole.narrow(dim, a, b - a).copy_(parts[j].narrow(dim, 0, b - a))
            out[name] = whole
        return out
