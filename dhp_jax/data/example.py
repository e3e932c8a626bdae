"""Example data written offline: a tiny tokenizer with the family's chat template and processor
files, and a LLaVA-style JSONL of generated images, short PyAV-encoded videos and conversations.

`write_processor_files(dir, family)` writes what transformers 5 saves next to a checkpoint
(`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`, `processor_config.json` with the
image and video processors nested); `write_example_data(dir, family)` writes `train.jsonl` and its
media. `dhp example` pairs them with a tiny random checkpoint of the family.

The Qwen2.5-VL template is the published one; the Qwen3-VL and InternVL templates keep the
published ones' turn and vision-token layout without their tool-calling and reasoning branches.
"""

from __future__ import annotations

import json
import os

import numpy as np

from dhp_jax import models as registry

# Each family's tokenizer specials, chat template and processor settings of the tiny example (the
# published families' values, with pixel bounds small enough that an image or a short clip is a
# few hundred tokens, a long video of up to 64 sampled frames about 2k) are its
# `FamilySpec.example` (`dhp_jax.models.<family>.spec`).
_WORDS = ("what is in the picture video image a red green blue yellow square circle moves left right up down "
          "there are two three shapes on background the color of it describe this clip frame shows").split()


# The released checkpoints' processor files: a stored model's, as its release publishes them
# (dhp_jax/data/models/<name>/); without a video processor file, the video processor reads the
# image processor's, as transformers does.
_TYPE_KEYS = ("image_processor_type", "video_processor_type", "processor_class", "feature_extractor_type")


def _published(family: str) -> tuple[dict, dict, dict]:
    """(image, video, processor) settings of the family's stored model's processor files."""
    from dhp_jax.data.processors import processor_configs

    spec = registry.spec(family)
    d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", spec.published_model)
    image, video, _ = processor_configs(d)
    strip = lambda c: {k: v for k, v in c.items() if k not in _TYPE_KEYS}   # noqa: E731
    return strip(image), strip(video), dict(spec.example.published_extra)


def write_processor_files(out_dir: str, family: str, vocab_size: int = 512, image_seq_length: int | None = None,
                          published: bool = False) -> None:
    """A tiny BPE tokenizer trained offline plus the family's template and processor configs,
    in the files and layout transformers 5 saves. `published`: the released models' pixel
    bounds and video sampling instead of the tiny example's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    ex = registry.spec(family).example
    cls, template, image_cfg, video_cfg, extra = ex.processor_class, ex.template, ex.image, ex.video, ex.extra
    if published:
        image_cfg, video_cfg, extra = _published(family)
        image_cfg = {"image_processor_type": ex.image["image_processor_type"], **image_cfg}
        video_cfg = {"video_processor_type": ex.video["video_processor_type"], **video_cfg}
    os.makedirs(out_dir, exist_ok=True)
    specials = ex.specials
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(_WORDS, 12)) + f" {i}.{i * 7 % 10} seconds Frame{i % 9}: \n" for i in range(400)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size - len(specials), show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(specials)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "extra_special_tokens": [], "model_max_length": 32768,
           "processor_class": cls}
    cfg.update(ex.tokenizer)
    _dump(os.path.join(out_dir, "tokenizer_config.json"), cfg)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    proc = {"processor_class": cls, "image_processor": image_cfg, "video_processor": video_cfg, **extra}
    if image_seq_length is not None and ex.accepts_image_seq_length:
        proc["image_seq_length"] = int(image_seq_length)
    _dump(os.path.join(out_dir, "processor_config.json"), proc)


def write_image(path: str, width: int, height: int, seed: int, mode: str = "RGB") -> str:
    """A background with a few coloured shapes; `mode` other than RGB tests the conversions."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    im = Image.new("RGB", (width, height), tuple(int(v) for v in rng.integers(0, 256, 3)))
    d = ImageDraw.Draw(im)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(1, width)), y0 + int(rng.integers(1, height))
        d.rectangle((x0, y0, x1, y1), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    if mode != "RGB":
        im = im.convert(mode)
    im.save(path)
    return path


def write_video(path: str, width: int, height: int, frames: int, fps: int, seed: int) -> str:
    """A square moving across a background, encoded with PyAV (MPEG-4 part 2, yuv420p)."""
    import av

    if frames < 1:
        raise ValueError(f"{path}: a video needs at least one frame, got {frames}")
    rng = np.random.default_rng(seed)
    bg = rng.integers(0, 256, 3).astype(np.uint8)
    fg = rng.integers(0, 256, 3).astype(np.uint8)
    side = max(2, min(width, height) // 3)
    with av.open(path, "w") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            a = np.empty((height, width, 3), np.uint8)
            a[:] = bg
            x = int((width - side) * i / max(1, frames - 1))
            a[height // 3:height // 3 + side, x:x + side] = fg
            for pkt in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    return path


def write_example_data(out_dir: str, num_samples: int = 24, seed: int = 0, max_side: int = 300,
                       long_videos: int = 0) -> str:
    """`out_dir/train.jsonl` with images, videos and conversations; returns the JSONL path.

    Every third sample has a short video (8 fps, 2-4 s, sides up to about max_side / 2), the others
    one or two images with sides of 40 px to `max_side`;
    some use `conversations` (LLaVA) and some `messages`; one image in eight is grey or RGBA.
    The last `long_videos` of the `num_samples` records are long videos instead (224 x 224, 8 fps,
    12 to 30 s: with the example's processors up to 64 sampled frames, about 0.8k-2k tokens), the
    long tail beside short captions that real multimodal batches have."""
    if not 0 <= long_videos <= num_samples:
        raise ValueError(f"long_videos must be between 0 and num_samples={num_samples}, got {long_videos}")
    rng = np.random.default_rng(seed)
    media = os.path.join(out_dir, "media")
    os.makedirs(media, exist_ok=True)
    lines = []
    for i in range(num_samples):
        q = " ".join(rng.choice(_WORDS, int(rng.integers(4, 10))))
        a = " ".join(rng.choice(_WORDS, int(rng.integers(3, 20)))) + "."
        rec: dict = {"id": f"sample-{i:04d}"}
        k_long = i - (num_samples - long_videos)
        if k_long >= 0:
            seconds = 12 + 18 * k_long // max(1, long_videos - 1)
            rec["video"] = os.path.relpath(write_video(os.path.join(media, f"v{i:04d}.mp4"), 224, 224, 8 * seconds, 8,
                                                       seed * 1000 + i), out_dir)
            marker = "<video>\n"
        elif i % 3 == 2:
            w, h = (int(rng.integers(4, 11)) * max_side // 300 * 16 // 2 * 2,
                    int(rng.integers(4, 9)) * max_side // 300 * 16 // 2 * 2)
            rec["video"] = os.path.relpath(write_video(os.path.join(media, f"v{i:04d}.mp4"), w, h,
                                                       int(rng.integers(16, 33)), 8, seed * 1000 + i), out_dir)
            marker = "<video>\n"
        else:
            k = 1 + int(i % 5 == 4)
            names = []
            for j in range(k):
                mode = ("L", "RGBA")[i % 2] if i % 8 == 7 else "RGB"
                ext = "png" if mode != "RGB" else "jpg"
                names.append(os.path.relpath(write_image(os.path.join(media, f"i{i:04d}_{j}.{ext}"),
                                                         int(rng.integers(40, max_side)), int(rng.integers(40, max_side)),
                                                         seed * 1000 + i * 10 + j, mode), out_dir))
            if k == 1:
                rec["image"] = names[0]
            else:
                rec["images"] = names
            marker = "<image>\n" * k
        if i % 4 == 1:
            rec["messages"] = [{"role": "user", "content": marker + q}, {"role": "assistant", "content": a}]
        else:
            rec["conversations"] = [{"from": "human", "value": marker + q}, {"from": "gpt", "value": a}]
            if i % 6 == 0:
                rec["conversations"] += [{"from": "human", "value": "and " + q},
                                         {"from": "gpt", "value": " ".join(rng.choice(_WORDS, 5)) + "."}]
        lines.append(json.dumps(rec))
    path = os.path.join(out_dir, "train.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _dump(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
