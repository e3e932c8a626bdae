"""The planner's cost model (DHP, arXiv 2602.21788, section 4.2): the coefficients of the time and
memory of one CP group.

`CostModel` holds coefficients only (model/hardware figures, the engine's memory fields) and the
executor's stream geometry as one field (`geometry`, a `dhp_jax.planner.cost.geometry.StreamGeometry`:
padding ladder, pad-skipping chunk, menu), and derives them (`preset`, `replace`, I/O). What uses
them lives with its concept: pricing (the formula below, makespans, the all-reduce) in
`dhp_jax.planner.cost.pricing`, the padded length in `dhp_jax.planner.cost.geometry`, the bytes of a
group or a step in `dhp_jax.planner.cost.memory`.

For a group of degree d holding sequences of lengths L_k with bidirectional shares eta_k:

    A      = sum_k a1 (1 + eta_k) L_k^2                 attention work on one rank (s)
    B      = sum_k (a2 + a2_vision sqrt(eta_k)) L_k      linear work (LLM GEMMs + vision encoder)
    S      = sum_k L_k                                   tokens of the packed stream
    T_cm   = (kv_bytes_per_token / v) S (d-1)/d + lat (d-1)      ring KV traffic of one rank
    T      = (A + B) / d + b1 + max(0, T_cm - A/d)

which is the paper's T_cp + T_cm - min(T_attn, T_cm) with compute split evenly over the ring (zigzag
halves balance causal work) and the ring traffic overlapping the attention blocks. v and lat are the
intra-node figures unless the group spans nodes (the slowest hop paces a ring). sqrt(eta_k) L_k is
the number of vision tokens when a sample has one vision span (eta = v^2/L^2), which prices the
vision encoder without a second per-sample input. Memory per rank is sum_k L_k mem_per_token / d:
linear in the local tokens, because the ring attention is tiled with a custom VJP (its per-token
state is part of `planner.cost.memory.activation_bytes_per_token`, its constant tile workspace is
`presets.attention_workspace_bytes`; `fixed_bytes` counts it or one loss chunk's logits, whichever is
larger: they are live in different phases of the program).

Traffic of one rank, derived by hand (S stream tokens, d ranks, each rank holding S/d of them):

- Ring: each of the d-1 steps passes the K/V block of S/d tokens to the next rank, so a rank sends
  (d-1) S/d tokens' K/V: kv_bytes_per_token S (d-1)/d bytes.
- Ulysses: an all-to-all re-shards Q, K, V from sequence to heads and another brings O back. A rank
  starts with all heads of its S/d tokens and keeps 1/d of the heads, so it sends (d-1)/d of its
  own S/d tokens' Q, K, V, O (a2a_bytes_per_token counts those four, all layers, fwd+bwd):
  a2a_bytes_per_token (S/d) (d-1)/d bytes, a factor d less per token than the ring's hops. It is
  paid without overlap:  T_cm = a2a_bytes_per_token / v_a2a (S/d) (d-1)/d + lat (d-1).

Two optional terms describe what a given machine and executor really run (both off by default,
which is the paper's model above):

- `compute_lanes` (n): how many ranks' compute truly runs at once. On accelerators every rank has
  its own chip (None). Fake XLA CPU devices share the host's physical cores, so a degree-d group's
  work is spread over min(d, n) cores, not d: compute is divided by p = min(d, n) instead of d,
  and the fixed per-rank work b1 (dispatch, launches, host syncs) of the d ranks runs on those same
  p cores, so a group pays b1 d/p (b1 when every rank has its own chip or d <= n). Likewise the
  per-message cost of the ring: at each of the d-1 steps every rank hands one message over, and
  those d hand-overs run p at a time, so the latency term is lat (d-1) d/p. The groups of one
  micro-batch also share the p cores, so `pricing.makespans` caps a micro-batch from below by the sum of
  its groups' core-seconds over the p lanes (a machine-wide term for shared-core hosts only; the
  planner's exact allocation is exact for the per-group model, and candidates are compared with it).
- `geometry.bucket_min` / `geometry.bucket_growth`: the executor pads each group's stream to
  `dhp_jax.geometry.layout.bucket_lengths(S, d)` (a geometric ladder of lengths rounded up to 2d,
  clamped to the memory budget), the one bucket rule. With `bucket_min > 0` the pad tokens go
  through the linear layers and around the ring: B = sum_k (...) L_k + a2 (P - S), ring traffic of P
  tokens, memory P mem_per_token / d, where P is the padded length. Every preset prices it.
- `geometry.linear_chunk` (C > 0): the executor skips the padding in the linear layers, chunk by chunk
  (`dhp_jax.geometry.layout`: each rank holds ceil(S/d) or floor(S/d) real tokens as a prefix of its
  shard, its padding at the end; chunks of at most C tokens with no real token are skipped). The
  busiest rank then computes W/d = `layout.linear_tokens(S, P, d, C)` tokens, its real tokens
  rounded up to whole chunks, so B = sum_k (...) L_k + a2 (W - S); ring traffic and memory stay on
  the padded P. C = 0 prices the pad tokens in full (W = P). The accelerator presets set the
  executors' default chunk (`layout.LINEAR_CHUNK`), which the JAX executor runs (the torch
  executor skips every pad row, so the price is an upper bound there). The vision encoder's term
  a2_vision sqrt(eta_k) L_k prices the group's vision tokens split evenly over the ranks; the JAX
  executor's vision blocks compute each rank's vision rows rounded up to whole chunks (vision rows
  first, `dhp_jax.model.mllm.vision_first`): at most one partly filled chunk more per rank. A rank
  may also hold more than its share of vision rows (the layout balances tokens, not vision
  tokens); neither is priced (the group terms carry no vision count per rank).
- `padded_attention`: how attention treats the padded stream. True (XLA:CPU, the fitted CPU
  profiles): every (query, key) pair of each ring block is evaluated under a mask (zigzag chunks are
  almost never wholly masked), so A = a1 P^2 whatever the packing and eta. False (the accelerator
  presets: fused attention kernels skip masked tiles): A stays the real samples' attention. The
  tiled ring skips the tile pairs with no allowed pair (other samples, the causal future, padding),
  so on CPU A = a1 P^2 is an upper bound of its attention work.
- `router_phase`: the step first runs, per micro-batch and group, a forward-only router program (the
  JAX engine with a mixture of experts' load-balancing loss on: `dhp_jax.sharding.router_phase`),
  one more forward pass of the vision encoder and projector and of the LLM layers up to and
  including the last sparse one (`ModelShape.router_depth`; the program returns the router counts
  only, so the compiled program has neither the layers after it nor the LM head). Its terms are
  added to a1, a2, a2_vision, b1, the ring and all-to-all bytes and the latencies (`preset(...,
  router_phase=True)`), so a group is priced as both of its programs back to back; the engine runs
  every micro-batch's router programs before the step's, which costs the same where one group paces
  a micro-batch in both. Its memory is not a term: the router program runs before the step's
  programs and frees its buffers, and holds, besides the gathered params the step holds too, one
  forward pass's working set with nothing kept for a backward pass. The torch executor runs each
  forward pass once (it keeps every micro-batch's activations until the counts are summed), so its
  cost models leave the flag off.
- `comm_overlap`: whether ring traffic runs alongside the attention blocks (True: a DMA engine or
  NIC moves K/V while the cores compute). Fake CPU devices copy with the same cores that compute,
  so nothing overlaps: T = (A + B)/p + b1 + T_cm.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, ClassVar, Mapping

import numpy as np

from dhp_jax.checks import positive_int
from dhp_jax.geometry.layout import GROWTH, LINEAR_CHUNK, MIN_BUCKET
from dhp_jax.planner.cost import memory as engine_memory, presets, tensor_parallel as tp
from dhp_jax.planner.cost.geometry import StreamGeometry, check_geometry

COST_SCHEMA = "dhp.cost/v1"
DEFAULT_STATE_SHARDS = 64        # ranks the state is sharded over when a preset is not told (DHP's 8 x 8 testbed)




@dataclasses.dataclass(frozen=True)
class CostModel:
    """Coefficients of the group time/memory model (units: seconds, bytes, tokens).

    a1: s per token^2 of causal attention, fwd+bwd, whole model, one rank.
    a2: s per token of the linear layers (GEMMs, norms, LM head), fwd+bwd, one rank.
    a2_vision: s per vision token of the vision encoder + projector (fwd only when frozen).
    b1: fixed s per group step (kernel launches and host syncs of every layer).
    kv_bytes_per_token: a3, bytes of K/V (and dK/dV) one token puts on the ring, all layers, fwd+bwd.
    a2a_bytes_per_token: bytes one token moves through Ulysses all-to-alls, all layers, fwd+bwd.
    bw_intra / bw_inter: point-to-point bytes/s of a ring hop inside / across nodes (v_p).
    a2a_bw_intra: per-rank all-to-all bandwidth inside a node (inter-node uses bw_inter).
    lat_intra / lat_inter: s per ring step (all layers), b2 = lat (d-1).
    mem_per_token: activation bytes per token kept on a rank (checkpoints + one layer's working set).
    memory_budget: bytes per rank available for activations (HBM minus model states and reserve).
    grad_bytes: bytes of one all-reduce that costs what the step's state collectives cost (the
        engine reduce-scatters fp32 gradients, 4P, and all-gathers params in the compute dtype, cb P;
        each moves (r-1)/r of its bytes, an all-reduce 2 (r-1)/r: grad_bytes = (4 + cb) P / 2).
    compute_lanes: ranks whose work runs in parallel (None: all; fake CPU devices: physical cores);
        compute is split min(d, lanes) ways; the ranks' fixed work b1 and ring latency lat (d-1) are
        multiplied by d / min(d, lanes).
    geometry: the executor's stream geometry (`StreamGeometry`: padding ladder `bucket_min` /
        `bucket_growth`, pad-skipping chunk `linear_chunk`, menu `bucket_menu` / `menu_kinds`).
        `preset(...)` and `replace(...)` take its fields by name as well (`replace(linear_chunk=0)`);
        `from_dict` reads them flat (older cost files) or under "geometry".
    padded_attention: attention is evaluated densely over the padded stream (see the module docstring).
    comm_overlap: ring traffic hides behind attention (False: they add up, as on shared CPU cores).
    The engine's memory choices (dhp_jax.planner.cost.memory; `preset` derives mem_per_token and
    memory_budget from them, so change them through `preset(...)`; `replace(linear_chunk=...)` on a
    preset re-derives its memory fields for the new chunk):
    param_count: parameters P of the model (0: unknown, static bytes are then 0).
    compute_bytes: bytes per element of the groups' compute dtype (2 bf16, 4 fp32).
    state_shards: ranks the fp32 master params, Adam moments and gradient accumulator are sharded over.
    remat: recompute policy of the blocks ("none", "layer", "selective"); sets the recompute passes.
    usable_bytes: device bytes the engine may use (HBM x the usable fraction; 0: unknown).
    fixed_bytes: token-independent temporaries of a group program (one loss chunk's logits, or the
        attention's tile workspace and one linear chunk's working set; and the block weights the
        stand-in's blocks keep at remat "none", `memory.kept_weight_bytes`).
    activation_bytes: bytes per element in which the compiled program holds activations other than
        what the blocks keep for their backward pass (0: compute_bytes; the kept values and the
        stacked gradients are stored in the compute dtype). XLA:CPU has no bf16 arithmetic: it
        computes bf16 values in fp32, so a bf16 program compiled for CPU devices holds its block
        working set in 4 bytes (`dhp bench memory` on CPU).
    backward_bytes: gradient bytes that exist in the blocks' phase of the group program (the
        decoder's stacked block gradients and the LM head's; `planner.cost.memory.backward_bytes`).
    assemble_bytes: gradient bytes of the program's last phase besides the row: every gradient
        piece the row is concatenated from and the embedding's and LM head's accumulators
        (`planner.cost.memory.assemble_bytes`). That phase holds no activations; `memory.group_program_bytes` is
        the larger of the two phases.
    tensor_parallel: devices per rank (`planner.cost.tensor`; set through `preset(..., tensor_parallel=t)`).
        With t > 1 every other field is one device's: its compute share, its CP traffic, its
        parameters (`param_count`: the weights it holds), its state shard (`state_shards` then
        counts the ranks each tensor-parallel shard's state is spread over: devices / t), and
        `num_heads` the heads it holds (Ulysses splits those); `ranks_per_node` counts ranks.
    sequence_parallel: with t > 1, the block stacks run sequence-parallel (`PlanExecutor(...,
        sequence_parallel=True)`): the rows the stacks carry (each block's input) are 1/t a device.
    router_phase: the time terms include the router program's forward pass (the module docstring;
        set through `preset(..., router_phase=True)`, which derives those terms).
    """

    a1: float
    a2: float
    b1: float
    kv_bytes_per_token: float
    bw_intra: float
    bw_inter: float
    lat_intra: float
    lat_inter: float
    mem_per_token: float
    memory_budget: float
    a2_vision: float = 0.0
    a2a_bytes_per_token: float = 0.0
    a2a_bw_intra: float = 0.0
    ranks_per_node: int = 8
    num_heads: int = 1
    grad_bytes: float = 0.0
    model: str = "custom"
    hardware: str = "custom"
    freeze_vision: bool = False
    compute_lanes: int | None = None
    geometry: StreamGeometry = StreamGeometry()
    comm_overlap: bool = True
    padded_attention: bool = True
    param_count: float = 0.0
    compute_bytes: int = 4
    state_shards: int = 1
    remat: str = "none"
    usable_bytes: float = 0.0
    fixed_bytes: float = 0.0
    activation_bytes: int = 0
    backward_bytes: float = 0.0
    assemble_bytes: float = 0.0
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    router_phase: bool = False

    MODELS: ClassVar[tuple[str, ...]] = tuple(presets.MODELS)
    HARDWARE: ClassVar[tuple[str, ...]] = tuple(presets.HARDWARE)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and (not math.isfinite(v) or v < 0):
                raise ValueError(f"CostModel.{f.name} must be a finite number >= 0, got {v}")
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"CostModel.ranks_per_node must be a positive integer, got {self.ranks_per_node!r}")
        if self.memory_budget <= 0 or self.mem_per_token <= 0:
            raise ValueError("CostModel.memory_budget and mem_per_token must be > 0")
        if self.bw_intra <= 0 or self.bw_inter <= 0:
            raise ValueError("CostModel bandwidths must be > 0")
        lanes = self.compute_lanes
        if lanes is not None and (isinstance(lanes, bool) or not isinstance(lanes, (int, np.integer)) or lanes < 1):
            raise ValueError(f"CostModel.compute_lanes must be None or a positive integer, got {lanes!r}")
        for name in ("compute_bytes", "state_shards", "tensor_parallel"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"CostModel.{name} must be a positive integer, got {v!r}")
        ab = self.activation_bytes
        if isinstance(ab, bool) or not isinstance(ab, (int, np.integer)) or ab < 0:
            raise ValueError(f"CostModel.activation_bytes must be an integer >= 0 (0: compute_bytes), got {ab!r}")
        if self.remat not in engine_memory.REMATS:
            raise ValueError(f"CostModel.remat must be one of {engine_memory.REMATS}, got {self.remat!r}")
        if not isinstance(self.geometry, StreamGeometry):
            raise ValueError(f"CostModel.geometry must be a StreamGeometry, got {type(self.geometry).__name__}")
        check_geometry(self.geometry, self.num_heads)

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, model: "str | presets.ModelShape", hardware: str, *, ranks_per_node: int = 8, freeze_vision: bool = False,
               state_shards: int | None = None, compute_dtype: str | None = None, remat: str = "layer",
               zero_shards: int | None = None, activation_bytes: int | None = None, require_fit: bool = True,
               tensor_parallel: int = 1, sequence_parallel: bool = False, router_phase: bool = False,
               **overrides: Any) -> "CostModel":
        """Coefficients derived from FLOPs and bytes of `model` (a preset name, a checkpoint
        directory with a config.json, or a `presets.ModelShape`) on `hardware` (see presets.py) for
        this engine (see memory.py): fp32 master params + Adam state sharded over `state_shards`
        ranks (default 64, the paper's 8 x 8 cluster: the engine shards the state over every
        rank of the run, so pass the run's rank count; `zero_shards` is the old name), groups computing in
        `compute_dtype` (default bfloat16, float32 on "cpu"), blocks recomputed per `remat`,
        activations held in `activation_bytes` per element (default: the compute dtype's; 4 for
        a bf16 program compiled by XLA:CPU). A model whose static bytes exceed the usable bytes is an
        error unless `require_fit=False` (the budget is then 1 byte: the memory bench sizes such
        programs). `overrides` replace fields.

        `tensor_parallel` = t > 1: a rank is t devices of one node (`dhp_jax.planner.cost.tensor_parallel`):
        `ranks_per_node` counts ranks (the node's devices / t), `state_shards` counts devices (the
        state stays sharded over all of them; t must divide it), and every coefficient is one
        device's: compute and memory / t where tensor parallelism splits them, the sequence-parallel
        collectives priced at the intra-node bandwidth. A model whose heads or widths t cannot split
        is refused, naming the model, the field and t. t = 1 is the model without it.

        `router_phase`: each group also runs the router program's forward pass before its step (the
        JAX engine with the load-balancing loss on; the module docstring): its compute, traffic
        and launches are added to the time terms (`router_forward`).
        """
        shape = model if isinstance(model, presets.ModelShape) else None
        if shape is None and str(model).lower() not in presets.MODELS and (Path(str(model)) / "config.json").is_file():
            shape = presets.ModelShape.from_config(str(model))   # a checkpoint directory, read as a preset is
        key_m, key_h = ("custom" if shape else str(model).lower()), str(hardware).lower()
        if shape is None and key_m not in presets.MODELS:
            raise ValueError(f"unknown model {model!r}; known models: {', '.join(presets.MODELS)}")
        if key_h not in presets.HARDWARE:
            raise ValueError(f"unknown hardware {hardware!r}; known hardware: {', '.join(presets.HARDWARE)}")
        m, hw = shape or presets.MODELS[key_m], presets.HARDWARE[key_h]
        if m.moe and not m.family:
            raise ValueError(f"model {key_m!r}: a mixture-of-experts shape is priced as its family's program "
                             f"(ModelShape.family), and this one names none (the stand-in engine has no experts)")
        dtype = compute_dtype or ("float32" if hw.bytes_per_element == 4 else "bfloat16")
        if dtype not in engine_memory.COMPUTE_BYTES:
            raise ValueError(f"compute_dtype must be one of {sorted(engine_memory.COMPUTE_BYTES)}, got {dtype!r}")
        if remat not in engine_memory.REMATS:
            raise ValueError(f"remat must be one of {engine_memory.REMATS}, got {remat!r}")
        el = engine_memory.COMPUTE_BYTES[dtype]
        ab = int(activation_bytes or el)
        t = positive_int(tensor_parallel, "tensor_parallel")
        tp.check_tensor_parallel(m, t, f"model {key_m!r}")
        if sequence_parallel and t == 1:
            raise ValueError("sequence_parallel needs tensor_parallel > 1 (it splits a rank's rows over its devices)")
        attn_passes, passes = engine_memory.REMAT_PASSES[remat]
        a1, a2, a2_vision, b1, kv_bytes, a2a_bytes, lat_intra, lat_inter = _pass_terms(
            m, hw, el, attn_passes, passes, 1.0 if freeze_vision else passes, lm_head=True)
        shards = int(state_shards or zero_shards or DEFAULT_STATE_SHARDS)
        params = float(engine_memory.engine_params(m))
        usable = hw.memory_bytes * presets.USABLE_MEMORY_FRACTION
        overrides = _with_geometry(StreamGeometry(MIN_BUCKET, GROWTH, LINEAR_CHUNK), overrides)
        chunk = overrides["geometry"].linear_chunk     # the blocks of the chunk an override names
        per_token, fixed = _chunk_memory(m, remat, el, ab, chunk, t, bool(sequence_parallel))
        backward = engine_memory.backward_bytes(m, el, ab)
        assemble = engine_memory.assemble_bytes(params, m, el, ab)
        lanes, tp_note = hw.compute_lanes, ""
        if t > 1:   # one device's share of a rank of t (dhp_jax.planner.cost.tensor_parallel)
            if shards % t:
                raise ValueError(f"state_shards {shards} (devices) is not a multiple of tensor_parallel {t}")
            seq_llm, seq_vision = tp.sequence_parallel_bytes(m, t, el, passes, freeze_vision)
            bw = tp.collective_bandwidth(hw, t)
            kv_local = tp.kv_heads_per_device(m, t)
            a1 = a1 / t
            a2 = passes * 2.0 * (tp.device_gemm_params(m, t) + tp.vocab_share(m, t) * m.hidden) \
                / (hw.peak_flops * hw.mfu_linear) + seq_llm / bw
            a2_vision = a2_vision / t + seq_vision / bw
            b1 = b1 + tp.collective_messages(m, t, passes, freeze_vision) * hw.lat_intra
            kv_bytes = kv_bytes * kv_local / m.kv_heads
            a2a_bytes = passes * m.layers * (2 * m.heads // t + 2 * kv_local) * m.head_dim * el
            backward = backward / t
            params = tp.device_params(m, params, t)
            assemble = params * el + 2.0 * tp.vocab_share(m, t) * m.hidden * ab
            shards = shards // t
            lanes = None if lanes is None else max(1, lanes // t)
            tp_note = f" at tensor_parallel {t} (per device: {params / 1e9:.2f} B params)"
        if router_phase:    # one more forward pass: the router program's (`router_forward`)
            fwd = router_forward(m, hw, el, t, passes)
            a1, a2, a2_vision, b1 = a1 + fwd["a1"], a2 + fwd["a2"], a2_vision + fwd["a2_vision"], b1 + fwd["b1"]
            kv_bytes, a2a_bytes = kv_bytes + fwd["kv_bytes_per_token"], a2a_bytes + fwd["a2a_bytes_per_token"]
            lat_intra, lat_inter = lat_intra + fwd["lat_intra"], lat_inter + fwd["lat_inter"]
        budget, static = _budget(usable, params, el, backward, assemble, fixed, shards, require_fit)
        if budget <= 0:
            raise ValueError(f"{model} does not fit on {hardware}{tp_note} with its state sharded over {shards} ranks "
                             f"(static bytes {static / 2**30:.1f} GiB of {usable / 2**30:.1f} GiB usable per rank)")
        fields = dict(
            a1=a1, a2=a2, a2_vision=a2_vision, b1=b1, kv_bytes_per_token=float(kv_bytes),
            a2a_bytes_per_token=float(a2a_bytes), bw_intra=hw.p2p_bw_intra, bw_inter=hw.bw_inter,
            a2a_bw_intra=hw.a2a_bw_intra, lat_intra=lat_intra, lat_inter=lat_inter,
            mem_per_token=per_token,
            memory_budget=float(budget), ranks_per_node=int(ranks_per_node), num_heads=m.heads // t,
            grad_bytes=float((4 + el) * params / 2), model=key_m, hardware=key_h, freeze_vision=bool(freeze_vision),
            compute_lanes=lanes, comm_overlap=hw.comm_overlap, param_count=params,
            compute_bytes=el, state_shards=shards, remat=remat, usable_bytes=float(usable),
            fixed_bytes=float(fixed), activation_bytes=ab, backward_bytes=backward, assemble_bytes=assemble,
            padded_attention=hw.padded_attention, tensor_parallel=t, sequence_parallel=bool(sequence_parallel),
            router_phase=bool(router_phase))
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown CostModel field(s) {sorted(unknown)}; fields: {sorted(fields)}")
        fields.update(overrides)
        cost = cls(**fields)
        object.__setattr__(cost, "_derivation", (m, bool(require_fit)))   # for `replace(linear_chunk=...)`
        return cost

    # ------------------------------------------------------------------ the model

    def ulysses_ok(self, degree: int) -> bool:
        """All-to-all attention needs the head count divisible by the degree."""
        return degree >= 1 and self.num_heads % degree == 0

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {"schema": COST_SCHEMA, **d, "geometry": self.geometry.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CostModel":
        if "cost" in d and isinstance(d["cost"], Mapping):  # a profiler report embedding the model
            d = d["cost"]
        schema = d.get("schema", COST_SCHEMA)
        if schema != COST_SCHEMA:
            raise ValueError(f"cost model schema is {schema!r}, expected {COST_SCHEMA!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names - set(StreamGeometry.FIELDS) - {"schema"}
        if unknown:
            raise ValueError(f"unknown cost model field(s) {sorted(unknown)}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = required - set(d)
        if missing:
            raise ValueError(f"cost model is missing field(s) {sorted(missing)}")
        kw = {k: v for k, v in d.items() if k in names and k != "geometry"}
        for k, v in kw.items():
            if isinstance(v, int) and not isinstance(v, bool) and k not in ("ranks_per_node", "num_heads",
                                                                                  "compute_lanes", "compute_bytes",
                                                                                  "state_shards", "activation_bytes",
                                                                                  "tensor_parallel"):
                kw[k] = float(v)
        # the geometry under "geometry", or flat as cost files written before it was one field hold it
        flat = {k: d[k] for k in StreamGeometry.FIELDS if k in d}
        nested = d.get("geometry") or {}
        if flat and nested:
            raise ValueError(f"cost model holds geometry field(s) {sorted(flat)} both flat and under 'geometry'")
        kw["geometry"] = StreamGeometry.from_dict(flat or nested)
        return cls(**kw)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def from_profile(cls, path: str | Path) -> "CostModel":
        """Load coefficients written by `save` (or a profiler report with a "cost" entry)."""
        try:
            d = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"cost profile {path}: not valid JSON ({e})") from None
        return cls.from_dict(d)

    def _memory_derived(self, m: "presets.ModelShape", require_fit: bool) -> tuple[float, float, float]:
        """(mem_per_token, fixed_bytes, memory_budget) that `preset` derives for model shape `m` from
        this cost's engine fields and chunk."""
        el, ab = self.compute_bytes, self.activation_bytes or self.compute_bytes
        per_token, fixed = _chunk_memory(m, self.remat, el, ab, self.geometry.linear_chunk, self.tensor_parallel,
                                         self.sequence_parallel)
        budget, _ = _budget(self.usable_bytes, self.param_count, el, self.backward_bytes, self.assemble_bytes,
                            fixed, self.state_shards, require_fit)
        return per_token, fixed, float(budget)

    def replace(self, **changes: Any) -> "CostModel":
        """A copy with `changes` applied. A cost made by `preset` keeps the blocks its memory prices in
        step with `linear_chunk`: a new chunk re-derives mem_per_token, fixed_bytes and memory_budget
        (chunked blocks' working set, or the one-pass working set for 0) from the preset's model
        shape and this cost's engine fields, as `preset(..., linear_chunk=...)` would; a memory
        field that `changes` names, or that no longer holds the preset's figure (an override or an
        earlier replace), is kept as given. A cost with no preset behind it (`from_profile`,
        `from_dict`, built field by field) has no model shape to re-derive from: it keeps its
        memory fields whatever the chunk (they are the profile's own figures). A new
        `tensor_parallel` is refused: it changes every coefficient, so it is `preset`'s to derive."""
        if "tensor_parallel" in changes and changes["tensor_parallel"] != self.tensor_parallel:
            raise ValueError(f"CostModel.replace(tensor_parallel={changes['tensor_parallel']!r}): every coefficient of "
                             f"{self.model} depends on the devices per rank (compute, TP traffic, memory); build it "
                             f"with CostModel.preset(..., tensor_parallel=t) (or profile a rank of t devices)")
        if "router_phase" in changes and bool(changes["router_phase"]) != self.router_phase:
            raise ValueError(f"CostModel.replace(router_phase={changes['router_phase']!r}): the router program's "
                             f"forward pass is part of {self.model}'s time terms; build it with "
                             f"CostModel.preset(..., router_phase=True) (a profile prices what it measured)")
        new = dataclasses.replace(self, **_with_geometry(self.geometry, changes))
        derivation = getattr(self, "_derivation", None)
        if derivation is None:
            return new
        if new.geometry.linear_chunk != self.geometry.linear_chunk:
            m, require_fit = derivation
            old_per_token, old_fixed, old_budget = self._memory_derived(m, require_fit)
            per_token, fixed, budget = new._memory_derived(m, require_fit)
            derived = {"mem_per_token": (self.mem_per_token == old_per_token, per_token),
                       "fixed_bytes": (self.fixed_bytes == old_fixed, fixed),
                       "memory_budget": (self.memory_budget == old_budget, budget)}
            again = {k: v for k, (held, v) in derived.items() if held and k not in changes}
            if again.get("memory_budget", 1.0) <= 0:
                raise ValueError(f"CostModel.replace(linear_chunk={new.geometry.linear_chunk}): {self.model} no longer "
                                 f"fits on {self.hardware} (budget {again['memory_budget'] / 2**30:.2f} GiB)")
            new = dataclasses.replace(new, **again)
        object.__setattr__(new, "_derivation", derivation)
        return new


def _with_geometry(geometry: StreamGeometry, changes: Mapping[str, Any]) -> dict[str, Any]:
    """`changes` with the stream geometry's fields it names (`linear_chunk=0`) applied to `geometry`
    (or to the `geometry` it names) as one `geometry` entry."""
    out = {k: v for k, v in changes.items() if k not in StreamGeometry.FIELDS}
    named = {k: v for k, v in changes.items() if k in StreamGeometry.FIELDS}
    out["geometry"] = out.get("geometry", geometry).replace(**named)
    return out


def check_router_phase(cost: "CostModel", router_phase: bool, source: str) -> None:
    """A fitted profile prices what it measured: `source` (how the run names the profile, e.g.
    "planner.cost_profile 'p.json'") is refused with a ValueError when its `router_phase` is not
    the run's (`router_phase`: the run adds a mixture of experts' load-balancing loss, so each group
    runs the router program's forward pass before its step)."""
    if cost.router_phase != bool(router_phase):
        raise ValueError(f"{source} prices {'a' if cost.router_phase else 'no'} router phase (router_phase="
                         f"{cost.router_phase}); the run {'adds' if router_phase else 'does not add'} the mixture "
                         f"of experts' load-balancing loss, so its steps {'run' if router_phase else 'do not run'} "
                         f"the router programs' forward pass")


def router_forward(m: "presets.ModelShape", hw: Any, el: int, t: int = 1, linear_passes: float = 4.0
                   ) -> dict[str, float]:
    """The time terms of one forward pass of the router program of model shape `m` on hardware `hw`
    (`preset(..., router_phase=True)` adds them; the module docstring): the vision encoder and
    projector (every encoder and merger GEMM once, also when the step keeps the encoder frozen) and
    the LLM layers 0 .. `m.router_depth` - 1 (attention, GEMMs, ring or all-to-all traffic, one
    launch set each), no LM head. With tensor parallelism over t devices: one device's share, the
    sequence-parallel collectives of one pass (`tensor_parallel.block_collectives(forward_only=True)`;
    `linear_passes` is the step's, from which `tensor_parallel` derives its passes) and their
    messages' latency. Keys are the `CostModel` fields they add to."""
    depth = m.router_depth
    mr = dataclasses.replace(m, layers=depth, router_layers=0)      # the layers the program runs
    flops_lin = hw.peak_flops * hw.mfu_linear
    a1, a2, a2_vision, b1, kv_bytes, a2a_bytes, lat_intra, lat_inter = _pass_terms(mr, hw, el, 1.0, 1.0, 1.0,
                                                                                   lm_head=False)
    if t > 1:
        seq_llm, seq_vision = tp.sequence_parallel_bytes(mr, t, el, linear_passes, True)
        seq_llm /= tp.comm_passes(linear_passes)           # the LLM's collectives of the forward pass alone
        bw = tp.collective_bandwidth(hw, t)
        kv_local = tp.kv_heads_per_device(m, t)
        a1 = a1 / t
        a2 = 2.0 * tp.device_gemm_params(mr, t) / flops_lin + seq_llm / bw
        a2_vision = a2_vision / t + seq_vision / bw
        per_block = sum(tp.block_collectives(linear_passes, forward_only=True).values())
        b1 = b1 + (t - 1) * (depth + m.vision_layers) * per_block * hw.lat_intra
        kv_bytes = kv_bytes * kv_local / m.kv_heads
        a2a_bytes = depth * (2 * m.heads // t + 2 * kv_local) * m.head_dim * el
    return {"a1": a1, "a2": a2, "a2_vision": a2_vision, "b1": b1, "kv_bytes_per_token": float(kv_bytes),
            "a2a_bytes_per_token": float(a2a_bytes), "lat_intra": lat_intra, "lat_inter": lat_inter}


def _pass_terms(m: "presets.ModelShape", hw: Any, el: int, attn_passes: float, passes: float,
                vision_passes: float, lm_head: bool) -> tuple[float, ...]:
    """The time terms (a1, a2, a2_vision, b1, kv and all-to-all bytes per token, per-message latency
    inside and across nodes) of `passes` passes over every LLM layer of `m` (the attention's
    `attn_passes`, the vision encoder's `vision_passes`; the projector runs with the layers), the
    LM head included when `lm_head`, on one device (`CostModel.preset` and `router_forward` scale
    them for tensor parallelism)."""
    # attention: QK^T and PV are 4*heads*head_dim FLOPs per query-key pair and layer; causal
    # attention touches L^2/2 pairs.
    a1 = attn_passes * 2.0 * m.heads * m.head_dim * m.layers / (hw.peak_flops * hw.mfu_attention)
    # linear layers: every GEMM weight a token runs through (a sparse layer's router and its k
    # experts, not all of them: `ModelShape.llm_gemm_params`), and the LM head
    a2 = passes * 2.0 * (m.llm_gemm_params + (m.vocab * m.hidden if lm_head else 0)) / (hw.peak_flops * hw.mfu_linear)
    # the vision encoder, the projector (patch merger) and Qwen3-VL's DeepStack mergers beside it
    proj_fwd = (1 + m.deepstack) * 2.0 * m.projector_params
    a2_vision = (vision_passes * _encoder_flops(m) + passes * proj_fwd) / (hw.peak_flops * hw.mfu_linear)
    # about 100 us of launches/syncs per layer and pass (Ascend/CUDA launch costs are 5-50 us/op)
    b1 = m.layers * passes * 100e-6
    kv_bytes = passes * m.layers * 2 * m.kv_heads * m.head_dim * el
    a2a_bytes = passes * m.layers * (2 * m.heads + 2 * m.kv_heads) * m.head_dim * el
    return (a1, a2, a2_vision, b1, kv_bytes, a2a_bytes, m.layers * passes * hw.lat_intra,
            m.layers * passes * hw.lat_inter)


def _encoder_flops(m: "presets.ModelShape") -> float:
    """Forward FLOPs of the vision encoder per LLM vision token: the patch embedding and every layer
    over the `patches_per_token` patches the token merges (the merge comes after the encoder), each
    patch attending (QK^T and PV: 4 x heads x head_dim FLOPs per pair) over its frame in full-
    attention layers and over its window in window-attention layers (Qwen2.5-VL)."""
    width = m.vision_heads * m.vision_head_dim
    spans = (m.vision_layers - m.window_layers) * m.frame_patches + m.window_layers * m.window_patches
    per_patch = 2.0 * m.vision_layers * m.vision_layer_params + 4.0 * width * spans
    return m.patches_per_token * per_patch + 2.0 * m.patch_dim * m.vision_hidden


def _chunk_memory(m: "presets.ModelShape", remat: str, el: int, ab: int, chunk: Any, t: int = 1,
                  sequence: bool = False) -> tuple[float, float]:
    """(mem_per_token, fixed_bytes) of model shape `m` when the blocks run their token-local work in
    chunks of `chunk` tokens (0: one pass over the stream; `planner.cost.memory._block`). The loss chunk's
    logits and the tiled ring's constant tile workspace (presets.py documents it; its per-token state
    is part of activation_bytes_per_token) are live in different phases (the loss before the blocks'
    backward pass, the tiles inside one block's), so the larger of the two counts, the latter with
    one chunk's working set when the blocks run in chunks; the weights the stand-in's blocks keep
    without recompute (`memory.kept_weight_bytes`) are live in both. With tensor parallelism over t devices
    a device computes with `tensor.local_shape` (heads, widths and vocabulary / t, the hidden
    width whole: the engines' psum form, `dhp_jax.planner.cost.tensor_parallel`); `sequence`: the block
    stacks run sequence-parallel, so each block's input, which every remat keeps for the backward
    pass (and without recompute or chunks its residual sum), is 1/t of the rows
    (`tensor.sequence_saving`: the LLM layers and the encoder blocks, and a family's DeepStack
    features; the other hidden-wide values are priced whole, an upper bound)."""
    chunked = isinstance(chunk, (int, np.integer)) and not isinstance(chunk, bool) and chunk > 0
    if t > 1:
        m = tp.local_shape(m, t)
    fixed = max(engine_memory.fixed_bytes(m, el), engine_memory.peak_attention_workspace(m, remat, chunked)
                + (engine_memory.chunk_bytes(m, chunk, ab) if chunked else 0.0)) \
        + engine_memory.kept_weight_bytes(m, remat, el)
    per_token = engine_memory.activation_bytes_per_token(m, remat, el, ab, chunked, tensor_parallel=t,
                                                         sequence_parallel=sequence)
    if t > 1 and sequence:      # a family's kept rows are priced in `ab` bytes (`family_bytes_per_token`)
        per_token -= tp.sequence_saving(m, t, el, remat, chunked)
    return float(per_token), float(fixed)


def _budget(usable: float, params: float, el: int, backward: float, assemble: float, fixed: float, shards: int,
            require_fit: bool) -> tuple[float, float]:
    """(memory_budget, static bytes) of a preset: the usable bytes less every token-independent byte
    of the blocks' phase; the last phase and the step's phases outside the group program (no
    activations) must fit too. A model that does not fit
    gets a budget <= 0, or 1 byte when `require_fit` is False (the memory bench sizes such programs)."""
    static = engine_memory.program_static_bytes(params, el, backward) + fixed + engine_memory.state_bytes(params, shards)
    budget = usable - static
    last = engine_memory.program_static_bytes(params, el, assemble) + engine_memory.state_bytes(params, shards)
    # the step's other phases (gather, a reduction with the params still held) hold no activations
    between = max(engine_memory.gather_bytes(params, el), engine_memory.reduce_bytes(params, el, shards))
    last = max(last, between + engine_memory.state_bytes(params, shards))
    if last > usable:
        budget = min(budget, usable - last)
    return (1.0 if budget <= 0 and not require_fit else budget), static

