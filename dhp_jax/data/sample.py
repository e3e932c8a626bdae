"""`Sample` and its modality segments: what one training sequence is made of.

The planner only reads lengths and modality spans; the model and the executors also read the
payload (text token ids, vision pixels) when it is present.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

MODALITIES = ("text", "image", "video")
VISION_MODALITIES = ("image", "video")


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """A contiguous span of one modality inside a sample's LLM token stream.

    `num_tokens` is the number of tokens the segment contributes to the LLM stream (for vision,
    after the encoder's patch merge). Payloads are optional: a lengths-only segment is enough for
    planning.

    - text: `token_ids` int32[num_tokens].
    - image / video: `pixels` float32[num_tokens, patch_dim], one merged patch per LLM token;
      `tokens_per_frame` splits a video (or a tiled image) into frames that the vision encoder
      attends within. Inside the LLM, a vision segment is one bidirectional span.
    """

    modality: str
    num_tokens: int
    token_ids: np.ndarray | None = None
    pixels: np.ndarray | None = None
    tokens_per_frame: int | None = None
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise ValueError(f"segment modality {self.modality!r} is not one of {MODALITIES}")
        if int(self.num_tokens) < 0:
            raise ValueError(f"segment num_tokens must be >= 0, got {self.num_tokens}")
        object.__setattr__(self, "num_tokens", int(self.num_tokens))
        if self.token_ids is not None and len(self.token_ids) != self.num_tokens:
            raise ValueError(
                f"{self.modality} segment has {len(self.token_ids)} token ids for num_tokens={self.num_tokens}")
        if self.pixels is not None and self.pixels.shape[0] != self.num_tokens:
            raise ValueError(
                f"{self.modality} segment has {self.pixels.shape[0]} pixel rows for num_tokens={self.num_tokens}")

    @property
    def is_vision(self) -> bool:
        return self.modality in VISION_MODALITIES


@dataclasses.dataclass(frozen=True, eq=False)
class Sample:
    """One training sequence: an ordered tuple of segments (text, image, video interleaved)."""

    segments: tuple[Segment, ...]
    sample_id: int | str | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.segments))
        if not self.segments:
            raise ValueError(f"sample {self.sample_id!r} has no segments")

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    @property
    def vision_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments if s.is_vision)

    @property
    def text_tokens(self) -> int:
        return self.num_tokens - self.vision_tokens

    @property
    def vision_spans(self) -> list[tuple[int, int]]:
        """[start, end) token offsets of the bidirectional vision spans."""
        spans, pos = [], 0
        for s in self.segments:
            if s.is_vision and s.num_tokens:
                spans.append((pos, pos + s.num_tokens))
            pos += s.num_tokens
        return spans

    @property
    def bidirectional_share(self) -> float:
        """eta: extra attention work of bidirectional vision spans relative to causal attention.

        Causal attention over L tokens touches about L^2/2 query-key pairs; a bidirectional span
        of v tokens adds about v^2/2 more. eta = sum v^2 / L^2, so a pure-vision sample costs
        about twice a causal one (eta = 1), as the mask-efficiency factor of DHP's cost model states
        (arXiv 2602.21788, section 4.2).
        """
        total = self.num_tokens
        if total == 0:
            return 0.0
        return float(sum((e - b) ** 2 for b, e in self.vision_spans)) / float(total * total)

    @classmethod
    def from_lengths(cls, text: int = 0, vision: int = 0, modality: str = "image",
                     sample_id: int | str | None = None, source: str | None = None) -> "Sample":
        """A payload-free sample: `vision` tokens of one vision span followed by `text` tokens."""
        segs = []
        if vision:
            segs.append(Segment(modality, vision))
        if text or not segs:
            segs.append(Segment("text", text))
        return cls(tuple(segs), sample_id=sample_id, source=source)


def sample_lengths(samples_or_lengths: Iterable[Sample] | Sequence[int] | np.ndarray) -> np.ndarray:
    """Token counts of a batch given as `Sample`s or as plain integers (int64[K])."""
    items = list(samples_or_lengths)
    out = np.empty(len(items), dtype=np.int64)
    for i, x in enumerate(items):
        n = x.num_tokens if isinstance(x, Sample) else x
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer, float, np.floating)):
            raise TypeError(f"sample {i}: length must be an integer, got {type(n).__name__}")
        if float(n) != int(n):
            raise ValueError(f"sample {i}: length must be an integer, got {n}")
        if int(n) < 0:
            raise ValueError(f"sample {i}: length must be >= 0, got {int(n)}")
        out[i] = int(n)
    return out


def sample_etas(samples_or_lengths: Iterable[Sample] | Sequence[int] | np.ndarray) -> np.ndarray:
    """Per-sample bidirectional share eta (float64[K]); plain lengths count as text (eta = 0)."""
    items = list(samples_or_lengths)
    return np.array([x.bidirectional_share if isinstance(x, Sample) else 0.0 for x in items],
                    dtype=np.float64)
