"""The tiny example's tokenizer and processor files of a Qwen-VL family (`dhp_jax.data.example`)."""

from __future__ import annotations

import dataclasses
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
TOKENIZER = dict(image_token="<|image_pad|>", video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                 vision_end_token="<|vision_end|>")
# the placeholders' names in `tiny_config`'s token_ids
TOKEN_NAMES = {"image": "<|image_pad|>", "video": "<|video_pad|>", "vision_start": "<|vision_start|>",
               "vision_end": "<|vision_end|>"}
CLIP_MEAN_LIST = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD_LIST = [0.26862954, 0.26130258, 0.27577711]


@dataclasses.dataclass(frozen=True)
class ExampleFiles:
    """`processor_class`, chat `template`, image / video processor configs and processor extras of
    the tiny example; the tokenizer's `specials` and the `tokenizer` config entries naming them;
    `token_names`: the placeholders `tiny_config` takes ids of; `published_extra`: the processor
    extras the released models' files imply; `accepts_image_seq_length`: the processor takes a
    tokens-per-tile setting."""

    processor_class: str
    template: str
    image: dict[str, Any]
    video: dict[str, Any]
    extra: dict[str, Any]
    specials: list[str]
    tokenizer: dict[str, str]
    token_names: dict[str, str]
    published_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    accepts_image_seq_length: bool = False    # `write_processor_files(image_seq_length=)` applies
