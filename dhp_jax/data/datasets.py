"""Named, payload-free dataset mixes for planning: `make_dataset(name, num_samples, seed)`.

Each mix draws the *shape* of real multimodal training data (clip durations, resolutions,
caption lengths) and turns it into token counts with a vision family's rules (vision.py). Facts
are published statistics of the dataset a mix is named after, cited next to the numbers (sources: docs/DESIGN.md,
section 10); every other parameter is marked as our choice. Where a
speed-up depends on a choice (the long-tail share of openvid and internvid), experiment e10
(experiments/configs/e10_tail_sweep.yaml) shows how it moves with it. A name ending in ".jsonl" (or naming an existing file) is a manifest:
`num_samples` lines are drawn from it by seed (manifest.py).

Tails are drawn as exact counts (round(share * num_samples) samples), not by chance, so a batch
of 512 always holds the long clips the mix was designed to have.
"""

from __future__ import annotations

import dataclasses
import math
import os
import numpy as np

from dhp_jax.data.sample import Sample, Segment
from dhp_jax.data.vision import VisionRules, image_segment, video_segment, vision_rules


@dataclasses.dataclass(frozen=True)
class LogNormal:
    """A length drawn log-normally by its median and log-space sigma, clipped to [lo, hi]
    (`truncate=True`: values outside [lo, hi] are drawn again, so no mass piles up at the ends)."""

    median: float
    sigma: float
    lo: float
    hi: float
    truncate: bool = False

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.lognormal(math.log(self.median), self.sigma, n)
        if self.truncate:
            bad = np.flatnonzero((x < self.lo) | (x > self.hi))
            while bad.size:
                x[bad] = rng.lognormal(math.log(self.median), self.sigma, bad.size)
                bad = bad[(x[bad] < self.lo) | (x[bad] > self.hi)]
        return np.clip(x, self.lo, self.hi)

    def draw_int(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.maximum(1, np.rint(self.draw(rng, n))).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class VideoMix:
    """A video-caption mix: log-normal body of clip durations plus an exact-count long tail.

    `tail_share` of the clips (rounded to a count) have durations log-uniform in `tail_s`.
    Each sample is [instruction text, video, caption text].
    """

    name: str
    description: str
    body_s: LogNormal
    tail_share: float
    tail_s: tuple[float, float]
    resolutions: tuple[tuple[int, int, float], ...]  # (width, height, weight)
    source_fps: tuple[float, ...]
    prompt_tokens: LogNormal
    caption_tokens: LogNormal

    def durations(self, rng: np.random.Generator, n: int) -> np.ndarray:
        n_tail = int(round(self.tail_share * n))
        lo, hi = self.tail_s
        tail = np.exp(rng.uniform(math.log(lo), math.log(hi), n_tail))
        body = self.body_s.draw(rng, n - n_tail)
        return rng.permutation(np.concatenate([body, tail]))

    def generate(self, rng: np.random.Generator, n: int, rules: VisionRules) -> list[list[Segment]]:
        dur = self.durations(rng, n)
        res = _pick(rng, n, [r[2] for r in self.resolutions])
        fps = rng.choice(np.asarray(self.source_fps), n)
        prompt = self.prompt_tokens.draw_int(rng, n)
        caption = self.caption_tokens.draw_int(rng, n)
        out = []
        for i in range(n):
            w, h, _ = self.resolutions[res[i]]
            d = round(float(dur[i]), 3)
            out.append([Segment("text", int(prompt[i]), meta={"role": "user"}),
                        video_segment(d, w, h, rules, source_fps=float(fps[i])),
                        Segment("text", int(caption[i]), meta={"role": "assistant"})])
        return out


@dataclasses.dataclass(frozen=True)
class ImageMix:
    """A LLaVA-style instruction mix: text-only, single-image and multi-image conversations.

    Image sizes are a base resolution scaled by a uniform factor in `jitter` (aspect kept).
    """

    name: str
    description: str
    shares: tuple[float, float, float]  # text-only, single image, multi-image
    text_only_tokens: LogNormal
    single_tokens: LogNormal
    multi_tokens: LogNormal
    multi_images: tuple[int, int]  # inclusive range of images in a multi-image sample
    resolutions: tuple[tuple[int, int, float], ...]
    jitter: tuple[float, float]

    def _image(self, rng: np.random.Generator, rules: VisionRules) -> Segment:
        w, h, _ = self.resolutions[_pick(rng, 1, [r[2] for r in self.resolutions])[0]]
        s = rng.uniform(*self.jitter)
        return image_segment(max(1, round(w * s)), max(1, round(h * s)), rules)

    def generate(self, rng: np.random.Generator, n: int, rules: VisionRules) -> list[list[Segment]]:
        kinds = rng.permutation(np.repeat(np.arange(3), _counts(self.shares, n)))
        out = []
        for kind in kinds:
            if kind == 0:
                out.append([Segment("text", int(self.text_only_tokens.draw_int(rng, 1)[0]))])
            elif kind == 1:
                out.append([self._image(rng, rules), Segment("text", int(self.single_tokens.draw_int(rng, 1)[0]))])
            else:
                k = int(rng.integers(self.multi_images[0], self.multi_images[1] + 1))
                segs = [self._image(rng, rules) for _ in range(k)]
                out.append(segs + [Segment("text", int(self.multi_tokens.draw_int(rng, 1)[0]))])
        return out


@dataclasses.dataclass(frozen=True)
class TextMix:
    """Text-only documents, one text segment each."""

    name: str
    description: str
    tokens: LogNormal

    def generate(self, rng: np.random.Generator, n: int, rules: VisionRules) -> list[list[Segment]]:
        return [[Segment("text", int(t))] for t in self.tokens.draw_int(rng, n)]


# --- the mixes ------------------------------------------------------------------------------
# Shared choices: instructions ~24 tokens; source frame rates 24/25/30 fps.
_PROMPT = LogNormal(24, 0.5, 4, 256)          # choice
_FPS = (24.0, 25.0, 30.0)                     # choice

OPENVID = VideoMix(
    name="openvid",
    description="OpenVid-1M-like: short high-resolution clips with long captions, 2% long tail 64-240 s",
    # Fact (DHP, arXiv 2602.21788, evaluation): the paper's video data is long-tailed, most clips under 8 s, a few past 64 s.
    # No published duration statistics of OpenVid-1M (Nan et al., arXiv 2407.02371) are cited here: the body and the tail share are
    # our choice (e10 shows how the speed-up moves with the tail share).
    # Choice: median 5.5 s (sigma 0.6, 1.5..60 s) so that most clips are under 8 s; 2% tail 64..240 s.
    body_s=LogNormal(5.5, 0.6, 1.5, 60.0), tail_share=0.02, tail_s=(64.0, 240.0),
    # Choice: high-resolution clips (OpenVid keeps >= 512 px clips; many are 720p/1080p).
    resolutions=((1920, 1080, 0.35), (1280, 720, 0.45), (512, 512, 0.2)),
    source_fps=_FPS, prompt_tokens=_PROMPT,
    caption_tokens=LogNormal(120, 0.35, 30, 400),   # choice: dense generated captions
)

INTERNVID = VideoMix(
    name="internvid",
    description="InternVid-like: mean ~11.7 s, most clips under 10 s, 1.5% tail 64-300 s, short captions",
    # Fact (InternVid, Wang et al., arXiv 2307.06942): 234M clips from 760k hours: mean ~11.7 s, most
    # clips under 10 s. The share and range of clips past 64 s are not published: our choice (e10
    # shows how the speed-up moves with the tail share).
    # Choice: body median 7 s, sigma 0.8 (2..60 s): P(< 10 s) ~ 0.67, body mean ~9.6 s; with a 1.5%
    # log-uniform tail on 64..300 s (mean ~153 s) the mix mean is ~11.8 s.
    body_s=LogNormal(7.0, 0.8, 2.0, 60.0), tail_share=0.015, tail_s=(64.0, 300.0),
    resolutions=((1280, 720, 0.6), (640, 360, 0.25), (1920, 1080, 0.15)),  # choice: YouTube sources
    source_fps=_FPS, prompt_tokens=_PROMPT,
    caption_tokens=LogNormal(18, 0.4, 5, 80),   # choice: one-sentence captions
)

MSRVTT = VideoMix(
    name="msrvtt",
    description="MSR-VTT-like: clips of 10-30 s, mean 14.8 s, no clip longer; low resolution, short captions",
    # Facts (MSR-VTT, Xu et al., CVPR 2016): 10k clips of 10-30 s each, 41.2 h in all,
    # so the mean clip is 41.2 * 3600 / 10000 = 14.8 s. No clip is longer than 30 s: no tail.
    # Choice: the shape inside 10..30 s, a log-normal of sigma 0.4 truncated to 10..30 s, whose
    # median 11.42 s makes the truncated mean 14.8 s.
    body_s=LogNormal(11.42, 0.4, 10.0, 30.0, truncate=True), tail_share=0.0, tail_s=(30.0, 30.0),
    resolutions=((320, 240, 0.7), (640, 480, 0.3)),   # choice: low-resolution web clips
    source_fps=_FPS, prompt_tokens=_PROMPT,
    caption_tokens=LogNormal(14, 0.35, 5, 60),    # choice: ~10-word captions
)

LLAVA_MIX = ImageMix(
    name="llava-mix",
    description="LLaVA-instruct-like: 6% text-only, 82% single-image, 12% multi-image (2-6) conversations",
    # All choices, shaped after LLaVA-1.5's 665k instruction mix (a small text-only share, mostly
    # single-image VQA/conversation, some multi-image samples).
    shares=(0.06, 0.82, 0.12),
    text_only_tokens=LogNormal(600, 0.9, 16, 8192),
    single_tokens=LogNormal(160, 0.8, 8, 4096),
    multi_tokens=LogNormal(220, 0.7, 16, 4096),
    multi_images=(2, 6),
    # Choice: COCO-like photos, screenshots, documents and scans.
    resolutions=((640, 480, 0.35), (500, 375, 0.15), (1024, 768, 0.15), (1280, 720, 0.1),
                 (1600, 1200, 0.1), (800, 1000, 0.1), (336, 336, 0.05)),
    jitter=(0.75, 1.25),
)

TEXT_LONGTAIL = TextMix(
    name="text-longtail",
    description="Wikipedia-like documents: mean 1014, median 347, p99 ~10.9k tokens",
    # Assumption (no primary source cited): a 1M-document Wikipedia sample has mean 1014, median 347,
    # p99 10921 tokens.
    # A log-normal fitted to the median and the mean: mu = ln 347, sigma = sqrt(2 ln(1014/347))
    # = 1.4645; its p99 is ~10470 (4% under the assumed 10921). Clipped to 1..131072 tokens.
    tokens=LogNormal(347, math.sqrt(2 * math.log(1014 / 347)), 1, 131072),
)

Mix = VideoMix | ImageMix | TextMix
DATASETS: dict[str, Mix] = {m.name: m for m in (OPENVID, INTERNVID, MSRVTT, LLAVA_MIX, TEXT_LONGTAIL)}


def is_manifest_name(name: str) -> bool:
    """True when `name` names a JSONL manifest rather than a built-in mix."""
    return name not in DATASETS and (name.endswith(".jsonl") or os.path.isfile(name))


def check_dataset(name: str) -> None:
    """A dataset name that is a manifest path must be a file: `FileNotFoundError` ("not found") or
    `IsADirectoryError` ("is a directory, expected a .jsonl file"), each naming the path; a command
    calls it before anything else, so a wrong path is the first thing it says."""
    if name in DATASETS:
        return
    if os.path.isdir(name):
        inside = sorted(p for p in os.listdir(name) if p.endswith(".jsonl"))[:1]
        raise IsADirectoryError(f"manifest {name!r} is a directory, expected a .jsonl file"
                                + (f" (e.g. {os.path.join(name, inside[0])})" if inside else ""))
    if is_manifest_name(name) and not os.path.isfile(name):
        raise FileNotFoundError(f"manifest {name!r} not found (it does not exist; and not a built-in mix: "
                                f"{', '.join(DATASETS)})")


def make_dataset(name: str, num_samples: int, seed: int = 0, *, vision: str | VisionRules = "qwen-vl") -> list[Sample]:
    """`num_samples` payload-free samples of a named mix (or drawn from a JSONL manifest path).

    `vision` picks the token rules of the model family ("qwen-vl", "internvl", "llava").
    Deterministic: the same (name, num_samples, seed, vision) gives the same samples.
    `sample_id` is the index in the returned list; `source` is the mix name (or manifest path).
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 0:
        raise ValueError(f"num_samples must be a non-negative integer, got {num_samples!r}")
    rules = vision_rules(vision)
    check_dataset(name)
    if is_manifest_name(name):
        from dhp_jax.data.manifest import draw_manifest  # lazy: only manifest users pay for it
        return draw_manifest(name, int(num_samples), seed, vision=rules)
    mix = DATASETS.get(name)
    if mix is None:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)} (or a .jsonl manifest path)")
    return sample_mix(mix, int(num_samples), seed, vision=rules)


def sample_mix(mix: Mix, num_samples: int, seed: int = 0, *, vision: str | VisionRules = "qwen-vl") -> list[Sample]:
    """`make_dataset` for a mix object (a built-in one, or a variant made with `dataclasses.replace`)."""
    segs = mix.generate(np.random.default_rng(seed), int(num_samples), vision_rules(vision))
    return [Sample(tuple(s), sample_id=i, source=mix.name) for i, s in enumerate(segs)]


def _counts(shares: tuple[float, ...], n: int) -> np.ndarray:
    """Exact per-component counts summing to n (largest remainder)."""
    raw = np.asarray(shares, dtype=np.float64) / sum(shares) * n
    counts = np.floor(raw).astype(np.int64)
    order = np.argsort(-(raw - counts), kind="stable")
    counts[order[: n - int(counts.sum())]] += 1
    return counts


def _pick(rng: np.random.Generator, n: int, weights: list[float]) -> np.ndarray:
    p = np.asarray(weights, dtype=np.float64)
    return rng.choice(len(p), size=n, p=p / p.sum())

