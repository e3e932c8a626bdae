"""Tensor parallelism inside a rank, as the cost model prices it (Megatron-style, with sequence parallelism).

With `tensor_parallel` = t a *rank* is t devices of one node that hold one model replica between
them (Megatron-LM, arXiv 1909.08053; sequence parallelism, arXiv 2205.05198). The planner's ranks
are devices / t and a plan's groups stay in rank units: the Plan contract does not change. Every
block, in the LLM and in the vision encoder, is split the Megatron way: q/k/v and the MLP's first
matrices by column (heads and MLP width over the t devices), the output projections by row, the
norms and residuals sequence-parallel between them (each device holds 1/t of the rank's tokens
there), the embedding and the LM head vocab-parallel. Per block and pass that is 2 all-gathers and
2 reduce-scatters of the activations (before / after attention and before / after the MLP), each
moving (t-1)/t of a [tokens, hidden] tensor in and out of every device.

What this module derives, per device (`CostModel.preset(..., tensor_parallel=t)` applies it; with
t = 1 nothing here is called and every coefficient is the one without tensor parallelism):

- compute: attention and linear FLOPs divided by t (heads and MLP width split; the vocabulary
  padded to a multiple of t, as Megatron pads it, so the LM head's share is ceil(vocab / t));
- the collectives: `sequence_parallel_bytes` per token of the rank's stream (LLM) and per LLM vision
  token (encoder rows), over `collective_bandwidth`, priced as linear work per token (they run
  between the GEMMs: no overlap); their per-message latency joins the fixed per-group term b1;
- the CP traffic of one device: its own kv heads' K/V (`kv_heads_per_device`: kv / t, or one
  replicated head when kv < t), its heads' Q/O;
- memory: the weights one device holds (`device_params`: the sharded ones / t, norms, patch
  embedding and the replicated kv projections in full), so its fp32 state and gradient row too;
  activations as both engines run them, the psum form (`local_shape`): the values as wide as the
  heads, the MLP or the vocabulary / t, those as wide as the hidden size (the block inputs a
  remat "layer" program keeps, norms, residuals) whole on every device; with `sequence_parallel`
  (the JAX engine's `PlanExecutor(..., sequence_parallel=True)`) each block's input is 1/t of the
  rows (`sequence_saving`: the LLM's and the encoder's stacks, of the stand-in and of a family).

Validation (`check_tensor_parallel`): every split must be even. A head count that t does not
divide, kv heads that neither t divides nor divide t (for replication), or an MLP width that t
does not divide is refused, naming the model, the config field and t.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dhp_jax.checks import positive_int

__all__ = ["block_collectives", "check_node", "check_tensor_parallel", "collective_bandwidth", "collective_messages",
           "device_params", "kv_heads_per_device", "local_shape", "replicated_params", "sequence_saving", "sequence_parallel_bytes", "unsplittable",
           "valid_degrees", "vocab_share"]


# the config.json fields behind each shape field (a shape's own `FIELD_NAMES` replaces them)
HF_FIELDS = {"heads": "text_config.num_attention_heads", "intermediate": "text_config.intermediate_size",
             "vision_heads": "vision_config heads (num_heads / num_attention_heads)",
             "vision_intermediate": "vision_config.intermediate_size", "kv_heads": "text_config.num_key_value_heads"}


def unsplittable(m: Any, t: int) -> str | None:
    """Why tensor parallelism over `t` devices cannot split model shape `m` evenly (None: it can)."""
    if t == 1:
        return None
    names = {**HF_FIELDS, **getattr(m, "FIELD_NAMES", {})}
    for key in ("heads", "intermediate", "vision_heads", "vision_intermediate"):
        v = getattr(m, key)
        if v % t:
            return f"tensor_parallel {t} cannot split {names[key]} = {v} evenly (t must divide it)"
    if m.kv_heads % t and t % m.kv_heads:
        return (f"tensor_parallel {t} cannot split {names['kv_heads']} = {m.kv_heads}: kv heads must be "
                f"a multiple of t, or divide t (each then replicated)")
    return None


def valid_degrees(m: Any, largest: int = 64) -> list[int]:
    """The tensor-parallel sizes up to `largest` that model shape `m` allows."""
    return [t for t in range(1, largest + 1) if unsplittable(m, t) is None]


def check_tensor_parallel(m: Any, t: int, name: str = "model") -> None:
    """A ValueError naming `name`, the first config field of shape `m` that tensor parallelism over
    `t` devices cannot split evenly, and t."""
    positive_int(t, "tensor_parallel")
    why = unsplittable(m, t)
    if why:
        raise ValueError(f"{name}: {why}; tensor_parallel values this model allows: {valid_degrees(m)}")


def check_node(devices_per_node: int, t: int) -> None:
    """A rank is t devices of one node: t must divide the node's devices."""
    positive_int(t, "tensor_parallel")
    if devices_per_node % t:
        raise ValueError(f"tensor_parallel {t} does not divide the {devices_per_node} devices of a node "
                         f"(a rank's t devices sit in one node)")


def kv_heads_per_device(m: Any, t: int) -> int:
    """K/V heads one device holds: kv / t, or one (replicated t / kv times) when kv < t."""
    return max(1, m.kv_heads // t)


def local_shape(m: Any, t: int) -> Any:
    """The shape one device of a rank of t computes with in the engines' psum form (both run it:
    `dhp_jax.sharding.tensor_parallel`, `npu_backend.tensor_parallel`): heads, kv heads, MLP widths and the
    vocabulary split, the hidden width whole (the activations between the split matrices, and so
    what a block keeps for its backward pass at remat "layer", are whole on every device)."""
    return dataclasses.replace(m, heads=m.heads // t, kv_heads=kv_heads_per_device(m, t),
                               intermediate=m.intermediate // t, vocab=vocab_share(m, t),
                               vision_heads=m.vision_heads // t, vision_intermediate=m.vision_intermediate // t)


def sequence_saving(m: Any, t: int, bytes_per_element: int, remat: str = "layer", chunked: bool = False) -> float:
    """Bytes per token a device does not keep when the block stacks run sequence-parallel (arXiv
    2205.05198; `dhp_jax.model.mllm.split_block`): the values a block keeps that are as wide as
    the hidden size and not an input of a column-split GEMM (those are gathered: whole rows) are
    1/t of the rows: its input, and without recompute and without chunks (`remat` "none",
    `chunked` False) also its residual sum after attention, the input of its second norm (with
    recompute, or in chunks whose VJP keeps their inputs, the input alone). Both stacks run so,
    in the stand-in and in a Hugging Face family (`m.family`: its LLM layers,
    `dhp_jax.model.hf.text.text_forward`, and its encoder's blocks,
    `dhp_jax.model.hf.layers.BlockStream`), the encoder's for each of its rows per LLM token
    (`memory.encoder_rows`: a family's patches per token, and InternVL's CLS row); a family's
    DeepStack features, which wait for the LLM layers they are added to, are cut into the LLM's
    rows too. The other hidden-wide values are priced whole: an upper bound on the bytes."""
    from dhp_jax.planner.cost.memory import _encoder, encoder_rows

    kept = 2 if remat == "none" and not chunked else 1
    rows = kept * (m.layers * m.hidden + encoder_rows(m) * m.vision_layers * m.vision_hidden)
    if getattr(m, "family", ""):
        rows += _encoder(m)[2] * m.hidden
    return float(bytes_per_element * rows * (t - 1) / t)


def vocab_share(m: Any, t: int) -> int:
    """Vocabulary rows one device holds: the vocabulary padded to a multiple of t, split t ways."""
    return -(-m.vocab // t)


def replicated_params(m: Any) -> int:
    """Weights every device of a rank holds in full: the norms (RMSNorm or LayerNorm scale and bias)
    of every block and the final ones, and the encoder's patch embedding (a convolution on the
    pixels, before the sequence is split). Position tables and biases are counted as split (they are
    small either way)."""
    return int((2 * m.layers + 1) * m.hidden + 4 * m.vision_layers * m.vision_hidden + m.patch_dim * m.vision_hidden)


def device_params(m: Any, params: float, t: int) -> float:
    """Parameters one device of a rank holds: the replicated ones in full, the rest / t, plus the kv
    projections' replicas when kv heads are fewer than t."""
    rep = replicated_params(m)
    extra = m.layers * 2 * m.hidden * m.head_dim * (kv_heads_per_device(m, t) - m.kv_heads / t)
    return float(rep + (params - rep) / t + extra)


def comm_passes(linear_passes: float) -> float:
    """Passes of the collectives per step: forward and backward, and the forward again when the
    blocks are recomputed (remat "layer": 4 linear passes); "selective" recomputes only attention,
    which has no tensor-parallel collective."""
    return 3.0 if linear_passes >= 4.0 else 2.0


def block_collectives(linear_passes: float, forward_only: bool = False) -> dict[str, float]:
    """{"all_gather": n, "reduce_scatter": n} one sequence-parallel block runs per step (Megatron SP,
    arXiv 2205.05198, sec. 4.2.2), per device: a pass of the block's token-local work all-gathers the
    rows before its two column-split groups (q/k/v, the MLP's first matrices) and reduce-scatters
    after its two row-split ones (the output projection, the MLP's last matrix), and the backward
    pass runs the duals (a reduce-scatter of the gradient behind each all-gather, an all-gather
    behind each reduce-scatter) with the gathered inputs saved from the forward pass, not gathered
    again (both engines: the JAX program's autodiff residual, `npu_backend.tensor_parallel._GatherLinear`);
    `comm_passes` of them per step (one, the forward pass, with `forward_only`: a frozen encoder).
    The psum form's two all-reduces a pass move the same bytes."""
    p = 1.0 if forward_only else comm_passes(linear_passes)
    return {"all_gather": 2.0 * p, "reduce_scatter": 2.0 * p}


def _per_block(linear_passes: float, forward_only: bool = False) -> float:
    return float(sum(block_collectives(linear_passes, forward_only).values()))


def sequence_parallel_bytes(m: Any, t: int, bytes_per_element: int, linear_passes: float, frozen_vision: bool
                            ) -> tuple[float, float]:
    """(bytes per token of the rank's stream through the LLM's collectives, bytes per LLM vision token
    through the encoder's) that one device sends: per block `block_collectives` of [tokens, width],
    each (t-1)/t of it; the encoder runs `patches_per_token` rows per LLM vision token, forward only
    when frozen."""
    share = (t - 1) / t * bytes_per_element
    llm = m.layers * _per_block(linear_passes) * share * m.hidden
    vision = _per_block(linear_passes, frozen_vision) * m.vision_layers * m.patches_per_token * share * m.vision_hidden
    return llm, vision


def collective_messages(m: Any, t: int, linear_passes: float, frozen_vision: bool) -> float:
    """Messages in sequence of one group step's tensor-parallel collectives (`block_collectives`,
    t-1 ring steps each)."""
    return (t - 1) * (m.layers * _per_block(linear_passes) + m.vision_layers * _per_block(linear_passes, frozen_vision))


def collective_bandwidth(hw: Any, t: int) -> float:
    """Bytes/s one device moves through a collective over t devices of its node: its t-1 peers each
    over a link of their own (`p2p_bw_intra`, a full mesh or a switch), capped by its injection
    bandwidth (`a2a_bw_intra`)."""
    return float(min(hw.a2a_bw_intra, (t - 1) * hw.p2p_bw_intra)) if t > 1 else math.inf
