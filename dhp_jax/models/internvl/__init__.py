"""InternVL, the transformers-native `-hf` layout (`spec.py` registers it; see `dhp_jax.models`)."""
