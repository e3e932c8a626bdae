"""Input checks shared by every part (imports nothing from the project, so `data` may use it)."""

from __future__ import annotations

from typing import Any

import numpy as np


def positive_int(value: Any, name: str, error: type[Exception] = ValueError) -> int:
    """`value` as an int when it is a positive integer (bool excluded); else `error` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise error(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def lengths_array(lengths: Any) -> np.ndarray:
    """Sequence lengths as float64[K]; a ValueError names the first that is negative or not finite."""
    arr = np.asarray(lengths, dtype=np.float64).reshape(-1)
    if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0):
        bad = int(np.flatnonzero(~np.isfinite(arr) | (arr < 0))[0])
        raise ValueError(f"sequence {bad}: length must be a finite number >= 0, got {arr[bad]}")
    return arr


def etas_array(etas: Any, n: int) -> np.ndarray:
    """Bidirectional shares as float64[n] (None: all 0); a ValueError names the first outside [0, 1]."""
    if etas is None:
        return np.zeros(n)
    arr = np.asarray(etas, dtype=np.float64).reshape(-1)
    if arr.size != n:
        raise ValueError(f"etas has {arr.size} entries for {n} lengths")
    if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0 or arr.max() > 1):
        bad = int(np.flatnonzero(~np.isfinite(arr) | (arr < 0) | (arr > 1))[0])
        raise ValueError(f"sequence {bad}: eta must be in [0, 1], got {arr[bad]}")
    return arr
