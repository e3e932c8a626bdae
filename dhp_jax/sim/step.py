"""`dhp_jax.sim.step_time`: the step time of a plan, priced by the planner (`planner.cost.pricing`).

The simulator's public name for it; pricing itself lives in the planner, so that the planner's
estimates and the simulator's figures come from one computation.
"""

from dhp_jax.planner.cost.pricing import step_time

__all__ = ["step_time"]
