"""The flax multimodal model: vision encoder + projector + decoder LLM, and the single-device reference."""

from dhp_jax._lazy import lazy_attributes

_LAZY = {
    "MLLMConfig": "dhp_jax.model.mllm_config",
    "init_params": "dhp_jax.model.mllm",
    "reference_loss": "dhp_jax.model.reference",
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
__all__ = list(_LAZY)
