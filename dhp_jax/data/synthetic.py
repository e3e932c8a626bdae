"""`random_samples`: synthetic samples with real payloads (token ids, pixels) of given lengths.

Each sample is one of: pure text, image + text, video (several frames) + text, or interleaved
text/image/text/image/text. Deterministic in `seed`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dhp_jax.data.sample import Sample, Segment, sample_lengths


def _split(rng: np.random.Generator, total: int, parts: int) -> list[int]:
    """`parts` non-negative integers summing to `total`, roughly uniform."""
    cuts = np.sort(rng.integers(0, total + 1, size=parts - 1))
    return list(np.diff(np.concatenate([[0], cuts, [total]])).astype(int))


def _text(rng: np.random.Generator, n: int, vocab: int) -> Segment:
    return Segment("text", n, token_ids=rng.integers(0, vocab, size=n).astype(np.int32))


def _vision(rng: np.random.Generator, n: int, patch_dim: int, modality: str,
            tokens_per_frame: int | None = None) -> Segment:
    pixels = rng.standard_normal((n, patch_dim)).astype(np.float32)
    return Segment(modality, n, pixels=pixels, tokens_per_frame=tokens_per_frame)


def random_samples(config: Any, lengths: Sequence[int], seed: int = 0,
                   kinds: Sequence[str] = ("text", "image", "video", "interleaved")) -> list[Sample]:
    """Samples (ids 0..K-1) whose token counts equal `lengths`, mixing text, images and frames.

    `config` needs `vocab_size` and `patch_dim` (an `MLLMConfig`). Samples shorter than 4 tokens
    are text only.
    """
    lens = sample_lengths(lengths)
    rng = np.random.default_rng(seed)
    vocab, patch = int(config.vocab_size), int(config.patch_dim)
    out = []
    for i, n in enumerate(int(x) for x in lens):
        kind = str(rng.choice(list(kinds))) if n >= 4 else "text"
        if kind == "text":
            segs = [_text(rng, n, vocab)]
        elif kind in ("image", "video"):
            v = int(rng.integers(max(1, n // 4), max(2, (3 * n) // 4) + 1))
            v = min(v, n - 1)
            a = int(rng.integers(0, n - v + 1))
            tpf = int(rng.integers(2, 9)) if kind == "video" else None
            segs = [_text(rng, a, vocab), _vision(rng, v, patch, kind, tpf), _text(rng, n - v - a, vocab)]
        elif kind == "interleaved":
            t0, i1, t1, i2, t2 = _split(rng, n - 2, 5)
            segs = [_text(rng, t0 + 1, vocab), _vision(rng, i1, patch, "image"), _text(rng, t1, vocab),
                    _vision(rng, i2, patch, "image"), _text(rng, t2 + 1, vocab)]
        else:
            raise ValueError(f"unknown sample kind {kind!r}; use text, image, video, interleaved")
        segs = [s for s in segs if s.num_tokens > 0] or [_text(rng, 0, vocab)]
        out.append(Sample(tuple(segs), sample_id=i, source="synthetic"))
    return out
