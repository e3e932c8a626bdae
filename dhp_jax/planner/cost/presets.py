"""Model shapes and hardware figures from which `CostModel.preset` derives its coefficients.

Everything here is a documented physical figure or a stated assumption; nothing is tuned to a
benchmark result. The model shapes are not kept here: each named model is its published Hugging
Face config.json, stored once in `dhp_jax/data/models/` (with the Hub repository it comes from)
and read by `dhp_jax.data.model_configs`; `MODELS` derives the planner's `ModelShape` of each from
those fields, as `dhp_jax.model.MLLMConfig.from_hf` derives the engine's config. A new model is one
config file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dhp_jax.data import model_configs


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Transformer shapes of one MLLM: an LLM decoder plus a ViT vision encoder, as the cost and
    memory models price it.

    The defaults of the vision fields describe the engine's stand-in encoder
    (`dhp_jax.model.mllm`): one SwiGLU block stack (`vision_mlp` 3) over already merged patches
    (`patches_per_token` 1), a projector vision -> hidden -> hidden, full attention. `from_facts`
    sets the real family's: the encoder runs on `patches_per_token` patches per LLM vision token
    (the 2x2 merge comes after it), GELU MLPs of 2 matrices (InternViT, Qwen3-VL) or SwiGLU of 3
    (Qwen2.5-VL), window attention in `window_layers` layers (Qwen2.5-VL), `deepstack` extra
    mergers (Qwen3-VL), and the exact parameter count of the published model (`param_count`).

    Mixture of experts (`experts` > 0, `dhp_jax.data.model_configs.ModelFacts`): `sparse_layers` of
    the `layers` LLM layers replace their SwiGLU MLP of width `intermediate` with a router (hidden x
    experts) and `experts` SwiGLU experts of width `expert_intermediate`, `experts_per_token` (k) of
    which run per token. Compute is priced on what a token runs (`llm_gemm_params`: the router and
    k experts' GEMMs), memory on every weight (`param_count`; `expert_params`), the active count
    is `active_param_count`.
    """

    layers: int
    heads: int
    kv_heads: int
    hidden: int
    intermediate: int  # SwiGLU FFN width of the LLM
    head_dim: int
    vocab: int
    vision_layers: int
    vision_hidden: int
    vision_intermediate: int  # MLP width of the ViT
    patches_per_token: int = 1  # encoder patches per LLM vision token (4: a 2x2 merge after the encoder)
    frame_patches: int = 1024  # span of the encoder's full attention: one tile / frame, in patches
    vision_heads: int = 16
    vision_head_dim: int = 64
    patch_dim: int = 2352      # input features per LLM vision token (all its patches' pixels)
    vision_mlp: int = 3        # matrices of the ViT MLP: 3 SwiGLU (stand-in, Qwen2.5-VL), 2 GELU
    window_patches: int = 0    # span of window attention, in patches (Qwen2.5-VL: (112/14)^2 = 64)
    window_layers: int = 0     # encoder layers that attend within windows; the rest attend over the frame
    deepstack: int = 0         # DeepStack mergers (Qwen3-VL: 3), each as wide as the main merger
    projector_hidden: int = 0  # middle width of the projector / merger (0: the LLM's hidden)
    param_count: int = 0       # exact parameters of the published model (0: the stand-in's formula)
    vision_rule: str = ""      # token rule of dhp_jax.data.vision ("" : from the model's name)
    family: str = ""           # the Hugging Face family ("internvl", "qwen2_5_vl", "qwen3_vl"; "": the stand-in)
    experts: int = 0           # experts per sparse layer (0: a dense LLM)
    experts_per_token: int = 0  # k: experts each token is routed to (top-k)
    expert_intermediate: int = 0  # SwiGLU width of one expert
    sparse_layers: int = 0     # LLM layers whose MLP is the sparse block (the rest are dense)
    active_param_count: int = 0  # parameters one token's forward pass uses (0: param_count)
    router_layers: int = 0     # LLM layers up to and including the last sparse one (0: all `layers`)

    @classmethod
    def from_facts(cls, f: "model_configs.ModelFacts") -> "ModelShape":
        """The shape of a published model (`dhp_jax.data.model_configs.ModelFacts`)."""
        return cls(f.layers, f.heads, f.kv_heads, f.hidden, f.intermediate, f.head_dim, f.vocab, f.vision_layers,
                   f.vision_hidden, f.vision_intermediate, patches_per_token=f.patches_per_token,
                   frame_patches=f.frame_patches, vision_heads=f.vision_heads, vision_head_dim=f.vision_head_dim,
                   patch_dim=f.patch_dim, vision_mlp=f.vision_mlp, window_patches=f.window_patches,
                   window_layers=f.window_layers, deepstack=f.deepstack, projector_hidden=f.projector_hidden,
                   param_count=f.params, vision_rule=f.vision_rule, family=f.family, experts=f.experts,
                   experts_per_token=f.experts_per_token, expert_intermediate=f.expert_intermediate,
                   sparse_layers=len(f.sparse_layers), active_param_count=f.active_params,
                   router_layers=max(f.sparse_layers) + 1 if f.sparse_layers else 0)

    @classmethod
    def from_config(cls, config: "Mapping[str, Any] | str") -> "ModelShape":
        """The shape of a published config.json (a dict, a checkpoint directory or the file)."""
        return cls.from_facts(model_configs.facts_from_config(model_configs.read_config(config)))

    @property
    def llm_layer_params(self) -> int:
        """Weights of one dense LLM layer's GEMMs: q, k, v, o and the SwiGLU MLP."""
        return self.llm_attention_params + 3 * self.hidden * self.intermediate

    @property
    def llm_attention_params(self) -> int:
        """Weights of one LLM layer's attention GEMMs (q, k, v, o)."""
        return self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2

    @property
    def moe(self) -> bool:
        """Whether some LLM layers are sparse mixture-of-experts blocks."""
        return self.experts > 0 and self.sparse_layers > 0

    @property
    def router_depth(self) -> int:
        """LLM layers a forward pass runs to reach the last router (`router_layers`; a shape that
        names none, all its layers; never more than `layers`)."""
        return min(self.router_layers, self.layers) if self.router_layers else self.layers

    @property
    def dense_layers(self) -> int:
        """LLM layers with a dense SwiGLU MLP."""
        return self.layers - self.sparse_layers if self.moe else self.layers

    @property
    def expert_layer_params(self) -> int:
        """Weights of one expert's GEMMs: the fused gate/up (2 x width x hidden) and down."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def router_params(self) -> int:
        """Weights of every sparse layer's router (hidden x experts each)."""
        return self.sparse_layers * self.hidden * self.experts if self.moe else 0

    @property
    def expert_params(self) -> int:
        """Weights of all experts of all sparse layers."""
        return self.sparse_layers * self.experts * self.expert_layer_params if self.moe else 0

    @property
    def llm_gemm_params(self) -> int:
        """GEMM weights one token runs through in the LLM's layers (2 FLOPs each, forward): every
        dense layer's, and per sparse layer its attention, its router and its k experts."""
        if not self.moe:
            return self.layers * self.llm_layer_params
        return (self.dense_layers * self.llm_layer_params
                + self.sparse_layers * (self.llm_attention_params + self.hidden * self.experts
                                        + self.experts_per_token * self.expert_layer_params))

    @property
    def vision_layer_params(self) -> int:
        """Weights of one encoder layer's GEMMs: q, k, v, o and the MLP's matrices."""
        width = self.vision_heads * self.vision_head_dim
        return 4 * self.vision_hidden * width + self.vision_mlp * self.vision_hidden * self.vision_intermediate

    @property
    def projector_width(self) -> int:
        return self.projector_hidden or self.hidden

    @property
    def projector_params(self) -> int:
        """Weights of the projector's (or one merger's) two GEMMs: merged patches -> middle -> LLM."""
        return self.vision_hidden * self.patches_per_token * self.projector_width + self.projector_width * self.hidden


MODELS: dict[str, ModelShape] = {name: ModelShape.from_facts(model_configs.model_facts(name))
                                 for name in model_configs.model_names()}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Per-device figures. Bandwidths are one direction, bytes/s; latencies per message, s."""

    peak_flops: float  # dense bf16/fp16 (fp32 for "cpu")
    memory_bytes: float  # device memory
    p2p_bw_intra: float  # one point-to-point link inside a node (a ring hop)
    a2a_bw_intra: float  # per-device injection bandwidth of an all-to-all inside a node
    bw_inter: float  # per-device network bandwidth between nodes
    lat_intra: float
    lat_inter: float
    mfu_linear: float  # assumed achieved fraction of peak on the GEMMs
    mfu_attention: float  # assumed achieved fraction of peak in flash attention
    bytes_per_element: int = 2
    source: str = ""
    # devices whose compute really runs at once (None: each device is its own chip)
    compute_lanes: int | None = None
    # ring traffic runs beside compute (False where the same cores do the copies)
    comm_overlap: bool = True
    # attention evaluated over every (query, key) pair of the padded stream (XLA:CPU's masked
    # blocks); False where fused attention kernels skip masked tiles, so only the linear layers,
    # the ring traffic and the memory pay for padding
    padded_attention: bool = False


GB = 1e9
GIB = 2 ** 30

HARDWARE: dict[str, Hardware] = {
    # Ascend 910B (64 GB HBM): 313 TFLOPS fp16 (910B3 datasheet; 280-376 across variants); HCCS full
    # mesh of 8 NPUs, 56 GB/s per link one way (7 links, 392 GB/s aggregate); DHP's testbed
    # (arXiv 2602.21788, evaluation): 100 Gb/s InfiniBand between nodes, taken as one 12.5 GB/s link per NPU.
    "ascend-910b": Hardware(313e12, 64 * GIB, 56 * GB, 392 * GB, 12.5 * GB, 10e-6, 20e-6, 0.45, 0.35,
                            source="Ascend 910B datasheet (313 TFLOPS fp16, 64 GB HBM, HCCS 56 GB/s/link); "
                                   "DHP testbed, arXiv 2602.21788 (100 Gb/s IB)"),
    # A100 SXM 80 GB: 312 TFLOPS bf16; NVLink3 300 GB/s per direction through NVSwitch (about 200 GB/s
    # achieved point to point); HDR InfiniBand 200 Gb/s per GPU (DGX A100).
    "a100": Hardware(312e12, 80 * GIB, 200 * GB, 240 * GB, 25 * GB, 8e-6, 15e-6, 0.50, 0.40,
                     source="NVIDIA A100 datasheet; DGX A100 (8x HDR 200 Gb/s)"),
    # H100 SXM 80 GB: 989 TFLOPS bf16 dense; NVLink4 450 GB/s per direction (about 350 achieved);
    # NDR InfiniBand 400 Gb/s per GPU (DGX H100).
    "h100": Hardware(989e12, 80 * GIB, 350 * GB, 400 * GB, 50 * GB, 6e-6, 12e-6, 0.45, 0.35,
                     source="NVIDIA H100 SXM datasheet; DGX H100 (8x NDR 400 Gb/s)"),
    # A host CPU "device" (the fake XLA CPU devices of the tests): about 100 GFLOP/s fp32 per device,
    # host memory (128 GiB: the fp32 engine state of the 8B presets must fit for planning; CPU runs
    # train the tiny model, so this limit never binds there), shared-memory copies of a few GB/s, loopback TCP between processes.
    # The fake devices of one host share its physical cores: this project's development and CI
    # machines have 2, so at most 2 devices compute at once (compute_lanes=2; override with
    # `CostModel.preset(..., compute_lanes=os.cpu_count())` on a larger host). The "ring hops" are
    # memory copies done by those same cores, so they do not overlap the attention.
    "cpu": Hardware(100e9, 128 * GIB, 5 * GB, 5 * GB, 1 * GB, 20e-6, 50e-6, 0.30, 0.20, bytes_per_element=4,
                    source="assumed desktop-class CPU core group, fp32; 2 physical cores per host",
                    compute_lanes=2, comm_overlap=False, padded_attention=True),
}

# Training-recipe assumptions shared by every preset (documented, not tuned); the recompute passes,
# state bytes and dtypes of the engine are in dhp_jax.planner.cost.memory and are CostModel fields:
USABLE_MEMORY_FRACTION = 0.9  # allocator fragmentation, communicator buffers, vision workspace


# Ring attention (dhp_jax.sharding.ring, npu_backend.ring): what it holds per rank beyond the
# per-layer working set above, for the layer being recomputed and differentiated. Linear in the
# local tokens: no [S_l, S_l] block is ever materialised, only score tiles of a fixed size.
ATTENTION_TILE = 512  # tokens per tile (dhp_jax.geometry.tiling.DEFAULT_TILE)


def ring_attention_bytes_per_token(m: ModelShape, bytes_per_element: int) -> float:
    """Bytes per local token that the tiled ring adds: the log-sum-exp kept from the forward pass
    (fp32 per head), the K/V block in flight (one more K/V copy), the dK/dV accumulators that travel
    with the blocks (the held one and the one in flight, fp32) and the dQ accumulator (fp32)."""
    kv = 2 * m.kv_heads * m.head_dim
    return 4.0 * m.heads + bytes_per_element * kv + 4.0 * 2 * kv + 4.0 * m.heads * m.head_dim


def attention_workspace_bytes(m: ModelShape) -> float:
    """Per-rank constant of the tiled ring: scores, probabilities, dP and dS of one
    (query tile, key tile) pair, fp32 [heads, tile, tile] each; taken off the activation budget."""
    return 4.0 * 4 * m.heads * ATTENTION_TILE ** 2
