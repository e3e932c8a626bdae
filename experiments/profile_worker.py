"""Subprocess body of experiment 5: profile group executables on fake CPU devices and fit the cost model.

Runs in its own process because the device count (XLA_FLAGS) must be set before jax is imported.
Uses only the public profiler API (dhp_jax/train/profile.py) and the executor; writes one JSON file.
`python -m experiments.profile_worker OUT.json '{"degrees": [...], ...}'`
"""

from __future__ import annotations

import json
import sys
import time

from dhp_jax.devices import force_cpu_devices


def main(out_path: str, params: dict) -> int:
    devices = int(params.get("devices", 8))
    force_cpu_devices(devices)
    import jax

    from dhp_jax.model import MLLMConfig, init_params
    from dhp_jax.planner import CostModel
    from dhp_jax.sharding import PlanExecutor
    from dhp_jax.train import profile

    config = MLLMConfig.preset(params.get("model_preset", "tiny"))
    devs = jax.devices()[:devices]
    if len(devs) < max(params["degrees"]):
        raise SystemExit(f"profile needs {max(params['degrees'])} devices, {len(devs)} available")
    executor = PlanExecutor(config, devs)
    weights = executor.replicate(init_params(config, jax.random.PRNGKey(int(params.get("seed", 0)))))
    timer = profile.ExecutorTimer(executor, weights, config, repeats=int(params.get("repeats", 3)),
                                  seed=int(params.get("seed", 0)))
    points = profile.default_points(params["degrees"], params["lengths"], packs=tuple(params.get("packs", (1, 2))))
    t0 = time.perf_counter()
    measurements = profile.measure_points(points, timer)
    # The base only seeds the fit's structure; ZeRO over 8 shards keeps its memory check satisfiable
    # on fewer devices (memory is not what this experiment measures).
    # The profiled model's own gradient size and head count, the executor's padding ladder and the
    # host's real parallelism are structure, not fitted figures (the same base `dhp profile` builds).
    from dhp_jax.geometry.layout import GROWTH, MIN_BUCKET

    lanes = profile.host_cores() if devs[0].platform == "cpu" else None
    base = CostModel.preset(params.get("base_model", "qwen3-vl-2b"), "cpu", ranks_per_node=devices,
                            zero_shards=max(8, devices), grad_bytes=4.0 * config.num_params(),
                            num_heads=config.num_heads, compute_lanes=lanes, bucket_min=MIN_BUCKET,
                            bucket_growth=GROWTH)
    cost, report = profile.fit_profile(measurements, base, holdout_every=int(params.get("holdout_every", 4)))
    out = {"machine": profile.machine_label(), "compute_lanes": lanes, "model_preset": config.name if hasattr(config, "name") else "tiny",
           "profile_wall_s": time.perf_counter() - t0, "cost": cost.to_dict(), "report": report,
           "measurements": measurements}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2])))
