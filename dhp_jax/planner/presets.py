"""Model shapes and hardware figures from which `CostModel.preset` derives its coefficients.

Everything here is a documented physical figure or a stated assumption; nothing is tuned to a
benchmark result. The planner keeps its own copy of the six model shapes (it must not import the
model package, which imports jax); the shapes are those DHP (arXiv 2602.21788) lists for its six
models (layers/heads/kv heads/hidden/vision hidden), completed with the FFN widths and head dims of
the public model configs (Hugging Face `config.json` of each checkpoint; repo ids below).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Transformer shapes of one MLLM: an LLM decoder plus a ViT vision encoder."""

    layers: int
    heads: int
    kv_heads: int
    hidden: int
    intermediate: int  # SwiGLU FFN width of the LLM
    head_dim: int
    vocab: int
    vision_layers: int
    vision_hidden: int
    vision_intermediate: int  # GELU MLP width of the ViT
    patches_per_token: int = 4  # 2x2 patch merge (pixel shuffle) before the LLM, both families
    frame_patches: int = 1024  # ViT attention span: one 448px tile / one frame of about 1k patches
    vision_heads: int = 16
    vision_head_dim: int = 64
    patch_dim: int = 2352      # input features per merged patch: 2x2 x 14x14x3 (InternViT), 2x2 x 16x16x3 x 2 (Qwen)

    @property
    def llm_layer_params(self) -> int:
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        return attn + 3 * self.hidden * self.intermediate

    @property
    def vision_layer_params(self) -> int:
        return 4 * self.vision_hidden ** 2 + 2 * self.vision_hidden * self.vision_intermediate

    @property
    def params(self) -> int:
        """All parameters: LLM layers, embedding + untied head, ViT, MLP projector."""
        llm = self.layers * self.llm_layer_params + 2 * self.vocab * self.hidden
        vit = self.vision_layers * self.vision_layer_params
        proj = self.vision_hidden * self.patches_per_token * self.hidden + self.hidden ** 2
        return llm + vit + proj


# layers/heads/kv/hidden/vision hidden: DHP (arXiv 2602.21788), evaluation. FFN widths, head dims, vocab and ViT depth/MLP:
# InternVL3-2B = InternViT-300M + Qwen2.5-1.5B; InternVL2.5-4B = InternViT-300M + Qwen2.5-3B;
# InternVL3-8B = InternViT-300M + Qwen2.5-7B; Qwen3-VL-{2,4,8}B = Qwen3-{1.7,4,8}B decoders with
# the Qwen3-VL ViT (24 x 1024 for 2B/4B, 27 x 1152 for 8B). config.json on the Hugging Face Hub:
# OpenGVLab/InternVL3-2B, OpenGVLab/InternVL2_5-4B, OpenGVLab/InternVL3-8B, Qwen/Qwen3-VL-{2B,4B,8B}-Instruct.
MODELS: dict[str, ModelShape] = {
    "internvl3-2b": ModelShape(28, 12, 2, 1536, 8960, 128, 151674, 24, 1024, 4096),
    "internvl2.5-4b": ModelShape(36, 16, 8, 2048, 11008, 128, 151674, 24, 1024, 4096),
    "internvl3-8b": ModelShape(28, 28, 4, 3584, 18944, 128, 151674, 24, 1024, 4096),
    "qwen3-vl-2b": ModelShape(28, 16, 8, 2048, 6144, 128, 151936, 24, 1024, 4096, patch_dim=6144),
    "qwen3-vl-4b": ModelShape(36, 32, 8, 2560, 9728, 128, 151936, 24, 1024, 4096, patch_dim=6144),
    "qwen3-vl-8b": ModelShape(36, 32, 8, 4096, 12288, 128, 151936, 27, 1152, 4304, vision_head_dim=72,
                              patch_dim=6144),
}


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
# state bytes and dtypes of the engine are in dhp_jax.planner.memory and are CostModel fields:
USABLE_MEMORY_FRACTION = 0.9  # allocator fragmentation, communicator buffers, vision workspace


# Ring attention (dhp_jax.sharding.ring, npu_backend.ring): what it holds per rank beyond the
# per-layer working set above, for the layer being recomputed and differentiated. Linear in the
# local tokens: no [S_l, S_l] block is ever materialised, only score tiles of a fixed size.
ATTENTION_TILE = 512  # tokens per tile (dhp_jax.data.tiling.DEFAULT_TILE)


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
