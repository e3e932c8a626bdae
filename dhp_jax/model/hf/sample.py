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
from dhp_jax.model.hf.families import shuffle_groups
from dhp_jax.model.hf.host import prepare
from dhp_jax.model.hf.inputs import as_numpy
from dhp_jax.model.hf.qwen_vision import MODALITIES, grids

QWEN = ("qwen2_5_vl", "qwen3_vl")


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
    if config.family in QWEN:
        kinds = as_numpy(inputs["mm_token_type_ids"]).reshape(-1) if inputs.get("mm_token_type_ids") is not None \
            else np.zeros_like(ids)
        vision = _qwen_vision_runs(config, inputs)
    else:
        kinds = (ids == config.token_ids["image"]).astype(np.int64)
        vision = _internvl_vision_runs(config, inputs)
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


def _qwen_vision_runs(config: HFConfig, inputs: Mapping[str, Any]) -> dict[str, list]:
    """Per modality, the (pixels [tokens, merge**2 * patch_dim], tokens per frame, meta) of each
    run in order (Qwen3-VL: one run per video frame)."""
    v = config.vision
    unit = v.merge ** 2
    out: dict[str, list] = {"image": [], "video": []}
    seconds = inputs.get("second_per_grid_ts")
    seconds = None if seconds is None else as_numpy(seconds).reshape(-1)
    for modality, pixel_key, grid_key in MODALITIES:
        if inputs.get(pixel_key) is None:
            continue
        rows = as_numpy(inputs[pixel_key]).astype(np.float32)
        at = 0
        for i, (t, h, w) in enumerate(grids(inputs, grid_key).tolist()):
            per_frame = h * w
            pieces = [(1, rows[at + f * per_frame: at + (f + 1) * per_frame]) for f in range(t)] \
                if config.family == "qwen3_vl" and modality == "video" else [(t, rows[at: at + t * per_frame])]
            for frames, patch in pieces:
                extra: dict[str, Any] = {"grid_thw": (frames, h, w)}
                if config.family == "qwen2_5_vl" and modality == "video":
                    extra["second_per_grid_ts"] = float(seconds[i]) if seconds is not None else 1.0
                out[modality].append((patch.reshape(-1, unit * patch.shape[1]), per_frame // unit, extra))
            at += t * per_frame
    return out


def _internvl_vision_runs(config: HFConfig, inputs: Mapping[str, Any]) -> dict[str, list]:
    """The image runs of an InternVL sample: each run of placeholders takes as many tiles as its
    tokens need; pixels [tokens, k*k * C*P*P], a token's k x k patches in pixel-shuffle order."""
    if inputs.get("pixel_values") is None:
        return {"image": [], "video": []}
    v = config.vision
    batch = prepare(config, inputs)
    patches = batch["image"]["patches"].astype(np.float32)                  # [tiles, hw, C*P*P]
    tiles, hw, width = patches.shape
    side, k = int(round(hw ** 0.5)), v.shuffle
    groups = shuffle_groups(side, k)
    per_tile = hw // (k * k)
    ids = batch["input_ids"]
    runs = [(a, b) for kind, a, b in _runs((ids == config.token_ids["image"]).astype(np.int64)) if kind]
    out, at = [], 0
    for a, b in runs:
        if (b - a) % per_tile:
            raise ValueError(f"internvl: an image run of {b - a} tokens is not whole tiles of {per_tile} tokens")
        n = (b - a) // per_tile
        rows = patches[at: at + n][:, groups].reshape(n * per_tile, k * k * width)
        out.append((rows, per_tile, {"grid_thw": (n, side, side)}))
        at += n
    return {"image": out, "video": []}


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
    if config.family in QWEN:
        out["mm_token_type_ids"] = np.concatenate(kinds)[None]
        unit = config.vision.merge ** 2
        for modality, pixel_key, grid_key in MODALITIES:
            if pixels[modality]:
                rows = np.concatenate(pixels[modality])
                out[pixel_key] = rows.reshape(rows.shape[0] * unit, rows.shape[1] // unit)
                out[grid_key] = np.array(grids_[modality], np.int64)
        if seconds:
            out["second_per_grid_ts"] = np.array(seconds, np.float32)
    elif pixels["image"]:
        v = config.vision
        k, (ph, pw), (h, w) = v.shuffle, v.patch_size, v.image_size
        side = h // ph
        groups = shuffle_groups(side, k)
        rows = np.concatenate(pixels["image"])
        per_tile = groups.shape[0]
        tiles = rows.shape[0] // per_tile
        patches = np.empty((tiles, side * side, rows.shape[1] // (k * k)), np.float32)
        patches[:, groups] = rows.reshape(tiles, per_tile, k * k, -1)
        px = patches.reshape(tiles, side, w // pw, v.channels, ph, pw).transpose(0, 3, 1, 4, 2, 5)
        out["pixel_values"] = px.reshape(tiles, v.channels, h, w)
    return out
