"""DHP-JAX: train multimodal LLMs with Dynamic Hybrid Parallelism (any-degree CP groups per micro-batch)."""

__version__ = "0.1.0"
