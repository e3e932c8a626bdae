"""One processor output as a `dhp_jax.data.Sample` (what the planner and the packers consume), and back.

A sample's LLM tokens are cut into segments at every change of modality: a text run keeps its
`token_ids`; a vision run (one image, one Qwen2.5-VL video, one Qwen3-VL video frame, the tiles
of one InternVL image) keeps `pixels` with one row per LLM token, that token's encoder patches
concatenated (the merge**2 patches the Qwen merger joins, the k x k patches InternVL's pixel
shuffle joins, each C*(T*)P*P long), and `tokens_per_frame` (LLM tokens per frame or tile,
the span the encoder attends within). Every segment's `meta` holds what else travels with its
tokens: `positions` int32[n, axes] (the decoder's rotary positions: M-RoPE (t, h, w) for the Qwen
families, the offset for InternVL), `labels` int64[n] (the unshifted labels, -100 = ignored) when
given, and for vision runs `grid_thw` (Qwen: the run's patch grid; InternVL: (tiles, H/P, W/P))
and, for a Qwen2.5-VL video, `second_per_grid_ts`.

`inputs_from_sample` rebuilds processor-style inputs from such a Sample, so the round trip is
checked by the logits (a Qwen3-VL video comes back as one single-frame video per frame: the
encoder attends within a frame and the decoder positions split the frames, so the result is the
same).
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping

import numpy as np

from dhp_jax.data.sample import Sample, Segment
from dhp_jax.model.hf.config import HFConfig
from dhp_jax.model.hf.families import hf_module
from dhp_jax.model.hf.host import prepare
from dhp_jax.model.hf.inputs import as_numpy


def _runs(kinds: np.ndarray) -> list[tuple[int, int, int]]:
    """(kind, start, end) of each run of equal values."""
    out, start = [], 0
    for kind, run in itertools.groupby(kinds.tolist()):
        n = len(list(run))
        out.append((int(kind), start, start + n))
        start += n
    return out


def sample_from_inputs(config: HFConfig, inputs: Mapping[str, Any], labels: Any = None,
                       sample_id: int | str | None = None) -> Sample:
    """The Sample of one processor output (batch size 1, no padding); `labels` [1, L] with -100
    where ignored (unshifted, as transformers takes them) or None."""
    batch = prepare(config, inputs)
    ids, positions = batch["input_ids"], batch["positions"]
    if not batch["keep"].all():
        raise ValueError(f"sample {sample_id!r}: attention_mask has padding; a Sample holds one unpadded sample")
    lab = None if labels is None else as_numpy(labels).reshape(-1).astype(np.int64)
    if lab is not None and lab.shape != ids.shape:
        raise ValueError(f"sample {sample_id!r}: labels have {lab.shape[0]} tokens, input_ids {ids.shape[0]}")
    # the family's: each token's kind (0 text, 1 image, 2 video) and per modality its runs' pixels
    kinds, vision = hf_module(config.family).vision_runs(config, inputs, batch)
    segments = []
    for kind, a, b in _runs(kinds):
        meta: dict[str, Any] = {"positions": positions[a:b]}
        if lab is not None:
            meta["labels"] = lab[a:b]
        if kind == 0:
            segments.append(Segment("text", b - a, token_ids=ids[a:b].astype(np.int32), meta=meta))
            continue
        modality = ("image", "video")[kind - 1]
        queue = vision[modality]
        if not queue:
            raise ValueError(f"sample {sample_id!r}: a run of {modality} tokens at {a} has no pixels left for it")
        pixels, per_frame, extra = queue.pop(0)
        if pixels.shape[0] != b - a:
            raise ValueError(f"sample {sample_id!r}: the {modality} run at {a} has {b - a} tokens, its pixels "
                             f"make {pixels.shape[0]}")
        segments.append(Segment(modality, b - a, pixels=pixels, tokens_per_frame=per_frame, meta={**meta, **extra}))
    return Sample(tuple(segments), sample_id=sample_id, source=config.family)


def samples_from_items(config: HFConfig, items: Any) -> list[Sample]:
    """The Samples of a fine-tuning batch (`dhp_jax.data.loader.Loader` items: each its processor
    output with its `labels`), numbered in batch order."""
    out = []
    for i, it in enumerate(items):
        inputs = {k: v for k, v in it["inputs"].items() if k != "labels"}
        out.append(sample_from_inputs(config, inputs, it["inputs"]["labels"], sample_id=i))
    return out


def inputs_from_sample(config: HFConfig, sample: Sample) -> dict[str, np.ndarray]:
    """Processor-style inputs (batch size 1) of a Sample made by `sample_from_inputs`."""
    ids, kinds, pixels, grids_, seconds = [], [], {"image": [], "video": []}, {"image": [], "video": []}, []
    for seg in sample.segments:
        if seg.modality == "text":
            ids.append(np.asarray(seg.token_ids, np.int64))
            kinds.append(np.zeros(seg.num_tokens, np.int64))
            continue
        ids.append(np.full(seg.num_tokens, config.token_ids[seg.modality], np.int64))
        kinds.append(np.full(seg.num_tokens, 1 if seg.modality == "image" else 2, np.int64))
        grids_[seg.modality].append(seg.meta["grid_thw"])
        pixels[seg.modality].append(np.asarray(seg.pixels, np.float32))
        if "second_per_grid_ts" in seg.meta:
            seconds.append(seg.meta["second_per_grid_ts"])
    input_ids = np.concatenate(ids)[None]
    out: dict[str, np.ndarray] = {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids)}
    hf_module(config.family).processor_pixels(config, out, np.concatenate(kinds), pixels, grids_, seconds)
    return out
