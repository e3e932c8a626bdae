"""The engine's memory per rank, from model shapes: what `CostModel.preset` puts in its memory fields.

The engine (dhp_jax.sharding.PlanExecutor with the trainer's sharded state) holds, per rank:

- state (outside the group program): fp32 master params, AdamW's two fp32 moments and the fp32
  gradient accumulator, each a 1/`state_shards` shard of the flat vector:
  `STATE_BYTES_PER_PARAM` x P / state_shards;
- the group program in two phases. Both hold the gathered params and the gradient row it returns,
  in the compute dtype (2 x P x cb; XLA allocates the outputs for the whole program). The blocks'
  phase (the peak is a decoder block's backward pass) adds the gradients that exist by then
  (`backward_bytes`: the decoder's stacked block gradients, kept in the compute dtype by the
  block scans' own VJP and stored bit-cast, so no compiler widens them, and the LM head's), one
  loss chunk's logits or the ring's tile workspace (`fixed_bytes`) and the activations. The last
  phase (no activations) concatenates the row from the gradient pieces (`assemble_bytes`: all P
  of them, plus the embedding's and the LM head's accumulators before their conversion);
- `fixed_bytes`: one loss chunk's logits (the LM head and cross entropy run over token chunks), or
  the ring's tile workspace if larger (they are live in different parts of the blocks' phase);
- activations, linear in the rank's local tokens S_l = S / d: `activation_bytes_per_token` below.
  Attention holds O(S_l x tile) temporaries (custom-VJP tiled ring: output + log-sum-exp per query
  saved), so attention adds a per-token term, not S_l^2.

- the step around the group programs (`step_phases`): the all-gather of the params, then per
  micro-batch the device's group program and the reduction of its gradient row (the row in the
  compute dtype and one fp32 piece of it, `reduce_pieces`; the executor reduces a micro-batch
  before the device starts its next one, so one row is held at a time), then the mean gradient and
  the optimizer update. `memory.device_step_bytes` is the largest of these besides the state;
  `dhp bench memory --step` measures the same sequence from the compiled programs.

Counts are per local token. What the blocks keep for their backward pass is loop state of the
block scans (`dhp_jax.model.mllm.block_stack`), stored in the compute dtype (cb bytes; bit-cast,
so no compiler widens it); the working set of the one block live at a time and the rest are in
elements of ab bytes (`CostModel.activation_bytes`: the compute dtype's, or 4 for a bf16 program
compiled by XLA:CPU, which computes bf16 in fp32) unless marked fp32. The recompute policy
(`MLLMConfig.remat`) decides what a block keeps: "layer" keeps the block input only; "selective"
keeps the outputs of the block's weight GEMMs; "none" keeps every intermediate. With the blocks in
chunks (the executor's `linear_chunk`, `_block`) a block keeps its chunk loops' inputs: "selective"
what "layer" does, "none" the block input, the attention's inputs and output. Without recompute a
block also keeps its weights (`kept_weight_bytes`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dhp_jax import models
from dhp_jax.checks import lengths_array, positive_int
from dhp_jax.planner.cost.geometry import padded_length

REMATS = ("none", "layer", "selective")
COMPUTE_BYTES = {"bfloat16": 2, "float32": 4}
STATE_BYTES_PER_PARAM = 16       # fp32 master + two fp32 Adam moments + fp32 gradient accumulator
# Passes over each term's FLOPs per step: forward + backward (2x forward) + recomputed forward.
# (attention, linear): "selective" keeps GEMM outputs, so only attention and cheap elementwise ops
# run again.
REMAT_PASSES = {"none": (3.0, 3.0), "layer": (4.0, 4.0), "selective": (4.0, 3.0)}
LOSS_CHUNK = 512                 # tokens per LM-head chunk (dhp_jax.model.mllm.LOSS_CHUNK)
INT_COLUMNS = 8                  # int32 input columns per token (dhp_jax.sharding.executor)
# The step's reduce-scatter takes a device's gradient row in pieces (`reduce_pieces`): one piece is
# at most REDUCE_PIECE_BYTES in fp32 (internvl3-8b over 64 ranks: 120 pieces), and a row is cut
# into at least MIN_REDUCE_PIECES, so even a small model's row is never held whole in fp32.
REDUCE_PIECE_BYTES = 256 * 2**20
MIN_REDUCE_PIECES = 4


def _block(hidden: int, heads: int, kv_heads: int, head_dim: int, ff: int, remat: str,
           chunked: bool = False, mlp: int = 3) -> tuple[int, int]:
    """(elements kept per token by one block for backward, in the compute dtype; elements of its
    backward working set). What a block keeps in 4 bytes whatever the dtype is `_kept_wide`.
    `mlp`: the MLP's matrices, 3 (SwiGLU: gate, up, their activation and product; the GEMM outputs
    gate and up) or 2 (GELU: fc1 and its activation; the GEMM output fc1).

    `chunked` (`MLLMConfig.linear_chunk` > 0): the token-local work runs chunk by chunk
    (`dhp_jax.model.mllm.split_block`), each chunk a custom VJP whose residuals are its inputs and
    that recomputes its own intermediates, so the MLP's and the norms' intermediates live one chunk
    at a time (`chunk_bytes`) and a block keeps, over the whole stream, the chunk loops' inputs:
    without recompute the block input and the attention output (`finish`'s input), and the ring
    attention's residuals and the rotary positions (`_kept_wide`); with remat "layer" its input.
    Remat "selective" keeps what "layer" keeps: every weight GEMM runs inside a chunk's custom VJP,
    where `jax.checkpoint`'s policy sees none (the compiled programs of the two are the same bytes:
    tests/test_memory.py). The backward pass of one block holds the cotangents of its input and
    output, of q, k, v and of the attention output, and with recompute the recomputed q, k, v."""
    qkv = (heads + 2 * kv_heads) * head_dim
    if chunked:
        cotangents = 2 * hidden + qkv + heads * head_dim
        if remat == "none":
            return hidden + heads * head_dim, cotangents
        return hidden, cotangents + qkv
    every = 6 * hidden + 2 * qkv + heads * head_dim + 2 * (mlp - 1) * ff   # norms, q/k/v (+rotary), attn out, MLP
    kept = {"layer": hidden, "selective": hidden + qkv + 2 * hidden + (mlp - 1) * ff, "none": every}[remat]
    return kept, every


def _kept_wide(heads: int, kv_heads: int, head_dim: int, remat: str, chunked: bool) -> int:
    """Elements per token one block keeps for its backward pass in 4 bytes whatever the compute
    dtype (`_block` counts the rest). With recompute none. Without: in one pass, the ring's fp32
    accumulator o, m, l and log-sum-exp (`_attention_fp32`); in chunks (`_block`), the residuals of
    the ring attention's custom VJP (`dhp_jax.sharding.ring`: q, k, v and the output, cast to fp32
    before it, and the log-sum-exp, one per head) and the int32 rotary positions the `project`
    chunks read."""
    if remat != "none":
        return 0
    if not chunked:
        return _attention_fp32(heads, head_dim)
    return (heads + 2 * kv_heads) * head_dim + heads * head_dim + heads + 1


def kept_weight_bytes(m: Any, remat: str, compute_bytes: int) -> float:
    """Token-independent bytes the stand-in's blocks keep for their backward pass: without recompute,
    each block's weights in the compute dtype (`stack_params`, both stacks). The residuals of a
    block's `jax.vjp` include its params, sliced off its row of the flat params (in one pass the
    GEMMs' transposes read them; in chunks each chunk's custom VJP keeps its inputs), and the block
    scan (`mllm.block_stack`) stores them per block: it restores only the row itself. A family
    program (`m.family`: its scans restore the params subtree) and a recomputed block keep none."""
    if remat != "none" or getattr(m, "family", ""):
        return 0.0
    return float(sum(stack_params(m)) * compute_bytes)


def chunk_bytes(m: Any, chunk: int, activation_bytes: int) -> float:
    """Token-independent: one chunk's working set of the larger block (`_block`'s whole-stream
    working set over `chunk` tokens; a family's, `_family_block`'s without chunks over `chunk` rows
    of either stream), live inside a block's backward pass."""
    if getattr(m, "family", ""):
        work = max(_llm_blocks(m, "layer", False)[1] if _moe(m) else _family_block(m, False, "layer", False)[1],
                   _family_block(m, True, "layer", False)[1])
        return float(chunk * work * activation_bytes)
    work = max(_block(m.hidden, m.heads, m.kv_heads, m.head_dim, m.intermediate, "layer")[1],
               _block(m.vision_hidden, m.vision_heads, m.vision_heads, m.vision_head_dim,
                      m.vision_intermediate, "layer", mlp=_encoder(m)[1])[1])
    return float(chunk * work * activation_bytes)


def _encoder(m: Any) -> tuple[int, int, int, int]:
    """(encoder patches per LLM token, MLP matrices, DeepStack mergers, projector middle width) of
    shape `m`; a shape without these fields is the engine's stand-in (1, 3, 0, hidden)."""
    return (int(getattr(m, "patches_per_token", 1)), int(getattr(m, "vision_mlp", 3)),
            int(getattr(m, "deepstack", 0)), int(getattr(m, "projector_hidden", 0) or m.hidden))


def _attention_fp32(heads: int, head_dim: int) -> int:
    """fp32 elements per token the ring attention keeps per block: accumulator o, m, l, lse."""
    return heads * head_dim + 3 * heads


def activation_bytes_per_token(m: Any, remat: str, compute_bytes: int, activation_bytes: int | None = None,
                               chunked: bool = False, tensor_parallel: int = 1,
                               sequence_parallel: bool = False) -> float:
    """Bytes per local token of one rank's group program for model shape `m` (presets.ModelShape):
    the blocks' kept values in `compute_bytes`, the rest in `activation_bytes` (default: the same);
    `chunked`: the blocks' token-local work runs in chunks (`_block`). A Hugging Face family's
    shape (`m.family`) is priced as the family program (`dhp_jax.sharding.family_adapter.FamilyModel`)
    runs at these choices, its inputs at 4 bytes, its blocks' kept values in `compute_bytes` but
    for those the program holds in fp32 (`_family_block_wide`), the rest in `activation_bytes`
    (`family_bytes_per_token`, which `dhp bench memory --families` compares with the compiled
    program; with `tensor_parallel` t > 1, `m` is one device's shape and `sequence_parallel` the
    block stacks' form); the formula below is the stand-in's."""
    if remat not in REMATS:
        raise ValueError(f"remat must be one of {REMATS}, got {remat!r}")
    if getattr(m, "family", ""):
        return family_bytes_per_token(m, float(compute_bytes if activation_bytes is None else activation_bytes),
                                      remat, chunked, kb=float(compute_bytes),
                                      tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel)
    kb = float(compute_bytes)
    cb = float(compute_bytes if activation_bytes is None else activation_bytes)
    # The encoder runs on `ppt` patches per LLM token (the real families merge 2x2 after it), so its
    # terms count ppt rows per token; every token is priced as a vision token (the bound for an
    # all-vision stream: the memory model has no per-sample vision share).
    ppt, mlp, deepstack, mid = _encoder(m)
    dec_kept, dec_work = _block(m.hidden, m.heads, m.kv_heads, m.head_dim, m.intermediate, remat, chunked)
    vit_kept, vit_work = _block(m.vision_hidden, m.vision_heads, m.vision_heads, m.vision_head_dim,
                                m.vision_intermediate, remat, chunked, mlp)
    # DeepStack: each merger's output waits (compute dtype) for the LLM layer it is added to
    kept = kb * (m.layers * dec_kept + ppt * m.vision_layers * vit_kept + deepstack * m.hidden)
    attn_f32 = 4.0 * max(_attention_fp32(m.heads, m.head_dim),
                         ppt * _attention_fp32(m.vision_heads, m.vision_head_dim))
    kept += 4.0 * (m.layers * _kept_wide(m.heads, m.kv_heads, m.head_dim, remat, chunked)
                   + ppt * m.vision_layers * _kept_wide(m.vision_heads, m.vision_heads, m.vision_head_dim, remat,
                                                        chunked))
    if kb < 4.0 and remat == "none" and not chunked:
        # in one pass the ring's custom VJP keeps its own fp32 copies of q, k and v
        # (`ring.ring_attention` casts them before it) besides the block's; in fp32 they are the block's
        kept += 4.0 * (m.layers * (m.heads + 2 * m.kv_heads) * m.head_dim
                       + ppt * m.vision_layers * 3 * m.vision_heads * m.vision_head_dim)
    work = cb * max(dec_work, ppt * vit_work) + attn_f32
    # Inputs (int32 columns, fp32 pixels + loss weight); each projector / merger (its input, fc1,
    # gelu, fc2), the token embedding, the merged stream and the LM head's input; the logits live
    # one loss chunk at a time (`fixed_bytes`).
    inputs = input_bytes_per_token(m)
    tail = cb * ((1 + deepstack) * (ppt * m.vision_hidden + 2 * mid + m.hidden) + 2 * m.hidden)
    return inputs + kept + work + tail


def input_bytes_per_token(m: Any) -> float:
    """Bytes per local token of a group program's inputs: int32 columns, fp32 pixels and loss weight
    (a family's program: `family_input_elements`), 4 bytes each whatever the compute dtype."""
    if getattr(m, "family", ""):
        return 4.0 * family_input_elements(m)
    return 4.0 * (INT_COLUMNS + m.patch_dim + 1)


def fixed_bytes(m: Any, compute_bytes: int) -> float:
    """Token-independent temporaries: one loss chunk's logits (cb), their fp32 copy and fp32
    gradient (`dhp_jax.model.mllm.LOSS_CHUNK` tokens)."""
    return LOSS_CHUNK * m.vocab * (compute_bytes + 8.0)


def engine_params(m: Any) -> int:
    """Parameters of the model of shape `m`: a published model's exact count (`param_count`, from
    its config.json; a test checks it against transformers' model), else the stand-in's,
    `dhp_jax.model.MLLMConfig.num_params` (one SwiGLU block stack over merged patches; a test
    checks that the two counts agree)."""
    if getattr(m, "param_count", 0):
        return int(m.param_count)
    d, v, vf = m.hidden, m.vision_hidden, m.vision_intermediate
    attn = d * m.head_dim * (2 * m.heads + 2 * m.kv_heads)
    dec = m.layers * (attn + 3 * d * m.intermediate + 2 * d)
    vis = m.vision_layers * (4 * v * m.vision_heads * m.vision_head_dim + 3 * v * vf + 2 * v)
    return m.vocab * d + m.patch_dim * v + v + vis + v + v * d + d + d * d + d + dec + d + d * m.vocab


def stack_params(m: Any) -> tuple[int, int]:
    """Parameters of the decoder and of the vision block stacks (the scans); a MoE model's sparse
    layers hold their router and all their experts (`_moe`) in place of a dense MLP."""
    d, v = m.hidden, m.vision_hidden
    dec = m.layers * (d * m.head_dim * (2 * m.heads + 2 * m.kv_heads) + 3 * d * m.intermediate + 2 * d)
    if _moe(m):
        dec += m.router_params + m.expert_params - m.sparse_layers * 3 * d * m.intermediate
    mlp = _encoder(m)[1]
    vis = m.vision_layers * (4 * v * m.vision_heads * m.vision_head_dim + mlp * v * m.vision_intermediate + 2 * v)
    return dec, vis


def backward_bytes(m: Any, compute_bytes: int, activation_bytes: int) -> float:
    """Gradient bytes that exist while the decoder blocks run backward (the peak of the blocks'
    phase): the decoder's stacked block gradients (compute dtype) and the LM head's, summed over
    the loss chunks in the loop state (`activation_bytes`); the embedding's, the vision stack's
    and the projector's come after."""
    if getattr(m, "family", ""):
        return family_backward_bytes(m, compute_bytes, activation_bytes)
    return float(stack_params(m)[0] * compute_bytes + m.vocab * m.hidden * activation_bytes)


def assemble_bytes(params: float, m: Any, compute_bytes: int, activation_bytes: int) -> float:
    """Gradient bytes of the program's last phase besides the row (no activations): every piece the
    row is concatenated from (P x compute bytes), and the embedding's and the LM head's gradients
    as accumulated (scatter-add over tokens, sum over loss chunks, in `activation_bytes`) before
    they are converted into their pieces. A family's LM head gradient is a piece already; its
    program holds the LM head's kernel copy (`family_head_copy_bytes`) to the end."""
    if getattr(m, "family", ""):
        return float(params * compute_bytes + m.vocab * m.hidden * activation_bytes
                     + family_head_copy_bytes(m, compute_bytes))
    return float(params * compute_bytes + 2 * m.vocab * m.hidden * activation_bytes)


def family_head_copy_bytes(m: Any, compute_bytes: int) -> float:
    """Bytes of the LM head's kernel copy a family program reads the head from (a slice of the flat
    params, in the compute dtype, that every loss chunk reads): live from the loss through the
    backward pass (`family_backward_bytes`) and, in the buffer assignment of the published families'
    programs (3 LLM layers and 3 encoder blocks, fp32), still live when the last phase concatenates
    the gradient row (`assemble_bytes`)."""
    return float(m.vocab * m.hidden * compute_bytes)


def program_static_bytes(params: float, compute_bytes: int, gradient_bytes: float) -> float:
    """Token-independent bytes of the group program: params in and the gradient row out, in the
    compute dtype (XLA allocates the outputs for the whole program), plus `gradient_bytes` of the
    gradients that exist at the time (`backward_bytes` or `assemble_bytes`)."""
    return 2.0 * params * compute_bytes + gradient_bytes


def reduce_pieces(padded: int, shards: int, piece_bytes: int = REDUCE_PIECE_BYTES) -> tuple[int, int]:
    """(c, k) of the step's reduce-scatter of a row of `padded` elements over `shards` devices: the
    row seen as [shards, padded / shards] is reduce-scattered in k pieces of c columns (each cast
    to fp32 on its own), then the tail of padded / shards - k c columns; one piece is [shards, c]
    fp32, at most `piece_bytes`."""
    shard = padded // shards
    k = min(max(MIN_REDUCE_PIECES, -(-4 * padded // piece_bytes)), max(shard, 1))
    return shard // k, k


def gather_bytes(params: float, compute_bytes: int) -> float:
    """Bytes per device of the step's all-gather besides the state: the gathered params in the
    compute dtype, and for a 2-byte dtype the bit-cast copy XLA:CPU makes of them."""
    return params * compute_bytes * (2.0 if compute_bytes < 4 else 1.0)


def reduce_bytes(params: float, compute_bytes: int, state_shards: int, params_held: bool = True) -> float:
    """Bytes per device of the reduction of one micro-batch, besides the state: the device's
    gradient row (compute dtype), one piece of it in fp32 with its reduce-scattered part
    (`reduce_pieces`), and the gathered params while a later micro-batch still needs them."""
    padded = -(-int(params) // state_shards) * state_shards
    c, _ = reduce_pieces(padded, state_shards)
    return params * compute_bytes * (2.0 if params_held else 1.0) + 4.0 * c * (state_shards + 1)


def finish_bytes(params: float, state_shards: int) -> float:
    """Bytes per device after the last reduction, besides the state: the mean gradient shard
    (fp32), made next to the accumulator it is divided from."""
    return 4.0 * params / state_shards


def update_bytes(params: float, state_shards: int) -> float:
    """Bytes per device of the optimizer update besides the state (donated, updated in place): one
    fp32 shard-sized temporary (the clipped update before it is applied)."""
    return 4.0 * params / state_shards


def step_phases(programs: Sequence[float], params: float, compute_bytes: int, state_shards: int
                ) -> list[tuple[str, float]]:
    """A device's bytes besides the state through one step, in the order it runs them: the
    all-gather, then per micro-batch its group program (`programs[m]`: bytes of the program, None
    if the device is idle in it) and the reduction of its gradient row, then the update. A device
    holds one row at a time: each micro-batch's reduction runs before its next group program. The
    step's peak is the largest of these (`memory.device_step_bytes`); the state comes on top."""
    out = [("gather", gather_bytes(params, compute_bytes))]
    for m, prog in enumerate(programs):
        if prog is not None:
            out.append((f"micro-batch {m} group program", float(prog)))
        out.append((f"micro-batch {m} reduction",
                    reduce_bytes(params, compute_bytes, state_shards, params_held=m + 1 < len(programs))))
    out.append(("finish", finish_bytes(params, state_shards)))
    out.append(("update", update_bytes(params, state_shards)))
    return out


def state_bytes(params: float, state_shards: int) -> float:
    """Bytes per rank of the sharded fp32 state (master, Adam moments, gradient accumulator)."""
    return STATE_BYTES_PER_PARAM * params / state_shards


# ------------------------------------------------------------------ the Hugging Face families' program
# `dhp_jax.sharding.family_adapter.FamilyModel` runs a family's own layers (`dhp_jax.model.hf`) as two
# block scans (`dhp_jax.model.hf.scan.run_blocks`): the forward scan stores, per block, the residuals
# of the block's `jax.vjp` (every value its backward pass reads, minus its params and the stack's
# constants), so without recompute a block keeps exactly those; with remat "layer"
# (`layers.remat_block`) it keeps its input, and the backward pass of the one block recomputed at a
# time holds its residuals again. The counts below are those residuals per row (elements), read off
# the programs' `jax.vjp` at published widths (`dhp bench memory --families`, docs/executor.md).
POSITION_TAPS = 4          # Qwen3-VL's interpolated position embedding (dhp_jax.model.hf.packed.TAPS)
# Cotangents the backward pass of one block holds on top of the residuals it reads, per row
# (elements): (values as wide as the MLP's middle, values as wide as the block). An LLM layer
# (SwiGLU): without recompute (its residuals are kept anyway) the cotangents of gate, up and their
# product and two hidden-wide ones; recomputed (remat "layer", the residuals are recomputed and
# freed as the pullback reads them) one MLP-wide and three hidden-wide. An encoder block,
# recomputed, by its MLP: the family's `MemoryTerms.encoder_cotangents` (`dhp_jax.models`). Fitted
# on the degree-1 rows of `dhp bench memory --families` (8k, 32k and 64k tokens) and checked on
# the others (experiments/REPORT.md, section 10).
FAMILY_LLM_COTANGENTS = {"none": (3, 2), "layer": (1, 3)}


def _terms(m: Any):
    """The family's per-row memory terms (`FamilySpec.memory`)."""
    return models.spec(m.family).memory


def family_llm_saved(m: Any) -> int:
    """Elements per token one LLM layer of a family program keeps for its backward pass without
    recompute (`layers.decoder_block`, the residuals of its `jax.vjp`): the layer input and its
    RMSNorm output (the input of the q/k/v GEMMs); the rotary tables cos and sin (head_dim each; the
    rotation is linear, so q and k before it are not kept); with QK-norm (Qwen3) q and k before
    their norms; the attention's q, k, v and output o (the ring's custom VJP) with its log-sum-exp
    (one per head); o again as o_proj's input (a reshape of it is a value of its own); the residual
    sum and its RMSNorm output (the input of gate and up); SwiGLU's gate, up and their product (the
    input of down). The norms and the activation are `layers.fused`: their VJP keeps their input."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    qk_norm = q + kv if _terms(m).llm_qk_norm else 0
    return 4 * m.hidden + 2 * m.head_dim + qk_norm + (2 * q + 2 * kv) + m.heads + q + 3 * m.intermediate


def family_encoder_saved(m: Any) -> int:
    """Elements per encoder row one encoder block keeps for its backward pass without recompute, as
    `family_llm_saved`, the family's `MemoryTerms.encoder_saved`: the block input and its norm
    output; q, k, v, the attention output and its log-sum-exp, the output again as the projection's
    input; the residual sum and its norm output; the MLP's values (`vision_mlp` of them: SwiGLU,
    Qwen2.5-VL, gate, up and their product; GELU, fc1's output and its activation). InternViT's
    layer scales keep the two branch outputs they multiply (the projection's and fc2's); the Qwen
    encoders' rotary tables cos and sin are kept as the LLM's."""
    v, w = m.vision_hidden, m.vision_heads * m.vision_head_dim
    ff = int(getattr(m, "vision_mlp", 3)) * m.vision_intermediate
    return _terms(m).encoder_saved(m, v, w, ff)


def family_tail(m: Any) -> tuple[int, int]:
    """(elements, bytes of bool masks) per LLM token a family program keeps outside its block scans
    for the backward pass (the residuals of its `jax.vjp` there): the pixels sliced off the input
    (one patch per encoder row, the patch embedding's input); the projector (InternVL: its
    LayerNorm's input and output, 4 patches wide, its activation's input and output) or the patch
    merger (Qwen: its norm's input, one encoder row per row, the merged norm output, exact GELU's
    input, two intermediates and output) and each DeepStack merger (its LayerNorm's input and
    output, GELU as the merger's), with the DeepStack features added to the LLM (one per level)
    and the encoder's tapped hidden states they are made from (one encoder row per row and level);
    the final RMSNorm's input and the LM head's input. The masks: the select of the vision
    features into the token stream (hidden), InternVL's CLS token (one per encoder element),
    DeepStack's (per level)."""
    rows, ppt = encoder_rows(m), _encoder(m)[0]
    v, mid, levels = m.vision_hidden, _encoder(m)[3], _encoder(m)[2]
    wide = ppt * v
    elements = rows * (m.patch_dim // ppt) + 2 * m.hidden
    masks = m.hidden + levels * m.hidden
    more, more_masks = _terms(m).tail(m, rows, v, wide, mid, levels)    # projector / mergers (the family's)
    return elements + more, masks + more_masks


def encoder_rows(m: Any) -> int:
    """Rows of the family program's vision stream per LLM token (`dhp_jax.model.hf.packed.unit`):
    the patches one LLM token merges, and for InternVL one more for its tile's CLS token (a dead row
    on all but the tile's first token). Every LLM slot has them, text and padding slots included:
    the program's shapes do not depend on the group's vision share, so neither do its bytes."""
    ppt = _encoder(m)[0]
    return ppt + (_terms(m).cls_rows if getattr(m, "family", "") else 0)


def _moe(m: Any) -> bool:
    """Whether shape `m` has sparse mixture-of-experts layers (`presets.ModelShape.moe`)."""
    return bool(getattr(m, "experts", 0) and getattr(m, "sparse_layers", 0))


def moe_saved(m: Any) -> int:
    """Elements per token a sparse layer's block keeps for its backward pass without recompute in
    place of a dense SwiGLU MLP's three values (`family_llm_saved`): the router's logits and their
    softmax (one per expert), the k gates and expert indices the top-k keeps, the dispatch buffer
    (the k copies of the normed row its experts read, in expert order), each routed row's gate, up
    and their product (3 x the expert width, k rows), and the k expert outputs the gates weigh
    (their gradient reads them). Static shapes: k rows per token on every device of a rank,
    whatever t (`tensor_parallel.local_shape` keeps these widths whole)."""
    k = m.experts_per_token
    return 2 * m.experts + 2 * k + 2 * k * m.hidden + 3 * k * m.expert_intermediate


# The grouped expert GEMM a MoE program compiled for CPU devices runs (`dhp_jax.model.hf.moe`, its
# "blocks" formulation: XLA:CPU has no grouped GEMM of its own, and jax's fallback for
# `ragged_dot` there masks the rows into a dense copy per expert) starts each expert's sorted rows
# at a whole block of B rows: its row buffers have S k + E_l (B - 1) rows where an accelerator's
# `ragged_dot` has S k, B the largest with E_l B <= S k / CPU_BLOCKS_PER_EXPERT (`moe.block_rows`),
# so the padding is about S k / CPU_BLOCKS_PER_EXPERT rows whatever E_l.
CPU_BLOCKS_PER_EXPERT = 16      # `dhp_jax.model.hf.moe.BLOCKS_PER_EXPERT`


def moe_routed_rows(m: Any, remat: str) -> tuple[int, int]:
    """(elements per token of the k routed rows a sparse layer keeps for its backward pass, those
    of the routed rows in the working set of its backward pass): the dispatch buffer, the gate, up
    and product and the expert outputs (`moe_saved`'s rows) and their cotangents
    (`moe_cotangents`'s rows); kept at remat "none", the gate and up at "selective", none at
    "layer" (its working set recomputes them)."""
    k, d, inter = m.experts_per_token, m.hidden, m.expert_intermediate
    saved = 2 * k * d + 3 * k * inter
    cf, _ = FAMILY_LLM_COTANGENTS["none" if remat == "none" else "layer"]
    cotangents = cf * k * inter + 2 * k * d
    if remat == "none":
        return saved, cotangents
    return (2 * k * inter if remat == "selective" else 0), saved + cotangents


def cpu_grouped_gemm_padding(m: Any, remat: str = "none") -> float:
    """Elements per token that a MoE group program compiled by XLA:CPU holds beyond the
    accelerator's figure: the padding rows of its blocked grouped GEMM, 1 / CPU_BLOCKS_PER_EXPERT of
    the routed rows (`moe_routed_rows`) that every sparse layer keeps and that the backward pass of
    one holds; 0 for a dense model. `dhp bench memory --families` adds it (in the activation bytes)
    to the model's figure when it compiles for CPU devices, and records the figure without it as the
    accelerator's; the planner never prices it."""
    if not _moe(m):
        return 0.0
    kept, work = moe_routed_rows(m, remat)
    return (m.sparse_layers * kept + work) / CPU_BLOCKS_PER_EXPERT


def moe_cotangents(m: Any, remat: str) -> int:
    """Cotangents a sparse layer's backward pass holds on top of what it reads, per token: the dense
    layer's (`FAMILY_LLM_COTANGENTS`) with the MLP-wide ones over the k routed rows of the expert
    width, and the cotangents of the dispatch buffer and of the expert outputs (k rows of hidden
    each)."""
    cf, cw = FAMILY_LLM_COTANGENTS["none" if remat == "none" else "layer"]
    k = m.experts_per_token
    return cf * k * m.expert_intermediate + cw * m.hidden + 2 * k * m.hidden


def _llm_blocks(m: Any, remat: str, chunked: bool) -> tuple[float, float]:
    """(elements kept per token by all LLM layers, elements of the working set of the LLM layer
    whose backward pass is the larger) of a family program (`_family_block`): a MoE model's
    dense and sparse layers each by its own block."""
    kept, work = _family_block(m, False, remat, chunked)
    if not _moe(m):
        return m.layers * kept, work
    s_kept, s_work = _family_block(m, False, remat, chunked, sparse=True)
    return m.dense_layers * kept + m.sparse_layers * s_kept, max(work if m.dense_layers else 0.0, s_work)


# Buffers of the collectives that the backward pass of one encoder block of a rank of t > 1 devices
# holds at its peak (the ring's backward pass) in the psum form (`dhp_jax.sharding.tensor_parallel`),
# per encoder row, where the family's program keeps them live there (`MemoryTerms.psum_buffers`;
# the buffer assignment of the tiny families' programs, degree 2, t = 2: InternViT, whose layer scales multiply the row-split
# GEMMs' outputs, holds three [rows, hidden] all-reduce buffers: an all-reduce's result is a buffer
# of its own beside its operand, and XLA combines a block's all-reduces, so the MLP phase's result
# and the attention phase's operand and result are live together; the Qwen encoders' all-reduces have
# finished before their ring's backward pass starts). Sequence-parallel, the block holds one
# reduce-scatter result [rows / t, hidden] there, within the hidden-wide values that form prices
# whole (`tensor_parallel.sequence_saving`), so none is added.
def family_collective_buffers(m: Any, t: int, sequence_parallel: bool, chunked: bool) -> float:
    """Elements per encoder row that the backward pass of one encoder block holds in its all-reduces'
    buffers on a rank of `t` devices in the psum form (`MemoryTerms.psum_buffers`; `m` is one device's
    shape); 0 at t = 1, sequence-parallel, in chunks (whose collectives run one chunk at a time) and
    for a family that holds none."""
    if t <= 1 or chunked or sequence_parallel:
        return 0.0
    return float(_terms(m).psum_buffers * m.vision_hidden) if getattr(m, "family", "") else 0.0


def family_bytes_per_token(m: Any, ab: float, remat: str = "none", chunked: bool = False,
                           kb: float | None = None, tensor_parallel: int = 1,
                           sequence_parallel: bool = False) -> float:
    """Bytes per local LLM token of a family's group program at the peak of its backward pass: its
    inputs (`input_bytes_per_token`); what every LLM layer and every encoder block keeps for its
    backward pass (`_family_block`), loop state of the block scans in `kb` bytes an element (the
    compute dtype's, stored bit-cast; default `ab`); in elements of `ab` bytes what the program
    keeps outside them (`family_tail`, its masks at a byte an element) and the working set of the
    block whose backward pass runs at the peak (`_family_block`; the LLM layer's or the encoder
    block's over its `encoder_rows` rows, whichever is larger); and of both, in 4 bytes, the values
    the program holds in fp32 whatever the dtype (`_family_block_wide`). With `tensor_parallel`
    t > 1 (`m` one device's shape; `sequence_parallel`: the block stacks' form) an encoder block's
    backward pass also holds its collectives' buffers (`family_collective_buffers`)."""
    kb = ab if kb is None else kb
    rows = encoder_rows(m)
    if _moe(m):
        dec_kept, dec_work = _llm_blocks(m, remat, chunked)
    else:
        dec_kept, dec_work = _family_block(m, False, remat, chunked)
        dec_kept = m.layers * dec_kept
    vit_kept, vit_work = _family_block(m, True, remat, chunked)
    dec_wide, dec_work_wide = _family_block_wide(m, False, remat, chunked)
    vit_wide, vit_work_wide = _family_block_wide(m, True, remat, chunked)
    kept = kb * (dec_kept + rows * m.vision_layers * vit_kept) \
        + (4.0 - kb) * (m.layers * dec_wide + rows * m.vision_layers * vit_wide)
    if kb < 4.0:
        kept += (4.0 - kb) * (m.layers * _family_ring_copies(m, False, remat, chunked)
                       + rows * m.vision_layers * _family_ring_copies(m, True, remat, chunked))
    dec_narrow, vit_narrow = _family_work_narrow(m, False, remat, chunked), _family_work_narrow(m, True, remat, chunked)
    vit_work += family_collective_buffers(m, tensor_parallel, sequence_parallel, chunked)
    work = max(ab * dec_work + (4.0 - ab) * dec_work_wide + (kb - ab) * dec_narrow,
               rows * (ab * vit_work + (4.0 - ab) * vit_work_wide + (kb - ab) * vit_narrow))
    tail, masks = family_tail(m)
    return float(input_bytes_per_token(m) + kept + work + ab * tail + masks)


def family_backward_bytes(m: Any, compute_bytes: int, activation_bytes: int) -> float:
    """`backward_bytes` of a family program: besides the LLM's stacked layer gradients and the LM
    head's (as the stand-in's), the copies its block scans and its head read the params from
    while the backward pass runs: the encoder's stacked block gradients and the LM head's kernel
    (a slice of the flat params read by every loss chunk), in the compute dtype."""
    dec, vis = stack_params(m)
    return float((dec + vis) * compute_bytes + family_head_copy_bytes(m, compute_bytes)
                 + m.vocab * m.hidden * activation_bytes)


# fp32 [heads, tile, tile] arrays of `presets.attention_workspace_bytes`' four (scores, probabilities,
# dP, dS) that a family block's ring backward pass holds at once: XLA fuses the others into the
# tile loop's GEMMs (the buffer assignment of the tiny families' programs holds two such arrays at
# the peak). With the blocks in chunks (whose working set `_family_block` counts as a whole, without
# the ring's backward pass) the four are priced. Where the block has one head on a device (t = 2
# of a two-head encoder), the tile loop's dP GEMM output is a third such array of its own (the
# buffer assignment of the tiny families' programs at t = 2: the exponentials, their product and
# the GEMM's output, three [1, tile, tile] arrays, at the peak), priced on every platform.
FAMILY_LIVE_TILES = 2
FAMILY_LIVE_TILES_ONE_HEAD = 3


def peak_attention_workspace(m: Any, remat: str, chunked: bool) -> float:
    """The tiled ring's constant workspace (`presets.attention_workspace_bytes`: fp32 scores,
    probabilities and their gradients of one tile pair per head) of the block whose backward pass
    is the program's peak: the LLM's heads for the stand-in; for a family, the encoder's when one
    encoder block's recomputed working set over its rows is the larger (`_family_block`, remat
    "layer", the same block at every remat and chunk: the ring attention's tiles are those of the
    block whose backward pass runs at the peak); of a family's four tile arrays, the
    `FAMILY_LIVE_TILES` its backward pass holds at once (`FAMILY_LIVE_TILES_ONE_HEAD` where the
    block has one head on a device)."""
    from dhp_jax.planner.cost.presets import attention_workspace_bytes

    if not getattr(m, "family", ""):
        return attention_workspace_bytes(m)
    llm = _llm_blocks(m, "layer", False)[1] if _moe(m) else _family_block(m, False, "layer", False)[1]
    vision = encoder_rows(m) * _family_block(m, True, "layer", False)[1] > llm
    heads = m.vision_heads if vision else m.heads
    live = 1.0 if chunked else (FAMILY_LIVE_TILES_ONE_HEAD if heads == 1 else FAMILY_LIVE_TILES) / 4.0
    return live * attention_workspace_bytes(m) * heads / m.heads


def family_input_elements(m: Any) -> int:
    """Input elements per local LLM token of a family's group program (int32 or fp32, 4 bytes each
    in any compute dtype; `FamilyModel`'s four stream shards, `dhp_jax.model.hf.packed`): the
    LLM stream's 5 id columns, its rotary position axes (InternVL 1, M-RoPE 3) and loss weight, and
    per vision row (`encoder_rows`) its 10 id columns, one patch's pixels and the position
    table's tap weights (`POSITION_TAPS`)."""
    axes = _terms(m).position_axes
    return 5 + axes + 1 + encoder_rows(m) * (10 + m.patch_dim // _encoder(m)[0] + POSITION_TAPS)


def family_rotary(m: Any, vision: bool) -> int:
    """Elements per row of the rotary tables cos and sin a block of a family program keeps (fp32,
    `layers.rotary`): two of head_dim for every LLM, and for an encoder whose block counts them
    (`MemoryTerms.encoder_saved`: the Qwen encoders; InternViT has none)."""
    if not vision:
        return 2 * m.head_dim
    return 2 * m.vision_head_dim if _terms(m).encoder_saved(m, 0, 0, 0) > m.vision_heads else 0


def _family_block_wide(m: Any, vision: bool, remat: str, chunked: bool) -> tuple[float, float]:
    """(elements of `_family_block`'s kept values, elements of its working set) that the family
    program holds in fp32 whatever the compute dtype, on every platform: the residuals of the
    ring attention's custom VJP (`dhp_jax.sharding.ring.ring_attention` casts q, k and v to fp32
    before it, so q, k, v, its output and the log-sum-exp per head are fp32) and the rotary tables
    (`family_rotary`). Kept without recompute; with recompute the backward pass of the one block
    recomputed at a time holds them again. Its working set holds the ring's backward pass
    (`family_ring_backward`) where the attention's phase is the larger (`_family_cotangents`). In
    chunks (`_block`), without recompute the ring's fp32 accumulator state (`_attention_fp32`) it
    keeps (and `_family_ring_copies`); its working set holds the ring's backward pass
    (`family_chunked_ring_backward`). The rest of a block's kept
    values are loop state of the block scans, stored bit-cast in the compute dtype
    (`scan.run_blocks`)."""
    if remat == "selective" and chunked:
        remat = "layer"
    if vision:
        heads, kv, head_dim = m.vision_heads, m.vision_heads, m.vision_head_dim
    else:
        heads, kv, head_dim = m.heads, m.kv_heads, m.head_dim
    if chunked:
        ring = family_chunked_ring_backward(heads, kv, head_dim, remat)
        return (_attention_fp32(heads, head_dim), ring) if remat == "none" else (0.0, ring)
    wide = 2 * (heads + kv) * head_dim + heads + family_rotary(m, vision)
    ring = _family_cotangents(m, vision, remat)[1]
    return (wide, ring) if remat == "none" else (0.0, wide + ring)


def _family_cotangents(m: Any, vision: bool, remat: str) -> tuple[int, int]:
    """(elements per row the backward pass of one dense LLM layer or encoder block holds on top of
    its residuals, those of them in fp32 on every platform): the larger of its two phases. The MLP's
    (`FAMILY_LLM_COTANGENTS`, `MemoryTerms.encoder_cotangents`: none in fp32) and the attention's,
    which runs after it: the ring attention's backward pass (`family_ring_backward`, fp32) with the
    cotangents of the attention output, of q, k and v (the ring's outputs), of the block's input
    and of its norm's output (the MLP's values are read and freed by then; the count keeps them, an
    upper bound)."""
    if vision:
        cf, cw = _terms(m).encoder_cotangents
        hidden, heads, kv, head_dim, ff = m.vision_hidden, m.vision_heads, m.vision_heads, m.vision_head_dim, \
            m.vision_intermediate
    else:
        cf, cw = FAMILY_LLM_COTANGENTS["none" if remat == "none" else "layer"]
        hidden, heads, kv, head_dim, ff = m.hidden, m.heads, m.kv_heads, m.head_dim, m.intermediate
    mlp = cf * ff + cw * hidden
    attention = family_attention_phase(heads, kv, head_dim, hidden)
    return (attention, family_ring_backward(heads, kv, head_dim)) if attention > mlp else (mlp, 0)


def family_attention_phase(heads: int, kv_heads: int, head_dim: int, hidden: int) -> int:
    """Elements per row the attention phase of a block's backward pass holds on top of its residuals
    (`_family_cotangents`; a sparse layer's as a dense one's): the ring's backward pass
    (`family_ring_backward`) and the cotangents of the attention output, q, k, v, the block input and
    its norm's output."""
    return family_ring_backward(heads, kv_heads, head_dim) + 2 * (heads + kv_heads) * head_dim + 2 * hidden


def _family_work_narrow(m: Any, vision: bool, remat: str, chunked: bool) -> float:
    """Elements of `_family_block`'s working set that the program holds in the compute dtype, not in
    the activation bytes (they differ where XLA:CPU computes a bf16 program in fp32): in the
    attention's phase (`_family_cotangents`), the cotangents of the attention output, q, k, v, the
    block input and its norm's output, values of the block's own dtype that the backward pass
    materialises between the ring's fp32 VJP and the block's GEMMs. In chunks
    (`family_chunked_attention_phase`), with recompute the recomputed q, k, v and the three
    hidden-wide cotangents; without, none."""
    if chunked:
        if vision:
            heads, kv, head_dim, hidden = m.vision_heads, m.vision_heads, m.vision_head_dim, m.vision_hidden
        else:
            heads, kv, head_dim, hidden = m.heads, m.kv_heads, m.head_dim, m.hidden
        as_run = "layer" if remat == "selective" else remat
        return float(family_chunked_attention_phase(heads, kv, head_dim, hidden, as_run)
                     - family_chunked_ring_backward(heads, kv, head_dim, as_run))
    work, ring = _family_cotangents(m, vision, remat)
    return float(work - ring) if ring else 0.0


def family_ring_backward(heads: int, kv_heads: int, head_dim: int) -> int:
    """fp32 elements per row the ring attention's backward pass (`dhp_jax.sharding.ring._ring_bwd`,
    `tiles.backward`) holds besides its residuals and the output cotangent, at the peak of a ring
    step (degree > 1): the tile-layout copies of the queries and of the output cotangent
    (`tiles.make_queries`, `tiles.heads_first`), the dq accumulator of the ring and that of the
    step's tile loop (heads x head_dim each); the key block it folds and the next one it receives
    (k and v each), the travelling dk / dv accumulators and those of the step's tile loop (kv heads x
    head_dim each); and delta, one per head. On every platform (the ring computes in fp32)."""
    q, k = heads * head_dim, kv_heads * head_dim
    return 4 * q + 8 * k + heads


def family_chunked_ring_backward(heads: int, kv_heads: int, head_dim: int, remat: str) -> int:
    """fp32 elements per row the ring attention's backward pass holds in a block whose token-local
    work runs in chunks (`_family_block`, `family_chunked_attention_phase`): without recompute,
    all of `family_ring_backward`; with recompute ("layer"; "selective" in chunks is priced as
    "layer") that less the key block it folds and the one it receives (k and v each, 4 x kv heads x
    head_dim): the recomputed k and v are the block it folds (counted with the recomputed q, k, v),
    and the buffer assignment of the tiny families' chunked programs holds no second pair there."""
    ring = family_ring_backward(heads, kv_heads, head_dim)
    return ring if remat == "none" else ring - 4 * kv_heads * head_dim


def family_chunked_attention_phase(heads: int, kv_heads: int, head_dim: int, hidden: int, remat: str) -> int:
    """Elements per row the backward pass of a block in chunks (`HFConfig.linear_chunk` > 0) holds
    on top of what it keeps, at its peak: the attention's phase, which runs on the whole rows
    outside the chunks' VJP (the MLP's values live one chunk at a time: `chunk_bytes`). Without
    recompute, the ring attention's backward pass (`family_chunked_ring_backward`, fp32; the
    cotangents around it are those of the chunk loops, one chunk at a time). With recompute, the
    ring's backward pass, the recomputed q, k and v it reads, and three hidden-wide values: the
    chunk loop's cotangent of the block input, its initial value, and the stream's cotangent
    (the buffer assignment of the tiny families' programs in chunks of 256, degree 2)."""
    ring = family_chunked_ring_backward(heads, kv_heads, head_dim, remat)
    if remat == "none":
        return ring
    return ring + (heads + 2 * kv_heads) * head_dim + 3 * hidden


def _family_ring_copies(m: Any, vision: bool, remat: str, chunked: bool) -> float:
    """Elements per row of `_family_block`'s kept values that a block of a family program holds in
    fp32, not in the compute dtype, when that is narrower (`family_bytes_per_token` prices them at
    4 bytes in place of the compute dtype's): in chunks without recompute, q, k and v, kept once,
    as the ring attention's VJP holds them (`ring.ring_attention` casts them to fp32 before it;
    the buffer assignment of the tiny families' bf16 programs in chunks holds no compute-dtype copy
    beside them). Without chunks the block keeps the fp32 copies only (`_family_block_wide`)."""
    if not chunked or remat != "none":
        return 0.0
    if vision:
        return float(3 * m.vision_heads * m.vision_head_dim)
    return float((m.heads + 2 * m.kv_heads) * m.head_dim)


def _family_block(m: Any, vision: bool, remat: str, chunked: bool, sparse: bool = False) -> tuple[float, float]:
    """(elements kept per row by one LLM layer or encoder block of a family program, elements of
    the working set of its backward pass) (`family_bytes_per_token`).

    Without chunks: remat "none" keeps the block's residuals (`family_llm_saved`,
    `family_encoder_saved`); "layer" its input; "selective" its input and the outputs of its
    weight GEMMs. The backward pass holds the block's cotangents (the larger of the MLP's,
    `FAMILY_LLM_COTANGENTS`, `MemoryTerms.encoder_cotangents`, and the attention's phase:
    `_family_cotangents`) and, when the block is recomputed, its
    residuals again. `chunked` (`HFConfig.linear_chunk` > 0): the chunks' VJP keeps their inputs
    only (the block input, q, k, v and the attention output) and recomputes the rest chunk by
    chunk; its backward pass holds the attention's phase, run on the whole rows
    (`family_chunked_attention_phase`). Remat "selective" with chunks is priced as "layer": `jax.checkpoint`'s policy keeps the
    outputs of the weight GEMMs it sees, and with chunks every GEMM runs inside a chunk's custom
    VJP, where it sees none, so the block keeps its input only (tiny Qwen3-VL, degree 2, 2048 and
    4096 tokens in chunks of 256: the compiled programs of the two are the same bytes).

    `sparse`: a MoE model's sparse LLM layer, whose MLP values are the sparse block's (`moe_saved`,
    and in its backward pass the larger of `moe_cotangents` and the attention's phase); with remat "selective" it also keeps the router's logits and the routed
    rows' gate and up (its weight GEMMs' outputs); with chunks its MLP still runs on the whole rows,
    outside the chunks' VJP, so the block keeps (remat "none": `moe_saved`) or holds (its working
    set) the routed rows (`moe_routed_rows`) on top of the chunked attention's."""
    if remat == "selective" and chunked:
        remat = "layer"
    if vision:
        hidden, heads, kv, head_dim = m.vision_hidden, m.vision_heads, m.vision_heads, m.vision_head_dim
        saved, ff, gemm_ff = family_encoder_saved(m), m.vision_intermediate, _encoder(m)[1] - 1
    else:
        hidden, heads, kv, head_dim = m.hidden, m.heads, m.kv_heads, m.head_dim
        saved, ff, gemm_ff = family_llm_saved(m), m.intermediate, 2
    qkv = (heads + 2 * kv) * head_dim
    attn = _attention_fp32(heads, head_dim)
    cotangents = _family_cotangents(m, vision, remat)[0]
    if sparse and not vision:
        saved = saved - 3 * m.intermediate + moe_saved(m)
        # the larger of its two phases: the sparse MLP's and the attention's, as a dense layer's
        cotangents = max(moe_cotangents(m, remat), family_attention_phase(heads, kv, head_dim, hidden))
        ff, gemm_ff = m.experts_per_token * m.expert_intermediate, 2
    if chunked:
        inputs = hidden + qkv + heads * head_dim + attn          # the chunks' and the attention's inputs
        work = family_chunked_attention_phase(heads, kv, head_dim, hidden, remat)
        if sparse and not vision:        # the sparse MLP runs on the whole rows, outside the chunks
            kept, rows = moe_routed_rows(m, remat)
            inputs, work = inputs + kept + 2 * m.experts + 2 * m.experts_per_token, work + rows
        return (inputs, work) if remat == "none" else (hidden, work)
    if remat == "layer":
        return hidden, saved + cotangents
    if remat == "selective":             # the input, q, k, v, the output projection, the MLP's GEMMs
        router = m.experts if sparse and not vision else 0
        return 2 * hidden + qkv + gemm_ff * ff + hidden + router, saved + cotangents
    return saved, cotangents


# ---------------------------------------------------------------- a cost model's bytes per rank
# The accounting of a `CostModel` (its memory fields, set by `CostModel.preset` from the formulas
# above): the one place a group's or a step's bytes are counted.

def max_tokens_per_rank(cost: Any) -> float:
    """Tokens a rank may hold within the cost's activation budget."""
    return cost.memory_budget / cost.mem_per_token


def group_activation_bytes(cost: Any, lengths: Any, degree: int) -> float:
    """Activation bytes per rank of a group of `degree` ranks holding these sequences (the padded
    stream: `planner.cost.geometry.padded_length`)."""
    positive_int(degree, "degree")
    return float(padded_length(cost, lengths_array(lengths).sum(), degree) * cost.mem_per_token / degree)



def over_budget(cost: Any, tokens: Any, degree: Any) -> np.ndarray:
    """Whether a group of `degree` ranks holding `tokens` real tokens exceeds the cost's per-rank
    activation budget (vectorised): the one feasibility criterion of the planner's plans
    (`solvers.build.build_plan`) and of `plan_check.check_memory`. The padded stream a rank runs
    is clamped to the budget by the bucket rule (`geometry.layout.bucket_lengths`), up to its
    rounding to a multiple of 2 x degree."""
    return np.asarray(tokens, dtype=np.float64) * cost.mem_per_token / np.asarray(degree, dtype=np.float64) \
        > cost.memory_budget * (1 + 1e-9)

def min_degree(cost: Any, lengths: Any) -> Any:
    """Least degree at which each single sequence fits the cost's memory budget (int64[K])."""
    L = lengths_array(lengths)
    return np.maximum(1, np.ceil(L * cost.mem_per_token / cost.memory_budget - 1e-12)).astype(np.int64)


def rank_state_bytes(cost: Any) -> float:
    """Bytes per rank of the cost's sharded fp32 state (outside the group program)."""
    return state_bytes(cost.param_count, cost.state_shards)


def group_static_bytes(cost: Any) -> float:
    """Token-independent bytes of a group program (params in, gradient row out, fixed temps)."""
    return program_static_bytes(cost.param_count, cost.compute_bytes, cost.backward_bytes) + cost.fixed_bytes


def rank_static_bytes(cost: Any) -> float:
    """Every byte per rank that does not depend on the tokens: group static bytes + state shard."""
    return group_static_bytes(cost) + rank_state_bytes(cost)


def group_program_bytes(cost: Any, lengths: Any, degree: int) -> float:
    """Bytes per device of the group program holding these sequences: what XLA's
    `memory_analysis()` of the compiled program reports (arguments + outputs + temp - aliases)."""
    last = program_static_bytes(cost.param_count, cost.compute_bytes, cost.assemble_bytes)
    return max(group_static_bytes(cost) + group_activation_bytes(cost, lengths, degree), last)


def device_step_phases(cost: Any, groups: Sequence[tuple[Sequence[int], int] | None]) -> list[tuple[str, float]]:
    """(phase, bytes besides the state) of a device's step, in order (`device_step_bytes`)."""
    programs = [None if g is None else group_program_bytes(cost, g[0], g[1]) for g in groups]
    return step_phases(programs, cost.param_count, cost.compute_bytes, cost.state_shards)


def device_step_bytes(cost: Any, groups: Sequence[tuple[Sequence[int], int] | None]) -> float:
    """Peak bytes per device of a training step besides the state shard (`rank_state_bytes`): the
    device's group program of each micro-batch (`groups[m]`: (lengths, degree) of its group,
    None if idle), each micro-batch's reduction, the gather and the update, as the engine
    runs them (`step_phases`)."""
    return max(b for _, b in device_step_phases(cost, groups))
