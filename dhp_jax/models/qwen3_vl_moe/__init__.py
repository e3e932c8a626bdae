"""Qwen3-VL-MoE (`spec.py` registers it; see `dhp_jax.models`)."""
