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
model, the field and t (`dhp_jax.planner.cost.tensor_parallel.check_tensor_parallel`, the planner's check).

The Hugging Face families (`npu_backend.hf.TorchFamilyModel`): their LLM is split the same way
(q/k/v weights and biases, gate/up; o_proj and down_proj; the embedding, and the LM head or the
tied embedding, vocab-parallel; the per-head q/k norm scales whole, their gradient summed over the
rank since each process normalises its own heads), and so are the blocks of their vision encoder
(`vision_slices`; every process of a rank runs the encoder on the rank's vision rows, its own heads
and MLP width): InternViT's q/k/v (and biases), Qwen2.5-VL's and Qwen3-VL's fused `qkv` [3 H D, d]
by heads inside each of its three parts, and the MLP's first matrices (fc1; gate and up) with their
biases by column; the attention output (`projection_layer`, `proj`) and the MLP's last matrix (fc2,
down) by row, their bias whole and added once, after the sum. InternViT's QK-norm (RMSNorm over all
heads) sums its squares over the rank (`TensorParallel.sum`); its layer scales, the norms, the
patch and position embeddings, Qwen's mergers (DeepStack's too) and InternVL's projector are
replicated. The vision heads and MLP width must split over t like the LLM's (`check_model`).

Mixture-of-experts layers (`npu_backend.moe`): a sparse block's experts are split by expert (process
j of a rank holds experts [j E/t, (j+1) E/t) of `mlp.experts.gate_up_proj` and `down_proj`), its
router whole; the block runs on the rows sequence parallelism gives a process (with or without it)
and its tokens travel to their experts' processes by all-to-all, so the router's gradient is summed
over the rank (`row_params`). E must split over t (`check_model`).

Sequence parallelism (`create(..., sequence=True)`; Megatron-LM, arXiv 2205.05198, sec. 4.2.2), in
every block of the stand-in and of the families alike: between the split matrices each process
holds 1/t of its rank's rows (`sequence_rows`: the stream padded to a multiple of t, the JAX
engine's rule), so the norms, the residuals and what autograd keeps of them are 1/t a process. The
stream is split before a block stack (`rows`: slice forward, all-gather of the gradient backward)
and joined after it (`stream`: all-gather forward, this process's rows of the gradient backward);
inside, a norm's output is all-gathered before the column-split matrices (`gather_linear`: the
gathered rows are saved for the weight gradients, as the JAX engine's autodiff keeps them; reduce-
scatter of the input's gradient) and a row-split matrix's partial output is reduce-scattered (`scatter`: all-gather of the
gradient backward), its bias added once after it. The whole parameters that act on a process's rows
only (`sequence_params`: the blocks' norms, the row-split biases, InternViT's layer scales) have
their gradients summed over the rank in `reduce_grads`.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dhp_jax import models
from dhp_jax.model.mllm_config import split_shape
from dhp_jax.planner.cost.tensor_parallel import check_node, check_tensor_parallel
from npu_backend import moe

# (field of the model shape the planner's check reads, the MLLMConfig field behind it)
# the names of a block's seven split matrices: the stand-in's, and the families' LLM (transformers)
_STAND_IN = {"q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.o", "gate": "mlp.gate", "up": "mlp.up",
             "down": "mlp.down"}
_FAMILY = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
FAMILY_LAYERS = "model.language_model.layers"
FAMILY_EMBED = "model.language_model.embed_tokens.weight"


def _is_family(model: Any) -> bool:
    from npu_backend.hf import TorchFamilyModel

    return isinstance(model, TorchFamilyModel)


def _family_widths(config: Any) -> tuple[int | None, int | None]:
    """(LLM MLP width, vision MLP width) of a family's config.json (None where it does not say)."""
    raw = getattr(config, "raw", None) or {}
    return (raw.get("text_config", {}).get("intermediate_size"), raw.get("vision_config", {}).get("intermediate_size"))


def check_model(config: Any, t: int, intermediate: int | None = None, vision_intermediate: int | None = None) -> None:
    """A ValueError naming the model, the config field and t unless t splits every layer evenly: an
    `MLLMConfig`, or a family's `HFConfig` (its LLM and its vision encoder; `intermediate`,
    `vision_intermediate`: their MLP widths, read from config.json when not given)."""
    if hasattr(config, "text"):       # a family: the LLM and the vision encoder are split
        sh = config.text.shape
        raw_inter, raw_vinter = _family_widths(config)
        shape = types.SimpleNamespace(
            heads=sh.num_heads, kv_heads=sh.num_kv_heads,
            intermediate=int(intermediate if intermediate is not None else raw_inter or 0),
            vision_heads=int(config.vision.num_heads),
            vision_intermediate=int(vision_intermediate if vision_intermediate is not None else raw_vinter or 0))
        vocab, field = config.vocab_size, "text_config.vocab_size"
    else:
        shape = split_shape(config)
        vocab, field = config.vocab_size, "MLLMConfig.vocab_size"
    check_tensor_parallel(shape, t, f"model {getattr(config, 'name', '?')!r}")
    spec = getattr(getattr(config, "text", None), "moe", None)
    if spec is not None and any(spec.sparse) and spec.num_experts % t:
        raise ValueError(f"model {getattr(config, 'name', '?')!r}: tensor_parallel {t} cannot split "
                         f"text_config.num_experts = {spec.num_experts} (a rank's processes hold E / t experts each)")
    if vocab < t or -(-vocab // t) * (t - 1) >= vocab:
        raise ValueError(f"model {getattr(config, 'name', '?')!r}: tensor_parallel {t} leaves a process no "
                         f"row of the vocabulary ({field} = {vocab})")


def shard_slices(model: Any, t: int, j: int) -> dict[str, tuple[int, ...]]:
    """{parameter name: (dim, start, stop[, parts])} of the slice tp index j of t holds (`part`); other
    parameters are whole."""
    out: dict[str, tuple[int, ...]] = {}
    params = dict(model.named_parameters())
    family = _is_family(model)
    c = model.config
    per_v = -(-c.vocab_size // t)
    for name in ((FAMILY_EMBED, "lm_head.weight") if family else ("embed.weight", "lm_head.weight")):
        if name in params:
            out[name] = (0, j * per_v, min(c.vocab_size, (j + 1) * per_v))

    def block(prefix: str, names: dict, heads: int, kv: int, d: int) -> None:
        n = {k: f"{prefix}.{v}" for k, v in names.items()}
        sparse = f"{prefix}.{moe.GATE_UP}" in params       # a sparse MoE block: its experts split instead
        hq = heads // t
        ff = 0 if sparse else params[n["gate"] + ".weight"].shape[0] // t
        kv_lo = j * (kv // t) if kv % t == 0 else j // (t // kv)   # first kv head held
        kv_n = kv // t if kv % t == 0 else 1
        rows = {"q": (j * hq * d, (j + 1) * hq * d), "k": (kv_lo * d, (kv_lo + kv_n) * d),
                "v": (kv_lo * d, (kv_lo + kv_n) * d), "gate": (j * ff, (j + 1) * ff), "up": (j * ff, (j + 1) * ff)}
        if sparse:      # tp index j holds experts [j E/t, (j+1) E/t) (`npu_backend.moe`)
            experts = params[f"{prefix}.{moe.GATE_UP}"].shape[0] // t
            for m in ("gate", "up"):
                del rows[m]
            for name in (moe.GATE_UP, moe.DOWN):
                out[f"{prefix}.{name}"] = (0, j * experts, (j + 1) * experts)
        for m, (a, b) in rows.items():
            for leaf in ("weight", "bias"):
                if f"{n[m]}.{leaf}" in params:
                    out[f"{n[m]}.{leaf}"] = (0, a, b)
        out[n["o"] + ".weight"] = (1, *rows["q"])        # a row-split matrix's bias (if any) stays whole
        if not sparse:
            out[n["down"] + ".weight"] = (1, *rows["gate"])

    if family:
        sh = c.text.shape
        for i in range(c.text.num_layers):
            block(f"{FAMILY_LAYERS}.{i}", _FAMILY, sh.num_heads, sh.num_kv_heads, sh.head_dim)
        out.update(vision_slices(model, t, j))
        return out
    for i in range(c.num_layers):
        block(f"layers.{i}", _STAND_IN, c.num_heads, c.num_kv_heads, c.head_dim)
    for i in range(c.vision_layers):
        block(f"vision_layers.{i}", _STAND_IN, c.vision_heads, c.vision_heads, c.vision_head_dim)
    return out


def vision_slices(model: Any, t: int, j: int) -> dict[str, tuple[int, ...]]:
    """The slices of a family's vision encoder blocks tp index j of t holds (`shard_slices`): per block,
    the attention's q/k/v (weights and biases; a fused `qkv` [3 H D, d] by heads inside each of its
    three parts: (dim, start, stop, 3)) and the MLP's first matrices (and biases) by rows, the output
    projection and the MLP's last matrix by columns (their biases whole: added once, after the sum);
    InternViT's QK-norm scales [H D] as q and k. Norms, layer scales, the patch and position
    embeddings, the mergers and the projector stay whole."""
    c, params = model.config, dict(model.named_parameters())
    out: dict[str, tuple[int, ...]] = {}

    def put(name: str, sl: tuple[int, ...], leaves=("weight", "bias")) -> None:
        for leaf in leaves:
            if f"{name}.{leaf}" in params:
                out[f"{name}.{leaf}"] = sl

    # the family's blocks (its `torch_model.vision_split`)
    models.spec(c.family).engine_module("torch").vision_split(c, params, j, t, put, out)
    return out


def sequence_params(model: Any) -> list[str]:
    """Names of the whole (unsplit) parameters that sequence parallelism applies to this process's
    rows only, so their gradient is a sum over the rank (Megatron's all-reduce of the layer-norm
    gradients, arXiv 2205.05198 sec. 4.2.2): the norms inside the sequence-parallel blocks, the
    biases of the row-split matrices (added after the reduce-scatter) and InternViT's layer scales."""
    params = dict(model.named_parameters())
    if not _is_family(model):
        return [n for n in params if n.startswith(("layers.", "vision_layers.")) and n.endswith("norm.scale")]
    c = model.config
    locals_ = [(f"{FAMILY_LAYERS}.{i}", ("input_layernorm", "post_attention_layernorm", "self_attn.o_proj",
                                         "mlp.down_proj")) for i in range(c.text.num_layers)]
    more, extra = models.spec(c.family).engine_module("torch").sequence_locals(c)   # the encoder's
    locals_ += more
    out = [f"{b}.{m}.{leaf}" for b, mods in locals_ for m in mods for leaf in ("weight", "bias")
           if f"{b}.{m}.{leaf}" in params and not (leaf == "weight" and m.endswith(("proj", "projection_layer", "fc2")))]
    return out + [n for n in extra if n in params]


def part(x: torch.Tensor, sl: tuple[int, ...]) -> torch.Tensor:
    """The slice `sl` = (dim, start, stop[, parts]) of a whole tensor x: rows start..stop of dim, or
    with `parts` those rows of each of the `parts` equal pieces of dim, concatenated."""
    dim, a, b = sl[:3]
    parts = sl[3] if len(sl) > 3 else 1
    if parts == 1:
        return x.narrow(dim, a, b - a)
    return x.unflatten(dim, (parts, -1)).narrow(dim + 1, a, b - a).flatten(dim, dim + 1)


def put_part(whole: torch.Tensor, sl: tuple[int, ...], local: torch.Tensor) -> None:
    """Write `local` (the shape `part(whole, sl)` has) into its slice of `whole` (contiguous), in place."""
    dim, a, b = sl[:3]
    parts = sl[3] if len(sl) > 3 else 1
    if parts == 1:
        whole.narrow(dim, a, b - a).copy_(local)
    else:
        whole.unflatten(dim, (parts, -1)).narrow(dim + 1, a, b - a).copy_(local.unflatten(dim, (parts, -1)))


def _whole_size(every: list, name: str) -> int:
    """The size along its split dim of the whole parameter `name` (the slices of every tp index)."""
    sl = every[0][name]
    return max(s[name][2] for s in every) * (sl[3] if len(sl) > 3 else 1)


def _vision_width(model: Any) -> int:
    """The MLP width of a family's vision blocks, from its first block's first MLP matrix."""
    params, c = dict(model.named_parameters()), model.config
    return int(params[models.spec(c.family).engine_module("torch").VISION_MLP_FIRST].shape[0])


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


# all-gather / reduce-scatter into and out of one flat tensor (the *_single names where this torch has them)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def sequence_rows(s: int, t: int) -> tuple[int, int]:
    """(c, c / t): a stream of s rows split sequence-parallel over t processes is padded with zero rows
    to c, s rounded up to a multiple of t, and tp index j holds rows [j c/t, (j+1) c/t). This is the
    JAX engine's rule (`dhp_jax.model.mllm.sequence_chunks` / `sequence_rows`) with one chunk: the
    torch blocks run the whole stream in one pass (no `linear_chunk`)."""
    c = -(-s // t) * t
    return c, c // t


def _pad_rows(x: torch.Tensor, c: int) -> torch.Tensor:
    return x if x.shape[0] == c else torch.cat([x, x.new_zeros((c - x.shape[0],) + tuple(x.shape[1:]))])


def _gather_rows(x: torch.Tensor, group: Any, t: int) -> torch.Tensor:
    """[c/t, ...] on each process of the rank -> [c, ...], tp index order."""
    out = x.new_empty((x.shape[0] * t,) + tuple(x.shape[1:]))
    _ALL_GATHER(out, x.contiguous(), group=group)
    return out


def _scatter_rows(x: torch.Tensor, group: Any, t: int) -> torch.Tensor:
    """[c, ...] partial sums on each process -> this process's [c/t, ...] rows of their sum."""
    out = x.new_empty((x.shape[0] // t,) + tuple(x.shape[1:]))
    _REDUCE_SCATTER(out, x.contiguous(), group=group)
    return out


class _Rows(torch.autograd.Function):
    """A whole stream x[s, ...] (the same on every process) -> this process's rows [c/t, ...]; backward
    all-gathers the rows' gradients (what every process's replicated work before it needs)."""

    @staticmethod
    def forward(ctx, x, tp):  # type: ignore[override]
        c, n = sequence_rows(x.shape[0], tp.size)
        ctx.tp, ctx.s = tp, x.shape[0]
        return _pad_rows(x, c).narrow(0, tp.index * n, n).clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return _gather_rows(g, ctx.tp.group, ctx.tp.size)[:ctx.s], None


class _Stream(torch.autograd.Function):
    """Every process's rows [c/t, ...] -> the whole stream [s, ...] (all-gather) for work replicated on
    every process after it; backward keeps this process's rows of the (identical) gradient."""

    @staticmethod
    def forward(ctx, x, s, tp):  # type: ignore[override]
        ctx.tp, ctx.s = tp, s
        return _gather_rows(x, tp.group, tp.size)[:s]

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        c, n = sequence_rows(ctx.s, ctx.tp.size)
        return _pad_rows(g, c).narrow(0, ctx.tp.index * n, n).clone(), None, None


class _Scatter(torch.autograd.Function):
    """A row-split matrix's partial output y[s, ...] -> this process's rows of the sum over the rank
    (reduce-scatter; Megatron's g-bar); backward all-gathers the gradient (its g)."""

    @staticmethod
    def forward(ctx, y, tp):  # type: ignore[override]
        ctx.tp, ctx.s = tp, y.shape[0]
        return _scatter_rows(_pad_rows(y, sequence_rows(y.shape[0], tp.size)[0]), tp.group, tp.size)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return _gather_rows(g, ctx.tp.group, ctx.tp.size)[:ctx.s], None


class _GatherLinear(torch.autograd.Function):
    """The column-split matrices of one input under sequence parallelism (Megatron's g before them):
    x[c/t, d] this process's rows -> all-gathered over the rank -> the whole stream's first s rows (or
    its rows `rows` only) -> F.linear with each (weight, bias). The gathered input is saved for the
    weight gradients (the residual the JAX engine's autodiff keeps, `dhp_jax.model.mllm.split_block`),
    so backward runs one collective: the reduce-scatter of the input's gradient, the sum of every
    matrix's, back to the rows (arXiv 2205.05198, sec. 4.2.2; per block and pass 2 all-gathers and
    2 reduce-scatters, `dhp_jax.planner.cost.tensor_parallel.block_collectives`)."""

    @staticmethod
    def forward(ctx, x, s, rows, tp, *wb):  # type: ignore[override]
        ctx.tp, ctx.s, ctx.n = tp, s, len(wb) // 2
        ctx.biased = [b is not None for b in wb[1::2]]
        whole = _gather_rows(x, tp.group, tp.size)[:s]
        y = whole if rows is None else whole.index_select(0, rows)
        ctx.save_for_backward(y, rows, *wb[0::2])
        return tuple(F.linear(y, wb[2 * i], wb[2 * i + 1]) for i in range(ctx.n))

    @staticmethod
    def backward(ctx, *gs):  # type: ignore[override]
        y, rows, *ws = ctx.saved_tensors
        tp, s = ctx.tp, ctx.s
        gy = sum(g @ w for g, w in zip(gs, ws))
        grads: list = []
        for g, biased in zip(gs, ctx.biased):
            grads += [g.t() @ y, g.sum(0) if biased else None]
        gx = gy if rows is None else gy.new_zeros((s, gy.shape[1])).index_copy(0, rows, gy)
        c = sequence_rows(s, tp.size)[0]
        return (_scatter_rows(_pad_rows(gx, c), tp.group, tp.size), None, None, None, *grads)


class _Sum(torch.autograd.Function):
    """All-reduce over the rank forward and backward: a sum of the processes' partial values that
    every process then uses on its own slice (e.g. the sum of squares of a norm over split heads)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return _all_reduce(g, ctx.group), None


@dataclasses.dataclass
class TensorParallel:
    """One process's place in a world of ranks of `size` processes, with its two process groups.

    `rank`: its plan rank (process // size); `index`: its tp index (process % size); `group`: the
    rank's processes (None when size is 1); `replicas`: the processes of every rank at this tp
    index (None: the world, when size is 1)."""

    size: int
    world: int
    process: int
    sequence: bool = False    # sequence parallelism between the split matrices (arXiv 2205.05198)
    group: Any = None
    replicas: Any = None
    vocab_range: tuple[int, int] = (0, 0)
    slices: list = dataclasses.field(default_factory=list)    # shard_slices of every tp index (`shard`)
    row_params: list = dataclasses.field(default_factory=list)   # `sequence_params` of the model (`shard`)

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
    def create(cls, world: int | None = None, t: int = 1, sequence: bool = False) -> "TensorParallel":
        """Every process calls this once, after init_process_group, with the same t (collective for t > 1).
        `sequence`: sequence parallelism between the split matrices (needs t > 1)."""
        world = dist.get_world_size() if world is None else int(world)
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tensor_parallel must be a positive integer, got {t!r}")
        if not isinstance(sequence, bool):
            raise ValueError(f"sequence_parallel must be True or False, got {sequence!r}")
        if sequence and t == 1:
            raise ValueError("sequence_parallel needs tensor_parallel > 1 (it splits a rank's rows over its "
                             "processes; a rank of one process holds every row)")
        if world % t:
            raise ValueError(f"tensor_parallel {t} does not divide the world of {world} processes")
        check_node(int(os.environ.get("LOCAL_WORLD_SIZE", world)), t)
        tp = cls(t, world, dist.get_rank(), sequence)
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
        c, family = model.config, _is_family(model)
        params = dict(model.named_parameters())
        if family:
            dense = [p for p in (f"{FAMILY_LAYERS}.{i}.{_FAMILY['gate']}.weight" for i in range(c.text.num_layers))
                     if p in params]       # a dense MLP's width (none when every layer is sparse)
            check_model(c, self.size, params[dense[0]].shape[0] if dense else None,
                        _vision_width(model))
        else:
            check_model(c, self.size)
        self.slices = [shard_slices(model, self.size, j) for j in range(self.size)]   # of the whole model
        slices = self.slices[self.index]
        with torch.no_grad():
            for name, sl in slices.items():
                params[name].data = part(params[name].data, sl).clone()
        if not family:
            for blocks, heads, kv in ((model.layers, c.num_heads, c.num_kv_heads),
                                      (model.vision_layers, c.vision_heads, c.vision_heads)):
                for blk in blocks:
                    blk.attn.heads, blk.attn.kv_heads = heads // self.size, max(1, kv // self.size)
                    blk.attn.tp = blk.mlp.tp = self
        self.vocab_range = slices[FAMILY_EMBED if family else "embed.weight"][1:]
        # the routers of sparse MoE blocks act on this process's rows only (`npu_backend.moe`), in both forms
        routers = [n for n in params if n.endswith(moe.GATE)] if family else []
        self.row_params = (sequence_params(model) if self.sequence else []) + routers
        model.tp = self

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return _Enter.apply(x, self.group)

    def exit(self, y: torch.Tensor) -> torch.Tensor:
        return _Exit.apply(y, self.group)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the rank of each process's partial x (all-reduce forward and backward)."""
        return _Sum.apply(x, self.group)

    # ------------------------------------------------------------------ sequence parallelism
    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """This process's rows of a whole stream x[s, ...] (`sequence_rows`); backward all-gathers."""
        return _Rows.apply(x, self)

    def local_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This process's rows of a whole stream x (`rows`, padded with zeros/False; no gradient)."""
        c, n = sequence_rows(x.shape[0], self.size)
        return _pad_rows(x, c).narrow(0, self.index * n, n)

    def stream(self, x: torch.Tensor, s: int) -> torch.Tensor:
        """The whole stream [s, ...] from every process's rows (all-gather), for replicated work after it."""
        return _Stream.apply(x, s, self)

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """This process's rows of the sum over the rank of a row-split matrix's partial output y[s, ...]."""
        return _Scatter.apply(y, self)

    def gather_linear(self, x: torch.Tensor, s: int, layers: list, rows: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, ...]:
        """F.linear(w, b) for each (w, b) in `layers` (b may be None) of the whole stream's first s rows
        (or its rows `rows`), x this process's rows: the column-split matrices after a sequence-parallel
        norm (all-gather forward, reduce-scatter backward; the gathered rows are saved)."""
        return _GatherLinear.apply(x, s, rows, self, *(t for wb in layers for t in wb))

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
    def reduce_grads(self, model: Any, local_loss: torch.Tensor) -> float:
        """Sum the gradients of this process's shard over the ranks (and a replicated kv head's over its
        replicas in the rank, and under sequence parallelism `row_params`' over the rank) in place;
        returns the loss summed over the ranks. Two all-reduces at most: one over the rank (replicated
        kv heads, sequence-parallel norms), one over the tp index's processes."""
        params = dict(model.named_parameters())
        for p in params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        every = self.slices
        # slices held by more than one process of the rank (a kv head replicated when kv < t)
        shared = [n for n in (every[0] if every else ()) if len({s[n] for s in every}) < self.size]
        if shared or self.row_params:
            # each replica adds its gradient at its own rows of the whole tensor, and a sequence-parallel
            # norm or bias its gradient of this process's rows: both summed over the rank, in one buffer
            wholes = []
            for name in shared:
                sl = every[self.index][name]
                shape = list(params[name].shape)
                shape[sl[0]] = _whole_size(every, name)
                whole = params[name].grad.new_zeros(shape)
                put_part(whole, sl, params[name].grad)
                wholes.append(whole)
            wholes += [params[name].grad for name in self.row_params]
            buf = torch.cat([w.reshape(-1) for w in wholes])
            dist.all_reduce(buf, group=self.group)
            off = 0
            for name, whole in zip(shared + self.row_params, wholes):
                summed = buf[off:off + whole.numel()].view_as(whole)
                params[name].grad = (part(summed, every[self.index][name]) if name in shared else summed).clone()
                off += whole.numel()
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
        every = self.slices
        out = {}
        for name, p in params.items():
            local = value(p)
            if name not in every[0]:
                out[name] = local.clone()
                continue
            dim = every[0][name][0]
            held = [(s[name][2] - s[name][1]) * (s[name][3] if len(s[name]) > 3 else 1) for s in every]
            pad = list(local.shape)
            pad[dim] = max(held) - local.shape[dim]
            buf = torch.cat([local, local.new_zeros(pad)], dim=dim) if pad[dim] else local.contiguous()
            parts = [torch.empty_like(buf) for _ in range(self.size)]
            dist.all_gather(parts, buf, group=self.group)
            shape = list(local.shape)
            shape[dim] = _whole_size(every, name)
            whole = local.new_zeros(shape)
            for j, s in enumerate(every):
                put_part(whole, s[name], parts[j].narrow(dim, 0, held[j]))
            out[name] = whole
        return out
