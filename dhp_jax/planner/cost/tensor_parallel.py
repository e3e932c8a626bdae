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

Mixture of experts (a model shape with `experts` > 0; `dhp_jax.planner.cost.presets.ModelShape`):
the experts of each sparse layer are split over the rank's t devices (expert parallelism E = t
inside the rank; DHP's groups stay independent, tokens never leave their rank): a device holds
experts / t of them, the router in full (`replicated_params`). Compute per device is the attention
and the dense layers / t, the k experts' GEMMs of a token / t (routing assumed balanced) and the
router whole (`device_gemm_params`). Each sparse layer exchanges the rank's rows among its devices in
place of the dense MLP's collectives (`moe_exchange_bytes`): the rows joined on every device and
the experts' partial sums scattered back, (t-1)/t of the rows each, as the engine runs it (an
all-to-all of a token's k rows would move as much at k = t, more at k > t).
Memory per device: its experts' weights, gradients and optimizer state (`device_params`); the
dispatch buffers hold all k rows of every token on every device (static shapes: tokens x k rows),
so the experts' activations are not divided by t (`local_shape` keeps them).

`choose` picks (t, degree) for one long sample by the memory model: the planner's choice of t.

Validation (`check_tensor_parallel`): every split must be even. A head count that t does not
divide, kv heads that neither t divides nor divide t (for replication), or an MLP width that t
does not divide (or an expert count, for a MoE model) is refused, naming the model, the config
field and t.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dhp_jax.checks import positive_int

__all__ = ["block_collectives", "check_node", "check_tensor_parallel", "choose", "collective_bandwidth",
           "collective_messages", "device_gemm_params", "device_params", "moe_exchange_bytes", "kv_heads_per_device", "local_shape", "replicated_params", "sequence_saving", "sequence_parallel_bytes", "unsplittable",
           "valid_degrees", "vocab_share"]


# the config.json fields behind each shape field (a shape's own `FIELD_NAMES` replaces them)
HF_FIELDS = {"heads": "text_config.num_attention_heads", "intermediate": "text_config.intermediate_size",
             "vision_heads": "vision_config heads (num_heads / num_attention_heads)",
             "vision_intermediate": "vision_config.intermediate_size", "kv_heads": "text_config.num_key_value_heads",
             "experts": "text_config.num_experts"}


def unsplittable(m: Any, t: int) -> str | None:
    """Why tensor parallelism over `t` devices cannot split model shape `m` evenly (None: it can)."""
    if t == 1:
        return None
    names = {**HF_FIELDS, **getattr(m, "FIELD_NAMES", {})}
    for key in ("heads", "intermediate", "vision_heads", "vision_intermediate"):
        v = getattr(m, key)
        if v % t:
            return f"tensor_parallel {t} cannot split {names[key]} = {v} evenly (t must divide it)"
    experts = getattr(m, "experts", 0)
    if experts and getattr(m, "sparse_layers", 0) and experts % t:
        return (f"tensor_parallel {t} cannot split {names['experts']} = {experts} evenly over a rank's devices "
                f"(t must divide it)")
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
    pixels, before the sequence is split), and a MoE model's routers (every device routes its rows).
    Position tables and biases are counted as split (they are small either way)."""
    router = getattr(m, "router_params", 0)
    return int((2 * m.layers + 1) * m.hidden + 4 * m.vision_layers * m.vision_hidden + m.patch_dim * m.vision_hidden
               + router)


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


def moe_exchange_bytes(m: Any, t: int, bytes_per_element: int, linear_passes: float) -> float:
    """Bytes per token of the rank's stream that one device sends to exchange the rows of every
    sparse layer among the rank's t devices, all passes (`comm_passes`: forward, backward, and the
    recomputed forward): the rows joined on every device before the router and the experts, and
    the experts' partial sums scattered back (`dhp_jax.model.hf.moe`: a device runs all k pairs
    of every row, those of its own experts non-zero, and the row-split collective of the dense MLP
    sums the devices' shares), each (t-1)/t of a [tokens, hidden] tensor, as the dense MLP's. An
    all-to-all of each token's k rows to its experts' devices would send k (t-1)/t^2 of it from
    the 1/t of the rows a device holds: the same where k = t, more where k > t (the released
    models: k = 8 >= t). 0 without experts or t = 1."""
    if not (getattr(m, "experts", 0) and getattr(m, "sparse_layers", 0)) or t == 1:
        return 0.0
    rows = 2.0 * comm_passes(linear_passes)
    return float(m.sparse_layers * rows * (t - 1) / t * bytes_per_element * m.hidden)


def device_gemm_params(m: Any, t: int) -> float:
    """GEMM weights one device of a rank of t runs per token of the rank's stream in the LLM's
    layers (`ModelShape.llm_gemm_params` split): attention and the dense MLPs / t, a token's k
    experts / t (balanced routing: each device computes the rows routed to its experts / t of
    them), the router whole (every device routes the rows it holds with the whole router)."""
    if not (getattr(m, "experts", 0) and getattr(m, "sparse_layers", 0)):
        return m.layers * m.llm_layer_params / t
    return (m.llm_gemm_params - m.sparse_layers * m.hidden * m.experts) / t + m.sparse_layers * m.hidden * m.experts


def sequence_parallel_bytes(m: Any, t: int, bytes_per_element: int, linear_passes: float, frozen_vision: bool
                            ) -> tuple[float, float]:
    """(bytes per token of the rank's stream through the LLM's collectives, bytes per LLM vision token
    through the encoder's) that one device sends: per block `block_collectives` of [tokens, width],
    each (t-1)/t of it; the encoder runs `patches_per_token` rows per LLM vision token, forward only
    when frozen. A sparse layer runs the attention's half of them and exchanges its rows for the
    experts (`moe_exchange_bytes`) in place of the MLP's half."""
    share = (t - 1) / t * bytes_per_element
    llm = m.layers * _per_block(linear_passes) * share * m.hidden
    if getattr(m, "experts", 0) and getattr(m, "sparse_layers", 0):
        llm += moe_exchange_bytes(m, t, bytes_per_element, linear_passes) \
            - m.sparse_layers * _per_block(linear_passes) / 2 * share * m.hidden
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


def choose(model: Any, hardware: str, tokens: int, devices: int, *, devices_per_node: int = 8,
           vision_share: float = 1.0, sequence_parallel: bool = True, **preset: Any) -> dict[str, Any]:
    """The tensor-parallel size t and the context-parallel degree the planner gives one sample of
    `tokens` tokens (vision share `vision_share`: its vision tokens / its tokens) on `devices`
    devices of `hardware`, state sharded over all of them. For each t this model allows (up to the
    node's devices) at which the model fits a device: the least degree of ranks at which the
    sample fits by the memory model (`memory.min_degree`, then the group program plus the state
    shard checked against the usable bytes), and every larger degree up to the devices / t ranks,
    each priced as the planner prices a step of that one group: its time at the best attention
    kind (`pricing.best_times`) plus the gradient all-reduce over the devices / t ranks
    (`pricing.allreduce_time`, which shrinks with t: a device's share of the weights); the fastest
    (t, degree) wins, the smaller t and degree on a tie. Returns {"t", "degree", "ranks", "step_s", "device_bytes",
    "usable_bytes", "fits", "tried": {t: {"least_degree", "degree", "step_s", "device_bytes"} or
    why not}}. A ValueError naming each t's reason when no t fits."""
    from dhp_jax.planner.cost import memory
    from dhp_jax.planner.cost.model import CostModel
    from dhp_jax.planner.cost.pricing import allreduce_time, best_times, sample_terms

    positive_int(tokens, "tokens")
    positive_int(devices, "devices")
    m = model
    if isinstance(model, str):
        from dhp_jax.planner.cost import presets
        if model.lower() not in presets.MODELS:
            raise ValueError(f"unknown model {model!r}; known models: {', '.join(presets.MODELS)}")
        m = presets.MODELS[model.lower()]
    tried: dict[int, Any] = {}
    best = None
    for t in valid_degrees(m, devices_per_node):
        if devices_per_node % t or devices % t:
            continue
        try:
            cost = CostModel.preset(model if isinstance(model, str) else m, hardware, tensor_parallel=t,
                                    ranks_per_node=devices_per_node // t, state_shards=devices,
                                    sequence_parallel=bool(sequence_parallel) and t > 1, **preset)
        except ValueError as e:
            tried[t] = str(e)
            continue
        ranks = devices // t

        def device_bytes(degree: int) -> float:
            return memory.group_program_bytes(cost, [tokens], degree) + memory.rank_state_bytes(cost)

        least = int(memory.min_degree(cost, [tokens])[0])
        while least <= ranks and device_bytes(least) > cost.usable_bytes:
            least += 1
        if least > ranks:
            tried[t] = f"{tokens} tokens need more than the {ranks} ranks of {devices} devices at t={t}"
            continue
        A, B, S = (x.sum() for x in sample_terms(cost, [tokens], [vision_share ** 2]))
        reduce = allreduce_time(cost, ranks)
        times = {d: float(best_times(cost, A, B, S, d)) + reduce for d in range(least, ranks + 1)
                 if device_bytes(d) <= cost.usable_bytes}
        degree = min(times, key=lambda d: (times[d], d))
        tried[t] = {"least_degree": least, "degree": degree, "step_s": times[degree],
                    "device_bytes": device_bytes(degree)}
        if best is None or times[degree] < best["step_s"]:
            best = {"t": t, "degree": degree, "ranks": ranks, "step_s": times[degree],
                    "device_bytes": device_bytes(degree), "usable_bytes": cost.usable_bytes,
                    "fits": device_bytes(degree) <= cost.usable_bytes}
    if best is None:
        raise ValueError(f"no tensor-parallel size fits one {tokens}-token sample on {devices} devices of "
                         f"{hardware}: " + "; ".join(f"t={t}: {v}" for t, v in tried.items()))
    best["tried"] = tried
    return best
