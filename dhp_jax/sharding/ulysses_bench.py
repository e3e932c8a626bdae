"""`dhp bench ulysses`: per-device temp memory of Ulysses and hybrid group programs vs the ring.

For each attention kind and degree d, the compiled group program of `PlanExecutor.executable`
(params given as `jax.ShapeDtypeStruct`, nothing allocated) at the same local length S/d, read
from XLA's `memory_analysis()`: Ulysses should stay flat in d (its local attention is tiled, with
a hand-written backward), like a ring whose blocks are tiled. The model is the tiny one with 8
query heads (2 KV heads), so Ulysses runs at d = 2, 4 and 8. Compile-only, on the local devices.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from dhp_jax.devices import force_cpu_devices
from dhp_jax.planner.contract.kinds import attention_kinds


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local-length", type=int, default=128, help="tokens per device (default 128)")
    parser.add_argument("--degrees", default="2,4,8", help="group degrees (default 2,4,8)")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices if jax is not yet imported")
    parser.add_argument("--json", action="store_true", help="print results as JSON")


def measure(local_length: int, degrees: list[int]) -> list[dict[str, Any]]:
    """One row per (kind, degree): temp bytes per device of the compiled group program."""
    import jax

    from dhp_jax.model import MLLMConfig, init_params
    from dhp_jax.sharding import PlanExecutor

    config = MLLMConfig.preset("tiny", num_heads=8, num_kv_heads=2)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    ex = PlanExecutor(config)
    rows = []
    for d in degrees:
        if d > len(ex.ranks.devices) or local_length % 2:
            raise ValueError(f"degree {d} needs {d} devices (have {len(ex.ranks.devices)}) and an even local length")
        devices = tuple(ex.ranks.devices[:d])
        for kind in attention_kinds(d, config.num_heads):
            t0 = time.perf_counter()
            exe = ex.executable(params, d, d * local_length, devices, kind)
            mem = exe.memory_analysis()
            hlo = exe.as_text()
            rows.append({"attention": kind, "degree": d, "local_length": local_length,
                         "temp_bytes": int(mem.temp_size_in_bytes),
                         "all_to_all": hlo.count(" all-to-all("), "collective_permute": hlo.count(" collective-permute("),
                         "compile_s": round(time.perf_counter() - t0, 2)})
    return rows


def run(args: argparse.Namespace) -> int:
    force_cpu_devices(args.devices)
    degrees = [int(x) for x in str(args.degrees).split(",") if x.strip()]
    rows = measure(int(args.local_length), degrees)
    label = "measured: XLA memory_analysis of the compiled group program on this machine's devices (compile only)"
    if args.json:
        print(json.dumps({"label": label, "rows": rows}, indent=2))
        return 0
    print(label)
    print(f"{'attention':>12} {'degree':>6} {'S/d':>5} {'temp MiB':>9} {'all-to-all':>10} {'permutes':>8}")
    for r in rows:
        print(f"{r['attention']:>12} {r['degree']:>6} {r['local_length']:>5} {r['temp_bytes'] / 2**20:9.2f} "
              f"{r['all_to_all']:>10} {r['collective_permute']:>8}")
    return 0
