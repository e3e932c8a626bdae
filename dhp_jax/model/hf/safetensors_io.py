"""Reading and writing the safetensors format with numpy only (no transformers, no torch).

The format (https://github.com/huggingface/safetensors, "Format"): 8 bytes little-endian u64 N,
N bytes of JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}?}, then the raw little-endian tensor bytes, offsets relative to the end of the header.
Reads are memory-mapped: a tensor's bytes are paged in only when the array is used, so a large
checkpoint is read shard by shard, tensor by tensor. bfloat16 is `ml_dtypes`' numpy dtype (as jax's).
"""

from __future__ import annotations

import functools
import json
import os
import struct
from typing import Any, Iterator, Mapping

import numpy as np


@functools.cache
def _dtypes() -> tuple[dict[str, np.dtype], dict[np.dtype, str]]:
    """(the format's dtype names -> numpy dtypes, the reverse). `ml_dtypes` is imported here, at
    the first read or write, not with the module: its import costs about half a CPU-second, which
    every process of the torch backend (that imports this module and may never read a file) paid."""
    import ml_dtypes

    dtypes = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
              "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
              "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
    return dtypes, {v: k for k, v in dtypes.items()}


def __getattr__(name: str) -> Any:
    """`DTYPES` (the format's dtype names -> numpy dtypes) and `NAMES` (the reverse), built on first use."""
    if name in ("DTYPES", "NAMES"):
        return _dtypes()[name == "NAMES"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > os.path.getsize(path) - 8:
            raise ValueError(f"{path}: header length {n} runs past the end of the file")
        header = json.loads(f.read(n))
    return header, 8 + n


def tensor_infos(path: str) -> Iterator[tuple[str, np.dtype, tuple[int, ...], int]]:
    """(name, dtype, shape, byte offset in the file) of each tensor of one .safetensors file, from
    its header alone (checked: known dtype, byte span matching the shape)."""
    header, start = _header(path)
    header.pop("__metadata__", None)
    dtypes = _dtypes()[0]
    for name, info in header.items():
        if info["dtype"] not in dtypes:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, not one of {sorted(dtypes)}")
        dtype = dtypes[info["dtype"]]
        begin, end = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        if end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} spans {end - begin} bytes, its shape {shape} needs "
                             f"{int(np.prod(shape)) * dtype.itemsize}")
        yield name, dtype, shape, start + begin


def read_file(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for each tensor of one .safetensors file, memory-mapped read-only."""
    infos = list(tensor_infos(path))
    data = np.memmap(path, dtype=np.uint8, mode="r") if infos else None
    for name, dtype, shape, offset in infos:
        yield name, data[offset:offset + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)


def checkpoint_files(path: str) -> list[str]:
    """The .safetensors files of a checkpoint directory (one file, or the shards its index names)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (a directory written by save_pretrained)")


def read_checkpoint(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, memory-mapped array) for every tensor of a checkpoint directory, shard by shard."""
    for file in checkpoint_files(path):
        yield from read_file(file)


def write_file(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` as one .safetensors file (names sorted, 8-byte aligned header)."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    names = _dtypes()[1]
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in names:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors")
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)


def write_checkpoint(path: str, tensors: Mapping[str, np.ndarray], max_shard_bytes: int = 5 * 2**30,
                     sizes: Mapping[str, int] | None = None) -> None:
    """Write a checkpoint directory's weights: one model.safetensors, or shards of at most
    `max_shard_bytes` with the index transformers reads (`model.safetensors.index.json`).
    With `sizes` ({name: bytes}), `tensors` may be a lazy mapping: each tensor is fetched once,
    when its shard is written, so only one shard is ever held."""
    os.makedirs(path, exist_ok=True)
    if sizes is None:
        sizes = {name: np.asarray(t).nbytes for name, t in tensors.items()}
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(sizes):
        if shards[-1] and size + sizes[name] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += sizes[name]
    if len(shards) == 1:
        write_file(os.path.join(path, SINGLE_FILE), {name: tensors[name] for name in shards[0]})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_file(os.path.join(path, file), {name: tensors[name] for name in shard})
        weight_map.update({name: file for name in shard})
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": int(sum(sizes.values()))}, "weight_map": weight_map}, f, indent=2,
                  sort_keys=True)
