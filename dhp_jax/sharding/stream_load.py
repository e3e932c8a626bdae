"""`load_sharded`: a Hugging Face checkpoint read straight into a family executor's sharded master
vector, piece by piece, never whole on the host.

    config = hf.load_config(path)
    ex = PlanExecutor(config, devices=...)
    master = load_sharded(path, ex)          # == ex.shard(hf.load_pretrained(path)[1]), bit for bit

The flat layout comes from the safetensors headers (`dhp_jax.model.hf.stream`), so nothing is read
before it is placed. Each device's shard [r S, (r + 1) S) of the fp32 vector is built on that
device, `chunk_elements` at a time: a host chunk is filled from the tensors it overlaps (each read
memory-mapped and converted to fp32 in place, `TensorSource.read`), copied to the device and
written into the device's shard buffer in place (a donated `dynamic_update_slice`); then the next.
The host holds one chunk (fp32) plus what one tensor read maps, whatever the model size; the
checkpoint's bytes stay in the OS page cache. Every chunk has the same shape (the last one of a
shard starts at S - chunk, rewriting a few elements with the same values), so one program per
device does every write. Multi-process: a process fills its own devices' shards.
"""

from __future__ import annotations

import bisect
from typing import Any

import jax
import numpy as np
from jax import lax

from dhp_jax.model.hf.config import HFConfig, read_config_json
from dhp_jax.model.hf.stream import BLOCK_BYTES, abstract_params, checkpoint_sources

CHUNK_ELEMENTS = 1 << 24     # fp32 elements per host chunk (64 MiB)


def chunk_starts(shard: int, chunk: int) -> list[int]:
    """Offsets of the equal chunks that cover [0, shard): every `chunk`, the last at shard - chunk."""
    if shard <= chunk:
        return [0]
    starts = list(range(0, shard - chunk, chunk))
    return starts + [shard - chunk]


def fill(out: np.ndarray, start: int, spans: list[tuple[int, int, Any]], block_bytes: int = BLOCK_BYTES) -> None:
    """out[:] = elements [start, start + len(out)) of the flat vector whose leaves lie at `spans`
    ((flat offset, size, source), in flat order); elements past the last leaf are zero."""
    end = start + out.size
    offsets = [o for o, _, _ in spans]
    j = max(0, bisect.bisect_right(offsets, start) - 1)
    filled = start
    while j < len(spans) and spans[j][0] < end:
        off, size, src = spans[j]
        a, b = max(start, off), min(end, off + size)
        if a < b:
            src.read(a - off, b - off, out[a - start:b - start], block_bytes)
            filled = b
        j += 1
    out[filled - start:] = 0


def load_sharded(path: str, executor: Any, chunk_elements: int = CHUNK_ELEMENTS,
                 block_bytes: int = BLOCK_BYTES) -> jax.Array:
    """The master params fp32[P_pad] of the checkpoint at `path`, sharded over `executor`'s mesh
    (`executor.sharded`), equal to `executor.shard(hf.load_pretrained(path)[1])`. `executor` is a
    family executor (`PlanExecutor(config)` with the checkpoint's `HFConfig`); its flat layout is
    bound to the checkpoint's tree (or checked against the one it has)."""
    config, sources = checkpoint_sources(path)
    if not isinstance(executor.config, HFConfig) or executor.config.family != config.family \
            or dict(executor.config.raw) != dict(read_config_json(path)):
        raise ValueError(f"{path}: its config.json is not the config of this executor "
                         f"(build it with PlanExecutor(hf.load_config({path!r})))")
    if int(chunk_elements) < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    executor.bind(abstract_params(sources))
    layout = executor.layout
    leaves = jax.tree.leaves(sources)
    spans, at = [], 0
    for i in layout.order:
        spans.append((at, layout.sizes[i], leaves[i]))
        at += layout.sizes[i]
    shard = layout.shard_size
    if shard >= 2**31:
        raise ValueError(f"{path}: a device shard of {shard} elements is beyond int32 offsets; use more devices")
    chunk = min(int(chunk_elements), shard)
    starts = chunk_starts(shard, chunk)
    write = jax.jit(lambda buf, x, at: lax.dynamic_update_slice(buf, x, (at,)), donate_argnums=0)
    me = jax.process_index()
    buffers = []
    for r, device in enumerate(executor.ranks.devices):
        if device.process_index != me:
            continue
        buf = jax.jit(lambda: jax.numpy.zeros((shard,), jax.numpy.float32),
                      out_shardings=jax.sharding.SingleDeviceSharding(device))()
        for c in starts:
            host = np.empty((chunk,), np.float32)
            fill(host, r * shard + c, spans, block_bytes)
            buf = write(buf, jax.device_put(host, device), np.int32(c))
            buf.block_until_ready()          # one chunk in flight: the host never queues more
            del host
        buffers.append(buf)
    return jax.make_array_from_single_device_arrays((layout.padded,), executor.sharded, buffers)
