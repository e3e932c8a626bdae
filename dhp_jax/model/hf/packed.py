"""The Hugging Face families on a packed, padded, zigzag-permuted group stream (what a DHP group runs).

Two streams per group, sharded alike over the group's devices:

- the LLM stream: S = bucket slots, the group's samples packed and permuted exactly as
  `dhp_jax.geometry.layout.pack_group` packs them (`real_slots`: same zigzag, same pad tails). Each
  slot carries its token id, whether it is a vision token, the decoder ids (segment = 1 + sample,
  0 = padding; position = offset in the sample: causal), the sample's own rotary positions
  (`meta["positions"]`, [n, 3] M-RoPE or [n, 1]) and its shifted label (target = label of the next
  token of the same sample, weight 1 unless that label is -100, as transformers shifts them);
- the vision stream: `unit` rows per LLM slot (S * unit rows), holding the encoder inputs of that
  slot's token *before* the merge: the merge**2 patches the Qwen merger joins (unit = merge**2), or
  the k*k patches InternVL's pixel shuffle joins plus one row for the tile's CLS token on the
  tile's first token (unit = k*k + 1; the row is dead on the others). Text and padding slots have
  dead vision rows (segment 0: they attend nowhere and nothing reads them). So the encoder runs on
  4x (or 5x) the LLM vision tokens, the merge is a reshape of a device's own rows, and the merged
  features (and the DeepStack features) land on the very slots of the tokens they replace or are
  added to, whatever the degree, the permutation and the attention kind: no data moves between
  the encoder and the LLM. Per vision row: the patch's (row, column) in its frame (2-D RoPE), its
  frame / tile id and Qwen2.5-VL window id (segments, unique in the group), the Qwen3-VL position
  table taps and weights, the InternVL position-table row.

Masks read ids only (`dhp_jax.model.attention`), so every attention function (dense, ring,
Ulysses, hybrid) gives the result of the unpacked sample. This module is NumPy only (the torch
backend packs with it too); the JAX forward pass over the streams is `packed_forward`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from dhp_jax.data.sample import Sample
from dhp_jax.geometry.layout import GROWTH, MIN_BUCKET, bucket_length, real_slots, zigzag_permutation
from dhp_jax import models
from dhp_jax.model.hf.config import HFConfig

IGNORE = -100
# int columns of the LLM stream (then the rotary axes), and of the vision stream
LLM_INTS = ("token_ids", "vision", "segment", "position", "target")
VISION_INTS = ("frame", "window", "row", "col", "tap0", "tap1", "tap2", "tap3", "table", "cls")
TAPS = 4


def _hf(config: HFConfig):
    return models.spec(config.family).engine_module("hf")


def rope_axes(config: HFConfig) -> int:
    """Rotary position axes of the family's LLM: 3 (M-RoPE) or 1 (its `ROPE_AXES`)."""
    return int(_hf(config).ROPE_AXES)


def patch_dim(config: HFConfig) -> int:
    """Width of one encoder patch row (C*(T*)P*P; the family's `patch_dim`)."""
    return int(_hf(config).patch_dim(config))


def unit(config: HFConfig) -> int:
    """Vision rows per LLM slot: the patches one LLM token merges (InternVL: + the CLS row; the
    family's `unit`)."""
    return int(_hf(config).unit(config))


@dataclasses.dataclass(frozen=True, eq=False)
class FamilyLayout:
    """One group's two streams (see the module docstring), permuted and padded to `bucket` slots.
    `llm_ints` int32[S, 5 + axes], `llm_floats` float32[S, 1] (loss weight), `vision_ints`
    int32[S * unit, 10], `vision_floats` float32[S * unit, patch_dim + 4] (pixels, tap weights)."""

    degree: int
    bucket: int
    num_tokens: int
    num_loss_tokens: int
    permutation: np.ndarray
    real_index: np.ndarray
    llm_ints: np.ndarray
    llm_floats: np.ndarray
    vision_ints: np.ndarray
    vision_floats: np.ndarray

    def inputs(self) -> tuple[np.ndarray, ...]:
        """The arrays a group program takes, in order (each sharded over the group along axis 0)."""
        return self.llm_ints, self.llm_floats, self.vision_ints, self.vision_floats


def _where(sample: Sample, index: int) -> str:
    return f"sample {sample.sample_id if sample.sample_id is not None else index!r}"


def _vision_rows(config: HFConfig, seg: Any, where: str, bases: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """(ints [k, unit, 10], floats [k, unit, patch_dim + 4]) of one vision segment of k LLM tokens,
    filled by the family's `vision_rows`; `bases` holds the group's frame / window counters
    (advanced there)."""
    k, u, width = seg.num_tokens, unit(config), patch_dim(config)
    grid = seg.meta.get("grid_thw")
    if seg.pixels is None or grid is None:
        raise ValueError(f"{where}: a {seg.modality} segment needs pixels and meta['grid_thw'] "
                         f"(a Sample made by hf.sample_from_inputs)")
    pixels = np.asarray(seg.pixels, np.float32)
    ints = np.zeros((k, u, len(VISION_INTS)), np.int32)
    floats = np.zeros((k, u, width + TAPS), np.float32)
    col = {name: i for i, name in enumerate(VISION_INTS)}
    models.spec(config.family).engine_module("hf").vision_rows(config, seg, grid, pixels, ints, floats, col, bases,
                                                                where)
    return ints, floats


def pack_family_group(samples: Sequence[Sample], degree: int, config: HFConfig, *, bucket: int | None = None,
                      min_bucket: int = MIN_BUCKET, growth: float = GROWTH) -> FamilyLayout:
    """Pack `samples` (made by `hf.sample_from_inputs`) for a group of `degree` devices; raises
    ValueError naming the sample and segment on a missing payload, position or label mismatch."""
    degree = int(degree)
    if degree < 1:
        raise ValueError(f"degree must be >= 1, got {degree}")
    if not samples:
        raise ValueError("pack_family_group needs at least one sample")
    n = sum(s.num_tokens for s in samples)
    bucket = bucket_length(n, degree, min_bucket, growth) if bucket is None else int(bucket)
    if bucket < n or bucket % (2 * degree):
        raise ValueError(f"bucket {bucket} cannot hold {n} tokens split in 2*{degree} chunks")
    axes, u, vocab = rope_axes(config), unit(config), config.vocab_size
    llm = np.zeros((n, len(LLM_INTS) + axes), np.int32)
    weights = np.zeros((n, 1), np.float32)
    vis_i = np.zeros((n, u, len(VISION_INTS)), np.int32)
    vis_f = np.zeros((n, u, patch_dim(config) + TAPS), np.float32)
    bases = {"frame": 0, "window": 0}
    off = 0
    for si, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise TypeError(f"group sample {si} is a {type(s).__name__}, not a Sample")
        where, start = _where(s, si), off
        labels = []
        for gi, seg in enumerate(s.segments):
            k, sl = seg.num_tokens, slice(off, off + seg.num_tokens)
            pos = seg.meta.get("positions")
            if pos is None:
                raise ValueError(f"{where} segment {gi}: no meta['positions'] (a Sample made by hf.sample_from_inputs)")
            pos = np.asarray(pos).reshape(k, -1)
            if pos.shape[1] != axes:
                raise ValueError(f"{where} segment {gi}: positions have {pos.shape[1]} axes, "
                                 f"{config.family} needs {axes}")
            config.text.check_positions(pos, f"{where} segment {gi}")
            llm[sl, len(LLM_INTS):] = pos
            if seg.is_vision:
                llm[sl, 1] = 1
                vis_i[sl], vis_f[sl] = _vision_rows(config, seg, f"{where} segment {gi}", bases)
                lab = seg.meta.get("labels")
                labels.append(np.full(k, IGNORE, np.int64) if lab is None else np.asarray(lab, np.int64))
            else:
                if seg.token_ids is None:
                    raise ValueError(f"{where} segment {gi} (text) has no token_ids")
                t = np.asarray(seg.token_ids, np.int64)
                if k and (t.min() < 0 or t.max() >= vocab):
                    raise ValueError(f"{where} segment {gi}: a token id is outside the vocabulary [0, {vocab})")
                llm[sl, 0] = t
                lab = seg.meta.get("labels")
                labels.append(t if lab is None else np.asarray(lab, np.int64))
            if labels[-1].shape != (k,):
                raise ValueError(f"{where} segment {gi}: labels have shape {labels[-1].shape}, expected ({k},)")
            off += k
        lab = np.concatenate(labels)
        if np.any((lab != IGNORE) & ((lab < 0) | (lab >= vocab))):
            raise ValueError(f"{where}: a label is outside the vocabulary [0, {vocab}) and is not {IGNORE}")
        llm[start:off, 2] = si + 1
        llm[start:off, 3] = np.arange(off - start)
        nxt = lab[1:]                                  # token i predicts the label of token i + 1
        keep = nxt != IGNORE
        llm[start:off - 1, 4] = np.where(keep, nxt, 0)
        weights[start:off - 1, 0] = keep
    slots = real_slots(n, bucket, degree)

    def place(x: np.ndarray) -> np.ndarray:
        out = np.zeros((bucket,) + x.shape[1:], x.dtype)
        out[slots] = x
        return out

    return FamilyLayout(degree, bucket, n, int(weights.sum()), zigzag_permutation(bucket, degree), slots,
                        place(llm), place(weights), place(vis_i).reshape(bucket * u, -1),
                        place(vis_f).reshape(bucket * u, -1))
