"""The Qwen-VL encoders' terms of the family program's memory (`dhp_jax.planner.cost.memory`)."""

from __future__ import annotations

from typing import Any


def qwen_encoder_saved(m: Any, v: int, w: int, ff: int) -> int:
    """The block input and its norm output, the rotary tables, q, k, v, the attention output and its
    log-sum-exp, the output again as the projection's input, the residual sum and its norm output,
    the MLP's values."""
    return 4 * v + 2 * m.vision_head_dim + 5 * w + m.vision_heads + ff


def qwen_tail(m: Any, rows: int, v: int, wide: int, mid: int, levels: int) -> tuple[int, int]:
    """The patch merger (its norm's input, one encoder row per row, the merged norm output, exact
    GELU's input, two intermediates and output) and each DeepStack merger (LayerNorm input and
    output, GELU as the merger's), the DeepStack features added to the LLM and the tapped encoder
    states they are made from."""
    return rows * v + wide + 4 * mid + levels * (2 * wide + 4 * mid + m.hidden + rows * v), 0
