"""Qwen3-VL-MoE in torch (the torch backend only): Qwen3-VL's encoder and its tensor-parallel split
(`dhp_jax.models.qwen3_vl.torch_model`); the LLM's sparse blocks are the backend's
(`npu_backend.moe`, run by `npu_backend.hf.TorchFamilyModel` where `config.text.moe` marks a layer
sparse)."""

from __future__ import annotations

from dhp_jax.models.qwen3_vl.torch_model import VISION_MLP_FIRST, encode, sequence_locals, vision_split

__all__ = ["VISION_MLP_FIRST", "encode", "sequence_locals", "vision_split"]
