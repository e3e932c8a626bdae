"""The demo's model: a tiny random config of a family (`model=tiny-qwen2_5_vl`, the default of
`dhp train`; `tiny-qwen3_vl`, `tiny-internvl`), trained on synthetic samples in that family's input
format (`model=tiny` trains the engine's stand-in instead).

The model is `dhp_jax.model.hf` at a tiny width and depth (`demo_config`: the family's config.json,
built without transformers), its weights drawn by `hf.init.random_params` from the run's seed.
The data is the stand-in's (`dhp_jax.train.pipeline.DataPipeline`): the same mix-shaped lengths,
scaled by `data.token_scale`, the same learnable signal (each sample shows one of
`data.num_classes` concepts: its pixels are that concept's prototype plus noise, its caption the
concept's fixed tokens after a two-token cue), written as the family's processor would emit it:

- Qwen2.5-VL: a video of f frames and p tokens a frame is `<|vision_start|>`, f*p video
  placeholders, `<|vision_end|>`, with `video_grid_thw` (f, 2a, 2b) (a*b = p merged 2x2 units,
  a <= b) and one pixel row of C*T*P*P per patch; an image likewise with (1, 2a, 2b).
- Qwen3-VL: the same grid, each frame its own `<|vision_start|>` ... `<|vision_end|>` run.
- InternVL: every frame (or image) is `<img>`, its tiles' placeholders (4 a tile at the
  demo's 8-px tiles: p tokens take ceil(p / 4) tiles), `</img>`, with `pixel_values`
  [tiles, 3, H, W].

The family's part (its model's demo size, how a frame or image is written) is its
`FamilySpec.demo` (`dhp_jax.models.<family>.spec`); any registered family has a demo model
`tiny-<family>`.

Labels are the caption's tokens (the cue and the concept's tokens; -100 elsewhere), shifted
inside as in transformers: the first concept token is predicted from the cue, which must read the
video to name it. Each sample goes through `hf.sample_from_inputs`, so the positions (M-RoPE),
segments and pixels the executor runs are the family's own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dhp_jax import models
from dhp_jax.data.sample import Sample, sample_etas, sample_lengths
from dhp_jax.train.pipeline import Batch, DataPipeline, _step_seed


def demo_models() -> dict[str, str]:
    """The demo's model names -> their family (`model=` / model.preset): `tiny-<family>` of every
    registered family."""
    return {f"tiny-{name}": name for name in models.names()}


def __getattr__(name: str):
    if name == "DEMO_MODELS":
        return demo_models()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# token ids of the vision placeholders and of the vision span's start and end (text ids follow them;
# InternVL's `<img>`/`</img>` are plain text tokens, given the same two ids)
TOKENS = {"image": 1, "video": 2, "vision_start": 3, "vision_end": 4}
FIRST_TEXT = 5
VOCAB = 256


def demo_config(family: str, vocab_size: int = VOCAB) -> dict[str, Any]:
    """The config.json of the demo's tiny model of `family`: `hf.init.tiny_config` (the family's
    own fields: Qwen2.5-VL window and full-attention layers, Qwen3-VL DeepStack, InternVL pixel
    shuffle) at the stand-in's width (LLM 32 wide, 2 layers, 4 query and 2 key/value heads of 8;
    encoder 16 wide, 2 layers) and with small patches."""
    from dhp_jax.model.hf.init import tiny_config

    raw = tiny_config(family, TOKENS, vocab_size)
    raw["text_config"].update(hidden_size=32, intermediate_size=64, head_dim=8)
    rope = raw["text_config"]["rope_parameters"]
    if "mrope_section" in rope:
        rope["mrope_section"] = [2, 1, 1]          # head_dim / 2 = 4 rotary frequencies over (t, h, w)
    v = raw["vision_config"]
    v.update(hidden_size=16, intermediate_size=32)
    # small patches (the family's `demo.shrink`: Qwen 4 px, InternVL 2-px patches of 8-px tiles, 4
    # tokens a tile): the demo's pixel rows stay short, so a batch is cheap to draw and move
    models.spec(family).demo.shrink(raw)
    return raw


class FamilyDemoPipeline(DataPipeline):
    """`pipeline.batch(step) -> Batch` of family samples (see the module docstring)."""

    def __init__(self, cfg: Any, hf_config: Any):
        self.hf = hf_config
        self.demo = models.spec(hf_config.family).demo
        patch = self.demo.setup(self, hf_config)
        super().__init__(cfg, hf_config.text.vocab_size, patch, first_token=FIRST_TEXT)

    def _text(self, ids: np.ndarray, labelled: bool) -> tuple[list, list, list]:
        ids = [int(i) for i in ids]
        return ids, [0] * len(ids), ids if labelled else [-100] * len(ids)

    def _inputs(self, shape: list, concept: int, rng: np.random.Generator) -> tuple[dict, np.ndarray]:
        """(processor-style inputs, labels [1, L]) of one sample of `shape` showing `concept`."""
        cfg = self.cfg
        ids: list[int] = []
        kinds: list[int] = []
        labels: list[int] = []
        rows: dict[str, list] = {"image": [], "video": []}
        grid: dict[str, list] = {"image": [], "video": []}

        def add(i: list, k: list, lab: list) -> None:
            ids.extend(i)
            kinds.extend(k)
            labels.extend(lab)

        def pixels(n: int) -> np.ndarray:
            noise = rng.normal(size=(n, self.patch_dim)).astype(np.float32)
            return self.prototypes[concept][None, :] + np.float32(cfg.noise) * noise

        for j, (modality, n, per_frame) in enumerate(shape):
            if modality == "text":
                if j == len(shape) - 1:   # the cue, then the concept's caption: the labelled part
                    head = self.instruction[-2:][:n]
                    add(*self._text(np.concatenate([head, self.captions[concept, :n - len(head)]]), True))
                else:
                    add(*self._text(self.instruction[:n], False))
                continue
            self.demo.add_vision(self, add, rows, grid, modality, n, per_frame, pixels, TOKENS)
        input_ids = np.array([ids], np.int64)
        inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids)}
        self.demo.finish(inputs, kinds, rows, grid)
        return inputs, np.array([labels], np.int64)

    def batch(self, step: int) -> Batch:
        from dhp_jax.model import hf

        source = self.source_batch(step)
        rng = np.random.default_rng(_step_seed(self.cfg.seed + 1, step))
        concepts = rng.integers(0, self.cfg.num_classes, size=len(source))
        samples: list[Sample] = []
        for i, (src, c) in enumerate(zip(source, concepts)):
            inputs, labels = self._inputs(self.scale_segments(src), int(c), rng)
            samples.append(hf.sample_from_inputs(self.hf, inputs, labels, sample_id=i))
        return Batch(step=step, samples=samples, source_samples=source, lengths=sample_lengths(samples),
                     etas=sample_etas(samples), concepts=concepts)
