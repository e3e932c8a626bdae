"""The stand-in model (`dhp_jax.model.mllm`) as a `PlanExecutor` runs it: its group layout, host
inputs and group program (`StandInModel`, the executor's model adapter for an `MLLMConfig`).

A group's samples are packed into one stream (`dhp_jax.geometry.layout.pack_group`); host -> device
traffic per group is two arrays: every int column in one int32[S, 8] and the float columns in one
float32[S, patch_dim + 1] (pixels, then loss_weights). The program is the model's forward pass on a
device's shard of the stream, attention by the group's kind, differentiated with respect to the
flat params (`group_program`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dhp_jax.data.sample import Sample
from dhp_jax.geometry.layout import ARRAY_NAMES, FLOAT_ARRAYS, MODEL_INPUTS, GroupLayout, pack_group
from dhp_jax.model.mllm_config import MLLMConfig
from dhp_jax.model.mllm import block_stack, chunked_loss_sum, init_params
from dhp_jax.sharding import tensor_parallel as tensor_split
from dhp_jax.sharding.flat import FlatLayout
from dhp_jax.sharding.mesh import CP_AXIS
from dhp_jax.sharding.ring import ring_attention_fn
from dhp_jax.sharding.sharded_state import require_float32, row_dtype

INT_COLUMNS = tuple(k for k in ARRAY_NAMES if k not in FLOAT_ARRAYS)


def pack_inputs(layout: GroupLayout) -> tuple[np.ndarray, np.ndarray]:
    """(ints int32[S, 8], floats float32[S, patch_dim + 1]) of a group layout."""
    ints = np.stack([getattr(layout, k).astype(np.int32) for k in INT_COLUMNS], axis=1)
    floats = np.concatenate([layout.pixels, layout.loss_weights[:, None]], axis=1)
    return ints, floats


def stacks_of(config: MLLMConfig) -> tuple[tuple[str, int, bool], ...]:
    """(params prefix, block count, vision) of the model's scanned block stacks."""
    return (("vision_layers_", config.vision_layers, True), ("layers_", config.num_layers, False))


def group_program(config: MLLMConfig, degree: int, layout: FlatLayout | tensor_split.TensorLayout,
                  attn: Callable[..., jax.Array] | None = None, tensor_parallel: int = 1,
                  sequence_parallel: bool = False):
    """The per-device body: (params flat[P_pad] in the compute dtype, ints, floats) ->
    (stats f32[1, 2] = (loss sum, loss-token count), grads[1, P_pad] in the compute dtype, a
    2-byte dtype bit-cast to its unsigned integer (`row_dtype`)).

    `attn` is the model's attention function (default: the tiled ring of `degree` over `cp`).
    `tensor_parallel` t > 1 (`layout` a `tensor_split.TensorLayout`): the body runs on a sub-mesh with
    a `tp` axis of size t and takes this device's share flat[1, L_pad] (`TensorLayout.local`),
    returns its share's gradient row [1, L_pad] (the copies' gradients summed over their holders,
    `tensor_split.tie_block`), and a rank's loss and token count are reported (and differentiated)
    once, by its device tp = 0. `sequence_parallel`: the block stacks run sequence-parallel over the
    tp devices (`dhp_jax.model.mllm.split_block`)."""
    attn = ring_attention_fn(CP_AXIS, degree) if attn is None else attn
    t = tensor_parallel
    tp = tensor_split.hooks(t, sequence_parallel) if t > 1 else None
    if tp is not None:
        table, layout = layout.table, layout.local      # the split table, built once per layout
    cuts = layout.cuts([(prefix, count) for prefix, count, _ in stacks_of(config)])

    def stack(pieces, prefix, count, vision):
        rows, tree = layout.piece_rows(pieces, cuts, prefix, count)
        if tp is not None:
            tree = (lambda local: lambda row: tensor_split.tie_block(local(row), table, vision, tp))(tree)
        return block_stack(config, rows, tree, vision, attn, tp)

    def body(flat, ints, floats):
        s_l = ints.shape[0]
        assert ints.shape == (s_l, len(INT_COLUMNS)) and floats.shape == (s_l, config.patch_dim + 1)
        if tp is not None:
            flat = flat[0]                  # this device's share, flat[1, L_pad] on the sub-mesh
        assert flat.shape == (layout.padded,), flat.shape
        cols = {k: ints[:, i] for i, k in enumerate(INT_COLUMNS)}
        batch = {k: cols[k] for k in MODEL_INPUTS if k in cols}
        batch["vision_mask"] = cols["vision_mask"] > 0
        batch["pixels"] = floats[:, :config.patch_dim]
        weights = floats[:, config.patch_dim]

        # with tensor parallelism a rank's loss counts once: on its device tp = 0
        lead = 1.0 if tp is None else (tp.index() == 0).astype(jnp.float32)

        def loss_sum(pieces):
            # the block stacks run as scans over rows of their pieces (no copy of the params)
            stacks = tuple(stack(pieces, prefix, count, vision) for prefix, count, vision in stacks_of(config))
            params = layout.unravel_pieces(pieces, cuts)
            if tp is not None:
                params = tensor_split.tie_top(params, table, tp)
            return lead * chunked_loss_sum(config, params, batch, cols["targets"], weights, attn, stacks=stacks, tp=tp)

        # Gradients stay per device (check_vma=False: no implicit psum over cp); the only
        # reduction is the reduce-scatter over the full mesh after the group program. The
        # gradient is taken piece by piece (the stacks' pieces get their stacked gradients as
        # they are) and the row is their concatenation: no zero-padded parts summed.
        value, grads = jax.value_and_grad(loss_sum)(layout.split(flat, cuts))
        row = jnp.concatenate(grads)
        if row_dtype(row.dtype) != row.dtype:
            # the reduction reads the row piece by piece: as uint16 no compiler widens it whole
            # (XLA:CPU has no bf16 slicing, it would copy the whole row to fp32 first)
            row = lax.bitcast_convert_type(row, row_dtype(row.dtype))
        return jnp.stack([value, lead * jnp.sum(weights)])[None], row[None]

    return body


def check_config(config: Any, config_type: type) -> None:
    """TypeError unless `config` is a `config_type` (what a model adapter runs)."""
    if not isinstance(config, config_type):
        raise TypeError(f"config must be a {config_type.__module__}.{config_type.__name__}, "
                        f"got {type(config).__name__}")


class ModelAdapter:
    """What every model adapter does alike: hold a config of its `config_type`, check a
    tensor-parallel degree against it, and give the config the programs compile with."""

    config_type: type = object
    # columns of a group program's per-device stats row: (loss sum, counted labels), then the
    # model's own per-step sums (a MoE family's router counts, `family_adapter.FamilyModel`)
    stats_width: int = 2

    def __init__(self, config: Any) -> None:
        check_config(config, self.config_type)
        self.config = config

    def check_tensor_parallel(self, t: int) -> None:
        """ValueError unless the model splits evenly over t devices (`dhp_jax.sharding.tensor_parallel.check`)."""
        tensor_split.check(self.config, t)

    def program_config(self, linear_chunk: int) -> Any:
        return dataclasses.replace(self.config, linear_chunk=linear_chunk)


class StandInModel(ModelAdapter):
    """The executor's model adapter for the stand-in `MLLMConfig`: the params tree is known from the
    config (`abstract_params`), a group is one packed stream, the program `group_program`."""

    config_type: type = MLLMConfig

    def abstract_params(self) -> Any:
        """The params tree as `jax.ShapeDtypeStruct`s."""
        return jax.eval_shape(lambda k: init_params(self.config, k), jax.random.key(0))

    def bind(self, params: Any, layout: Any, make_layout: Callable[[Any], Any]) -> Any:
        """The layout of `params` (this model's tree, shapes and float32 leaves, else an error)."""
        if not layout.matches(params):
            if FlatLayout.of(params, 1).shapes == layout.shapes:
                require_float32(params)
            raise ValueError("params do not have the structure (tree, shapes, dtypes) of this executor's "
                             f"model {self.config.name!r}")
        return layout

    def pack(self, group: Sequence[Sample], degree: int, bucket: int | None, min_bucket: int,
             growth: float) -> GroupLayout:
        return pack_group(group, degree, self.config, bucket=bucket, min_bucket=min_bucket, growth=growth)

    def inputs(self, layout: GroupLayout) -> tuple[np.ndarray, ...]:
        """The host arrays of a group layout that its program takes after the params."""
        return pack_inputs(layout)

    def input_shapes(self, bucket: int) -> list[tuple[tuple[int, ...], Any]]:
        """(shape, dtype) of each of those arrays for a stream of `bucket` tokens."""
        return [((bucket, len(INT_COLUMNS)), jnp.int32), ((bucket, self.config.patch_dim + 1), jnp.float32)]

    def program(self, config: MLLMConfig, degree: int, layout: Any, attn: Any, tensor_parallel: int,
                sequence_parallel: bool):
        return group_program(config, degree, layout, attn, tensor_parallel, sequence_parallel)

    def unbound(self) -> ValueError:
        return ValueError("the stand-in executor's layout comes from its config")   # never: built in __init__
