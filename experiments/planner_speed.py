"""The planner's solve-time table and its plan guard.

    python -m experiments.planner_speed dump OUT.json [--wide] [--bench]  # the "dhp" plans of a fixed set of batches
    python -m experiments.planner_speed compare A.json B.json
    python -m experiments.planner_speed table BEFORE.json AFTER.json [--commits B A] [--write MD]

`dump` plans a fixed set of (model, mix, ranks, seed) batches from 8 to 1024 ranks (`--wide`: 160
plans more; `--bench`: the 300 batches `dhp bench planner` times, see `bench_batches`) and writes each plan's decisions (`Plan.decisions`) and estimated step time, so that two
commits' plans can be compared exactly (`compare`: the batches whose plans differ with the step-time
ratio of each; it fails when a plan of the second dump is slower than the first's by more than
`SLOWER_TOLERANCE`).
`table` turns two outputs of `dhp bench planner --models all --datasets all --sizes
64:512,1024:4096 --repeats 5 --json` (the same machine, one after the other) into the solve-time
table of experiments/results/planner_targets.md (printed as Markdown, or written over that file's
solve-time section with `--write`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

# (model, mix, ranks, batch, seed): 8 to 1024 ranks, every built-in mix, both model families
BATCHES = [(m, ds, n, b, s)
           for m in ("internvl3-8b", "qwen3-vl-8b", "qwen3-vl-2b")
           for ds, n, b, s in (("openvid", 8, 64, 0), ("llava-mix", 8, 32, 1), ("text-longtail", 16, 64, 2),
                               ("msrvtt", 32, 128, 3), ("internvid", 64, 512, 4), ("openvid", 64, 512, 5),
                               ("llava-mix", 128, 512, 6), ("text-longtail", 256, 1024, 7),
                               ("internvid", 1024, 4096, 8), ("msrvtt", 1024, 4096, 9))]


def wide_batches() -> list[tuple[str, str, int, int, int, str]]:
    """80 more (model, mix, ranks, batch, seed) batches, 8 to 1024 ranks, six models, each planned in
    "best" and "ring" mode (`dump --wide`)."""
    models = ("internvl3-2b", "internvl2.5-4b", "internvl3-8b", "qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b")
    mixes = ("openvid", "internvid", "msrvtt", "llava-mix", "text-longtail")
    cells = [(m, ds, n, b) for n, b in ((8, 32), (8, 64), (16, 128), (24, 96), (32, 256), (64, 512), (128, 512),
                                        (1024, 4096)) for m in models for ds in mixes]
    return [(m, ds, n, b, 100 + i, att) for i, (m, ds, n, b) in enumerate(cells, 1) if i % 3 == 0
            for att in ("best", "ring")]


def bench_batches() -> list[tuple[str, str, int, int, int, str]]:
    """The batches of the solve-time table (`dhp bench planner --models all --datasets all --sizes
    64:512,1024:4096 --repeats 5`: every model preset and mix, seeds 0-4), in "best" mode, as that
    bench plans them (`dump --bench`). A change that keeps the other batches' plans can still move
    these: the search's heuristics decide plans batch by batch."""
    from dhp_jax.data.datasets import DATASETS
    from dhp_jax.planner.cli_args import cost_model
    from dhp_jax.planner.cost.presets import MODELS

    def fits(m: str) -> bool:  # the bench leaves out presets too large for the hardware's memory
        try:
            cost_model(m, "ascend-910b")
        except ValueError:
            return False
        return True

    return [(m, ds, n, b, s, "best") for m in MODELS if fits(m) for ds in DATASETS
            for n, b in ((64, 512), (1024, 4096)) for s in range(5)]


def dump(wide: bool = False, bench: bool = False) -> list[dict[str, Any]]:
    from dhp_jax.data import make_dataset, sample_etas, sample_lengths
    from dhp_jax.planner.api import plan_batch
    from dhp_jax.planner.cli_args import cost_model
    from dhp_jax.planner.contract.plan import PlanningError

    out = []
    for model, ds, ranks, batch, seed, attention in ([b + ("best",) for b in BATCHES]
                                                     + (wide_batches() if wide else [])
                                                     + (bench_batches() if bench else [])):
        cost = cost_model(model, "ascend-910b")
        samples = make_dataset(ds, batch, seed)
        try:
            plan = plan_batch(sample_lengths(samples), ranks, cost, "dhp", etas=sample_etas(samples),
                              attention=attention)
        except PlanningError as e:  # a sample longer than all ranks hold: the same error on both sides
            out.append({"batch": [model, ds, ranks, batch, seed, attention], "decisions": str(e),
                        "step_s": float("nan"), "solve_cpu_ms": 0.0})
            continue
        out.append({"batch": [model, ds, ranks, batch, seed, attention], "decisions": plan.decisions(),
                    "step_s": plan.est_step_time_s, "solve_cpu_ms": plan.solver["solve_cpu_ms"]})
        print(f"{model} {ds} {ranks}/{batch} seed {seed} {attention}: {plan.est_step_time_s:.6f} s, "
              f"{plan.solver['solve_cpu_ms']:.1f} ms", file=sys.stderr)
    return out


SLOWER_TOLERANCE = 1e-3  # a changed plan may be this fraction slower (estimated step time) at most


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]], tolerance: float = SLOWER_TOLERANCE) -> int:
    """Print the batches whose plans differ between two dumps, each with its step-time ratio (B / A),
    and a summary (identical plans, the worst ratio, summed solve thread CPU); 1 when a plan of B is
    slower than A's by more than `tolerance` (estimated step time), else 0."""
    if len(a) != len(b):
        raise ValueError(f"the dumps list {len(a)} and {len(b)} batches")
    diff, worse, worst = 0, 0, 1.0
    for x, y in zip(a, b):
        if x["batch"] != y["batch"]:
            raise ValueError(f"the dumps list other batches: {x['batch']} vs {y['batch']}")
        if x["decisions"] != y["decisions"]:
            diff += 1
            ratio = y["step_s"] / x["step_s"]
            worst = max(worst, ratio)
            bad = not ratio <= 1 + tolerance  # NaN (one side unplannable) counts as slower
            worse += bad
            print(f"plan differs: {x['batch']}: step {x['step_s']:.6f} s -> {y['step_s']:.6f} s, "
                  f"ratio {ratio:.5f}{' (slower beyond the tolerance)' if bad else ''}")
    ta, tb = sum(x["solve_cpu_ms"] for x in a), sum(y["solve_cpu_ms"] for y in b)
    print(f"{len(a) - diff} of {len(a)} plans identical; worst step-time ratio {worst:.5f}; {worse} slower by more "
          f"than {tolerance:.1%}; summed solve thread CPU {ta:.0f} ms -> {tb:.0f} ms")
    return 1 if worse else 0


def table(before: list[dict[str, Any]], after: list[dict[str, Any]], commits: tuple[str, str],
          notes: tuple[str, ...] = ()) -> str:
    from dhp_jax.planner.bench import target_met

    def rows(outs: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
        return {(o["model"], o["dataset"], r["ranks"]): r for o in outs for r in o["results"]}

    rb, ra = rows(before), rows(after)
    keys = sorted({(m, ds) for m, ds, _ in ra})
    sizes = sorted({n for _, _, n in ra})
    lines = ["## Solve time (thread CPU of one global batch, ms: median (max) of 5 batches)", "",
             "`dhp bench planner --models all --datasets all --sizes 64:512,1024:4096 --repeats 5 --json`. Targets: "
             "median <= 5 ms at 64 ranks / 512 samples and <= 20 ms at 1024 / 4096, max <= 2x the median.", "",
             f"Measured at commits {commits[0]} (\"before\") and {commits[1]} (\"after\") on the same machine "
             f"({after[0]['measured_on']}), one after the other; load average at the start of each bench: before "
             f"{', '.join(f'{x:.2f}' for x in before[0]['load_average'])}, after "
             f"{', '.join(f'{x:.2f}' for x in after[0]['load_average'])} (1, 5, 15 min). The machine's cores "
             f"were shared with other work, which inflates thread CPU time too; compare the columns, not the "
             f"absolute figures.", "",
             "| model | mix | " + " | ".join(f"{n}/{ra[keys[0] + (n,)]['batch']} {w}" for n in sizes
                                          for w in ("before", "after")) + " |",
             "|---|---|" + "---|" * (2 * len(sizes))]

    def cell(r: dict[str, Any] | None) -> str:
        return "-" if r is None or "solve_cpu_ms_median" not in r else \
            f"{r['solve_cpu_ms_median']:.1f} ({r['solve_cpu_ms_max']:.1f})"

    for m, ds in keys:
        lines.append(f"| {m} | {ds} | " + " | ".join(cell(rr.get((m, ds, n))) for n in sizes for rr in (rb, ra)) + " |")
    lines.append("")
    for n in sizes:
        med = {w: float(np.median([rr[(m, ds, n)]["solve_cpu_ms_median"] for m, ds in keys]))
               for w, rr in (("before", rb), ("after", ra))}
        met = sum(target_met(ra[(m, ds, n)]) for m, ds in keys if "target_ms" in ra[(m, ds, n)])
        worst = max(ra[(m, ds, n)]["solve_cpu_ms_max"] / ra[(m, ds, n)]["solve_cpu_ms_median"] for m, ds in keys)
        lines.append(f"- {n} ranks: median of the medians {med['before']:.1f} ms before, {med['after']:.1f} ms after; "
                     f"target met on {met} of {len(keys)} (model, mix) rows after; largest max / median after "
                     f"{worst:.2f}.")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--wide", action="store_true", help="80 more batches, each in 'best' and 'ring' mode")
    d.add_argument("--bench", action="store_true", help="the 300 batches of the solve-time table, in 'best' mode")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    t = sub.add_parser("table")
    t.add_argument("before")
    t.add_argument("after")
    t.add_argument("--commits", nargs=2, default=("before", "after"))
    t.add_argument("--write", metavar="MD", help="replace the solve-time section of this results file")
    t.add_argument("--note", action="append", default=[], help="a bullet under the table (repeatable)")
    args = p.parse_args(argv)
    if args.cmd == "dump":
        with open(args.out, "w") as f:
            json.dump(dump(args.wide, args.bench), f)
        return 0
    if args.cmd == "compare":
        with open(args.a) as fa, open(args.b) as fb:
            return compare(json.load(fa), json.load(fb))
    with open(args.before) as fb, open(args.after) as fa:
        text = table(json.load(fb), json.load(fa), tuple(args.commits), tuple(args.note))
    if not args.write:
        print(text)
        return 0
    with open(args.write) as f:
        doc = f.read()
    start = doc.find("## Solve time")
    if start < 0:
        print(f"planner_speed: {args.write} has no '## Solve time' section", file=sys.stderr)
        return 2
    end = doc.find("\n## ", start + 1)
    with open(args.write, "w") as f:
        f.write(doc[:start] + text + "\n" + (doc[end:] if end >= 0 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
