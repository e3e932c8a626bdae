"""Render the result JSONs as Markdown tables inside experiments/REPORT.md.

REPORT.md holds the prose; each table sits between `<!-- table:NAME -->` and `<!-- /table -->` and
is rewritten from experiments/results/NAME.json: `python -m experiments.report` after a regeneration.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

from experiments.runner import REPO, RESULTS_DIR

REPORT = REPO / "experiments" / "REPORT.md"


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _provenance(r: dict[str, Any]) -> str:
    m = r["machine"]
    return (f"*{r['label']}. Config `{r['config_file']}`, seed {r['seed']}, commit {r['versions'].get('dhp_jax_commit')}"
            f"{' (uncommitted changes)' if r['versions'].get('dhp_jax_dirty') else ''}, "
            f"generated {r['created_utc']} in {r['wall_s']:.0f} s on {m['cpu']} ({m['cpu_count']} cores, "
            f"load average {m.get('loadavg_1_5_15')}).*")


def _short(label: str) -> str:
    """'simulated (ascend-910b preset, model, 8x8 ranks)' -> 'simulated (ascend-910b preset)'."""
    head, _, rest = label.partition("(")
    return f"{head}({rest.split(',')[0].rstrip(')')})" if rest else label


def end_to_end(r: dict[str, Any]) -> str:
    strategies = r["config"]["strategies"]
    head = "| model | data | " + " | ".join(f"{s} (s)" for s in strategies) + \
           " | lower bound (s) | best static <degrees> | DHP speed-up vs best static | bound on any speed-up | vs FlexSP-style | how |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in r["rows"]:
        cells = [row["model"], row["dataset"]] + [_fmt(row["step_s"].get(s), ".2f") for s in strategies]
        degs = ",".join(str(d) for d in row.get("best_static_degrees", []))
        cells += [_fmt(row.get("lower_bound_s")), f"{row.get('best_static', '—')} <{degs}>",
                  f"**{_fmt(row.get('speedup_vs_best_static'))}x**", f"{_fmt(row.get('max_attainable_speedup'))}x",
                  f"{_fmt(row.get('speedup_vs_flexsp'))}x", _short(row["label"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scaling(r: dict[str, Any]) -> str:
    lines = ["| ranks | GBS | strategy | step (s) | tokens/s/rank | scaling efficiency | DHP speed-up | utilisation | plan (ms, measured) | how |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['ranks']} | {row['batch']} | {row['strategy']} | {row['step_s']:.2f} | "
                     f"{row['tokens_per_s_per_rank']:.0f} | {row['scaling_efficiency']:.1%} | "
                     f"{_fmt(row.get('dhp_speedup'))}x | {row['utilisation']:.2f} | {row['plan_wall_ms']:.0f} | {_short(row['label'])} |")
    return "\n".join(lines)


def overhead(r: dict[str, Any]) -> str:
    lines = ["| ranks | GBS | solver ms (median / max) | whole scheduling ms (median / max) | simulated step s | scheduling / step | how |",
             "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['ranks']} | {row['batch']} | {row['solver_ms_median']:.1f} / {row['solver_ms_max']:.1f} | "
                     f"{row['scheduling_ms_median']:.1f} / {row['scheduling_ms_max']:.1f} | {row['sim_step_s_mean']:.2f} | "
                     f"{row['scheduling_share_of_step']:.2%} | {r['label']}; step simulated |")
    return "\n".join(lines)


def estimator(r: dict[str, Any]) -> str:
    if not r.get("measured"):
        return f"**Not measured:** {r.get('reason')}"
    lines = ["| model | devices | points (held out) | held-out mean error | median | max | train mean error | how |",
             "|---|---|---|---|---|---|---|---|"]
    for t in r["table"]:
        lines.append(f"| {t['model']} | {r['config']['devices']} fake CPU | {t['points']} ({t['held_out']}) | "
                     f"**{t['mean_rel_error']:.1%}** | {t['median_rel_error']:.1%} | {t['max_rel_error']:.1%} | "
                     f"{_fmt(t['train_mean_rel_error'], '.1%')} | {t['label']} |")
    return "\n".join(lines)


def case_study(r: dict[str, Any]) -> str:
    lines = ["| data | best static (config, micro-batches, s) | DHP groups per micro-batch (degree x count) | DHP s | speed-up | how |",
             "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['dataset']} | {row['baseline']} {row['baseline_config']}, {row['baseline_micro_batches']}, "
                     f"{row['baseline_step_s']:.2f} | {' ; '.join(row['dhp_micro_batches'])} | {row['dhp_step_s']:.2f} | "
                     f"**{row['speedup']:.2f}x** | {_short(row['label'])} |")
    return "\n".join(lines)


def optimality(r: dict[str, Any]) -> str:
    import numpy as np

    small = [x for x in r["small"] if "ratio" in x]
    proven = [x["ratio"] for x in small if x["milp_optimal"]]
    lines = ["| instances | count | median | p90 | max | share within 1 % / 3 % | how |", "|---|---|---|---|---|---|---|"]
    how = _short(r["label"].split(";")[0])
    if proven:
        a = np.asarray(proven)
        lines.append(f"| small, DHP / proven MILP optimum | {a.size} of {len(small)} | {np.median(a):.4f} | "
                     f"{np.percentile(a, 90):.4f} | {a.max():.4f} | {np.mean(a <= 1.01):.0%} / {np.mean(a <= 1.03):.0%} | {how} |")
    unproven = [x for x in small if not x["milp_optimal"]]
    if unproven:
        a = np.asarray([x["ratio"] for x in unproven])
        lines.append(f"| small, MILP hit its time limit: DHP / MILP incumbent | {a.size} of {len(small)} | "
                     f"{np.median(a):.4f} | {np.percentile(a, 90):.4f} | {a.max():.4f} | "
                     f"{np.mean(a <= 1.01):.0%} / {np.mean(a <= 1.03):.0%} | {how} |")
    a = np.asarray([x["dhp_step_s"] / x["lower_bound_s"] for x in small])
    if a.size:
        lines.append(f"| small, DHP / lower bound (all) | {a.size} | {np.median(a):.4f} | {np.percentile(a, 90):.4f} | "
                     f"{a.max():.4f} | {np.mean(a <= 1.01):.0%} / {np.mean(a <= 1.03):.0%} | {how} |")
    for n in sorted({x["ranks"] for x in r["large"]}):
        rs = [x for x in r["large"] if x["ranks"] == n]
        a = np.asarray([x["dhp_over_bound"] for x in rs])
        b = np.asarray([x["static_over_bound"] for x in rs])
        lines.append(f"| {n} ranks, DHP / lower bound (static ring / bound: {np.median(b):.3f}) | {a.size} | "
                     f"{np.median(a):.4f} | {np.percentile(a, 90):.4f} | {a.max():.4f} | "
                     f"{np.mean(a <= 1.01):.0%} / {np.mean(a <= 1.03):.0%} | {how} |")
    if r.get("versus_flexsp"):
        lines = [] if len(lines) == 2 else lines + [""]
        lines += _versus_flexsp(r)
    return "\n".join(lines)


def _versus_flexsp(r: dict[str, Any]) -> list[str]:
    import numpy as np

    rows = r["versus_flexsp"]
    out = ["| data | batches (flexsp / dhp) | dhp / flexsp: geo. mean | worst | dhp / bound (median) | "
           "flexsp / bound (median) | micro-batches dhp / flexsp / token bound | dhp micro-batches over the bound "
           "(+k: batches) | dhp within 1 of the bound | dhp solve median (CPU) | flexsp solve median | how |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for ds in dict.fromkeys(x["dataset"] for x in rows):
        rs = [x for x in rows if x["dataset"] == ds]
        fx = [x for x in rs if "dhp_over_flexsp" in x]
        q = np.asarray([x["dhp_over_flexsp"] for x in fx])
        mbs = " ".join(f"{x['dhp_mb']}/{x['flexsp_mb']}/{x['token_lower_bound_mb']}" for x in fx)
        over = np.asarray([x["dhp_mb"] - x["token_lower_bound_mb"] for x in rs])
        hist = ", ".join(f"+{k}: {int(np.sum(over == k))}" for k in sorted(set(over.tolist())))
        near = int(np.sum(over <= 1))
        vs = (f"{np.exp(np.log(q).mean()):.4f} | {q.max():.4f} | "
              f"{np.median([x['dhp_over_bound'] for x in fx]):.4f} | "
              f"{np.median([x['flexsp_over_bound'] for x in fx]):.4f} | {mbs}") if fx else "— | — | — | — | —"
        fx_s = f"{np.median([x['flexsp_solve_s'] for x in fx]):.1f} s" if fx else "—"
        out.append(f"| {ds}, {rs[0]['ranks']} ranks, GBS {rs[0]['samples']} | {len(fx)} / {len(rs)} | {vs} | {hist} | "
                   f"{near} of {len(rs)} ({near / len(rs):.0%}) | "
                   f"{np.median([x['dhp_solve_ms'] for x in rs]):.1f} ms "
                   f"({np.median([x['dhp_solve_cpu_ms'] for x in rs]):.1f} ms) | "
                   f"{fx_s} | simulated (FlexSP-matched profile) |")
    sm = r.get("solve_ms", {})
    if sm.get("preset_openvid_wall_ms"):
        out.append(f"| openvid, internvl3-8b / ascend-910b preset (solve time only) | — / {len(sm['preset_openvid_wall_ms'])} | "
                   f"— | — | — | — | — | — | — | {np.median(sm['preset_openvid_wall_ms']):.1f} ms "
                   f"({np.median(sm['preset_openvid_cpu_ms']):.1f} ms) | — | measured on this machine |")
    return out


def ablations(r: dict[str, Any]) -> str:
    lines = ["| data | variant | step (s) | vs full DHP | micro-batches | utilisation | how |", "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        if "infeasible" in row:
            lines.append(f"| {row['dataset']} | {row['variant']} | infeasible | — | — | — | {_short(row['label'])} |")
            continue
        lines.append(f"| {row['dataset']} | {row['variant']} | {row['step_s']:.2f} | {row['slowdown_vs_full']:.3f}x | "
                     f"{row['micro_batches']:.1f} | {row['utilisation']:.2f} | {_short(row['label'])} |")
    return "\n".join(lines)


def sensitivity(r: dict[str, Any]) -> str:
    lines = ["| model | inter-node GB/s per rank | DHP (s) | best static (s) | DHP speed-up | how |",
             "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['model']} | {row['inter_node_gbps']:g} | {row['dhp_step_s']:.2f} | "
                     f"{row['best_static']} {row['best_static_step_s']:.2f} | **{row['speedup']:.2f}x** | "
                     f"{_short(row['label'])} |")
    return "\n".join(lines)


def tail_sweep(r: dict[str, Any]) -> str:
    lines = ["| model | data | long-clip share | DHP (s) | best static (s) | DHP speed-up | how |",
             "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        share = f"{row['tail_share']:.1%}" + (" (built-in)" if row["built_in"] else "")
        lines.append(f"| {row['model']} | {row['dataset']} | {share} | {row['dhp_step_s']:.2f} | "
                     f"{row['best_static']} {row['best_static_step_s']:.2f} | **{row['speedup']:.2f}x** | "
                     f"{_short(row['label'])} |")
    return "\n".join(lines)


def attention_choice(r: dict[str, Any]) -> str:
    lines = ["| cost model | model | data | DHP (s) | DHP ring-only (s) | speed-up | multi-rank groups by kind | how |",
             "|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        kinds = ", ".join(f"{k} {n}" for k, n in row["multi_rank_groups"].items())
        lines.append(f"| {row['variant']} | {row['model']} | {row['dataset']} | {row['step_s']['dhp']:.2f} | "
                     f"{row['step_s']['dhp ring-only']:.2f} | **{row['speedup']:.3f}x** | {kinds} | "
                     f"{_short(row['label'])} |")
    return "\n".join(lines)


def compiles(r: dict[str, Any]) -> str:
    steps = r["config"]["steps"]
    lines = [f"| bucket rule | padded / real tokens | programs over {steps} steps | executables per process, max "
             "(x programs it runs: placement / none) | step (s) | unpadded (s) | lost to the rule and placement "
             "(of which: menu degrees / padding) | how |",
             "|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        split = ""
        if row.get("padding_step_time_lost") is not None:
            split = (f" ({100 * row['menu_degrees_step_time_lost']:+.1f} % / "
                     f"{100 * row['padding_step_time_lost']:+.1f} %)")
        off = f" ({row['off_menu_programs']} off the menu)" if row.get("off_menu_programs") else ""
        lines.append(f"| {row.get('rule', row['growth'])} | {row['padded_over_real']:.3f} | {row['programs']}{off} | "
                     f"{row['executables_per_process_max']} ({row['executables_per_program_per_process_max']:.2f}x / "
                     f"{row['executables_per_program_per_process_max_no_placement']:.2f}x) | {row['step_s']:.2f} | "
                     f"{row['step_s_unpadded']:.2f} | {100 * row['step_time_lost']:+.1f} %{split} | {_short(r['label'])} |")
    return "\n".join(lines)


def memory(r: dict[str, Any]) -> str:
    """The group program table (compiled vs CostModel.program_bytes by model and degree, one cell per
    token count) and the whole-step table (compiled step peak vs CostModel.step_bytes)."""
    tokens = r["config"]["tokens"]
    by = {}
    for row in r["rows"]:
        by.setdefault((row["model"], row["degree"]), {})[row["tokens"]] = row
    cells = lambda d, f: " / ".join(f(d[t]) if t in d else "—" for t in tokens)  # noqa: E731
    head = " / ".join(f"{t // 1024}k" for t in tokens)
    lines = [f"| model | degree | compiled GB ({head} tokens) | CostModel GB | error |", "|---|---|---|---|---|"]
    for (model, degree), d in by.items():
        got = cells(d, lambda x: format(x["compiled_bytes"] / 1e9, ".1f"))
        want = cells(d, lambda x: format(x["model_bytes"] / 1e9, ".1f"))
        err = cells(d, lambda x: format(100 * x["rel_error"], "+.1f") + "%")
        lines.append(f"| {model} | {degree} | {got} | {want} | {err} |")
    lines += ["", "| model | degree | tokens per micro-batch | micro-batches | compiled step peak GB | "
                  "CostModel.step_bytes GB | error | + state GB | of usable GB | peak in |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["step_rows"]:
        total = (row["compiled_step_bytes"] + row["state_bytes"]) / 1e9
        lines.append(f"| {row['model']} | {row['degree']} | {row['tokens']} | {row['micro_batches']} | "
                     f"{row['compiled_step_bytes'] / 1e9:.2f} | {row['model_step_bytes'] / 1e9:.2f} | "
                     f"{100 * row['rel_error']:+.1f}% | **{total:.2f}** ({'fits' if row['fits'] else 'does NOT fit'}) | "
                     f"{row['usable_bytes'] / 1e9:.2f} | {row['peak_phase']}"
                     f"{' (extrapolated depth)' if row['extrapolated'] else ''} |")
    return "\n".join(lines)


RENDER: dict[str, Callable[[dict[str, Any]], str]] = {
    "end_to_end": end_to_end, "scaling": scaling, "overhead": overhead, "estimator": estimator,
    "case_study": case_study, "optimality": optimality, "ablations": ablations, "sensitivity": sensitivity,
    "tail_sweep": tail_sweep,
    "attention_choice": attention_choice,
    "compiles": compiles,
    "memory": memory,
}


def render(name: str, results_dir: Path = RESULTS_DIR) -> str:
    r = json.loads((results_dir / f"{name}.json").read_text())
    body = RENDER[r["experiment"]](r)
    # Tables that already say everything skip the per-row summary lines.
    lines = [] if r["experiment"] in ("overhead", "ablations", "case_study") else r.get("summary", [])
    summary = "\n".join(f"- {s}" for s in lines)
    return f"{body}\n\n{summary}\n\n{_provenance(r)}"


def update(report: Path = REPORT, results_dir: Path = RESULTS_DIR) -> list[str]:
    text = report.read_text()
    names = []

    def sub(m: re.Match) -> str:
        name = m.group(1)
        names.append(name)
        if not (results_dir / f"{name}.json").exists():
            return f"<!-- table:{name} -->\n*(no result yet: run the config)*\n<!-- /table -->"
        return f"<!-- table:{name} -->\n{render(name, results_dir)}\n<!-- /table -->"

    text = re.sub(r"<!-- table:([\w.-]+) -->.*?<!-- /table -->", sub, text, flags=re.S)
    report.write_text(text)
    return names


if __name__ == "__main__":
    done = update()
    print(f"updated {len(done)} tables in {REPORT}: {', '.join(done)}")
    sys.exit(0)
