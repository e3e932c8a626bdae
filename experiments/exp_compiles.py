"""Experiment 12: the bucket rule's trade-off at cluster scale: padding vs programs vs step time.

For each bucket ladder growth (and each menu of programs fitted to calibration batches, see
`dhp_jax.planner.programs.menu`), `dhp bench compiles`' planning pass (`plan_run`: real batches
planned with padding priced, nothing compiled) counts the distinct (degree, padded tokens,
attention kind) programs, the executables each process would hold (with and without the reuse
placement), the padded / real tokens, and the simulated step time against planning and pricing
without padding. A menu's programs carry one attention kind each (`menu_kinds`: per bucket or per
degree), so its budget bounds the programs; the variants at `kind_budget` show what fixing the
kinds costs against choosing them per group ("group": a program budget then bounds only the
(degree, bucket) shapes). A ladder's programs carry one attention kind each too, fixed without data
(`StreamGeometry.kind_rule` "program", `pricing.program_kind`); the rows "kinds per group" plan the
same batches with each group's own fastest kind.
"""

from __future__ import annotations

from typing import Any, Callable

from dhp_jax.geometry.layout import GROWTH, MIN_BUCKET
from dhp_jax.bench.compiles import cost_for, menu_cost, plan_run
from experiments.common import save_figure


# the bounds at 64 ranks over 1,000 steps (and the first early_steps); the summary names the rows meeting them all
TARGETS = {"padded_over_real": 1.05, "programs": 64, "executables_per_program_per_process_max": 2.0,
           "executables_per_program_per_process_max_early": 2.0, "step_time_lost": 0.01}

KIND_PER = {"bucket": "bucket", "degree": "degree", "group": None}
DEFAULT_RULE = f"ladder {GROWTH:g}"   # the row of the presets' own ladder (with min_bucket MIN_BUCKET)


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    for k in [p["menu_kinds"], *p["kind_variants"]]:
        if k not in KIND_PER:
            raise ValueError(f"compiles: menu kinds must be one of {sorted(KIND_PER)}, got {k!r}")
    from dhp_jax.planner.programs.menu import DEGREE_SETS

    for v in [p["menu_degree_set"], *p["degree_set_variants"]]:
        if v not in DEGREE_SETS:
            raise ValueError(f"compiles: a menu's degree set must be one of {DEGREE_SETS}, got {v!r}")
    rows = []
    md, kb = p["menu_max_degrees"], p["kind_budget"]
    ds = p["menu_degree_set"]
    # (name, growth, menu budget, menu kinds, menu degrees, degree set, the ladder's kind rule)
    settings = [(f"ladder {g:g}", g, None, None, None, None, "program") for g in p["growths"]]
    settings += [(f"ladder {g:g}, kinds per group", g, None, None, None, None, "group")
                 for g in p["ladder_group_kinds"]]
    settings += [(f"menu of {b}", p["menu_growth"], b, p["menu_kinds"], md, ds, "program") for b in p["menu_budgets"]]
    settings += [(f"menu of {kb}, kinds per {k}", p["menu_growth"], kb, k, md, ds, "program") for k in p["kind_variants"]]
    settings += [(f"menu of {kb}, {m} degrees", p["menu_growth"], kb, p["menu_kinds"], m, ds, "program")
                 for m in p["degree_variants"]]
    settings += [(f"menu of {kb}, {v} degrees", p["menu_growth"], kb, p["menu_kinds"], md, v, "program")
                 for v in p["degree_set_variants"]]
    references: dict = {}  # the unpadded reference plans, shared by the rows
    for name, g, budget, kinds, max_degrees, degree_set, kind_rule in settings:
        cost = cost_for(p["model"], p["hardware"], p["ranks_per_node"], g, p["min_bucket"], kind_rule)
        if budget:
            cost = menu_cost(cost, p["ranks"], p["menu_calibration_batches"], budget, p["batch"], p["dataset"],
                             max_degrees, kind_per=KIND_PER[kinds], degree_set=degree_set)
        early = min(p["early_steps"], p["steps"])
        r = plan_run(cost, p["ranks"], p["steps"], p["batch"], p["dataset"], p["ranks_per_process"], True, seed,
                     references, counts_at=(early,))
        row = {"rule": name, "growth": g, "kind_rule": kind_rule, "menu_budget": budget, "menu_kinds": kinds, "menu_max_degrees": max_degrees,
               "menu_degree_set": degree_set,
               "menu_degrees": [d for d, _ in cost.geometry.bucket_menu], "off_menu_programs": r.get("off_menu_programs"),
               "programs": r["placement"]["programs"], "padded_over_real": r["padded_over_real"],
               "executables_per_process_max": r["placement"]["executables_per_process_max"],
               "executables_per_program_per_process_max": r["placement"]["executables_per_program_per_process_max"],
               "early_steps": early, "executables_per_program_per_process_max_early":
                   r["placement_at"][str(early)]["executables_per_program_per_process_max"],
               "executables_per_program_per_process_max_no_placement":
                   r["no_placement"]["executables_per_program_per_process_max"],
               "step_s": r["step_s_mean"], "step_s_unpadded": r["step_s_mean_unpadded"],
               "step_time_lost": r["step_time_lost"], "placement_step_time_lost": r["placement_step_time_lost"],
               "menu_degrees_step_time_lost": r.get("menu_degrees_step_time_lost"),
               "padding_step_time_lost": r.get("padding_step_time_lost"),
               "plan_ms_median": r["plan_ms_median"]}
        log(f"{name}: {row['programs']} programs, padded/real {row['padded_over_real']:.3f}, "
            f"step {row['step_s']:.3f} s vs {row['step_s_unpadded']:.3f} s unpadded")
        rows.append(row)
    t = TARGETS
    ok = [r for r in rows if all(r[k] <= v for k, v in t.items())]
    summary = [f"{r['rule']}: padded/real {r['padded_over_real']:.3f}, {r['programs']} programs, "
               f"{r['executables_per_program_per_process_max']:.2f} executables per program per process (max; "
               f"{r['executables_per_program_per_process_max_early']:.2f} over the first {r['early_steps']}), "
               f"step time +{100 * r['step_time_lost']:.1f} % vs unpadded"
               + (f" (menu degrees {100 * r['menu_degrees_step_time_lost']:+.1f} %, padding "
                  f"{100 * r['padding_step_time_lost']:+.1f} %)" if r.get("padding_step_time_lost") is not None else "")
               for r in rows]
    summary.append(f"settings meeting padded/real <= {t['padded_over_real']}, <= {t['programs']} programs over "
                   f"{p['steps']} steps, <= {t['executables_per_program_per_process_max']}x executables per "
                   f"program per process (over {p['steps']} steps and over the first {min(p['early_steps'], p['steps'])}) "
                   f"and <= {100 * t['step_time_lost']:g} % step time lost: {[r['rule'] for r in ok] or 'none'}")
    default = [r for r in rows if r["rule"] == DEFAULT_RULE and p["min_bucket"] == MIN_BUCKET]
    if default:  # the rule every plan uses unless a menu is given: the bounds without padding's
        r = default[0]
        met = all(r[k] <= v for k, v in t.items() if k != "padded_over_real")
        summary.append(f"the default rule ({DEFAULT_RULE}, the presets' ladder) {'meets' if met else 'misses'} "
                       f"the bounds on programs, executables and step time")
    return {"label": f"simulated ({p['model']} on {p['hardware']} preset), counts from real plans, nothing compiled",
            "rows": rows, "summary": summary}


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.6))
    ladders = [r for r in rows if not r["menu_budget"] and "," not in r["rule"]]
    variants = [r for r in rows if "," in r["rule"]]
    menus = [r for r in rows if r["menu_budget"] and "," not in r["rule"]]
    for sel, style, name in ((ladders, "o-", "ladders"), (menus, "s-", "menus (budget sweep)"),
                             (variants, "^", "menu variants")):
        if not sel:
            continue
        pad = [100 * (r["padded_over_real"] - 1) for r in sel]
        ax[0].plot([r["programs"] for r in sel], pad, style, label=name)
        ax[1].plot(pad, [100 * r["step_time_lost"] for r in sel], style, label=name)
        for r, y in zip(sel, pad):
            ax[0].annotate(r["rule"].replace("menu of ", ""), (r["programs"], y), fontsize=6)
    ax[0].axhline(5, color="k", lw=0.6, ls="--")
    ax[0].axvline(64, color="k", lw=0.6, ls="--")
    ax[0].set_xlabel(f"programs over {result['config']['steps']} steps")
    ax[0].set_ylabel("padding (% of real tokens)")
    ax[0].legend(fontsize=7)
    ax[1].set_xlabel("padding (% of real tokens)")
    ax[1].set_ylabel("simulated step time vs unpadded (%)")
    save_figure(fig, path, f"{result['name']}: {result['label']}", fontsize=8)
