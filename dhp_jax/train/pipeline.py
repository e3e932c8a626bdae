"""Training data with a learnable signal: mix-shaped batches of real token ids and pixels.

Each step's batch is a pure function of (seed, step): the lengths come from `make_dataset` (an
openvid-like mix, say), every segment's token count is scaled down to fit the tiny model, and the
payload carries a signal the model can learn. Every sample shows one of `num_classes` "concepts":
its vision tokens are that concept's prototype patch plus noise, and its caption is that concept's
fixed token sequence, after a fixed two-token cue. So the caption's first token is predictable
only from the image, the rest from the caption itself, and the loss falls visibly within a few
dozen steps. The prompt before the video is
one fixed instruction, as in instruction-tuning data.

Because a batch depends only on (seed, step), the data-loader position is the step index: a
resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dhp_jax.data import make_dataset
from dhp_jax.data.sample import Sample, Segment, sample_etas, sample_lengths
from dhp_jax.train.train_config import DataConfig

# The fixed tables (prototypes, captions, instruction) do not depend on the run's seed: the task
# is the same task whatever the seed, only the draw of batches changes.
_TABLE_SEED = 20260229
# A caption opens with this many fixed cue tokens: the loss counts text tokens whose next token is
# text, so the cue's last token is the position that must read the image to name the concept.
_CUE = 2


@dataclasses.dataclass
class Batch:
    step: int
    samples: list[Sample]          # scaled, with payloads: what the executor runs
    source_samples: list[Sample]   # unscaled, payload-free: what the simulator sees at full size
    lengths: np.ndarray            # int64[K] scaled token counts
    etas: np.ndarray               # float64[K]
    concepts: np.ndarray           # int64[K] the concept each sample shows

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def _step_seed(seed: int, step: int) -> int:
    return int(np.random.SeedSequence([int(seed), int(step)]).generate_state(1)[0])


class DataPipeline:
    """`pipeline.batch(step) -> Batch`; deterministic, stateless, cheap enough for the planner thread."""

    def __init__(self, cfg: DataConfig, vocab_size: int, patch_dim: int, first_token: int = 1):
        if vocab_size < first_token + 1:
            raise ValueError(f"vocab_size must be >= {first_token + 1}, got {vocab_size}")
        self.cfg, self.vocab_size, self.patch_dim = cfg, int(vocab_size), int(patch_dim)
        rng = np.random.default_rng(_TABLE_SEED)
        # Text ids start at `first_token`: token 0 is never used so that a padding id can never look
        # like data (a family model's demo also keeps its vision placeholders' ids out of the text)
        self.captions = rng.integers(first_token, vocab_size, size=(cfg.num_classes, cfg.max_tokens), dtype=np.int64)
        self.instruction = rng.integers(first_token, vocab_size, size=cfg.max_tokens, dtype=np.int64)
        self.prototypes = rng.normal(size=(cfg.num_classes, patch_dim)).astype(np.float32)

    # ------------------------------------------------------------------ lengths
    def source_batch(self, step: int, batch_size: int | None = None) -> list[Sample]:
        """The unscaled, payload-free samples of step `step` (`batch_size` of them: default the run's)."""
        return make_dataset(self.cfg.dataset, batch_size or self.cfg.batch_size, _step_seed(self.cfg.seed, step))

    def scale_segments(self, sample: Sample) -> list[tuple[str, int, int | None]]:
        """(modality, num_tokens, tokens_per_frame) of the scaled sample, total <= max_tokens.

        Vision spans keep their frame count where they can (fewer, smaller frames); the final
        segment is a caption of at least `min_text_tokens`; overflow is cut from the largest
        vision span first, then from the text.
        """
        cfg = self.cfg
        out: list[list] = []
        for seg in sample.segments:
            n = int(round(seg.num_tokens * cfg.token_scale))
            if seg.is_vision:
                n = max(1, n)
                frames = seg.num_tokens // seg.tokens_per_frame if seg.tokens_per_frame else 1
                out.append([seg.modality, n, max(1, min(frames, n))])  # third field: frames for now
            elif n > 0:
                out.append(["text", n, None])
        if not out or out[-1][0] != "text":
            out.append(["text", cfg.min_text_tokens, None])
        out[-1][1] = max(out[-1][1], cfg.min_text_tokens)
        excess = sum(s[1] for s in out) - cfg.max_tokens
        while excess > 0:
            vis = [s for s in out if s[0] != "text" and s[1] > 1]
            if vis:
                big = max(vis, key=lambda s: s[1])
                cut = min(excess, big[1] - 1)
            else:  # only text left to cut: trim earlier text first, keep the caption's minimum
                texts = [s for s in out[:-1] if s[0] == "text" and s[1] > 1] or [out[-1]]
                big = texts[0]
                floor = cfg.min_text_tokens if big is out[-1] else 1
                cut = min(excess, big[1] - floor)
                if cut <= 0:
                    raise ValueError(f"data.max_tokens={cfg.max_tokens} cannot hold sample {sample.sample_id}")
            big[1] -= cut
            excess -= cut
        result = []
        for modality, n, frames in out:
            if modality == "text":
                result.append(("text", n, None))
            else:
                frames = max(1, min(frames, n))
                per_frame = n // frames
                result.append((modality, frames * per_frame, per_frame))  # whole frames only
        return result

    # ------------------------------------------------------------------ payloads
    def batch(self, step: int) -> Batch:
        cfg = self.cfg
        source = self.source_batch(step)
        rng = np.random.default_rng(_step_seed(cfg.seed + 1, step))
        concepts = rng.integers(0, cfg.num_classes, size=len(source))
        samples = []
        for i, (src, c) in enumerate(zip(source, concepts)):
            segs = []
            shape = self.scale_segments(src)
            for j, (modality, n, per_frame) in enumerate(shape):
                if modality == "text":
                    is_caption = j == len(shape) - 1
                    if is_caption:  # "describe:" (2 fixed tokens), then the concept's caption
                        head = self.instruction[-_CUE:][:n]
                        ids = np.concatenate([head, self.captions[c, :n - len(head)]]).astype(np.int32)
                    else:
                        ids = self.instruction[:n].astype(np.int32)
                    segs.append(Segment("text", n, token_ids=ids, meta={"role": "caption" if is_caption else "prompt"}))
                else:
                    noise = rng.normal(size=(n, self.patch_dim)).astype(np.float32)
                    pixels = self.prototypes[c][None, :] + np.float32(cfg.noise) * noise
                    segs.append(Segment(modality, n, pixels=pixels, tokens_per_frame=per_frame))
            samples.append(Sample(tuple(segs), sample_id=i, source=src.source))
        return Batch(step=step, samples=samples, source_samples=source, lengths=sample_lengths(samples),
                     etas=sample_etas(samples), concepts=concepts)

    def batches(self, steps: Sequence[int]) -> list[Batch]:
        return [self.batch(s) for s in steps]
