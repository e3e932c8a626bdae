"""`dhp bench executor`: host-side overhead of a DHP step and its time relative to one static
single-group executable doing the same total work, on the local devices.

On CPU the devices are fake (`--xla_force_host_platform_device_count`) and share the machine's
cores, so every figure here is an overhead figure, never a speed-up: disjoint groups cannot run
faster than one big group when all devices are the same few cores.

Phases of a DHP step (host wall time, medians over `--repeats` steps after warm-up):
- layout: plan checks + `pack_group` of every group (NumPy);
- lookup: executable cache lookups of the plan's keys;
- dispatch: sub-mesh param views, input `device_put`, executable launches (asynchronous);
- reduce: assembling per-device partials into full-mesh arrays + launching the reduction;
- step: the whole `loss_and_grads` until results are ready.
The static reference: the same samples packed once as one degree-N group, inputs already on the
devices, its executable + the same reduction, timed until ready.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any


from dhp_jax.data.synthetic import random_samples
from dhp_jax.devices import force_cpu_devices
from dhp_jax.geometry.layout import pack_group
from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan

PLANS = {
    "3+5": [[(0, 1, 2), "a"], [(3, 4, 5, 6, 7), "b"]],
    "1+2+5": [[(0,), "a"], [(1, 2), "a"], [(3, 4, 5, 6, 7), "b"]],
    "8x1": [[(i,), "a"] for i in range(8)],
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", default="3+5", choices=sorted(PLANS), help="group shape (default 3+5)")
    parser.add_argument("--lengths", default="300,180,120,90,60,40,30,20,12,6,3,1",
                        help="comma-separated sample lengths (tokens) of the batch")
    parser.add_argument("--repeats", type=int, default=15, help="timed steps (default 15)")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices if jax is not yet imported")
    parser.add_argument("--full-opt", action="store_true",
                        help="compile with XLA's default backend optimisation (the CPU default is level 0)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")


def _split(lengths: list[int], groups: list) -> list[list[int]]:
    """Greedy longest-first assignment of samples to groups, weighted by group degree."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    load = [0.0] * len(groups)
    out: list[list[int]] = [[] for _ in groups]
    for i in order:
        g = min(range(len(groups)), key=lambda j: (load[j] + lengths[i]) / len(groups[j][0]))
        out[g].append(i)
        load[g] += lengths[i]
    return out


def _say(text: str, enabled: bool) -> None:
    if enabled:
        print(f"dhp bench executor: {text}", file=sys.stderr, flush=True)


def bench(plan_name: str = "3+5", lengths: list[int] | None = None, repeats: int = 15,
          compiler_options: dict[str, Any] | None = None, progress: bool = False) -> dict[str, Any]:
    """Host-side overhead of one DHP step on the local devices; `progress` says each phase on stderr."""
    import jax  # lazy: `dhp bench --help` and the target table stay jax-free

    from dhp_jax.model import MLLMConfig, init_params
    from dhp_jax.sharding.executor import PlanExecutor, pack_inputs

    lengths = list(lengths or [300, 180, 120, 90, 60, 40, 30, 20, 12, 6, 3, 1])
    n_dev = len(jax.devices())
    shape = PLANS[plan_name]
    if max(max(r) for r, _ in shape) >= n_dev:
        raise SystemExit(f"plan {plan_name} needs 8 devices, found {n_dev}")
    config = MLLMConfig.preset("tiny")
    samples = random_samples(config, lengths, seed=0)
    parts = _split(lengths, shape)
    plan = Plan(n_dev, (MicroBatch(tuple(Group(tuple(r), len(r), tuple(p)) for (r, _), p in zip(shape, parts)
                                         if p)),))
    ex = PlanExecutor(config, compiler_options=compiler_options)
    params = ex.replicate(init_params(config, jax.random.key(0)))
    _say(f"compiling the {len(plan.groups)} group programs of plan {plan_name} and warming up ...", progress)
    jax.block_until_ready(ex.loss_and_grads(params, samples, plan))          # compile + warm up
    _say(f"timing {repeats} DHP steps ...", progress)

    t = {k: [] for k in ("layout", "lookup", "dispatch", "reduce", "step")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        work = ex.prepare(samples, plan)
        t1 = time.perf_counter()
        for w in work:
            ex.executable(params, w.layout.degree, w.layout.bucket, w.devices, w.attention)
        t2 = time.perf_counter()
        rows = ex.dispatch(ex.flat_params(params), work.local)       # one micro-batch
        t3 = time.perf_counter()
        out = ex.state.finish(ex.state.accumulate(None, rows))
        t4 = time.perf_counter()
        jax.block_until_ready(out)
        t5 = time.perf_counter()
        for k, a, b in (("layout", t0, t1), ("lookup", t1, t2), ("dispatch", t2, t3), ("reduce", t3, t4),
                        ("step", t0, t5)):
            t[k].append(b - a)

    # Static reference: all samples as one degree-N group, inputs placed once, no per-step layout.
    _say(f"compiling and timing the static single-group reference (degree {n_dev}, {repeats} steps) ...", progress)
    devs = tuple(jax.devices())
    lay = pack_group(samples, n_dev, config)
    exe = ex.executable(params, n_dev, lay.bucket, devs)
    cp = jax.sharding.NamedSharding(ex.ranks.submesh(devs), jax.sharding.PartitionSpec("cp"))
    ints, floats = (jax.device_put(a, cp) for a in pack_inputs(lay))
    flat = ex.flat_params(params)
    view = ex._views(flat, [(devs, "ring")])[(devs, "ring")]

    def static_step():
        stats, grads = exe(view, ints, floats)
        rows = {s.device: s.data for s in grads.addressable_shards}
        return ex.state.finish(ex.state.accumulate(None, {s.device: (s.data, rows[s.device])
                                                          for s in stats.addressable_shards}))

    jax.block_until_ready(static_step())
    ts = []
    for _ in range(repeats):
        a = time.perf_counter()
        jax.block_until_ready(static_step())
        ts.append(time.perf_counter() - a)

    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    host = med["layout"] + med["lookup"] + med["dispatch"] + med["reduce"]
    static_ms = statistics.median(ts) * 1e3
    return {
        "label": "CPU-measured on fake devices sharing the host cores: overhead figures, not speed-ups",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "devices": n_dev,
                    "device_kind": jax.devices()[0].device_kind,
                    "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "model": "tiny", "plan": plan_name, "degrees": [g.degree for g in plan.groups],
        "lengths": lengths, "total_tokens": int(sum(lengths)), "repeats": repeats,
        "median_ms": {k: round(v, 3) for k, v in med.items()},
        "host_overhead_ms": round(host, 3),
        "host_overhead_share": round(host / med["step"], 4),
        "static_single_group_ms": round(static_ms, 3),
        "dhp_over_static_time": round(med["step"] / static_ms, 4),
        "num_compiles": ex.num_compiles,
        "compiler_options": ex.compiler_options,
    }


def run(args: argparse.Namespace) -> int:
    force_cpu_devices(args.devices)
    lengths = [int(x) for x in str(args.lengths).split(",") if x.strip()]
    res = bench(args.plan, lengths, args.repeats, {} if args.full_opt else None, progress=True)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    m = res["median_ms"]
    print(f"DHP step, plan {res['plan']} (degrees {res['degrees']}), {res['total_tokens']} tokens, "
          f"tiny model, {res['repeats']} repeats; {res['label']}")
    print(f"  median step {m['step']:.2f} ms: layout {m['layout']:.2f}, lookup {m['lookup']:.3f}, "
          f"dispatch {m['dispatch']:.2f}, reduce {m['reduce']:.2f} ms (host)")
    print(f"  host overhead share {res['host_overhead_share']:.1%}")
    print(f"  static single-group (degree {res['machine']['devices']}) {res['static_single_group_ms']:.2f} ms; "
          f"DHP/static time {res['dhp_over_static_time']:.2f}")
    return 0
