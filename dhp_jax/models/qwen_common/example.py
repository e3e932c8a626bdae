"""The tiny example's tokenizer and processor files of a Qwen-VL family (`dhp_jax.data.example`)."""

from __future__ import annotations

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
TOKENIZER = dict(image_token="<|image_pad|>", video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                 vision_end_token="<|vision_end|>")
# the placeholders' names in `tiny_config`'s token_ids
TOKEN_NAMES = {"image": "<|image_pad|>", "video": "<|video_pad|>", "vision_start": "<|vision_start|>",
               "vision_end": "<|vision_end|>"}
CLIP_MEAN_LIST = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD_LIST = [0.26862954, 0.26130258, 0.27577711]
