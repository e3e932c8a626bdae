"""The "DHP against its baselines" section of experiments/results/planner_targets.md.

    python -m experiments.baselines_table run OUT.json          # plan and price every batch
    python -m experiments.baselines_table table OUT.json [--write MD]

The rows of the section's run are experiments/results/planner_baselines.json.

One batch per (model, mix, ranks): `make_dataset(mix, 4 x ranks, 500)`, 8 ranks per node,
ascend-910b presets, ranks 8 to 128. Each batch is planned by "dhp" and the baselines
"static-ring:best", "static-ulysses:best" and "flexsp" (its MILP at its node limit, so every run
gives the same plan), every plan priced by `sim.step_time`; beside them the lower bound of
`sim.bounds.lower_bound`. `table` prints the section as Markdown or writes it over that file's
section with `--write`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

MODELS = ("internvl3-8b", "qwen3-vl-8b")
MIXES = ("openvid", "llava-mix", "text-longtail")
RANKS = (8, 16, 32, 64, 128)
BASELINES = ("static-ring:best", "static-ulysses:best", "flexsp")
SEED = 500
HEADING = "## DHP against its baselines"
LABEL = "simulated (ascend-910b presets, the project's cost model: sim.step_time and sim.bounds.lower_bound)"


def run(baselines: tuple[str, ...] = BASELINES) -> list[dict[str, Any]]:
    from dhp_jax.data import make_dataset, sample_etas, sample_lengths
    from dhp_jax.planner import CostModel, PlanningError, plan_batch
    from dhp_jax.sim import step_time
    from dhp_jax.sim.bounds import lower_bound

    rows = []
    for model in MODELS:
        cost = CostModel.preset(model, "ascend-910b", ranks_per_node=8)
        for mix in MIXES:
            for n in RANKS:
                samples = make_dataset(mix, 4 * n, SEED)
                L, E = sample_lengths(samples), sample_etas(samples)
                try:
                    dhp = plan_batch(L, n, cost, "dhp", etas=E)
                except PlanningError as e:  # a sample longer than all ranks hold
                    print(f"{model} {mix} {n}: skipped ({e})", file=sys.stderr)
                    continue
                row = {"model": model, "mix": mix, "ranks": n, "dhp_s": step_time(dhp, L, cost, E),
                       "chosen": dhp.solver.get("chosen", "dhp")}
                for b in baselines:  # None: no static degree holds the batch's longest sequence
                    try:
                        row[b] = step_time(plan_batch(L, n, cost, b, etas=E), L, cost, E)
                    except PlanningError:
                        row[b] = None
                lb = lower_bound(L, n, cost, E)
                row.update(bound_s=lb.step_s, work_s=lb.work_s, longest_s=lb.longest_s,
                           micro_batch_s=lb.micro_batch_s, allreduce_s=lb.allreduce_s)
                rows.append(row)
                print(f"{model} {mix} {n}: dhp / bound {row['dhp_s'] / lb.step_s:.4f}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = [f"{HEADING} (the project's cost model, `sim.step_time`)", "",
           "`python -m experiments.baselines_table run experiments/results/planner_baselines.json` then "
           "`table experiments/results/planner_baselines.json --write experiments/results/planner_targets.md`. "
           "One batch per (model, mix, ranks): "
           "`make_dataset(mix, 4 x ranks, 500)`, 8 ranks per node, ascend-910b presets. Baselines (`--baselines`): "
           f"{', '.join(sorted({b for r in rows for b in BASELINES if r.get(b) is not None})) or 'none'} "
           "(`flexsp`, when run: its MILP at its node limit). Lower bound: "
           "`sim.bounds.lower_bound` (work with the traffic every plan pays, the micro-batch count by bin "
           "packing, the micro-batch structure of the longest sequences; its module docstring has the proof). "
           "Target: DHP / best baseline <= 1.000 on every batch; DHP / lower bound median <= 1.01.", "",
           "| model | mix | ranks | best baseline | DHP / best | DHP / bound | bound binding | chosen |",
           "|---|---|---|---|---|---|---|---|"]
    ratios, lbs = [], []
    for r in rows:
        have = [b for b in BASELINES if r.get(b) is not None]
        best = min(have, key=lambda b: r[b]) if have else "—"
        ratio, lb = (r["dhp_s"] / r[best] if have else np.nan), r["dhp_s"] / r["bound_s"]
        if have:
            ratios.append(ratio)
        lbs.append(lb)
        terms = {"work": r["work_s"], "longest": r["longest_s"], "structure": r["micro_batch_s"]}
        top = max(terms.values())
        binding = ", ".join(k for k, v in terms.items() if v >= top * (1 - 1e-12))
        vs = f"{ratio:.4f}" if have else "—"
        out.append(f"| {r['model']} | {r['mix']} | {r['ranks']} | {best} | {vs} | {lb:.4f} | {binding} | {r['chosen']} |")
    ratios, lbs = np.asarray(ratios), np.asarray(lbs)
    vs = (f"DHP / best baseline worst {ratios.max():.4f}, {int((ratios > 1).sum())} above 1, median "
          f"{np.median(ratios):.4f} ({ratios.size} batches with baselines); ") if ratios.size else "no baselines run; "
    out += ["", f"- {len(rows)} batches; {vs}DHP / lower bound median {np.median(lbs):.4f}, worst {lbs.max():.4f}."]
    return "\n".join(out) + "\n"


NOTES = "<!-- notes: kept by --write -->"


def write_section(md: Path, text: str) -> None:
    """Replace the section's generated part; its notes (from the NOTES line on) stay."""
    src = md.read_text()
    start = src.index(HEADING)
    nxt = src.find("\n## ", start + len(HEADING))
    end = len(src) if nxt < 0 else nxt
    at = src.find(NOTES, start, end)
    notes = "\n" + src[at:end].rstrip("\n") + "\n" if at >= 0 else ""
    md.write_text(src[:start] + text + notes + src[end:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.baselines_table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("--baselines", default=",".join(BASELINES),
                   help="comma-separated baselines to plan ('' for none: DHP and the bound only)")
    t = sub.add_parser("table")
    t.add_argument("rows")
    t.add_argument("--write", default=None)
    a = p.parse_args(argv)
    if a.cmd == "run":
        rows = run(tuple(b for b in a.baselines.split(",") if b))
        # a result file as the results folder's readers (notebooks/03_paper_figures) expect: a label,
        # the command that made it, then the rows
        Path(a.out).write_text(json.dumps({"label": LABEL, "command": f"python -m experiments.baselines_table run "
                                                                       f"{a.out}", "rows": rows}, indent=1))
        return 0
    text = table(json.loads(Path(a.rows).read_text())["rows"])
    if a.write:
        write_section(Path(a.write), text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
