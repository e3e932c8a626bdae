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
    "vision_rules": "dhp_jax.data.vision",
    "rules_for_model": "dhp_jax.data.vision",
    "FinetuneData": "dhp_jax.data.finetune",
    "DataError": "dhp_jax.data.finetune",
    "Loader": "dhp_jax.data.loader",
    "iter_source": "dhp_jax.data.sources",
    "VisionProcessor": "dhp_jax.data.processors",
    "ChatTokenizer": "dhp_jax.data.chat",
    "write_example_data": "dhp_jax.data.example",
    "write_processor_files": "dhp_jax.data.example",
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
__all__ = ["MODALITIES", "Sample", "Segment", "sample_etas", "sample_lengths", *_LAZY]
