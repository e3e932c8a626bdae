"""Reading images (Pillow) and videos (PyAV): sizes from headers first, pixels only when asked.

The planner needs token counts before anything is decoded, so `image_size` opens a file lazily
(Pillow reads the header only) and `video_info` reads the container's stream metadata; `load_image`
and `load_video_frames` decode. Every failure is a `MediaError` naming the file as the caller
wrote it, so a bad sample can be reported against its manifest line.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import IO, Sequence, Union

import numpy as np

Source = Union[str, os.PathLike, bytes]  # a path, or the file's bytes (a webdataset member, a parquet cell)


class MediaError(ValueError):
    """A media file that cannot be read. `kind`: "missing", "corrupt" or "no_frames"."""

    def __init__(self, kind: str, name: str, message: str):
        self.kind, self.name = kind, name
        super().__init__(f"{name}: {message}")


@dataclasses.dataclass(frozen=True)
class VideoInfo:
    """A video stream's metadata, as transformers' PyAV reader reports it: `total_frames` is the
    stream's frame count and `fps` its average rate."""

    total_frames: int
    fps: float
    width: int
    height: int

    @property
    def duration(self) -> float:
        return self.total_frames / self.fps if self.fps else 0.0


def _open(src: Source, name: str) -> IO[bytes] | str:
    if isinstance(src, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(src))
    path = os.fspath(src)
    if not os.path.exists(path):
        raise MediaError("missing", name, "file not found")
    return path


def image_size(src: Source, name: str | None = None) -> tuple[int, int]:
    """(width, height) from the image header, without decoding the pixels."""
    from PIL import Image, UnidentifiedImageError

    name = name or _name(src)
    f = _open(src, name)
    try:
        with Image.open(f) as im:
            return int(im.width), int(im.height)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError("corrupt", name, f"not a readable image ({e})") from None


def load_image(src: Source, name: str | None = None):
    """The decoded image as an RGB `PIL.Image`, and its original mode.

    Non-RGB images are converted, not refused: transparency is composited onto white (what the
    families' processors do), palette, grey, CMYK and 16-bit images go through Pillow's convert.
    """
    from PIL import Image, UnidentifiedImageError

    name = name or _name(src)
    f = _open(src, name)
    try:
        with Image.open(f) as im:
            im.load()
            mode = im.mode
            if "A" in im.getbands() or im.info.get("transparency") is not None:
                rgba = im.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                rgb = Image.alpha_composite(white, rgba).convert("RGB")
            elif mode == "RGB":
                rgb = im.copy()
            elif mode in ("I;16", "I;16B", "I;16L", "I"):  # 16/32-bit grey: scale to 8 bits
                a = np.asarray(im, dtype=np.float64)
                top = 65535.0 if mode.startswith("I;16") else max(float(a.max()), 1.0)
                rgb = Image.fromarray(np.clip(a / top * 255.0 + 0.5, 0, 255).astype(np.uint8)).convert("RGB")
            else:
                rgb = im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise MediaError("corrupt", name, f"not a readable image ({e})") from None
    return rgb, mode


def video_info(src: Source, name: str | None = None) -> VideoInfo:
    """Frame count, frame rate and frame size from the container, without decoding."""
    import av

    name = name or _name(src)
    f = _open(src, name)
    try:
        with av.open(f) as c:
            if not c.streams.video:
                raise MediaError("no_frames", name, "the file has no video stream")
            s = c.streams.video[0]
            frames, rate = int(s.frames or 0), s.average_rate
            if frames <= 0 and rate:  # containers that store no frame count (WebM, some MKV): from the duration
                seconds = float(s.duration * s.time_base) if s.duration else (c.duration or 0) / 1e6
                frames = int(round(seconds * float(rate)))
            info = VideoInfo(frames, float(rate) if rate else 0.0, int(s.width), int(s.height))
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError) as e:
        raise MediaError("corrupt", name, f"not a readable video ({e})") from None
    if info.total_frames <= 0 or info.width <= 0 or info.height <= 0:
        raise MediaError("no_frames", name, "the video stream has no frames")
    if info.fps <= 0:
        raise MediaError("corrupt", name, "the video stream has no frame rate")
    return info


def load_video_frames(src: Source, indices: Sequence[int], name: str | None = None) -> np.ndarray:
    """Frames at `indices` (decode order, 0-based) as uint8 [len(indices), H, W, 3] RGB.

    Decodes from the start up to the last index, as transformers' PyAV reader does; an index past
    the decoded frames repeats the last decoded frame (a stream whose header over-counts frames).
    """
    import av

    name = name or _name(src)
    want = [int(i) for i in indices]
    if not want:
        raise MediaError("no_frames", name, "no frame indices to decode")
    f = _open(src, name)
    picked: dict[int, np.ndarray] = {}
    last, last_frame = None, None
    wanted, end = set(want), max(want)
    try:
        with av.open(f) as c:
            if not c.streams.video:
                raise MediaError("no_frames", name, "the file has no video stream")
            for i, frame in enumerate(c.decode(video=0)):
                if i > end:
                    break
                if i in wanted:
                    picked[i] = frame.to_ndarray(format="rgb24")
                last, last_frame = i, frame
            tail = picked[last] if last in picked else (
                last_frame.to_ndarray(format="rgb24") if last_frame is not None else None)
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError) as e:
        raise MediaError("corrupt", name, f"not a decodable video ({e})") from None
    if tail is None:
        raise MediaError("no_frames", name, "the video decodes to no frames")
    out = [picked.get(i, tail) for i in want]
    return np.stack(out)


def _name(src: Source) -> str:
    return "<bytes>" if isinstance(src, (bytes, bytearray, memoryview)) else os.fspath(src)
