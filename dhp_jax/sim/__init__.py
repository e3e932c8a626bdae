"""Cluster simulator: step time of a plan on a described cluster, at any scale (pure NumPy)."""

from dhp_jax._lazy import lazy_attributes

_LAZY = {
    "step_time": "dhp_jax.sim.step",
    "Cluster": "dhp_jax.sim.cluster",
    "simulate": "dhp_jax.sim.simulate",
    "evaluate": "dhp_jax.sim.simulate",
    "lower_bound": "dhp_jax.sim.bounds",
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
__all__ = list(_LAZY)
