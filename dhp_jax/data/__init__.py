"""Data the planner and the model see: `Sample`, modality segments, vision-token rules, generators."""

from dhp_jax._lazy import lazy_attributes
from dhp_jax.data.sample import MODALITIES, Sample, Segment, sample_etas, sample_lengths

_LAZY = {
    "make_dataset": "dhp_jax.data.datasets",
    "DATASETS": "dhp_jax.data.datasets",
    "random_samples": "dhp_jax.data.synthetic",
    "read_manifest": "dhp_jax.data.manifest",
    "iter_manifest": "dhp_jax.data.manifest",
    "ManifestError": "dhp_jax.data.manifest",
    "image_tokens": "dhp_jax.data.vision",
    "video_tokens": "dhp_jax.data.vision",
    "VISION_FAMILIES": "dhp_jax.data.vision",
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
__all__ = ["MODALITIES", "Sample", "Segment", "sample_etas", "sample_lengths", *_LAZY]
