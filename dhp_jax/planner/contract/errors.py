"""The contract's errors: a plan that cannot be made, and a plan that breaks an invariant."""

from __future__ import annotations


class PlanningError(ValueError):
    """The planner cannot produce a plan for this input (e.g. a sample too long for all ranks)."""


class PlanValidationError(ValueError):
    """A plan breaks an invariant of the contract; the message names the group or sample."""
