"""`reference_loss`: the batch token-mean loss on one device, plain attention, no sharding.

The independent reference every sharded step is checked against: it builds its own unpadded,
unpermuted stream straight from the samples' segments (not through `dhp_jax.geometry.layout`) and
runs the model with dense attention.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from dhp_jax.data.sample import Sample
from dhp_jax.geometry.layout import INT_ARRAYS
from dhp_jax.model.mllm_config import MLLMConfig
from dhp_jax.model.mllm import apply_model, token_loss_sum


def reference_stream(config: MLLMConfig, samples: Sequence[Sample]) -> dict[str, np.ndarray]:
    """The whole batch as one stream (model inputs + targets + loss_weights), sample by sample."""
    cols: dict[str, list] = {k: [] for k in ("token_ids", "pixels", "vision_mask", "segment_ids",
                                             "positions", "span_ids", "frame_ids", "frame_positions",
                                             "targets", "loss_weights")}
    n_span = n_frame = 0
    for si, s in enumerate(samples):
        name = s.sample_id if s.sample_id is not None else si
        kinds: list[bool] = []
        toks: list[int] = []
        for sg in s.segments:
            for j in range(sg.num_tokens):
                if sg.is_vision:
                    if sg.pixels is None:
                        raise ValueError(f"sample {name!r}: {sg.modality} segment has no pixels")
                    tpf = sg.tokens_per_frame or sg.num_tokens
                    cols["pixels"].append(np.asarray(sg.pixels[j], np.float32))
                    cols["token_ids"].append(0)
                    cols["span_ids"].append(n_span + 1)
                    cols["frame_ids"].append(n_frame + 1 + j // tpf)
                    cols["frame_positions"].append(j % tpf)
                    toks.append(0)
                else:
                    if sg.token_ids is None:
                        raise ValueError(f"sample {name!r}: text segment has no token_ids")
                    t = int(sg.token_ids[j])
                    if not 0 <= t < config.vocab_size:
                        raise ValueError(f"sample {name!r}: token id {t} is outside the vocabulary "
                                         f"[0, {config.vocab_size})")
                    cols["pixels"].append(np.zeros(config.patch_dim, np.float32))
                    cols["token_ids"].append(t)
                    cols["span_ids"].append(0)
                    cols["frame_ids"].append(0)
                    cols["frame_positions"].append(0)
                    toks.append(t)
                kinds.append(sg.is_vision)
                cols["vision_mask"].append(sg.is_vision)
                cols["segment_ids"].append(si + 1)
                cols["positions"].append(len(kinds) - 1)
            if sg.is_vision and sg.num_tokens:
                n_span += 1
                n_frame += -(-sg.num_tokens // (sg.tokens_per_frame or sg.num_tokens))
        for j in range(len(kinds)):
            ok = j + 1 < len(kinds) and not kinds[j] and not kinds[j + 1]
            cols["targets"].append(toks[j + 1] if ok else 0)
            cols["loss_weights"].append(1.0 if ok else 0.0)
    out = {k: np.asarray(v) for k, v in cols.items()}
    out["pixels"] = out["pixels"].reshape(-1, config.patch_dim).astype(np.float32)
    out["loss_weights"] = out["loss_weights"].astype(np.float32)
    for k in INT_ARRAYS:
        out[k] = out[k].astype(np.int32)
    out["vision_mask"] = out["vision_mask"].astype(bool)
    return out


@functools.partial(jax.jit, static_argnums=0)
def _loss_sum(config: MLLMConfig, params: Mapping[str, Any], stream: Mapping[str, jax.Array]) -> jax.Array:
    batch = {k: v for k, v in stream.items() if k not in ("targets", "loss_weights")}
    return token_loss_sum(apply_model(config, params, batch), stream["targets"], stream["loss_weights"])


def reference_loss(config: MLLMConfig, params: Mapping[str, Any], samples: Sequence[Sample]) -> jax.Array:
    """Token-mean next-token loss of the batch: sum of text-loss terms / their count.

    Differentiable in `params` (e.g. `jax.value_and_grad(lambda p: reference_loss(c, p, s))`).
    """
    stream = reference_stream(config, samples)
    count = float(stream["loss_weights"].sum())
    if count == 0:
        raise ValueError("the batch has no text token followed by a text token: the loss is undefined")
    return _loss_sum(config, params, stream) / count
