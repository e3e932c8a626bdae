"""The Qwen-VL processors' placeholder tokens: an image is its pad tokens (inside the template's
own `<|vision_start|>`/`<|vision_end|>`), a video its pad tokens (Qwen3-VL: one timestamped run
per temporal patch, `dhp_jax.models.qwen3_vl.spec`)."""

from __future__ import annotations

# token names the processor looks up on the tokenizer, with their defaults
TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
          "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}


class QwenChat:
    tokens = TOKENS

    def placeholders(self, names: dict, token_id) -> tuple[str, str, list[int], list[int]]:
        """(image placeholder, video placeholder, the image's token ids, the video's token ids)."""
        return (names["image_token"], names["video_token"], [token_id(names["image_token"])],
                [token_id(names["video_token"])])

    def image_expansion(self, ct, tokens: int) -> str:
        return ct.image_placeholder * tokens

    def video_expansion(self, ct, plan, image_seq_length: int, merge: int) -> str:
        return ct.video_placeholder * plan.tokens
