"""`dhp bench compiles`: how many programs and executables DHP plans need, and what padding costs.

Plans `--steps` real batches (`make_dataset`, a fresh seed per step) on `--ranks` ranks and counts,
without compiling anything:
- programs: distinct (degree, padded_tokens, attention kind) group programs over the run;
- executables per process: distinct (degree, padded_tokens, ranks, attention) touching each
  process of `--ranks-per-process` ranks (max and median), and their ratio to the programs it runs;
- padded / real tokens summed over every group of every step (the bucket rule's waste);
- simulated step time (the planner's own estimate, `Plan.est_step_time_s`, of the hardware preset,
  pad tokens priced as the executor skips them: `CostModel.geometry.linear_chunk`) with the placement policy
  (`planner.programs.cache.reuse_ranks`) and without it, and without padding (with a menu also unpadded on
  the menu's degrees: the loss split between degrees and padding);
- with a menu whose programs carry their attention kinds (`--kinds`), the programs off the menu.
`--compile` also compiles every program of a small run of the tiny model on 8 fake CPU devices
(`PlanExecutor.executable`, ahead of time) and reports the compile seconds measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

from dhp_jax.data import make_dataset, sample_etas, sample_lengths
from dhp_jax.data.vision import rules_for_model
from dhp_jax.planner import CostModel, plan_batch
from dhp_jax.planner.api import reuse_placement
from dhp_jax.planner.programs.cache import ProgramCache
from dhp_jax.planner.programs.menu import fit_menu
from dhp_jax.train.train_config import DataConfig
from dhp_jax.train.pipeline import DataPipeline


KINDS = ("bucket", "degree", "group")  # --kinds: planner.programs.menu's kind_per, "group" for none


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1000, help="batches planned (default 1000)")
    parser.add_argument("--batch", type=int, default=512, help="global batch size (default 512)")
    parser.add_argument("--ranks-per-process", type=int, default=8, help="ranks one process drives (default 8)")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--model", default="internvl3-8b")
    parser.add_argument("--hardware", default="ascend-910b")
    parser.add_argument("--dataset", default="openvid")
    parser.add_argument("--growth", type=float, default=None, help="bucket ladder growth (default: the preset's)")
    parser.add_argument("--min-bucket", type=int, default=None, help="smallest bucket (default: the preset's)")
    parser.add_argument("--kind-rule", choices=("program", "group"), default=None,
                        help="attention kinds on the ladder: one per (degree, bucket) program, fixed without data "
                             "(`pricing.program_kind`), or chosen per group (default: the preset's, program)")
    parser.add_argument("--menu", type=int, default=0, metavar="BATCHES",
                        help="fit a menu of programs (planner.programs.menu) on this many calibration batches (other seeds), "
                             "planned on the --growth ladder (default 1.1), and plan with it")
    parser.add_argument("--budget", type=int, default=64, help="programs in the fitted menu (default 64)")
    parser.add_argument("--max-degrees", type=int, default=8,
                        help="degrees the menu keeps, by token mass (plus 1 and --ranks; default 8)")
    parser.add_argument("--kinds", choices=KINDS, default="bucket",
                        help="the menu's attention kinds: one per (degree, bucket) program (default), one per "
                             "degree, or chosen per group (then a program budget does not bound the programs)")
    parser.add_argument("--degrees", choices=("aligned", "any"), default="aligned",
                        help="the menu's degrees: those that tile nodes (divisors and multiples of "
                             "--ranks-per-node; default) or any")
    parser.add_argument("--no-padding-baseline", action="store_true",
                        help="skip re-planning every batch unpadded (the step-time reference of the bucket rule)")
    parser.add_argument("--compile", action="store_true",
                        help="also compile the tiny model's programs on 8 fake CPU devices (measured)")
    parser.add_argument("--json", action="store_true", help="print only JSON")


def cost_for(model: str, hardware: str, ranks_per_node: int, growth: float | None = None,
             min_bucket: int | None = None, kind_rule: str | None = None) -> Any:
    over: dict[str, Any] = {}
    if kind_rule is not None:
        over["kind_rule"] = kind_rule
    if growth is not None:
        over["bucket_growth"] = float(growth)
    if min_bucket is not None:
        over["bucket_min"] = int(min_bucket)
    return CostModel.preset(model, hardware, ranks_per_node=ranks_per_node, **over)


def menu_cost(cost: Any, ranks: int, batches: int, budget: int = 64, batch: int = 512, dataset: str = "openvid",
              max_degrees: int | None = 8, kind_per: str | None = "bucket", degree_set: str = "aligned") -> Any:
    """`cost` with a menu of `budget` programs fitted to `batches` calibration batches (seeds
    10,000,000 + i, never those `plan_run` evaluates) planned with `cost`'s own ladder; each program
    with its one attention kind (`kind_per`, see `planner.programs.menu.fit_menu`; None: chosen per group), on
    `degree_set` degrees ("aligned": those that tile nodes, `planner.programs.menu.aligned_degrees`; "any")."""
    vision = rules_for_model(cost.model)
    if kind_per is None:  # kinds chosen per group, on and off the menu
        cost = cost.replace(kind_rule="group")
    cal = []
    for i in range(batches):
        samples = make_dataset(dataset, batch, 10_000_000 + i, vision=vision)
        cal.append((sample_lengths(samples), sample_etas(samples)))
    # the calibration plans choose kinds per group: a menu's programs replace the ladder's (their kinds
    # are fitted to these groups' kind times, `kind_per`); plans searched on the ladder programs' fixed
    # kinds would fit the menu's buckets to groups that a search on the menu does not form
    return fit_menu(cost.replace(kind_rule="group"), cal, ranks, budget, max_degrees, kind_per,
                    degree_set).apply(cost)


def plan_run(cost: Any, ranks: int, steps: int, batch: int = 512, dataset: str = "openvid",
             ranks_per_process: int | None = 8, unpadded_reference: bool = True, seed: int = 0,
             references: dict | None = None, counts_at: Sequence[int] = ()) -> dict[str, Any]:
    """Plan `steps` batches and count programs, executables and padding (nothing is compiled).
    `references`: a dict shared by runs of one model, hardware, data and ranks, keeping the
    unpadded reference step times (they depend on neither the ladder nor the menu's buckets), so
    that a sweep plans them once. `counts_at`: step counts at which the placement's counts are
    also kept (`placement_at`: {"200": summary after the first 200 batches}), since executables
    per program fall as a run meets its programs again."""
    vision = rules_for_model(cost.model)
    placed, free = ProgramCache(ranks_per_process), ProgramCache(ranks_per_process)
    plain = cost.replace(bucket_min=0, bucket_menu=(), menu_kinds=())  # the reference: no ladder, no menu
    real = padded = 0
    geo = cost.geometry
    menu_degrees = [d for d, _ in geo.bucket_menu]
    t_free, t_placed, t_plain, t_plain_menu, plan_ms = [], [], [], [], []
    at: dict[str, Any] = {}
    for step in range(steps):
        samples = make_dataset(dataset, batch, seed * 1_000_003 + step, vision=vision)
        lengths, etas = sample_lengths(samples), sample_etas(samples)
        t0 = time.perf_counter()
        plan = plan_batch(lengths, ranks, cost, etas=etas, attention="best")
        moved = reuse_placement(plan, lengths, etas, cost, placed, attention="best")
        plan_ms.append((time.perf_counter() - t0) * 1e3)
        free.add(plan)
        if step + 1 in counts_at:
            at[str(step + 1)] = placed.summary()
        t_free.append(plan.est_step_time_s)
        t_placed.append(moved.est_step_time_s)
        real += sum(g.tokens for g in plan.groups)
        padded += sum(g.padded_tokens for g in plan.groups)
        if unpadded_reference:
            t_plain.append(_reference(references, (seed, step, batch, None), lambda: plan_batch(
                lengths, ranks, plain, etas=etas).est_step_time_s))
            if menu_degrees:  # unpadded on the menu's degrees: what the menu's degree bound costs alone
                t_plain_menu.append(_reference(references, (seed, step, batch, tuple(menu_degrees)), lambda: plan_batch(
                    lengths, ranks, plain, etas=etas, degrees=menu_degrees).est_step_time_s))
    out = {"ranks": ranks, "steps": steps, "batch": batch, "dataset": dataset, "model": cost.model,
           "hardware": cost.hardware, "bucket_min": geo.bucket_min, "bucket_growth": geo.bucket_growth,
           "kind_rule": geo.kind_rule,
           "linear_chunk": geo.linear_chunk, "menu": {str(d): list(b) for d, b in geo.bucket_menu} or None,
           "ranks_per_process": ranks_per_process, "padded_over_real": padded / real if real else None,
           "placement": placed.summary(), "no_placement": free.summary(), "placement_at": at,
           "step_s_mean": float(np.mean(t_placed)), "step_s_mean_no_placement": float(np.mean(t_free)),
           "plan_ms_median": float(np.median(plan_ms)),
           "labels": {"step_s": f"simulated, preset {cost.model} on {cost.hardware}",
                      "plan_ms": f"measured on {platform.node()} ({os.cpu_count()} CPUs)"}}
    if t_plain:
        out["step_s_mean_unpadded"] = float(np.mean(t_plain))
        out["step_time_lost"] = out["step_s_mean"] / out["step_s_mean_unpadded"] - 1.0
    if t_plain_menu:  # the loss split: the menu's degrees (unpadded), then the padding on them
        out["step_s_mean_unpadded_menu_degrees"] = float(np.mean(t_plain_menu))
        out["menu_degrees_step_time_lost"] = out["step_s_mean_unpadded_menu_degrees"] / out["step_s_mean_unpadded"] - 1.0
        out["padding_step_time_lost"] = out["step_s_mean"] / out["step_s_mean_unpadded_menu_degrees"] - 1.0
    out["placement_step_time_lost"] = out["step_s_mean"] / out["step_s_mean_no_placement"] - 1.0
    if geo.bucket_menu:
        out["menu_programs"] = sum(len(b) for _, b in geo.bucket_menu)
        out["menu_kinds"] = {f"{d},{b}": k for d, b, k in geo.menu_kinds} or None
        on_menu = {(d, b, k) for d, b, k in geo.menu_kinds}
        out["off_menu_programs"] = len(placed.programs - on_menu) if on_menu else None
    return out


def _reference(cache: dict | None, key: tuple, make: Any) -> float:
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


def compile_run(steps: int = 4, seed: int = 0) -> dict[str, Any]:
    """Compile every program the tiny demo's plans need on 8 fake CPU devices (measured here)."""
    import jax

    from dhp_jax.model import MLLMConfig, init_params
    from dhp_jax.sharding import PlanExecutor

    devices = jax.devices()
    n = min(8, len(devices))
    cfg = MLLMConfig.preset("tiny")
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    cost = CostModel.preset("internvl3-2b", "cpu", ranks_per_node=n)
    ex = PlanExecutor(cfg, devices[:n], min_bucket=cost.geometry.bucket_min, growth=cost.geometry.bucket_growth)
    pipe = DataPipeline(DataConfig(), cfg.vocab_size, cfg.patch_dim)
    by_id = {dev.id: dev for dev in ex.ranks.devices}
    programs = ProgramCache()  # plans placed for reuse, as `dhp train` plans them
    seconds = []
    for step in range(steps):
        batch = pipe.batch(seed + step)
        plan = plan_batch(batch.samples, n, cost, programs=programs)
        for d, p, ids, kind in dict.fromkeys(ex.plan_keys(batch.samples, plan)):
            before, t0 = ex.num_compiles, time.perf_counter()
            ex.executable(params, d, p, tuple(by_id[i] for i in ids), kind)
            if ex.num_compiles > before:
                seconds.append(time.perf_counter() - t0)
    return {"devices": f"{n} x {devices[0].platform}", "model": "tiny", "steps": steps,
            "programs": ex.num_programs, "executables": ex.num_compiles,
            "compile_s_median": statistics.median(seconds) if seconds else None,
            "compile_s_total": sum(seconds), "label": f"measured on {platform.node()} ({os.cpu_count()} CPUs)"}


def run(args: argparse.Namespace) -> int:
    if min(args.ranks, args.steps, args.batch, args.ranks_per_process, args.max_degrees) < 1:
        print("dhp bench compiles: --ranks, --steps, --batch, --ranks-per-process and --max-degrees must be >= 1",
              file=sys.stderr)
        return 2
    if args.menu and args.growth is None:
        args.growth = 1.1
    cost = cost_for(args.model, args.hardware, args.ranks_per_node, args.growth, args.min_bucket, args.kind_rule)
    if args.menu:
        cost = menu_cost(cost, args.ranks, args.menu, args.budget, args.batch, args.dataset, args.max_degrees,
                         kind_per=None if args.kinds == "group" else args.kinds, degree_set=args.degrees)
    out = plan_run(cost, args.ranks, args.steps, args.batch, args.dataset, args.ranks_per_process,
                   not args.no_padding_baseline)
    if args.compile:
        if "jax" not in sys.modules:
            flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count")]
            os.environ["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=8"])
        out["compile"] = compile_run()
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    p, f = out["placement"], out["no_placement"]
    menu = (f" with a menu of {out['menu_programs']} programs"
            f"{' with one attention kind each' if out['menu_kinds'] else ', attention kinds chosen per group'}"
            if out["menu"] else "")
    print(f"dhp bench compiles: {out['steps']} batches of {out['batch']} ({out['dataset']}) on {out['ranks']} ranks, "
          f"{out['model']} on {out['hardware']}, bucket ladder min {out['bucket_min']} growth {out['bucket_growth']}"
          f" (attention kinds per {out['kind_rule']})"
          f"{menu}, pad skipped in chunks of {out['linear_chunk']} (0: computed); "
          f"planning {out['plan_ms_median']:.1f} ms/step median ({out['labels']['plan_ms']})")
    off = f" ({out['off_menu_programs']} off the menu)" if out.get("off_menu_programs") is not None else ""
    print(f"  programs (degree, padded tokens, attention kind): {p['programs']}{off}")
    print(f"  padded / real tokens: {out['padded_over_real']:.3f}")
    print(f"  executables per process ({out['ranks_per_process']} ranks each), max / median: with placement "
          f"{p['executables_per_process_max']} / {p['executables_per_process_median']:g} "
          f"({p['executables_per_program_per_process_max']:.2f}x the programs it runs, max); without "
          f"{f['executables_per_process_max']} / {f['executables_per_process_median']:g} "
          f"({f['executables_per_program_per_process_max']:.2f}x)")
    line = (f"  step time ({out['labels']['step_s']}): {out['step_s_mean']:.3f} s with placement, "
            f"{out['step_s_mean_no_placement']:.3f} s without ({100 * out['placement_step_time_lost']:+.2f} %)")
    if "step_s_mean_unpadded" in out:
        line += (f"; {out['step_s_mean_unpadded']:.3f} s planned and priced unpadded "
                 f"(bucket rule + placement cost {100 * out['step_time_lost']:+.2f} %)")
        if "step_s_mean_unpadded_menu_degrees" in out:
            line += (f"; of which the menu's degrees {100 * out['menu_degrees_step_time_lost']:+.2f} % (unpadded "
                     f"on them: {out['step_s_mean_unpadded_menu_degrees']:.3f} s), padding "
                     f"{100 * out['padding_step_time_lost']:+.2f} %")
    print(line)
    if "compile" in out:
        c = out["compile"]
        print(f"  --compile: {c['programs']} programs, {c['executables']} executables of the tiny model on "
              f"{c['devices']}: {c['compile_s_median']:.1f} s median, {c['compile_s_total']:.1f} s total ({c['label']})")
    return 0
