"""The parts of a tiny Qwen-VL config.json both families share (`FamilySpec.tiny_config`)."""

from __future__ import annotations

from typing import Any, Mapping


def qwen_tiny(model_type: str, architecture: str, text: dict, text_extra: dict, vision: dict,
              token_ids: Mapping[str, int]) -> dict[str, Any]:
    return {"model_type": model_type, "architectures": [architecture],
            "text_config": {**text, **text_extra},
            "vision_config": {"model_type": model_type, "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                              "num_heads": 2, "spatial_merge_size": 2, "temporal_patch_size": 2,
                              "out_hidden_size": 64, "in_channels": 3, **vision},
            "image_token_id": token_ids["image"], "video_token_id": token_ids["video"],
            "vision_start_token_id": token_ids["vision_start"], "vision_end_token_id": token_ids["vision_end"],
            "tie_word_embeddings": False}
