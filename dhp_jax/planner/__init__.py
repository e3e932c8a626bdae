"""The planner: cost model, memory-aware packing, degree allocation, placement, baselines, `Plan`.

Pure Python/NumPy (no jax import), so it can run in a loader thread or another process.
"""

from dhp_jax.planner.plan import SCHEMA, Group, MicroBatch, Plan, PlanningError, PlanValidationError

__all__ = ["SCHEMA", "Group", "MicroBatch", "Plan", "PlanningError", "PlanValidationError"]
