"""Data the planner and the model see: `Sample`, modality segments, vision-token rules, generators."""

from dhp_jax._lazy import lazy_attributes
from dhp_jax.data.sample import MODALITIES, Sample, Segment, sample_etas, sample_lengths

_LAZY = {
    "make_dataset": "dhp_jax.data.datasets",
    "DATASETS": "dhp_jax.data.datasets",
    "random_samples": "dhp_jax.data.synthetic",
    "read_manifest": "dhp_jax.data.manifest",
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
__all__ = ["MODALITIES", "Sample", "Segment", "sample_etas", "sample_lengths", *_LAZY]
