"""Data the planner and the model see: `Sample`, modality segments, vision-token rules, generators."""

from dhp_jax.data.sample import MODALITIES, Sample, Segment, sample_etas, sample_lengths

__all__ = ["MODALITIES", "Sample", "Segment", "sample_etas", "sample_lengths"]
