"""Multi-process JAX for `dhp train`: launch-environment resolution (`launch.py`) and the per-step
agreement and watchdog (`step_sync.py`), under the one name the trainer and the CLI import."""

from dhp_jax.train.launch import (DistributedConfig, DistributedError, describe, expand_nodelist, initialize,
                                  resolve, slurm_port)
from dhp_jax.train.step_sync import WATCHDOG_EXIT_CODE, PlanMismatchError, StepSync, StepTimeoutError

__all__ = ["DistributedConfig", "DistributedError", "PlanMismatchError", "StepSync", "StepTimeoutError",
           "WATCHDOG_EXIT_CODE", "describe", "expand_nodelist", "initialize", "resolve", "slurm_port"]
