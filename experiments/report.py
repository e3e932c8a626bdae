"""Render the result JSONs as Markdown tables inside experiments/REPORT.md.

REPORT.md holds the prose; each table sits between `<!-- table:NAME -->` and `<!-- /table -->` and
is rewritten from experiments/results/NAME.json: `python -m experiments.report` after a regeneration.

A table is a `Table`: the rows it draws from a result and its columns, each a header and a cell
function `(row, result) -> text`; `num`, `text` and `how` build the common cells. A new table is
one more entry in `RENDER` (the experiment's name -> its `Table`, or any `result -> str`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from experiments.runner import REPO, RESULTS_DIR

REPORT = REPO / "experiments" / "REPORT.md"

Row = dict[str, Any]
Cell = Callable[[Row, dict[str, Any]], str]  # (row, whole result) -> the cell's text


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _short(label: str) -> str:
    """'simulated (ascend-910b preset, model, 8x8 ranks)' -> 'simulated (ascend-910b preset)'."""
    head, _, rest = label.partition("(")
    return f"{head}({rest.split(',')[0].rstrip(')')})" if rest else label


def num(key: str, spec: str = ".2f", wrap: str = "{}", *, optional: bool = False) -> Cell:
    """The row's number `key` formatted by `spec`, placed in `wrap` ('**{}x**'); an optional key that is
    absent or None reads '—' (a required one that is absent is a KeyError: a broken result)."""
    return lambda row, r: wrap.format(_fmt(row.get(key) if optional else row[key], spec))


def text(key: str) -> Cell:
    """The row's value `key` as it is."""
    return lambda row, r: str(row[key])


def how(source: str = "row") -> Cell:
    """The provenance column: the row's own label ('row') or the result's ('result'), shortened."""
    return lambda row, r: _short((row if source == "row" else r)["label"])


@dataclasses.dataclass(frozen=True)
class Table:
    """A Markdown table: `columns` (header, cell) or a function of the result giving them, one line
    per element of `rows(result)`. Headers may name result fields: '{config[steps]}'."""

    columns: Sequence[tuple[str, Cell]] | Callable[[dict[str, Any]], Sequence[tuple[str, Cell]]]
    rows: Callable[[dict[str, Any]], Iterable[Row]] = lambda r: r["rows"]

    def __call__(self, r: dict[str, Any]) -> str:
        cols = self.columns(r) if callable(self.columns) else self.columns
        lines = ["| " + " | ".join(h.format(**r) for h, _ in cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(cell(row, r) for _, cell in cols) + " |" for row in self.rows(r)]
        return "\n".join(lines)


def _end_to_end_columns(r: dict[str, Any]) -> list[tuple[str, Cell]]:
    def step(s: str) -> Cell:
        return lambda row, r: _fmt(row["step_s"].get(s))

    def best(row: Row, r: dict[str, Any]) -> str:
        return f"{row.get('best_static', '—')} <{','.join(str(d) for d in row.get('best_static_degrees', []))}>"

    return [("model", text("model")), ("data", text("dataset")),
            *[(f"{s} (s)", step(s)) for s in r["config"]["strategies"]],
            ("lower bound (s)", num("lower_bound_s", optional=True)), ("best static <degrees>", best),
            ("DHP speed-up vs best static", num("speedup_vs_best_static", wrap="**{}x**", optional=True)),
            ("bound on any speed-up", num("max_attainable_speedup", wrap="{}x", optional=True)),
            ("vs FlexSP-style", num("speedup_vs_flexsp", wrap="{}x", optional=True)), ("how", how())]


def _pair(a: str, b: str, spec: str = ".1f") -> Cell:
    return lambda row, r: f"{row[a]:{spec}} / {row[b]:{spec}}"


def _measured(table: Table) -> Callable[[dict[str, Any]], str]:
    """The table, or why nothing was measured."""
    return lambda r: table(r) if r.get("measured") else f"**Not measured:** {r.get('reason')}"


def _feasible(cell: Cell, infeasible: str = "—") -> Cell:
    return lambda row, r: infeasible if "infeasible" in row else cell(row, r)


def _stats(a: np.ndarray) -> dict[str, Any]:
    """The distribution columns of the optimality tables: median, p90, max, share within 1 % / 3 %."""
    return {"median": np.median(a), "p90": np.percentile(a, 90), "max": a.max(),
            "within": f"{np.mean(a <= 1.01):.0%} / {np.mean(a <= 1.03):.0%}"}


def _optimality_rows(r: dict[str, Any]) -> list[Row]:
    small = [x for x in r["small"] if "ratio" in x]
    proven = [x["ratio"] for x in small if x["milp_optimal"]]
    unproven = [x["ratio"] for x in small if not x["milp_optimal"]]
    rows = []
    if proven:
        rows.append({"instances": "small, DHP / proven MILP optimum", "count": f"{len(proven)} of {len(small)}",
                     **_stats(np.asarray(proven))})
    if unproven:
        rows.append({"instances": "small, MILP hit its time limit: DHP / MILP incumbent",
                     "count": f"{len(unproven)} of {len(small)}", **_stats(np.asarray(unproven))})
    if small:
        rows.append({"instances": "small, DHP / lower bound (all)", "count": str(len(small)),
                     **_stats(np.asarray([x["dhp_step_s"] / x["lower_bound_s"] for x in small]))})
    for n in sorted({x["ranks"] for x in r["large"]}):
        rs = [x for x in r["large"] if x["ranks"] == n]
        static = np.median([x["static_over_bound"] for x in rs])
        rows.append({"instances": f"{n} ranks, DHP / lower bound (static ring / bound: {static:.3f})",
                     "count": str(len(rs)), **_stats(np.asarray([x["dhp_over_bound"] for x in rs]))})
    return rows


_OPTIMALITY = Table([("instances", text("instances")), ("count", text("count")), ("median", num("median", ".4f")),
                     ("p90", num("p90", ".4f")), ("max", num("max", ".4f")),
                     ("share within 1 % / 3 %", text("within")),
                     ("how", lambda row, r: _short(r["label"].split(";")[0]))], rows=_optimality_rows)


def _versus_flexsp_rows(r: dict[str, Any]) -> list[Row]:
    rows = r["versus_flexsp"]
    out = []
    for ds in dict.fromkeys(x["dataset"] for x in rows):
        rs = [x for x in rows if x["dataset"] == ds]
        fx = [x for x in rs if "dhp_over_flexsp" in x]
        q = np.asarray([x["dhp_over_flexsp"] for x in fx])
        over = np.asarray([x["dhp_mb"] - x["token_lower_bound_mb"] for x in rs])
        near = int(np.sum(over <= 1))
        row = {"data": f"{ds}, {rs[0]['ranks']} ranks, GBS {rs[0]['samples']}", "batches": f"{len(fx)} / {len(rs)}",
               "geo": "—", "worst": "—", "dhp_bound": "—", "flexsp_bound": "—", "mbs": "—",
               "over": ", ".join(f"+{k}: {int(np.sum(over == k))}" for k in sorted(set(over.tolist()))),
               "near": f"{near} of {len(rs)} ({near / len(rs):.0%})",
               "dhp_solve": f"{np.median([x['dhp_solve_ms'] for x in rs]):.1f} ms "
                            f"({np.median([x['dhp_solve_cpu_ms'] for x in rs]):.1f} ms)",
               "flexsp_solve": "—", "how": "simulated (FlexSP-matched profile)"}
        if fx:
            row.update(geo=f"{np.exp(np.log(q).mean()):.4f}", worst=f"{q.max():.4f}",
                       dhp_bound=f"{np.median([x['dhp_over_bound'] for x in fx]):.4f}",
                       flexsp_bound=f"{np.median([x['flexsp_over_bound'] for x in fx]):.4f}",
                       mbs=" ".join(f"{x['dhp_mb']}/{x['flexsp_mb']}/{x['token_lower_bound_mb']}" for x in fx),
                       flexsp_solve=f"{np.median([x['flexsp_solve_s'] for x in fx]):.1f} s")
        out.append(row)
    sm = r.get("solve_ms", {})
    if sm.get("preset_openvid_wall_ms"):
        out.append({"data": "openvid, internvl3-8b / ascend-910b preset (solve time only)",
                    "batches": f"— / {len(sm['preset_openvid_wall_ms'])}", "geo": "—", "worst": "—", "dhp_bound": "—",
                    "flexsp_bound": "—", "mbs": "—", "over": "—", "near": "—",
                    "dhp_solve": f"{np.median(sm['preset_openvid_wall_ms']):.1f} ms "
                                 f"({np.median(sm['preset_openvid_cpu_ms']):.1f} ms)",
                    "flexsp_solve": "—", "how": "measured on this machine"})
    return out


_VERSUS_FLEXSP = Table([(h, text(k)) for h, k in [
    ("data", "data"), ("batches (flexsp / dhp)", "batches"), ("dhp / flexsp: geo. mean", "geo"), ("worst", "worst"),
    ("dhp / bound (median)", "dhp_bound"), ("flexsp / bound (median)", "flexsp_bound"),
    ("micro-batches dhp / flexsp / token bound", "mbs"), ("dhp micro-batches over the bound (+k: batches)", "over"),
    ("dhp within 1 of the bound", "near"), ("dhp solve median (CPU)", "dhp_solve"),
    ("flexsp solve median", "flexsp_solve"), ("how", "how")]], rows=_versus_flexsp_rows)


def optimality(r: dict[str, Any]) -> str:
    """Experiment 7: the small/large instance table, then (when run) the FlexSP comparison below it."""
    parts = [_OPTIMALITY(r)] if _optimality_rows(r) else []
    if r.get("versus_flexsp"):
        parts.append(_VERSUS_FLEXSP(r))
    return "\n\n".join(parts) or _OPTIMALITY(r)


def _attention_kinds(row: Row, r: dict[str, Any]) -> str:
    return ", ".join(f"{k} {n}" for k, n in row["multi_rank_groups"].items())


def _share(row: Row, r: dict[str, Any]) -> str:
    return f"{row['tail_share']:.1%}" + (" (built-in)" if row["built_in"] else "")


def _compiles_lost(row: Row, r: dict[str, Any]) -> str:
    split = ""
    if row.get("padding_step_time_lost") is not None:
        split = f" ({100 * row['menu_degrees_step_time_lost']:+.1f} % / {100 * row['padding_step_time_lost']:+.1f} %)"
    return f"{100 * row['step_time_lost']:+.1f} %{split}"


def _compiles_programs(row: Row, r: dict[str, Any]) -> str:
    off = f" ({row['off_menu_programs']} off the menu)" if row.get("off_menu_programs") else ""
    return f"{row['programs']}{off}"


def _compiles_executables(row: Row, r: dict[str, Any]) -> str:
    return (f"{row['executables_per_process_max']} ({row['executables_per_program_per_process_max']:.2f}x / "
            f"{row['executables_per_program_per_process_max_no_placement']:.2f}x; "
            f"{row['executables_per_program_per_process_max_early']:.2f}x)")


def memory(r: dict[str, Any]) -> str:
    """The group program table (compiled vs memory.group_program_bytes by model and degree, one cell per
    token count) and the whole-step table (compiled step peak vs memory.device_step_bytes)."""
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
                  "memory.device_step_bytes GB | error | + state GB | of usable GB | peak in |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["step_rows"]:
        total = (row["compiled_step_bytes"] + row["state_bytes"]) / 1e9
        lines.append(f"| {row['model']} | {row['degree']} | {row['tokens']} | {row['micro_batches']} | "
                     f"{row['compiled_step_bytes'] / 1e9:.2f} | {row['model_step_bytes'] / 1e9:.2f} | "
                     f"{100 * row['rel_error']:+.1f}% | **{total:.2f}** ({'fits' if row['fits'] else 'does NOT fit'}) | "
                     f"{row['usable_bytes'] / 1e9:.2f} | {row['peak_phase']}"
                     f"{' (extrapolated depth)' if row['extrapolated'] else ''} |")
    return "\n".join(lines)


def memory_families(r: dict[str, Any]) -> str:
    """The family group programs: model / compiled by model, remat and degree, one cell per token
    count ("not run" where the row was not measured), and the per-layer rows."""
    tokens = r["config"]["tokens"]
    by: dict[tuple[str, str, int], dict[int, Any]] = {}
    for row in r["rows"]:
        by.setdefault((row["model"], row.get("remat", "none"), row["degree"]), {})[row["tokens"]] = row
    for row in r["not_run"]:
        by.setdefault((row["model"], row.get("remat", "none"), row["degree"]), {})
    cell = lambda d, t: (f"{d[t]['compiled_bytes'] / 1e9:.1f} / {d[t]['model_bytes'] / 1e9:.1f} GB: "  # noqa: E731
                         f"**{d[t]['ratio']:.3f}**") if t in d else "not run"
    lines = [f"| model | remat | degree | {' | '.join(f'{t // 1024}k: compiled / model, ratio' for t in tokens)} |",
             "|---|---|---|" + "---|" * len(tokens)]
    for (model, remat, degree), d in sorted(by.items()):
        lines.append(f"| {model} | {remat} | {degree} | {' | '.join(cell(d, t) for t in tokens)} |")
    if r["layer_rows"]:
        lines += ["", "| model | remat | degree | tokens | one more | compiled MB | model MB | ratio |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in r["layer_rows"]:
            lines.append(f"| {row['model']} | {row.get('remat', 'none')} | {row['degree']} | {row['tokens']} | "
                         f"{row['added']} | {row['compiled_bytes'] / 1e6:.0f} | {row['model_bytes'] / 1e6:.0f} | "
                         f"{row['ratio']:.3f} |")
    return "\n".join(lines)


def tensor_parallel(r: dict[str, Any]) -> str:
    """Step time of DHP and the best static strategy at each tensor-parallel size t (a cell per t:
    "DHP / best static s", or why no plan runs), each at its best t and the gain; then the long
    sample's (t, degree) and whether the memory model says it fits."""
    ts = r["config"]["tensor_parallel"]

    def cell(v: dict[str, Any]) -> str:
        if "error" in v:
            return "refused: heads" if "cannot split" in v["error"] else "does not fit"
        steps = v["step_s"]
        static = [steps[s] for s in ("static-ring:best", "static-ulysses:best") if s in steps]
        return f"{steps['dhp']:.1f} / {min(static):.1f}" if "dhp" in steps and static else "—"

    lines = [f"| model | devices | {' | '.join(f't={t}: DHP / static s' for t in ts)} | DHP best (t) | "
             "best static (t) | DHP gain |", "|---|---|" + "---|" * (len(ts) + 3)]
    for row in r["rows"]:
        cells = " | ".join(cell(row["per_t"][str(t)]) for t in ts)
        if "gain" in row:
            tail = (f"{row['dhp_s']:.1f} s (t={row['dhp_t']}) | {row['static_s']:.1f} s ({row['static']}, "
                    f"t={row['static_t']}) | **{row['gain']:.2f}x**")
        else:
            tail = "— | — | no t runs it"
        lines.append(f"| {row['model']} | {row['devices']} | {cells} | {tail} |")
    lines += ["", f"| model | one sample of | devices | {' | '.join(f't={t}' for t in ts)} | planner picks |",
              "|---|---|---|" + "---|" * (len(ts) + 1)]
    for row in r["long_rows"]:
        def long_cell(v: dict[str, Any]) -> str:
            if "error" in v:
                return "refused: heads" if "cannot split" in v["error"] else "does not fit"
            return (f"degree {v['degree']}, {v['step_s']:.2f} s, {v['device_bytes'] / 1e9:.1f} of "
                    f"{v['usable_bytes'] / 1e9:.1f} GB ({'fits' if v['fits'] else 'does NOT fit'})")
        pick = (f"t={row['best_t']}, degree {row['best_degree']} ({'fits' if row['fits'] else 'does NOT fit'})"
                if "best_t" in row else "nothing runs it")
        lines.append(f"| {row['model']} | {row['tokens'] // 1024}k tokens | {row['devices']} | "
                     f"{' | '.join(long_cell(row['per_t'][str(t)]) for t in ts)} | {pick} |")
    return "\n".join(lines)


def moe(r: dict[str, Any]) -> str:
    """Experiment 13's tables (`tensor_parallel`) for mixture-of-experts models, a row per data mix;
    then the long sample's (t, degree) by the planner's plans and by the memory model."""
    rows = [{**row, "model": f"{row['model']} | {row['dataset']}"} for row in r["rows"]]
    body = tensor_parallel({**r, "rows": rows}).replace("| model | devices |", "| model | data | devices |", 1)
    body = body.replace("|---|---|", "|---|---|---|", 1)
    lines = ["", "| model | memory model's pick for the long sample (`tensor_parallel.choose`) |", "|---|---|"]
    for row in r["long_rows"]:
        c = row["choose"]
        lines.append(f"| {row['model']} | " + (f"t={c['t']}, degree {c['degree']}, {c['device_bytes'] / 1e9:.1f} of "
                                               f"{c['usable_bytes'] / 1e9:.1f} GB" if "t" in c else "nothing fits")
                     + " |")
    return body + "\n" + "\n".join(lines)


RENDER: dict[str, Callable[[dict[str, Any]], str]] = {
    "end_to_end": Table(_end_to_end_columns),
    "scaling": Table([
        ("ranks", text("ranks")), ("GBS", text("batch")), ("strategy", text("strategy")), ("step (s)", num("step_s")),
        ("tokens/s/rank", num("tokens_per_s_per_rank", ".0f")), ("scaling efficiency", num("scaling_efficiency", ".1%")),
        ("DHP speed-up", num("dhp_speedup", wrap="{}x", optional=True)), ("utilisation", num("utilisation")),
        ("plan (ms, measured)", num("plan_wall_ms", ".0f")), ("how", how())]),
    "overhead": Table([
        ("ranks", text("ranks")), ("GBS", text("batch")),
        ("solver ms (median / max)", _pair("solver_ms_median", "solver_ms_max")),
        ("whole scheduling ms (median / max)", _pair("scheduling_ms_median", "scheduling_ms_max")),
        ("simulated step s", num("sim_step_s_mean")), ("scheduling / step", num("scheduling_share_of_step", ".2%")),
        ("how", lambda row, r: f"{r['label']}; step simulated")]),
    "estimator": _measured(Table([
        ("model", text("model")), ("devices", lambda row, r: f"{r['config']['devices']} fake CPU"),
        ("points (held out)", lambda row, r: f"{row['points']} ({row['held_out']})"),
        ("held-out mean error", num("mean_rel_error", ".1%", "**{}**")), ("median", num("median_rel_error", ".1%")),
        ("max", num("max_rel_error", ".1%")), ("train mean error", num("train_mean_rel_error", ".1%")),
        ("how", text("label"))], rows=lambda r: r["table"])),
    "case_study": Table([
        ("data", text("dataset")),
        ("best static (config, micro-batches, s)", lambda row, r: f"{row['baseline']} {row['baseline_config']}, "
                                                                  f"{row['baseline_micro_batches']}, {row['baseline_step_s']:.2f}"),
        ("DHP groups per micro-batch (degree x count)", lambda row, r: " ; ".join(row["dhp_micro_batches"])),
        ("DHP s", num("dhp_step_s")), ("speed-up", num("speedup", wrap="**{}x**")), ("how", how())]),
    "optimality": optimality,
    "ablations": Table([
        ("data", text("dataset")), ("variant", text("variant")), ("step (s)", _feasible(num("step_s"), "infeasible")),
        ("vs full DHP", _feasible(num("slowdown_vs_full", ".3f", "{}x"))),
        ("micro-batches", _feasible(num("micro_batches", ".1f"))), ("utilisation", _feasible(num("utilisation"))),
        ("how", how())]),
    "sensitivity": Table([
        ("model", text("model")), ("inter-node GB/s per rank", num("inter_node_gbps", "g")), ("DHP (s)", num("dhp_step_s")),
        ("best static (s)", lambda row, r: f"{row['best_static']} {row['best_static_step_s']:.2f}"),
        ("DHP speed-up", num("speedup", wrap="**{}x**")), ("how", how())]),
    "tail_sweep": Table([
        ("model", text("model")), ("data", text("dataset")), ("long-clip share", _share), ("DHP (s)", num("dhp_step_s")),
        ("best static (s)", lambda row, r: f"{row['best_static']} {row['best_static_step_s']:.2f}"),
        ("DHP speed-up", num("speedup", wrap="**{}x**")), ("how", how())]),
    "attention_choice": Table([
        ("cost model", text("variant")), ("model", text("model")), ("data", text("dataset")),
        ("DHP (s)", lambda row, r: f"{row['step_s']['dhp']:.2f}"),
        ("DHP ring-only (s)", lambda row, r: f"{row['step_s']['dhp ring-only']:.2f}"),
        ("speed-up", num("speedup", ".3f", "**{}x**")), ("multi-rank groups by kind", _attention_kinds),
        ("how", how())]),
    "compiles": Table([
        ("bucket rule", lambda row, r: str(row.get("rule", row["growth"]))),
        ("padded / real tokens", num("padded_over_real", ".3f")),
        ("programs over {config[steps]} steps", _compiles_programs),
        ("executables per process, max (x programs it runs: placement / none; placement over the first "
         "{config[early_steps]} steps)", _compiles_executables),
        ("step (s)", num("step_s")), ("unpadded (s)", num("step_s_unpadded")),
        ("lost to the rule and placement (of which: menu degrees / padding)", _compiles_lost),
        ("how", how("result"))]),
    "memory": memory,
    "memory_families": memory_families,
    "tensor_parallel": tensor_parallel,
    "moe": moe,
}

# Tables that already say everything skip the per-row summary lines.
NO_SUMMARY = ("overhead", "ablations", "case_study", "tensor_parallel", "moe")


def _provenance(r: dict[str, Any]) -> str:
    m = r["machine"]
    return (f"*{r['label']}. Config `{r['config_file']}`, seed {r['seed']}, commit {r['versions'].get('dhp_jax_commit')}"
            f"{' (uncommitted changes)' if r['versions'].get('dhp_jax_dirty') else ''}, "
            f"generated {r['created_utc']} in {r['wall_s']:.0f} s on {m['cpu']} ({m['cpu_count']} cores, "
            f"load average {m.get('loadavg_1_5_15')}).*")


def render(name: str, results_dir: Path = RESULTS_DIR) -> str:
    r = json.loads((results_dir / f"{name}.json").read_text())
    body = RENDER[r["experiment"]](r)
    lines = [] if r["experiment"] in NO_SUMMARY else r.get("summary", [])
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
