"""Qwen2.5-VL (`spec.py` registers it; see `dhp_jax.models`)."""
