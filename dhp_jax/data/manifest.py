"""Streaming reader of JSONL dataset manifests: one training sample per line, as token counts.

Accepted records (one JSON object per line; unknown keys are ignored):

- LLaVA-style: `{"id": .., "image": "a.jpg" | ["a.jpg", "b.jpg"], "width": 640, "height": 480,
  "conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", "value": ".."}]}`.
  Sizes may also be given per image as `"image_sizes": [[w, h], ...]`, or images as objects
  `{"path": .., "width": .., "height": ..}`. Without a size, the file is opened with Pillow (header
  only); paths are relative to `image_root` (default: the manifest's folder). "images" is
  accepted for "image" (and "videos" for "video").
- Video: `{"video": "clip.mp4", "duration": 12.3, "fps": 30, "resolution": "1280x720",
  "conversations": [..]}`; `"width"`/`"height"` or `[w, h]` for the resolution; `"num_frames"` with
  `"fps"` instead of a duration; `"video"` may be a list of such objects.
- Text: `"conversations"` (`from`/`value`), `"messages"` (`role`/`content`) or a plain `"text"`.

Text tokens: a tokenizer when one is given (a callable, or a `tokenizer.json` path loaded with the
`tokenizers` package, or the `DHP_TOKENIZER` environment variable naming one), else an estimate
(see `estimate_text_tokens`). Vision tokens follow the family's rules (vision.py).

Bad lines raise `ManifestError` naming the line and the field; with `skip_bad=True` they are
counted in `ManifestStats`. A missing image file whose size the manifest gives is counted and
reported, not fatal. Lines are streamed: memory does not grow with the manifest.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Iterator

import numpy as np

from dhp_jax.data.sample import Sample, Segment
from dhp_jax.data.vision import VisionRules, vision_rules

try:  # a faster JSON parser when present; the standard library otherwise (same results)
    import orjson as _json_fast

    def _loads(line: bytes) -> Any:
        return _json_fast.loads(line)
    _JSON_ERRORS: tuple[type[Exception], ...] = (_json_fast.JSONDecodeError, UnicodeDecodeError)
except ImportError:  # pragma: no cover - depends on the environment
    import json as _json_std
    import json.scanner as _json_scanner

    # The C scanner behind json.loads, called directly: json.loads spends about half its time
    # on encoding detection and argument checks that a UTF-8 JSONL line does not need.
    _scan_once = _json_scanner.make_scanner(_json_std.JSONDecoder())

    def _loads(line: bytes) -> Any:
        s = line.decode("utf-8")
        start = len(s) - len(s.lstrip())
        try:
            obj, end = _scan_once(s, start)
        except StopIteration:
            raise ValueError("expecting a JSON value") from None
        if s[end:].strip():
            raise ValueError(f"extra data after the JSON value at column {end + 1}")
        return obj
    _JSON_ERRORS = (ValueError, UnicodeDecodeError)

# Choice: chat-template tokens around each turn (role marker, start/end tokens), as in the
# Qwen/InternVL chat templates ("<|im_start|>user\n ... <|im_end|>\n" is about 4-5 tokens).
TURN_OVERHEAD_TOKENS = 4
# Choice: ~4 characters per token for ASCII (English BPE rule of thumb) and ~1.5 for other
# characters (CJK and accented text split into more tokens per character).
ASCII_CHARS_PER_TOKEN = 4  # an integer: the hot path divides with integer arithmetic
OTHER_CHARS_PER_TOKEN = 1.5
_PLACEHOLDERS = ("<image>", "<video>")
MAX_REPORTED = 10  # error messages / missing paths kept in the stats
_CACHE_LIMIT = 200_000  # shared video segments kept before the cache is reset (bounds memory)


class ManifestError(ValueError):
    """A manifest line that cannot be read: names the line (1-based) and the field."""

    def __init__(self, line: int, field: str | None, message: str, path: str | None = None):
        self.line, self.field, self.message = line, field, message
        where = f"{path}:" if path else ""
        what = f" field {field!r}:" if field else ""
        super().__init__(f"{where}line {line}:{what} {message}")


@dataclasses.dataclass
class ManifestStats:
    """Counters filled while a manifest streams."""

    lines: int = 0            # non-blank lines seen
    samples: int = 0
    skipped: int = 0          # bad lines skipped (skip_bad=True)
    missing_images: int = 0   # image files absent although the manifest gave their size
    images_read: int = 0      # image sizes read from files
    errors: list[str] = dataclasses.field(default_factory=list)
    missing_paths: list[str] = dataclasses.field(default_factory=list)
    text_counter: str = "estimate"


def estimate_text_tokens(text: str) -> int:
    """Tokens of `text` without a tokenizer: ASCII chars / 4 + other chars / 1.5, rounded up."""
    if text.isascii():
        return math.ceil(len(text) / ASCII_CHARS_PER_TOKEN)
    other = sum(1 for c in text if ord(c) > 127)
    return math.ceil((len(text) - other) / ASCII_CHARS_PER_TOKEN + other / OTHER_CHARS_PER_TOKEN)


def text_counter(tokenizer: str | Callable[[str], int] | None = None) -> tuple[Callable[[str], int], str]:
    """(count function, description). None: `DHP_TOKENIZER` if set, else the estimate."""
    if tokenizer is None:
        tokenizer = os.environ.get("DHP_TOKENIZER") or None
    if tokenizer is None:
        return estimate_text_tokens, f"estimate ({ASCII_CHARS_PER_TOKEN:g} ASCII chars/token)"
    if callable(tokenizer):
        return tokenizer, getattr(tokenizer, "__name__", "callable")
    if os.path.isfile(tokenizer):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(f"tokenizer file {tokenizer!r} needs the 'tokenizers' package, which is not installed") from None
        tok = Tokenizer.from_file(tokenizer)
        return (lambda s: len(tok.encode(s, add_special_tokens=False).ids)), f"tokenizers:{tokenizer}"
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"tokenizer {tokenizer!r} is not a file and 'transformers' is not installed") from None
    hf = AutoTokenizer.from_pretrained(tokenizer)
    return (lambda s: len(hf.encode(s, add_special_tokens=False))), f"transformers:{tokenizer}"


class _LineParser:
    """Turns one parsed JSON record into a `Sample`; caches immutable segments to stay fast."""

    def __init__(self, rules: VisionRules, image_root: str, count_text: Callable[[str], int],
                 stats: ManifestStats, check_files: bool):
        self.rules, self.count_text = rules, count_text
        self.root = os.path.join(image_root, "")  # with a trailing separator: paths are appended
        self.stats, self.check_files = stats, check_files
        self._images: dict[tuple[int, int], Segment] = {}
        self._texts: dict[int, Segment] = {}
        self._videos: dict[tuple, Segment] = {}

    # --- text -----------------------------------------------------------------------------
    def text_tokens(self, rec: dict, line: int) -> int:
        turns = rec.get("conversations")
        key, text_key = "conversations", "value"
        if turns is None and "messages" in rec:
            turns, key, text_key = rec["messages"], "messages", "content"
        if turns is None:
            text = rec.get("text", "")
            if not isinstance(text, str):
                raise ManifestError(line, "text", f"must be a string, got {type(text).__name__}")
            return self.count_text(text) if text else 0
        if not isinstance(turns, list):
            raise ManifestError(line, key, f"must be a list of turns, got {type(turns).__name__}")
        total = TURN_OVERHEAD_TOKENS * len(turns)
        count, estimate = self.count_text, self.count_text is estimate_text_tokens
        for i, turn in enumerate(turns):
            value = turn.get(text_key) if type(turn) is dict else None
            if type(value) is not str:
                raise ManifestError(line, f"{key}[{i}].{text_key}", "missing or not a string")
            if "<" in value:
                for p in _PLACEHOLDERS:
                    value = value.replace(p, "")
            if estimate and value.isascii():  # inlined estimate: the hot path of big manifests
                total += -(-len(value) // ASCII_CHARS_PER_TOKEN)
            else:
                total += count(value)
        return total

    # --- images ---------------------------------------------------------------------------
    def image_items(self, rec: dict, img: Any, key: str, line: int) -> list[tuple[Any, Any, Any, str]]:
        """(path, width, height, field) per image of `rec[key]`."""
        if type(img) is str and "image_sizes" not in rec:  # the common LLaVA line, kept fast
            return [(img, rec.get("width"), rec.get("height"), key)]
        if isinstance(img, (str, dict)):
            img = [img]
        if not isinstance(img, list) or not img:
            raise ManifestError(line, key, "must be a path, an object or a non-empty list")
        sizes = rec.get("image_sizes")
        if sizes is not None and (not isinstance(sizes, list) or len(sizes) != len(img)):
            raise ManifestError(line, "image_sizes", f"must be a list of {len(img)} [width, height] pairs")
        items = []
        for i, it in enumerate(img):
            field = key if len(img) == 1 else f"{key}[{i}]"
            if isinstance(it, dict):
                items.append((it.get("path"), it.get("width"), it.get("height"), field))
            elif sizes is not None:
                wh = sizes[i]
                if not isinstance(wh, list) or len(wh) != 2:
                    raise ManifestError(line, f"image_sizes[{i}]", "must be [width, height]")
                items.append((it, wh[0], wh[1], field))
            elif len(img) == 1:
                items.append((it, rec.get("width"), rec.get("height"), field))
            else:
                items.append((it, None, None, field))
        return items

    def image_segment(self, path: Any, w: Any, h: Any, field: str, line: int) -> Segment:
        if path is not None and not isinstance(path, str):
            raise ManifestError(line, field, f"path must be a string, got {type(path).__name__}")
        if w is None or h is None:
            if (w is None) != (h is None):
                raise ManifestError(line, "height" if h is None else "width", "given without its pair")
            if path is None:
                raise ManifestError(line, field, "has neither a path nor a size")
            full = path if path.startswith("/") else self.root + path
            try:
                from PIL import Image
                with Image.open(full) as im:  # reads the header only
                    w, h = im.size
            except FileNotFoundError:
                raise ManifestError(line, field, f"file {full!r} not found and no width/height given") from None
            except Exception as e:  # Pillow raises several types for unreadable files
                raise ManifestError(line, field, f"cannot read the size of {full!r}: {e}") from None
            self.stats.images_read += 1
        else:
            _check_pixels(w, "width", line)
            _check_pixels(h, "height", line)
            if self.check_files and path is not None:
                full = path if path.startswith("/") else self.root + path
                if not os.path.exists(full):
                    self.stats.missing_images += 1
                    if len(self.stats.missing_paths) < MAX_REPORTED:
                        self.stats.missing_paths.append(f"line {line}: {full}")
        key = (int(w), int(h))
        seg = self._images.get(key)
        if seg is None:
            try:
                n = self.rules.image_tokens(*key)
            except ValueError as e:
                raise ManifestError(line, field, str(e)) from None
            seg = self._images[key] = Segment("image", n, meta={"width": key[0], "height": key[1],
                                                                "family": self.rules.name})
        return seg

    # --- videos ---------------------------------------------------------------------------
    def video_segment(self, v: Any, rec: dict, field: str, line: int) -> Segment:
        src = v if isinstance(v, dict) else rec
        if not isinstance(v, (dict, str)):
            raise ManifestError(line, field, "must be a path or an object")
        fps = src.get("fps")
        if fps is not None and not _positive(fps):
            raise ManifestError(line, "fps", f"must be a positive number, got {fps!r}")
        dur = src.get("duration", src.get("duration_s"))
        if dur is None:
            nf = src.get("num_frames")
            if nf is None or fps is None:
                raise ManifestError(line, "duration", "missing (give duration, or num_frames with fps)")
            if not _positive(nf):
                raise ManifestError(line, "num_frames", f"must be a positive number, got {nf!r}")
            dur = nf / fps
        elif not _positive(dur):
            raise ManifestError(line, "duration", f"must be a positive number of seconds, got {dur!r}")
        w, h = src.get("width"), src.get("height")
        res = src.get("resolution")
        if res is not None:
            w, h = _parse_resolution(res, line)
        if w is None or h is None:
            raise ManifestError(line, "resolution", "missing (give resolution \"WxH\" or width and height)")
        _check_pixels(w, "width", line)
        _check_pixels(h, "height", line)
        key = (float(dur), int(w), int(h), float(fps) if fps else None)
        seg = self._videos.get(key)
        if seg is None:  # segments are immutable: clips of the same shape share one
            try:
                t = self.rules.video(*key)
            except ValueError as e:
                raise ManifestError(line, field, str(e)) from None
            if len(self._videos) > _CACHE_LIMIT:
                self._videos.clear()
            seg = self._videos[key] = Segment(
                "video", t.num_tokens, tokens_per_frame=t.tokens_per_frame,
                meta={"duration_s": key[0], "width": key[1], "height": key[2], "fps": key[3],
                      "frames": t.frames, "units": t.units, "family": self.rules.name})
        return seg

    # --- one record -----------------------------------------------------------------------
    def sample(self, rec: Any, line: int, sample_id: int | str, source: str | None) -> Sample:
        if not isinstance(rec, dict):
            raise ManifestError(line, None, f"expected a JSON object, got {type(rec).__name__}")
        segs: list[Segment] = []
        key, img = "image", rec.get("image")
        if img is None:  # both spellings are in use
            key, img = "images", rec.get("images")
        if img is not None:
            for path, w, h, field in self.image_items(rec, img, key, line):
                segs.append(self.image_segment(path, w, h, field, line))
        key, v = "video", rec.get("video")
        if v is None:
            key, v = "videos", rec.get("videos")
        if v is not None:
            vids = v if isinstance(v, list) else [v]
            for i, item in enumerate(vids):
                segs.append(self.video_segment(item, rec, key if len(vids) == 1 else f"{key}[{i}]", line))
        n = self.text_tokens(rec, line)
        if n or not segs:
            seg = self._texts.get(n)
            if seg is None:
                seg = self._texts[n] = Segment("text", n)
            segs.append(seg)
        return Sample(tuple(segs), sample_id=sample_id, source=source)


def iter_manifest(path: str | os.PathLike, vision: str | VisionRules = "qwen-vl", *, skip_bad: bool = False,
                  image_root: str | None = None, tokenizer: str | Callable[[str], int] | None = None,
                  stats: ManifestStats | None = None, check_files: bool = True,
                  limit: int | None = None) -> Iterator[Sample]:
    """Stream the manifest's samples; `sample_id` is the 1-based line number.

    Pass a `ManifestStats` to read counts (skipped lines, missing images) as the stream goes.
    """
    path = os.fspath(path)
    stats = stats if stats is not None else ManifestStats()
    count, stats.text_counter = text_counter(tokenizer)
    parser = _LineParser(vision_rules(vision), image_root or os.path.dirname(os.path.abspath(path)),
                         count, stats, check_files)
    source = os.path.basename(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if limit is not None and stats.samples >= limit:
                break
            if not raw.strip():
                continue
            stats.lines += 1
            try:
                try:
                    rec = _loads(raw)
                except _JSON_ERRORS as e:
                    raise ManifestError(lineno, None, f"invalid JSON ({e})") from None
                sample = parser.sample(rec, lineno, lineno, source)
            except ManifestError as e:
                if not skip_bad:
                    raise ManifestError(e.line, e.field, e.message, path) from None
                stats.skipped += 1
                if len(stats.errors) < MAX_REPORTED:
                    stats.errors.append(str(e))
                continue
            stats.samples += 1
            yield sample


class ManifestSamples(list):
    """The samples of a manifest (a plain list) with the reading stats in `.stats`."""

    stats: ManifestStats


def read_manifest(path: str | os.PathLike, vision: str | VisionRules = "qwen-vl", *, skip_bad: bool = False,
                  image_root: str | None = None, tokenizer: str | Callable[[str], int] | None = None,
                  limit: int | None = None) -> ManifestSamples:
    """All samples of a manifest (or the first `limit`); `.stats` holds skipped/missing counts."""
    stats = ManifestStats()
    out = ManifestSamples(iter_manifest(path, vision, skip_bad=skip_bad, image_root=image_root,
                                        tokenizer=tokenizer, stats=stats, limit=limit))
    out.stats = stats
    return out


_OFFSETS_CACHE: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray]] = {}


def line_offsets(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets and 1-based line numbers of the non-blank lines (int64[N] each).

    One pass over the file, cached by (path, size, mtime): a loader that draws a batch from the
    same manifest every step scans it once.
    """
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    hit = _OFFSETS_CACHE.get(key)
    if hit is None:
        if len(_OFFSETS_CACHE) >= 4:
            _OFFSETS_CACHE.clear()
        hit = _OFFSETS_CACHE[key] = _scan_offsets(path)
    return hit


def _scan_offsets(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    offsets, numbers, pos = [], [], 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                offsets.append(pos)
                numbers.append(lineno)
            pos += len(raw)
    return np.asarray(offsets, dtype=np.int64), np.asarray(numbers, dtype=np.int64)


def draw_manifest(path: str | os.PathLike, num_samples: int, seed: int = 0,
                  vision: str | VisionRules = "qwen-vl", *, image_root: str | None = None,
                  tokenizer: str | Callable[[str], int] | None = None) -> list[Sample]:
    """`num_samples` lines drawn by `seed`: without replacement when the manifest has that many
    lines, with replacement otherwise. `sample_id` is the index in the result, as `make_dataset`
    promises; `source` the manifest path. Bad lines raise: a dataset for planning must be clean."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"manifest {path!r} not found")
    offsets, numbers = line_offsets(path)
    if num_samples and len(offsets) == 0:
        raise ValueError(f"manifest {path!r} has no lines")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(offsets), size=num_samples, replace=num_samples > len(offsets)) if num_samples else []
    stats = ManifestStats()
    count, stats.text_counter = text_counter(tokenizer)
    parser = _LineParser(vision_rules(vision), image_root or os.path.dirname(os.path.abspath(path)),
                         count, stats, check_files=False)
    out = []
    with open(path, "rb") as f:
        for i, k in enumerate(picks):
            f.seek(int(offsets[k]))
            lineno = int(numbers[k])
            try:
                try:
                    rec = _loads(f.readline())
                except _JSON_ERRORS as e:
                    raise ManifestError(lineno, None, f"invalid JSON ({e})") from None
                out.append(parser.sample(rec, lineno, i, path))
            except ManifestError as e:
                raise ManifestError(e.line, e.field, e.message, path) from None
    return out


def _positive(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_pixels(v: Any, field: str, line: int) -> None:
    if type(v) is int and v >= 1:  # the common case, checked first for speed
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 1 or v != int(v):
        raise ManifestError(line, field, f"must be a positive integer number of pixels, got {v!r}")


def _parse_resolution(res: Any, line: int) -> tuple[Any, Any]:
    if isinstance(res, str):
        parts = res.lower().replace("*", "x").split("x")
        if len(parts) == 2:
            try:
                return int(parts[0]), int(parts[1])
            except ValueError:
                pass
    elif isinstance(res, (list, tuple)) and len(res) == 2:
        return res[0], res[1]
    raise ManifestError(line, "resolution", f"must be \"WxH\" or [width, height], got {res!r}")
