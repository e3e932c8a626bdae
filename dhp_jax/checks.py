"""Input checks shared by every part (imports nothing from the project, so `data` may use it)."""

from __future__ import annotations

from typing import Any

import numpy as np


def positive_int(value: Any, name: str, error: type[Exception] = ValueError) -> int:
    """`value` as an int when it is a positive integer (bool excluded); else `error` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise error(f"{name} must be a positive integer, got {value!r}")
    return int(value)
