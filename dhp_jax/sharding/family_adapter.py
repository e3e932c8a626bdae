"""`FamilyModel`: the `PlanExecutor`'s model adapter for the Hugging Face families (`dhp_jax.model.hf`).

`PlanExecutor(hf_config, devices=...)` composes one (`dhp_jax.sharding.executor.model_adapter`
picks the adapter by the config). The step is the executor's, the same as the stand-in's: the plan is checked and every group laid out before any
device work, the fp32 master params live as a flat vector sharded over the full mesh
(`shard`, `loss_and_grad_shards`: the trainer's path), one all-gather per step, each group's
program on its own sub-mesh (ring, Ulysses or hybrid attention of any degree), the groups'
gradient rows reduce-scattered into the state's shards, the token-weighted mean at the end.

What differs is the group: its samples are packed into the two streams of
`dhp_jax.model.hf.packed` (the LLM tokens and the encoder's patches before the merge, sharded
alike), and the program is the family's forward pass on a device's shard of them, attention by
the group's kind, differentiated with respect to the flat params. The loss is transformers':
each sample's labels shifted inside the sample (-100 ignored), summed over the batch and divided
by the number of counted labels.

The blocks run as the stand-in's do: `HFConfig.remat` recomputes every LLM layer and encoder
block in the backward pass (`layers.remat_block`: "layer" keeps the block input only, "selective"
`jax.checkpoint` with the GEMM outputs kept), and `linear_chunk` (the executor's, as for the
stand-in) cuts every block's token-local work (norms, projections, MLP) into chunks and skips
the dead ones (`mllm.split_block`): in the LLM stream a shard's padding tail, in the vision stream
the rows of text and padding slots (and InternVL's CLS rows off a tile's first token), which the
encoder's blocks run reordered live rows first (`layers.BlockStream`), so a rank computes its
real tokens and its live vision rows in whole chunks. Neither changes a value.

The block stacks (the encoder's blocks, the LLM's layers) run as one scan each over rows of the
flat params (`dhp_jax.model.hf.scan`: a slice and a reshape, no copy), with their own VJP, so a
group program's op count does not grow with depth. The params tree (and so the flat layout) is
taken from the first tree bound (`shard`, `loss_and_grads`, `bind`): the family's tree has no
shape table apart from a checkpoint.

With `tensor_parallel` t > 1 every block is split Megatron-style over a rank's t devices
(`dhp_jax.sharding.tensor_parallel`); `sequence_parallel=True` runs the LLM layers and the encoder's blocks
sequence-parallel (arXiv 2205.05198, `dhp_jax.model.hf.layers.BlockStream`: each device carries
1/t of the rows between the split matrices, the DeepStack features cut alike).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from dhp_jax.data.sample import Sample
from dhp_jax.model.hf.config import HFConfig
from dhp_jax.model.hf.packed import (LLM_INTS, TAPS, VISION_INTS, FamilyLayout, pack_family_group, patch_dim,
                                     rope_axes, unit)
from dhp_jax.model.hf import moe
from dhp_jax.model.hf.packed_forward import packed_loss_sum
from dhp_jax.model.hf.scan import BlockRows, block_stacks, stack_rows, with_stacks
from dhp_jax.sharding import tensor_parallel as tensor_split
from dhp_jax.sharding.flat import FlatLayout
from dhp_jax.sharding.sharded_state import require_float32, row_dtype
from dhp_jax.sharding.standin import ModelAdapter


def router_stats(sums: Any, config: HFConfig) -> dict[str, float]:
    """The router's figures of one step from the executor's `state.step_sums()` (a MoE family): tokens per
    expert (the (token, expert) pairs routed to each, summed over the sparse layers, / the sparse
    layers) max and mean, the pairs dropped (k x live rows - pairs routed: 0, the routing is
    dropless; a ValueError otherwise) and, when the step adds the load-balancing loss, its value
    `moe_aux_loss` (transformers' `aux_loss`, before the weight `router_aux_loss_coef`)."""
    import numpy as np
    moe_spec = config.text.moe
    sums = np.asarray(sums, np.float64)
    e = moe_spec.num_experts
    counts, rows = sums[:e], float(sums[e])
    layers = max(1, sum(moe_spec.sparse))
    dropped = moe_spec.top_k * rows - float(counts.sum())
    if abs(dropped) > 0.5:
        raise ValueError(f"router: {dropped:.0f} (token, expert) pairs dropped this step "
                         f"({counts.sum():.0f} routed of {moe_spec.top_k} x {rows:.0f} live rows over the sparse layers)")
    per = counts / layers
    out = {"moe_tokens_per_expert_max": float(per.max()), "moe_tokens_per_expert_mean": float(per.mean()),
           "moe_pairs_dropped": int(round(dropped))}
    if sums.shape[0] > e + 1:
        out["moe_aux_loss"] = float(sums[e + 1])
    return out


def family_program(config: HFConfig, layout: FlatLayout | tensor_split.TensorLayout, attn: Any, tensor_parallel: int = 1,
                   sequence_parallel: bool = False, aux: bool = False, router_only: bool = False):
    """The per-device body: (params flat[P_pad] in the compute dtype, the four stream shards) ->
    (stats f32[1, 2] = (loss sum, counted labels), for a MoE LLM followed by its router counts
    (`FamilyModel.stats_width`), grads[1, P_pad] in the compute dtype, a 2-byte
    dtype bit-cast to its unsigned integer (`row_dtype`), as the stand-in's `group_program`).

    `tensor_parallel` t > 1 (`layout` a `tensor_split.TensorLayout`), as the stand-in's: the body runs on
    a sub-mesh with a last `tp` axis, takes this device's share flat[1, L_pad] and returns its
    share's gradient row, the copies' gradients summed over their holders (`tensor_split.tie_rows` for
    the block stacks, `tensor_split.tie_top` for the rest), a rank's loss counted once (device tp = 0).
    `sequence_parallel`: the LLM layers and the encoder's blocks run sequence-parallel over the t
    devices (`dhp_jax.model.hf.text.text_forward`, the family's `encode`).

    `aux` (a MoE LLM, the load-balancing loss on): the body takes a sixth input, f32[E + 1]
    replicated: the batch's expert weights w (`moe.aux_weights`, from the whole batch's router
    counts) and the scale coef x the batch's counted labels; each live token adds scale x sum_e
    w_e p_e(token) to the loss sum (the loss's share of this group: the step's division by the
    counted labels leaves coef x E sum_e (count_e / R)(prob_e / R) over the batch), and the stats
    row ends with the unweighted share sum w_e prob_e (a rank's counted once). `router_only`: the
    forward pass alone up to the router statistics, stats f32[1, E + 1] (pairs routed to each expert,
    live rows; a rank's counted once) and no gradient: the first phase of such a step."""

    t = tensor_parallel
    tp = tensor_split.hooks(t, sequence_parallel) if t > 1 else None
    if tp is not None:
        table, layout = layout.table, layout.local      # the split table, built once per layout
    stacks = [("/".join(path) + "/", count, path, first) for path, count, first in block_stacks(config)]
    cuts = layout.cuts([(prefix, count, first) for prefix, count, _, first in stacks], leaves=True)

    def body(flat, llm_ints, llm_floats, vision_ints, vision_floats, *weights):
        if tp is not None:
            flat = flat[0]                  # this device's share, flat[1, L_pad] on the sub-mesh
        # with tensor parallelism a rank's loss counts once: on its device tp = 0
        lead = 1.0 if tp is None else (tp.index() == 0).astype(jnp.float32)

        def loss_sum(pieces):
            # the block stacks run as scans over rows of their pieces (a reshape, no copy of the params)
            found = []
            for prefix, count, path, first in stacks:
                r = layout.piece_rows(pieces, cuts, prefix, count, first)[0]
                leaves = layout.block_leaves(prefix, count, first)[2]
                if tp is not None:
                    r = tensor_split.tie_rows(r, table, prefix, leaves, tp)
                found.append(((path, first), BlockRows(r, leaves)))
            params = layout.unravel_pieces(pieces, cuts)
            if tp is not None:
                params = tensor_split.tie_top(params, table, tp)
            params = with_stacks(params, stack_rows(found))
            with moe.collect() as router:      # a MoE LLM's router counts (no gradient), counted once a rank
                loss = lead * packed_loss_sum(config, params, llm_ints, llm_floats, vision_ints, vision_floats,
                                              attn, tp=tp)
            extra = [lead * jnp.concatenate([router[0][0][0], router[0][1][None]])] if router else []
            if aux:     # the load-balancing loss: linear in this group's probability sums
                w = weights[0]
                share = lead * jnp.dot(w[:-1], router[0][0][1])
                loss = loss + w[-1] * share
                extra.append(share[None])
            return loss, extra

        if router_only:
            stats = loss_sum(layout.split(flat, cuts))[1][0]
            return stats[None]

        # per device (check_vma=False: no implicit psum over the group); the reduction is the
        # executor's reduce-scatter over the full mesh. Differentiated with respect to one piece
        # per leaf, so the row is a concatenation of the leaves' gradients (differentiating the
        # whole vector makes it a sum of zero-padded P-sized parts: several P-sized temporaries);
        # a block stack is one piece, its gradient stacked [count, n] by the scan
        (value, extra), grads = jax.value_and_grad(loss_sum, has_aux=True)(layout.split(flat, cuts))
        row = jnp.concatenate(grads)
        if row_dtype(row.dtype) != row.dtype:       # as the stand-in's rows (and an idle device's zero row)
            row = lax.bitcast_convert_type(row, row_dtype(row.dtype))
        stats = jnp.concatenate([jnp.stack([value, lead * jnp.sum(llm_floats[:, 0])]), *extra])
        return stats[None], row[None]

    return body


class FamilyModel(ModelAdapter):
    """The executor's model adapter for a Hugging Face family's `HFConfig` (see the module docstring)."""

    config_type: type = HFConfig
    # the load-balancing loss's weight (`moe.aux_loss_coef`; 0: off), set by the executor
    aux_coef: float = 0.0

    @property
    def stats_width(self) -> int:
        """(loss sum, counted labels), and for a MoE LLM (`router_stats`) the (token, expert) pairs
        routed to each of the E experts and the live rows, both summed over the sparse layers,
        then with the load-balancing loss on its value (unweighted)."""
        moe = self.config.text.moe
        return 2 if moe is None else 3 + moe.num_experts + (self.aux_coef > 0)

    @property
    def router_width(self) -> int:
        """Columns of a router program's stats row (`family_program(router_only=True)`): the pairs
        routed to each expert and the live rows."""
        return self.config.text.moe.num_experts + 1

    def abstract_params(self) -> None:
        """None: the layout is taken from the first params tree bound."""
        return None

    def bind(self, params: Any, layout: Any, make_layout: Callable[[Any], Any]) -> Any:
        """The layout of `params` (float32): a new one from the first tree bound, else `layout`
        after checking the tree against it."""
        require_float32(params)
        if layout is None:
            return make_layout(params)
        if not layout.matches(params):
            raise ValueError(f"params do not have the structure (tree, shapes) of the tree this "
                             f"{self.config.family} executor was bound to")
        return layout

    def unbound(self) -> ValueError:
        return ValueError(f"{self.config.family} executor: bind a params tree first "
                          f"(bind, shard or loss_and_grads) before compiling")

    def pack(self, group: Sequence[Sample], degree: int, bucket: int | None, min_bucket: int,
             growth: float) -> FamilyLayout:
        return pack_family_group(group, degree, self.config, bucket=bucket, min_bucket=min_bucket, growth=growth)

    def inputs(self, layout: FamilyLayout) -> tuple:
        return layout.inputs()

    def input_shapes(self, bucket: int) -> list[tuple[tuple[int, ...], Any]]:
        """(shape, dtype) of the four stream arrays of a group of `bucket` LLM tokens."""
        rows = bucket * unit(self.config)
        return [((bucket, len(LLM_INTS) + rope_axes(self.config)), jnp.int32), ((bucket, 1), jnp.float32),
                ((rows, len(VISION_INTS)), jnp.int32), ((rows, patch_dim(self.config) + TAPS), jnp.float32)]

    def program(self, config: HFConfig, degree: int, layout: Any, attn: Any, tensor_parallel: int,
                sequence_parallel: bool):
        return family_program(config, layout, attn, tensor_parallel, sequence_parallel, aux=self.aux_coef > 0)

    def router_program(self, config: HFConfig, degree: int, layout: Any, attn: Any, tensor_parallel: int,
                       sequence_parallel: bool):
        """The forward pass to the router statistics (`family_program(router_only=True)`)."""
        return family_program(config, layout, attn, tensor_parallel, sequence_parallel, router_only=True)
