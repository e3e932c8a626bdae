"""`dhp profile`: time group executables on the current devices, fit the cost model, write JSON.

Example: `dhp profile --out profile.json` then `dhp train planner.cost_profile=profile.json`.
jax is imported inside `run`, after XLA_FLAGS asks for the fake CPU devices (`--cpu-devices`).
"""

from __future__ import annotations

import argparse
import json
import sys


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="MLLMConfig preset to time (default: tiny)")
    parser.add_argument("--degrees", type=_ints, default=[1, 2, 3, 4, 6, 8], help="group degrees, e.g. 1,2,4,8")
    parser.add_argument("--lengths", type=_ints, default=[64, 128, 256, 512], help="group token totals")
    parser.add_argument("--packs", type=_ints, default=[1, 2], help="sequences per group at each point")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per point and pass (minimum kept)")
    parser.add_argument("--passes", type=int, default=2, help="passes over the whole grid (minimum kept)")
    parser.add_argument("--holdout-every", type=int, default=4, help="every k-th point is held out of the fit")
    parser.add_argument("--base-model", default="internvl3-2b",
                        help="cost preset whose non-fitted fields (memory, bandwidth names) seed the fit")
    parser.add_argument("--hardware", default="cpu", help="hardware preset of the base cost model")
    parser.add_argument("--cpu-devices", type=int, default=8,
                        help="fake CPU devices to create when jax runs on the host (0: leave XLA_FLAGS alone)")
    parser.add_argument("--out", default="profile.json", help="fitted CostModel JSON (report beside it)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    if args.cpu_devices:
        from dhp_jax.train.cli import force_cpu_devices

        force_cpu_devices(args.cpu_devices)
    import jax

    from dhp_jax.model import MLLMConfig, init_params
    from dhp_jax.planner import CostModel
    from dhp_jax.sharding import PlanExecutor
    from dhp_jax.train.profile import (ExecutorTimer, default_points, fit_profile, machine_label,
                                       measure_points, write_profile)

    n = len(jax.devices())
    too_big = [d for d in args.degrees if d > n]
    if too_big:
        print(f"dhp profile: degrees {too_big} exceed the {n} devices available", file=sys.stderr)
        return 2
    model = MLLMConfig.preset(args.model)
    executor = PlanExecutor(model, jax.devices())
    params = executor.replicate(init_params(model, jax.random.PRNGKey(0))) if hasattr(executor, "replicate") \
        else jax.device_put(init_params(model, jax.random.PRNGKey(0)), executor.replicated)
    timer = ExecutorTimer(executor, params, model, repeats=args.repeats)
    points = default_points(args.degrees, args.lengths, packs=args.packs)
    quiet = args.json

    def progress(i, p, s):
        if not quiet:
            print(f"  point {i + 1}/{len(points)}: degree {p.degree}, lengths {list(p.lengths)}: {s * 1e3:.2f} ms",
                  file=sys.stderr)

    measurements = measure_points(points, timer, progress, passes=args.passes)
    # the profiled model's own gradient size and head count; the rest of the base is refitted
    base = CostModel.preset(args.base_model, args.hardware, ranks_per_node=n,
                            grad_bytes=4.0 * model.num_params(), num_heads=model.num_heads)
    cost, report = fit_profile(measurements, base, holdout_every=args.holdout_every)
    extra = {"machine": machine_label(), "model": args.model, "repeats": args.repeats, "passes": args.passes,
             "label": "measured on this machine's devices; fitted with dhp_jax.planner.fit.fit_cost_model"}
    path, report_path = write_profile(args.out, cost, report, measurements, extra)
    if args.json:
        print(json.dumps({**extra, **{k: v for k, v in report.items() if k != "held_out"},
                          "profile": str(path), "report": str(report_path)}, indent=2, default=float))
    else:
        print(f"profiled {len(measurements)} points on {extra['machine']}")
        print(f"held-out mean relative error {100 * report['held_out_mean_rel_error']:.1f} % "
              f"(max {100 * report['held_out_max_rel_error']:.1f} %, {report['num_held_out']} points); "
              f"train {100 * report['train_mean_rel_error']:.1f} %")
        print(f"cost model: {path}  (use: dhp train planner.cost_profile={path})")
        print(f"report:     {report_path}")
    return 0
