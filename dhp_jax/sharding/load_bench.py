"""`dhp bench load`: peak host memory of `load_sharded` on a synthetic bf16 checkpoint of a real layout.

The checkpoint is Qwen3-VL in transformers' layout (`Qwen3VLForConditionalGeneration`'s weight
names and shapes), from the published Qwen3-VL-2B config (`dhp_jax/data/models/qwen3-vl-2b/config.json`)
with its LLM and vision depths scaled so the model has at least `--params` parameters (DeepStack
levels scaled with the vision depth); below what the published widths allow, every width is
halved until a one-layer model fits. The weights are random bf16, written shard by shard
(`--shard-mb` per file, with transformers' index), one shard in memory at a time.

The load runs in a fresh process on `--devices` fake CPU devices: `PlanExecutor(config)`, then
`load_sharded` into the fp32 master vector sharded over all of them. Measured there from
/proc/self/status: `baseline` VmRSS before the load (jax and the executor set up), `peak` VmHWM
of the load (the high-water mark is reset just before it, `clear_refs`), `after` VmRSS once the
sharded state is built. On CPU devices the device memory is host memory, so the peak includes
the state the load produces, fp32[P_pad] = about 2x the bf16 size, which a host with
accelerators would not hold. Reported: `overhead` = peak - baseline - state bytes, what the load
itself holds on the host beyond its result (the target: <= 1.5x the bf16 size), and
`peak_over_baseline` = peak - baseline, everything included. The checkpoint's bytes are read
through the OS page cache, which no process's RSS counts; the pages a read maps while it copies
them do count (at most `BLOCK_BYTES` at a time).

jax and the modules that import it are imported inside the functions the measuring child process
runs: the parent, which writes the checkpoint and starts the child with its device count in the
environment, never imports jax.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any, Mapping

import ml_dtypes
import numpy as np

BASE_MODEL = "qwen3-vl-2b"
GOAL = 1.5


def _scaled(n: int, k: int, floor: int = 1) -> int:
    return max(floor, n // k)


def synthetic_config(params: int, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A Qwen3-VL config.json of at least `params` parameters: the base model's widths divided by
    the smallest power of two whose one-layer model fits, then the fewest LLM layers (vision depth
    and DeepStack levels in the base's proportion) that reach `params`."""
    if base is None:
        from dhp_jax.data.model_configs import model_config
        base = model_config(BASE_MODEL)
    t0, v0 = base["text_config"], base["vision_config"]
    for k in (2 ** i for i in range(12)):
        t = dict(t0, hidden_size=_scaled(t0["hidden_size"], k, 16), intermediate_size=_scaled(t0["intermediate_size"], k, 16),
                 num_attention_heads=_scaled(t0["num_attention_heads"], k), vocab_size=_scaled(t0["vocab_size"], k, 512),
                 num_key_value_heads=_scaled(t0["num_key_value_heads"], k))
        t["num_attention_heads"] -= t["num_attention_heads"] % t["num_key_value_heads"]
        v = dict(v0, hidden_size=_scaled(v0["hidden_size"], k, 16), intermediate_size=_scaled(v0["intermediate_size"], k, 16),
                 num_heads=_scaled(v0["num_heads"], k), out_hidden_size=t["hidden_size"])
        if param_count(_with_depth(base, t, v, 1)) <= params or v["hidden_size"] == 16:
            break
    layers = 1
    while param_count(_with_depth(base, t, v, layers)) < params:
        layers += 1
    return _with_depth(base, t, v, layers)


def _with_depth(base: Mapping[str, Any], t: dict, v: dict, layers: int) -> dict[str, Any]:
    """`base` with widths `t` / `v` (which keep the base's depths) and `layers` LLM layers; the
    vision depth and its DeepStack blocks in the base's proportion."""
    from dhp_jax.model.hf.config import with_depth

    depth = max(1, round(layers * v["depth"] / t["num_hidden_layers"]))
    return with_depth(dict(base, text_config=t, vision_config=v), layers, depth, spread=True)


def weight_shapes(raw: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """{transformers name: shape} of every weight of a config.json dict (`hf.init.weight_shapes`:
    transformers' `state_dict()`, a tied lm_head left out as transformers saves it)."""
    from dhp_jax.model.hf.families import parse_config
    from dhp_jax.model.hf.init import weight_shapes as named_shapes
    return {name: shape for name, (_, shape) in named_shapes(parse_config(raw)).items()}


def param_count(raw: Mapping[str, Any]) -> int:
    return int(sum(int(np.prod(s)) for s in weight_shapes(raw).values()))


class _RandomWeights(Mapping):
    """{name: random bf16 weight}, each made when asked (seeded by its name, N(0, 0.02))."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.shapes = shapes

    def __getitem__(self, name: str) -> np.ndarray:
        n = int(np.prod(self.shapes[name]))
        g = np.random.default_rng(zlib.crc32(name.encode()))
        tile = (0.02 * g.standard_normal(min(n, 1 << 20), np.float32)).astype(ml_dtypes.bfloat16)
        return np.resize(tile, n).reshape(self.shapes[name])

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def write_synthetic(path: str, raw: Mapping[str, Any], shard_bytes: int = 512 * 2**20) -> dict[str, Any]:
    """Write a random bf16 checkpoint of the Qwen3-VL config `raw` (`synthetic_config`) to `path`:
    config.json, safetensors shards of at most `shard_bytes` and their index."""
    from dhp_jax.model.hf import safetensors_io

    raw = dict(raw, dtype="bfloat16")
    shapes = weight_shapes(raw)
    sizes = {name: int(np.prod(s)) * 2 for name, s in shapes.items()}
    os.makedirs(path, exist_ok=True)
    safetensors_io.write_checkpoint(path, _RandomWeights(shapes), shard_bytes, sizes=sizes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2, sort_keys=True)
    return {"params": param_count(raw), "bf16_bytes": sum(sizes.values()), "files": len(safetensors_io.checkpoint_files(path)),
            "text_layers": raw["text_config"]["num_hidden_layers"], "vision_depth": raw["vision_config"]["depth"],
            "hidden": raw["text_config"]["hidden_size"]}


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def measure_child(path: str, chunk: int) -> dict[str, Any]:
    """In this (fresh) process: set up the executor, then load `path` with the HWM reset first."""
    import jax

    from dhp_jax.model import hf
    from dhp_jax.sharding import PlanExecutor
    from dhp_jax.sharding.stream_load import load_sharded

    ex = PlanExecutor(hf.load_config(path))
    base = _status()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                      # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    t0 = time.perf_counter()
    master = load_sharded(path, ex, chunk_elements=chunk)
    master.block_until_ready()
    seconds = time.perf_counter() - t0
    end = _status()
    return {"devices": len(jax.devices()), "padded": int(master.shape[0]), "state_bytes": int(master.shape[0]) * 4,
            "baseline_rss": base["VmRSS"], "peak_rss": end["VmHWM"], "after_rss": end["VmRSS"],
            "after_rss_anon": end.get("RssAnon"), "after_rss_file": end.get("RssFile"), "hwm_reset": reset,
            "load_s": round(seconds, 2)}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=float, default=1e9, help="parameters of the synthetic checkpoint (at least; default 1e9)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a new folder under the temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (default: removed after the bench)")
    parser.add_argument("--out", default=None, help="also write the result as JSON to this file")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices of the loading process (default 8)")
    parser.add_argument("--chunk", type=int, default=None, help="fp32 elements per host chunk (default: load_sharded's)")
    parser.add_argument("--shard-mb", type=float, default=512, help="largest safetensors file, MiB (default 512)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.child:                          # the measuring process
        from dhp_jax.sharding.stream_load import CHUNK_ELEMENTS
        print(json.dumps(measure_child(args.child, args.chunk or CHUNK_ELEMENTS)))
        return 0
    path = args.dir or tempfile.mkdtemp(prefix="dhp-bench-load-")
    try:
        t0 = time.perf_counter()
        ckpt = write_synthetic(path, synthetic_config(int(args.params)), int(args.shard_mb * 2**20))
        ckpt["write_s"] = round(time.perf_counter() - t0, 2)
        env = dict(os.environ)
        from dhp_jax.devices import _set
        _set(env, args.devices)
        env["JAX_PLATFORMS"] = "cpu"
        cmd = [sys.executable, "-m", "dhp_jax", "bench", "load", "--child", path]
        if args.chunk:
            cmd += ["--chunk", str(args.chunk)]
        got = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if got.returncode:
            sys.stderr.write(got.stderr)
            raise RuntimeError(f"dhp bench load: the loading process failed (exit {got.returncode})")
        m = json.loads(got.stdout.strip().splitlines()[-1])
    finally:
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
    b = ckpt["bf16_bytes"]
    overhead = m["peak_rss"] - m["baseline_rss"] - m["state_bytes"]
    result = {"checkpoint": dict(ckpt, path=path if args.keep else None), "load": m,
              "overhead_bytes": overhead, "overhead_ratio": round(overhead / b, 3),
              "peak_over_baseline_ratio": round((m["peak_rss"] - m["baseline_rss"]) / b, 3),
              "state_ratio": round(m["state_bytes"] / b, 3), "goal": GOAL, "meets_goal": overhead / b <= GOAL,
              "load_average": list(os.getloadavg()), "cpus": os.cpu_count()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    mib = 2**20
    print(f"synthetic {BASE_MODEL}-layout checkpoint: {ckpt['params'] / 1e9:.3f} B params, bf16 {b / mib:.0f} MiB in "
          f"{ckpt['files']} files ({ckpt['text_layers']} LLM layers, {ckpt['vision_depth']} vision blocks, "
          f"hidden {ckpt['hidden']}); written in {ckpt['write_s']} s")
    print(f"load_sharded on {m['devices']} CPU devices in {m['load_s']} s: baseline RSS {m['baseline_rss'] / mib:.0f} MiB, "
          f"peak {m['peak_rss'] / mib:.0f} MiB, after {m['after_rss'] / mib:.0f} MiB "
          f"(fp32 sharded state {m['state_bytes'] / mib:.0f} MiB = {result['state_ratio']}x bf16)")
    print(f"load overhead (peak - baseline - state): {overhead / mib:.0f} MiB = {result['overhead_ratio']}x the bf16 size "
          f"(goal <= {GOAL}); peak - baseline = {result['peak_over_baseline_ratio']}x"
          + ("" if m["hwm_reset"] else "  [VmHWM could not be reset: the peak includes the set-up]"))
    return 0
