"""Reading a processor output (one sample, batch size 1) whatever array type holds it."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np


def as_numpy(x: Any) -> np.ndarray:
    """A processor output (torch tensor, numpy or jax array, list) as a numpy array."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
    return np.asarray(x)


def sample_tokens(inputs: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids int64[L], keep bool[L]) of one sample: `input_ids` [1, L] and its attention mask
    (all kept when absent)."""
    ids = as_numpy(inputs["input_ids"])
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids: shape {ids.shape}, expected [1, L] (one sample)")
    ids = ids[0].astype(np.int64)
    mask = inputs.get("attention_mask")
    keep = np.ones(ids.shape, bool) if mask is None else as_numpy(mask).reshape(-1).astype(bool)
    if keep.shape != ids.shape:
        raise ValueError(f"attention_mask: {keep.shape[0]} tokens, input_ids has {ids.shape[0]}")
    return ids, keep


def vision_scatter_index(input_ids: np.ndarray, token_id: int, count: int, what: str) -> np.ndarray:
    """Token offsets of the `token_id` placeholders, which must number `count` (the features)."""
    where = np.nonzero(input_ids == token_id)[0]
    if len(where) != count:
        raise ValueError(f"{what}: {len(where)} placeholder tokens (id {token_id}) in input_ids, "
                         f"but the encoder makes {count} features")
    return where
