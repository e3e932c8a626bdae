"""The sharding compiler: each plan group on its own device sub-mesh with ring attention."""

from dhp_jax._lazy import lazy_attributes

_LAZY = {
    "PlanExecutor": "dhp_jax.sharding.executor",
    "load_sharded": "dhp_jax.sharding.stream_load",
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
__all__ = list(_LAZY)
