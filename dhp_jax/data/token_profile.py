"""A dataset's token profile: per-sample token counts by modality, length statistics, a histogram.

Kept as counts only (a few bytes a sample), so a manifest of millions of lines streams through.
`dhp analyze` (`dhp_jax.sim.analyze`) adds what DHP would gain on the data.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import numpy as np

from dhp_jax.data.manifest import ManifestStats, iter_manifest
from dhp_jax.data.sample import Sample


@dataclasses.dataclass
class TokenProfile:
    """Per-sample token counts of a dataset (int64[K] each) and bidirectional shares (float64[K])."""

    text: np.ndarray
    image: np.ndarray
    video: np.ndarray
    eta: np.ndarray

    @property
    def total(self) -> np.ndarray:
        return self.text + self.image + self.video

    @classmethod
    def from_samples(cls, samples: Sequence[Sample] | Any) -> "TokenProfile":
        """Collect counts while iterating (works on a stream: only the counts are kept)."""
        cols: list[list[Any]] = [[], [], [], []]
        for s in samples:
            t = i = v = 0
            for g in s.segments:
                if g.modality == "text":
                    t += g.num_tokens
                elif g.modality == "image":
                    i += g.num_tokens
                else:
                    v += g.num_tokens
            for col, x in zip(cols, (t, i, v, s.bidirectional_share)):
                col.append(x)
        return cls(*(np.asarray(c, dtype=np.int64) for c in cols[:3]), np.asarray(cols[3], dtype=np.float64))


def summary(profile: TokenProfile) -> dict[str, Any]:
    """Length statistics, token shares by modality and sample counts by kind."""
    total = profile.total
    n = int(total.size)
    if n == 0:
        raise ValueError("the dataset has no samples to analyze")
    tok = float(total.sum())
    return {
        "samples": n,
        "tokens": int(tok),
        "length": {"mean": float(total.mean()), "median": float(np.median(total)),
                   "p90": float(np.percentile(total, 90)), "p99": float(np.percentile(total, 99)),
                   "min": int(total.min()), "max": int(total.max())},
        "token_share": {"text": float(profile.text.sum() / tok) if tok else 0.0,
                        "image": float(profile.image.sum() / tok) if tok else 0.0,
                        "video": float(profile.video.sum() / tok) if tok else 0.0},
        "sample_kinds": {"text_only": int(np.sum((profile.image == 0) & (profile.video == 0))),
                         "with_image": int(np.sum(profile.image > 0)),
                         "with_video": int(np.sum(profile.video > 0))},
    }


def histogram(profile: TokenProfile) -> list[dict[str, Any]]:
    """Samples binned by total length on a powers-of-two ladder, with each bin's modality tokens.

    Bin b holds lengths in [2^b, 2^(b+1)) (bin 0 also holds length 0).
    """
    total = profile.total
    b = np.floor(np.log2(np.maximum(total, 1))).astype(np.int64)
    rows = []
    for k in range(int(b.min()), int(b.max()) + 1):
        m = b == k
        rows.append({"lo": int(2 ** k), "hi": int(2 ** (k + 1)), "samples": int(m.sum()),
                     "text_tokens": int(profile.text[m].sum()), "image_tokens": int(profile.image[m].sum()),
                     "video_tokens": int(profile.video[m].sum())})
    return rows


def load_profile(source: str, vision: str, *, skip_bad: bool = False, image_root: str | None = None,
                 tokenizer: str | None = None, mix_samples: int = 8192,
                 seed: int = 0) -> tuple[TokenProfile, dict[str, Any]]:
    """Token profile of a manifest path (streamed) or of a built-in mix (`mix_samples` drawn)."""
    from dhp_jax.data.datasets import DATASETS, check_dataset, make_dataset
    if source in DATASETS and not os.path.isfile(source):
        prof = TokenProfile.from_samples(make_dataset(source, mix_samples, seed, vision=vision))
        return prof, {"source": source, "kind": "built-in mix", "samples_drawn": mix_samples}
    check_dataset(source)       # a directory: said so
    if not os.path.isfile(source):
        raise FileNotFoundError(f"manifest {source!r} not found (and not a built-in mix: {', '.join(DATASETS)})")
    stats = ManifestStats()
    prof = TokenProfile.from_samples(iter_manifest(source, vision, skip_bad=skip_bad, image_root=image_root,
                                                   tokenizer=tokenizer, stats=stats))
    info = {"source": source, "kind": "manifest", **dataclasses.asdict(stats)}
    return prof, info
