"""Qwen3-VL (`spec.py` registers it; see `dhp_jax.models`)."""
