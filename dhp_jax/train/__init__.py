"""The trainer: typed configs, data with a learnable signal, optax state, the planner thread,
orbax checkpoints, metrics, the profiler and the `dhp train` / `dhp profile` jobs."""

from dhp_jax._lazy import lazy_attributes

_LAZY = {
    "TrainConfig": "dhp_jax.train.train_config",
    "load_config": "dhp_jax.train.train_config",
    "ConfigError": "dhp_jax.train.train_config",
    "DataPipeline": "dhp_jax.train.pipeline",
    "PlannerThread": "dhp_jax.train.planner_thread",
    "Checkpointer": "dhp_jax.train.checkpoint",
    "Trainer": "dhp_jax.train.trainer",
    "dry_run": "dhp_jax.train.trainer",
    "fit_profile": "dhp_jax.train.profile",
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
__all__ = list(_LAZY)
