# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · Paper-style figures from `experiments/results/`
#
# Every experiment writes one JSON file (config, seed, versions, machine, rows) under
# `experiments/results/`; `python -m experiments.run --all` regenerates them. This notebook only
# reads those files and draws the figures: the end-to-end speed-up bars, the scaling lines and the
# overhead table, then the case study, the optimality check and the ablations.
#
# Each figure's title carries the result's own label: **simulated** numbers come from the analytic
# cost model of the named hardware preset; **measured** numbers name the machine they were taken on.
# The notebook also re-derives the headline ratios from the raw step times, so a result file whose
# summary disagrees with its own rows fails here.

# %%
import json
import os
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display


def find_repo() -> Path:
    """The repository root: the first folder at or above the working directory holding experiments/."""
    for d in [Path.cwd(), *Path.cwd().parents]:
        if (d / "experiments" / "report.py").is_file():
            return d
    raise FileNotFoundError(f"no experiments/ folder in {Path.cwd()} or above: run this notebook inside the repository")


REPO = find_repo()
# $DHP_RESULTS_DIR points the notebook at another run's results (e.g. a --tiny run's --out folder)
RESULTS = Path(os.environ.get("DHP_RESULTS_DIR") or REPO / "experiments" / "results").resolve()
sys.path.insert(0, str(REPO))  # the `experiments` package lives at the repository root, uninstalled
from experiments.common import LABELS
from experiments.report import RENDER


def load(stem: str) -> dict:
    """One result file by its stem (e.g. "e1_end_to_end"); a `_tiny` variant is used if it is all there is."""
    for name in (f"{stem}.json", f"{stem}_tiny.json"):
        if (RESULTS / name).is_file():
            r = json.loads((RESULTS / name).read_text())
            r["_file"] = name
            return r
    raise FileNotFoundError(f"{RESULTS / (stem + '.json')} is missing: regenerate it with "
                            f"`python -m experiments.run experiments/configs/{stem}.yaml`")


def caption(r: dict) -> str:
    return f"{r['_file']}: {r['label']}"


def table(r: dict) -> None:
    """The result as the Markdown table of experiments/REPORT.md (same renderer), with its summary."""
    display(Markdown(RENDER[r["experiment"]](r) + "\n\n" + "\n".join(f"- {s}" for s in r.get("summary", []))))


print("results folder:", RESULTS)
for p in sorted(RESULTS.glob("*.json")):
    r = json.loads(p.read_text())
    # experiments record their commit (memory_bench.json too, since experiments/configs/memory_bench.yaml)
    source = (f"commit {r['versions'].get('dhp_jax_commit')}" if "versions" in r
              else f"`{r.get('command', '?')}`")
    print(f"  {p.name:<28} {r.get('label', '?'):<62} {source}, {r.get('created_utc', '?')}")

# %% [markdown]
# ## End-to-end speed-up (experiments 1 and 2)
# Step time of DHP relative to the best static baseline (the better of ring CP and Ulysses at their
# best single degree) and to FlexSP-style power-of-two groups, for each model and video mix on the
# same batches. Experiment 2 repeats experiment 1 with the vision encoder frozen.

# %%
STATIC = ("static-ring:best", "static-ulysses:best")


def check_end_to_end(r: dict) -> None:
    """The stored speed-ups must follow from the stored step times."""
    for row in r["rows"]:
        st = row["step_s"]
        static = {s: st[s] for s in STATIC if s in st}
        best = min(static, key=static.get)
        assert row["best_static"] == best, row
        assert np.isclose(row["speedup_vs_best_static"], static[best] / st["dhp"], rtol=1e-9), row
        if "flexsp" in st:
            assert np.isclose(row["speedup_vs_flexsp"], st["flexsp"] / st["dhp"], rtol=1e-9), row


def speedup_bars(ax, r: dict, key: str, ylabel: str) -> None:
    models = list(dict.fromkeys(row["model"] for row in r["rows"]))
    datasets = list(dict.fromkeys(row["dataset"] for row in r["rows"]))
    w = 0.8 / len(datasets)
    x = np.arange(len(models))
    top = 1.0
    for j, ds in enumerate(datasets):
        vals = [next((row.get(key, np.nan) for row in r["rows"] if row["model"] == m and row["dataset"] == ds), np.nan)
                for m in models]
        bars = ax.bar(x + (j - (len(datasets) - 1) / 2) * w, vals, w, label=ds)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
        top = max(top, np.nanmax(vals))
    ax.set_ylim(0, top * 1.25)  # room for the labels and the legend
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, models, rotation=20, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(caption(r), fontsize=8)
    ax.legend(fontsize=7, ncols=len(datasets), loc="upper left")


e2e = {"e1_end_to_end": load("e1_end_to_end"), "e2_frozen_vision": load("e2_frozen_vision")}
for r in e2e.values():
    check_end_to_end(r)

fig, axes = plt.subplots(1, 3, figsize=(16, 3.8), layout="constrained")
speedup_bars(axes[0], e2e["e1_end_to_end"], "speedup_vs_best_static", "DHP speed-up vs best static")
speedup_bars(axes[1], e2e["e1_end_to_end"], "speedup_vs_flexsp", "DHP speed-up vs FlexSP-style")
speedup_bars(axes[2], e2e["e2_frozen_vision"], "speedup_vs_best_static", "vs best static, vision frozen")
for r in e2e.values():
    sp = np.array([row["speedup_vs_best_static"] for row in r["rows"]])
    print(f"{r['_file']}: DHP vs best static {sp.min():.2f}x - {sp.max():.2f}x, median {np.median(sp):.2f}x "
          f"over {sp.size} settings [{r['label']}]")

# %% [markdown]
# ## Scaling (experiment 3)
# A fixed number of samples per rank, from one node to thousands of ranks. Throughput per rank
# (tokens/s/rank) and scaling efficiency relative to the smallest size, per strategy.

# %%
sc = load("e3_scaling")
strategies = list(dict.fromkeys(row["strategy"] for row in sc["rows"]))
by = {s: sorted((row for row in sc["rows"] if row["strategy"] == s), key=lambda row: row["ranks"])
      for s in strategies}
for s, rows in by.items():  # efficiency = throughput per rank / that of the smallest run
    for row in rows:
        assert np.isclose(row["scaling_efficiency"],
                          row["tokens_per_s_per_rank"] / rows[0]["tokens_per_s_per_rank"], rtol=1e-9), row

fig, axes = plt.subplots(1, 3, figsize=(16, 3.8), layout="constrained")
for s, rows in by.items():
    n = [row["ranks"] for row in rows]
    axes[0].plot(n, [row["tokens_per_s_per_rank"] for row in rows], "o-", label=LABELS.get(s, s))
    axes[1].plot(n, [row["scaling_efficiency"] for row in rows], "o-", label=LABELS.get(s, s))
    if s != "dhp":
        axes[2].plot(n, [row["step_s"] / d["step_s"] for row, d in zip(rows, by["dhp"])], "o-",
                     label=f"{LABELS.get(s, s)} / DHP")
for ax, yl in zip(axes, ("tokens / s / rank", "scaling efficiency", "step time relative to DHP")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel(yl)
    ax.legend(fontsize=7)
axes[1].axhline(1.0, color="black", lw=0.6)
axes[2].axhline(1.0, color="black", lw=0.6)
fig.suptitle(caption(sc), fontsize=9)
print("\n".join(sc["summary"]))

# %% [markdown]
# ## Planning overhead (experiment 4)
# Wall time of the solver and of the whole scheduling step (data to plan) **measured** on the
# machine named in the label, against the **simulated** step time it would sit beside. The
# planner runs one step ahead in a background thread, so this is hidden as long as it stays well
# under the step time.

# %%
ov = load("e4_overhead")
for row in ov["rows"]:
    assert np.isclose(row["scheduling_share_of_step"], row["scheduling_ms_median"] / 1e3 / row["sim_step_s_mean"],
                      rtol=1e-9), row
table(ov)

fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
points = sorted(ov["rows"], key=lambda row: (row["ranks"], row["batch"]))
labels = [f"{row['ranks']}\n{row['batch']}" for row in points]
x = np.arange(len(labels))
ax.bar(x - 0.2, [row["solver_ms_median"] for row in points], 0.4, label="solver (median)")
ax.bar(x + 0.2, [row["scheduling_ms_median"] for row in points], 0.4, label="whole scheduling (median)")
ax.set_xticks(x, labels, fontsize=7)
ax.set_xlabel("ranks / global batch")
ax.set_ylabel("ms (measured)")
ax.set_yscale("log")
ax.legend(fontsize=7)
ax.set_title(caption(ov), fontsize=8);

# %% [markdown]
# ## Case study (experiment 6)
# What DHP actually chose for one batch: groups per micro-batch as "degree x count", next to the
# best static configuration "<degree> x groups".

# %%
cs = load("e6_case_study")
for row in cs["rows"]:
    assert np.isclose(row["speedup"], row["baseline_step_s"] / row["dhp_step_s"], rtol=1e-9), row
table(cs)

# %% [markdown]
# ## How far from optimal (experiment 7)
# Small instances: DHP's step time over the exact MILP's (1.0 = optimal where the MILP proved it).
# Large instances: DHP and the best static ring over a lower bound on any plan's step time.

# %%
opt = load("e7_optimality")
table(opt)
small = [x for x in opt["small"] if "ratio" in x]
fig, axes = plt.subplots(1, 2, figsize=(12, 3.2), layout="constrained")
ratios = np.array([x["ratio"] for x in small])
bins = np.linspace(ratios.min() - 1e-3, ratios.max() + 1e-3, 21)
axes[0].hist([[x["ratio"] for x in small if x["milp_optimal"]], [x["ratio"] for x in small if not x["milp_optimal"]]],
             bins=bins, stacked=True, label=["MILP proved optimal", "MILP hit its time limit (incumbent)"])
axes[0].set_xlabel("DHP step / MILP step")
axes[0].set_ylabel("instances")
axes[0].legend(fontsize=7)
large = opt["large"]
for key, name in (("dhp_over_bound", "DHP"), ("static_over_bound", "static ring (best)")):
    axes[1].plot([x["ranks"] for x in large], [x[key] for x in large], "o", label=name)
axes[1].set_xscale("log", base=2)
axes[1].axhline(1.0, color="black", lw=0.6)
axes[1].set_xlabel("ranks")
axes[1].set_ylabel("step / lower bound")
axes[1].legend(fontsize=7)
fig.suptitle(caption(opt), fontsize=9)
assert all(x["dhp_over_bound"] >= 1 - 1e-9 for x in large), "a step below its lower bound: bound or simulator bug"

# %% [markdown]
# ## Ablations (experiment 8)
# The full planner against itself with one part switched off: step time relative to full DHP.

# %%
ab = load("e8_ablations")
datasets = list(dict.fromkeys(row["dataset"] for row in ab["rows"]))
variants = [v for v in dict.fromkeys(row["variant"] for row in ab["rows"]) if v != "full"]
fig, ax = plt.subplots(figsize=(9, 0.3 * len(variants) * len(datasets) + 1.2), layout="constrained")
h = 0.8 / len(datasets)
for j, ds in enumerate(datasets):
    vals = []
    for v in variants:
        row = next(row for row in ab["rows"] if row["dataset"] == ds and row["variant"] == v)
        vals.append(row.get("slowdown_vs_full", np.nan))  # NaN = infeasible (no bar)
    # bars start at 1.0 (full DHP), so their length is the change
    bars = ax.barh(np.arange(len(variants)) + (j - (len(datasets) - 1) / 2) * h, np.asarray(vals) - 1.0, h,
                   left=1.0, label=ds)
    ax.bar_label(bars, labels=[f"{v:.3f}x" for v in vals], fontsize=6, padding=2)
ax.set_yticks(np.arange(len(variants)), variants, fontsize=8)
ax.axvline(1.0, color="black", lw=0.8)
ax.set_xlabel("step time / full DHP (right of 1 = the part switched off was helping)")
ax.legend(fontsize=7)
ax.set_title(caption(ab), fontsize=8)
infeasible = [f"{row['dataset']} / {row['variant']}" for row in ab["rows"] if "infeasible" in row]
print("infeasible variants:", infeasible or "none")

# %% [markdown]
# ## Estimator accuracy (experiment 5)
# The cost model fitted from profiled group times, checked on held-out points. This one is a
# **measurement** on the machine in the label (or says why it was not measured). Unlike the
# simulated results it is only regenerated where the profiler can run, so its file may be absent.

# %%
try:
    est = load("e5_estimator")
except FileNotFoundError as e:
    est = None
    print(f"no estimator result to show: {e}")
if est is not None:
    table(est)
if est is not None and est.get("measured") and est["rows"]:
    fig, ax = plt.subplots(figsize=(4.2, 4), layout="constrained")
    m = np.array([x["measured_s"] for x in est["rows"]]) * 1e3
    e = np.array([x["estimate_s"] for x in est["rows"]]) * 1e3
    ax.plot(m, e, "o")
    lim = [0, max(m.max(), e.max()) * 1.1]
    ax.plot(lim, lim, "k-", lw=0.6, label="estimate = measurement")
    ax.set_xlim(lim)
    ax.set_ylim(lim)
    ax.legend(fontsize=7)
    ax.set_xlabel("measured group time (ms)")
    ax.set_ylabel("estimated (ms)")
    ax.set_title(caption(est), fontsize=7);
elif est is not None:
    print("not measured:", est.get("reason"))
