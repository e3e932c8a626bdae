"""What the Qwen families' torch sides share (the torch backend only): the encoder blocks'
tensor-parallel split and their sequence-parallel parameters."""

from __future__ import annotations


# ----------------------------------------------------------------- tensor parallelism (`npu_backend.tensor_parallel`)
def qwen_vision_split(c, params: dict, j: int, t: int, put, out: dict, first: tuple[str, ...], last: str) -> None:
    """The slices tp index j of t holds of each Qwen encoder block: the fused qkv by heads inside
    each of its three parts, proj by columns, the MLP's `first` matrices by rows, `last` by columns."""
    v = c.vision
    hq, d = v.num_heads // t, v.hidden_size // v.num_heads
    for i in range(v.depth):
        b = f"model.visual.blocks.{i}"
        put(f"{b}.attn.qkv", (0, j * hq * d, (j + 1) * hq * d, 3))
        out[f"{b}.attn.proj.weight"] = (1, j * hq * d, (j + 1) * hq * d)
        ff = params[f"{b}.mlp.{first[0]}.weight"].shape[0] // t
        for name in first:
            put(f"{b}.mlp.{name}", (0, j * ff, (j + 1) * ff))
        out[f"{b}.mlp.{last}.weight"] = (1, j * ff, (j + 1) * ff)


def qwen_sequence_locals(c, last: str) -> tuple[list, list]:
    """(block, modules) whose parameters sequence parallelism applies to local rows only: the norms,
    and the row-split matrices' biases; no extra whole parameters."""
    return [(f"model.visual.blocks.{i}", ("norm1", "norm2", "attn.proj", last)) for i in range(c.vision.depth)], []
