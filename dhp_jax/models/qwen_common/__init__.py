"""What Qwen2.5-VL and Qwen3-VL share: the patch-row processor, the placeholder tokens, the
encoder's parameter count and memory terms (pure Python and NumPy; `hf_*`/`jax_*`/`torch_*` files
are the engines' shared parts)."""
