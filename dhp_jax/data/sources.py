"""Where training records come from: LLaVA-style JSONL, webdataset tar shards, a local Hugging
Face `datasets` directory or parquet files. Each yields `Record`s: the raw JSON-like dict, its
media (paths resolved against the file's folder, or bytes from a shard or a parquet cell) and
where it was found, so a bad record can be named ("train.jsonl:17", "shard-000.tar:key")."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import tarfile
from typing import Any, Iterator

IMAGE_KEYS, VIDEO_KEYS = ("image", "images"), ("video", "videos")
IMAGE_EXTS = {"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff"}
VIDEO_EXTS = {"mp4", "avi", "mkv", "webm", "mov"}


@dataclasses.dataclass
class Media:
    """One image or video of a record: `name` as the data wrote it; `src` a path or bytes."""

    kind: str  # "image" | "video"
    name: str
    src: Any


@dataclasses.dataclass
class Record:
    """A raw sample. `where`: file and 1-based line (JSONL), shard and key, or file and row.
    `error` is set (and `data` empty) when the line itself cannot be read."""

    where: str
    data: dict
    media: list[Media]
    error: str | None = None

    @property
    def sample_id(self) -> str:
        v = self.data.get("id")
        return str(v) if v is not None else self.where


def _media_from_fields(data: dict, root: str, where: str) -> list[Media]:
    out = []
    for kind, keys in (("image", IMAGE_KEYS), ("video", VIDEO_KEYS)):
        for k in keys:
            v = data.get(k)
            if v is None:
                continue
            for it in (v if isinstance(v, list) else [v]):
                if isinstance(it, dict) and it.get("bytes") is not None:
                    out.append(Media(kind, str(it.get("path") or f"{where}:{k}"), bytes(it["bytes"])))
                elif isinstance(it, dict) and it.get("path"):
                    out.append(Media(kind, it["path"], os.path.join(root, it["path"])))
                elif isinstance(it, str):
                    out.append(Media(kind, it, os.path.join(root, it)))
                else:
                    raise ValueError(f"field {k!r}: {type(it).__name__} is not a path or {{'bytes', 'path'}}")
    return out


def iter_jsonl(path: str, media_root: str | None = None) -> Iterator[Record]:
    """Records of a JSONL file; media paths are relative to `media_root` (default: its folder)."""
    root = media_root or os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{name}:{n}"
            try:
                data = json.loads(raw)
                if not isinstance(data, dict):
                    raise ValueError(f"a JSON {type(data).__name__}, not an object")
                yield Record(where, data, _media_from_fields(data, root, where))
            except (ValueError, UnicodeDecodeError) as e:
                yield Record(where, {}, [], error=f"unreadable line ({e})")


def iter_webdataset(pattern: str) -> Iterator[Record]:
    """Records of webdataset tar shards (a path or a glob): members grouped by key (the name up to
    the first dot); `json` holds the record, image/video members its media in name order."""
    paths = sorted(glob.glob(pattern)) or [pattern]
    for path in paths:
        shard = os.path.basename(path)
        groups: dict[str, dict[str, bytes]] = {}
        order: list[str] = []
        with tarfile.open(path) as tf:
            for m in tf:
                if not m.isfile():
                    continue
                base = os.path.basename(m.name)
                key, _, ext = base.partition(".")
                key = os.path.join(os.path.dirname(m.name), key)
                if key not in groups:
                    groups[key] = {}
                    order.append(key)
                groups[key][ext.lower()] = tf.extractfile(m).read()
        for key in order:
            g, where = groups[key], f"{shard}:{key}"
            try:
                data = json.loads(g["json"]) if "json" in g else {}
                if not isinstance(data, dict):
                    raise ValueError("the json member is not an object")
                if "json" not in g and "txt" in g:
                    data = {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": g["txt"].decode()}]}
                data.setdefault("id", key)
            except (ValueError, UnicodeDecodeError) as e:
                yield Record(where, {}, [], error=f"unreadable json member ({e})")
                continue
            media = []
            for ext in sorted(g):
                last = ext.rsplit(".", 1)[-1]
                kind = "image" if last in IMAGE_EXTS else "video" if last in VIDEO_EXTS else None
                if kind:
                    media.append(Media(kind, f"{key}.{ext}", g[ext]))
            yield Record(where, data, media)


def iter_hf_dataset(path: str) -> Iterator[Record]:
    """Records of a local `datasets` directory (save_to_disk) or parquet file(s) (a path or glob).
    Image/video columns may hold paths (relative to the dataset's folder) or {'bytes', 'path'}."""
    import datasets

    if os.path.isdir(path) and not glob.glob(os.path.join(path, "*.parquet")):
        ds = datasets.load_from_disk(path)
        root = path
    else:
        files = sorted(glob.glob(os.path.join(path, "*.parquet") if os.path.isdir(path) else path))
        if not files:
            raise FileNotFoundError(f"{path}: no parquet files")
        ds = datasets.load_dataset("parquet", data_files=files, split="train")
        root = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(files[0]))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    for col, feat in ds.features.items():  # keep media undecoded: bytes/paths, decoded in workers
        if type(feat).__name__ in ("Image", "Video"):
            ds = ds.cast_column(col, type(feat)(decode=False))
    name = os.path.basename(os.path.normpath(path))
    for i, row in enumerate(ds):
        where = f"{name}:row {i}"
        for k in ("conversations", "messages"):
            if isinstance(row.get(k), str):  # a JSON string column
                try:
                    row[k] = json.loads(row[k])
                except ValueError as e:
                    yield Record(where, {}, [], error=f"column {k!r} is not JSON ({e})")
                    break
        else:
            try:
                yield Record(where, row, _media_from_fields(row, root, where))
            except ValueError as e:
                yield Record(where, {}, [], error=str(e))


SOURCE_FIELDS = (("jsonl", "manifest"), ("webdataset", "webdataset"), ("hf", "hf_dataset"))


def source_spec(data_cfg: Any) -> tuple[str, str]:
    """(path or pattern, kind) of the configured fine-tuning data: the `data` section of a run's
    config, as the config object or its JSON dict (what a checkpoint stores)."""
    get = data_cfg.get if isinstance(data_cfg, dict) else lambda k: getattr(data_cfg, k, None)
    for kind, field in SOURCE_FIELDS:
        if get(field):
            return get(field), kind
    raise ValueError("no fine-tuning data: set data.manifest, data.webdataset or data.hf_dataset")


def iter_source(spec: str, kind: str | None = None) -> Iterator[Record]:
    """Records of a manifest (`.jsonl`), shards (`.tar`) or a datasets directory/parquet."""
    kind = kind or ("webdataset" if spec.endswith(".tar") else
                    "jsonl" if spec.endswith((".jsonl", ".json")) else "hf")
    if kind == "jsonl":
        return iter_jsonl(spec)
    if kind == "webdataset":
        return iter_webdataset(spec)
    if kind == "hf":
        return iter_hf_dataset(spec)
    raise ValueError(f"unknown data source kind {kind!r}")
