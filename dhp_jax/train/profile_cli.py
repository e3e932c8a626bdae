"""`dhp profile`: time group executables on the current devices, fit the cost model, write JSON.

Example: `dhp profile --out profile.json` then `dhp train planner.cost_profile=profile.json`.
jax is imported inside `run`, after XLA_FLAGS asks for the fake CPU devices (`--cpu-devices`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dhp_jax.planner.cli_args import add_cost_args, add_mllm_arg, cost_model, mllm_preset


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    add_mllm_arg(parser)
    parser.add_argument("--degrees", type=_ints, default=[1, 2, 3, 4, 6, 8], help="group degrees, e.g. 1,2,4,8")
    # rungs of the executor's padding ladder and totals between them (96 -> 128, 384 -> 512): the
    # off-rung points check that the model prices the padded stream, not the real tokens
    parser.add_argument("--lengths", type=_ints, default=[32, 64, 96, 128, 256, 384, 512], help="group token totals")
    parser.add_argument("--packs", type=_ints, default=[1, 2], help="sequences per group at each point")
    parser.add_argument("--kinds", default="ring,ulysses,hybrid",
                        help="attention kinds to time: ring plus any of ulysses, hybrid (every split the heads allow)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per point and pass (minimum kept)")
    parser.add_argument("--passes", type=int, default=3, help="passes over the whole grid (minimum kept)")
    parser.add_argument("--holdout-every", type=int, default=4, help="every k-th point is held out of the fit")
    # the base cost model whose non-fitted fields (memory, bandwidth names) seed the fit
    add_cost_args(parser, model="internvl3-2b", hardware="cpu", ranks_per_node=None)
    parser.add_argument("--base-model", dest="model", help=argparse.SUPPRESS)  # the old spelling of --model
    parser.add_argument("--cpu-devices", type=int, default=8,
                        help="fake CPU devices to create when jax runs on the host (0: leave XLA_FLAGS alone)")
    parser.add_argument("--lanes", type=int, default=None,
                        help="devices whose compute runs at once (default: the host's cores when the devices are "
                             "CPUs, else every device)")
    parser.add_argument("--out", default="profile.json", help="fitted CostModel JSON (report beside it)")
    parser.add_argument("--from-report", default=None, metavar="REPORT",
                        help="refit the measurements saved in a profile report instead of timing again")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _load_report(path: str) -> dict:
    try:
        report = json.loads(open(path).read())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--from-report {path}: cannot read a profile report ({e})") from None
    if not isinstance(report, dict) or not isinstance(report.get("measurements"), list) or not report["measurements"]:
        raise ValueError(f"--from-report {path}: no 'measurements' list (write one with `dhp profile`)")
    return report


def run(args: argparse.Namespace) -> int:
    if args.cpu_devices:
        from dhp_jax.devices import force_cpu_devices

        force_cpu_devices(args.cpu_devices)
    import jax

    from dhp_jax.geometry.layout import GROWTH, MIN_BUCKET
    from dhp_jax.model import MLLMConfig
    from dhp_jax.train.profile import fit_profile, host_cores, load_average, machine_label, write_profile

    args.mllm = mllm_preset(args, "dhp profile")
    model = MLLMConfig.preset(args.mllm)
    n = len(jax.devices())
    if args.from_report:
        # refit saved timings (e.g. after a cost-model change) without timing anything again
        try:
            old = _load_report(args.from_report)
        except ValueError as e:
            print(f"dhp profile: {e}", file=sys.stderr)
            return 2
        measurements = old["measurements"]
        keep = ("machine", "model", "repeats", "passes", "compute_lanes", "load_average_before",
                "load_average_after", "load_average_during", "bucket_min", "bucket_growth", "num_devices", "note")
        extra = {k: old[k] for k in keep if k in old}
        extra["refit_from"] = str(args.from_report)
        n = int(old.get("num_devices", n))
        lanes = args.lanes if args.lanes is not None else old.get("compute_lanes")
        bucket_min, growth = int(old.get("bucket_min", MIN_BUCKET)), float(old.get("bucket_growth", GROWTH))
    else:
        too_big = [d for d in args.degrees if d > n]
        if too_big:
            print(f"dhp profile: degrees {too_big} exceed the {n} devices available", file=sys.stderr)
            return 2
        lanes = args.lanes
        if lanes is None and jax.devices()[0].platform == "cpu":
            lanes = host_cores()
        measurements, bucket_min, growth = _time_grid(args, model)
        extra = {"machine": machine_label(), "model": args.mllm, "repeats": args.repeats, "passes": args.passes,
                 "num_devices": n, "compute_lanes": lanes, "bucket_min": bucket_min, "bucket_growth": growth,
                 "load_average_before": args.load_before, "load_average_after": load_average()}
    # the profiled model's own gradient size and head count; the executor's padding ladder and the
    # host's parallelism are structure, not fitted figures; the rest of the base is refitted
        raw = f"{args.out}.measurements.json"
        with open(raw, "w") as f:  # kept until the fit is written: a failed fit loses no timings
            json.dump({**extra, "measurements": measurements}, f, indent=1)
    base = cost_model(args.cost or args.model, args.hardware, ranks_per_node=n,
                      grad_bytes=4.0 * model.num_params(), num_heads=model.num_heads,
                      compute_lanes=lanes, bucket_min=bucket_min, bucket_growth=growth)
    cost, report = fit_profile(measurements, base, holdout_every=args.holdout_every)
    extra["label"] = "measured on this machine's devices; fitted with dhp_jax.planner.cost.fit.fit_cost_model"
    path, report_path = write_profile(args.out, cost, report, measurements, extra)
    if not args.from_report:
        os.remove(raw)
    if args.json:
        print(json.dumps({**extra, **{k: v for k, v in report.items() if k != "held_out"},
                          "profile": str(path), "report": str(report_path)}, indent=2, default=float))
    else:
        print(f"profiled {len(measurements)} points on {extra.get('machine')}")
        print(f"held-out mean relative error {100 * report['held_out_mean_rel_error']:.1f} % "
              f"(max {100 * report['held_out_max_rel_error']:.1f} %, {report['num_held_out']} points); "
              f"train {100 * report['train_mean_rel_error']:.1f} %")
        print(f"cost model: {path}  (use: dhp train planner.cost_profile={path})")
        print(f"report:     {report_path}")
    return 0


def _time_grid(args: argparse.Namespace, model) -> tuple[list[dict], int, float]:
    """Time the grid through a real executor; returns (measurements, bucket_min, bucket_growth)."""
    import jax

    from dhp_jax.model import init_params
    from dhp_jax.sharding import PlanExecutor
    from dhp_jax.train.profile import ExecutorTimer, default_points, load_average, measure_points

    executor = PlanExecutor(model, jax.devices())
    params = executor.replicate(init_params(model, jax.random.PRNGKey(0)))
    timer = ExecutorTimer(executor, params, model, repeats=args.repeats)
    points = default_points(args.degrees, args.lengths, packs=args.packs,
                            kinds=[k.strip() for k in args.kinds.split(",") if k.strip()], num_heads=model.num_heads)
    quiet = args.json

    def progress(i, p, s):
        if not quiet:
            print(f"  point {i + 1}/{len(points)}: degree {p.degree} {p.attention}, lengths {list(p.lengths)}: "
                  f"{s * 1e3:.2f} ms",
                  file=sys.stderr)

    args.load_before = load_average()
    measurements = measure_points(points, timer, progress, passes=args.passes)
    return measurements, int(executor.min_bucket), float(executor.growth)
