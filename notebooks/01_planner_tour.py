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
# # 01 · A tour of the DHP planner
#
# The planner turns one global batch of multimodal samples into a `Plan`: micro-batches, each a
# set of context-parallel (CP) groups `(ranks, degree, samples)` of any size. This notebook
#
# 1. draws a batch from each built-in data mix and looks at its token-length histogram,
# 2. plans one batch with `"dhp"` and with the static baselines (one CP degree for everything),
# 3. draws each plan as a ranks x time picture,
# 4. asks "what if" questions (more ranks, less memory, another model) by re-planning.
#
# Everything here is pure Python/NumPy (no JAX) and every time shown is **simulated** with the
# analytic `CostModel` preset named in each cell, not measured.

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import LogNorm

from dhp_jax.data import DATASETS, make_dataset, sample_etas, sample_lengths
from dhp_jax.data.token_profile import TokenProfile, summary
from dhp_jax.planner import CostModel, Plan, PlanningError, plan_batch
from dhp_jax.planner.cost.memory import max_tokens_per_rank
from dhp_jax.planner.cost.plan_check import check_plan
from dhp_jax.planner.cost.pricing import allreduce_time
from dhp_jax.planner.plot import draw_plan as draw_plan_on
from dhp_jax.sim import step_time

# %% [markdown]
# ## Parameters
# Change these and re-run the notebook; the "what-if" section below varies them one at a time.

# %%
MODEL = "qwen3-vl-8b"      # one of CostModel.MODELS
HARDWARE = "ascend-910b"   # one of CostModel.HARDWARE
NUM_RANKS = 32             # model replicas (data-parallel ranks); 8 per node
BATCH = 256                # samples in the global batch
SEED = 0
MIX = "openvid"            # the mix planned in sections 2-4

print("models:  ", ", ".join(CostModel.MODELS))
print("hardware:", ", ".join(CostModel.HARDWARE))
print("mixes:   ", ", ".join(DATASETS))
cost = CostModel.preset(MODEL, HARDWARE)
print(f"\n{MODEL} on {HARDWARE}: {cost.memory_budget / 2**30:.1f} GiB activations per rank "
      f"= {max_tokens_per_rank(cost):,.0f} tokens per rank")

# %% [markdown]
# ## 1. One batch from each mix: token lengths
# Long-tailed video mixes put a few very long samples (tens of thousands of tokens) next to many
# short ones; that spread is what one static CP degree handles badly. The red line is the longest
# sample one rank's activation memory holds under the cost model above: anything right of it must
# be split over a CP group of several ranks.

# %%
batches = {name: make_dataset(name, BATCH, SEED) for name in DATASETS}

rows = []
for name, samples in batches.items():
    s = summary(TokenProfile.from_samples(samples))
    rows.append((name, s["length"]["median"], s["length"]["mean"], s["length"]["p99"], s["length"]["max"],
                 s["token_share"]["video"] + s["token_share"]["image"]))
print(f"{'mix':<14}{'median':>9}{'mean':>9}{'p99':>9}{'max':>9}{'vision share':>14}")
for name, med, mean, p99, mx, vis in rows:
    print(f"{name:<14}{med:>9.0f}{mean:>9.0f}{p99:>9.0f}{mx:>9d}{vis:>14.1%}")

# %%
fig, axes = plt.subplots(1, len(batches), figsize=(3.2 * len(batches), 2.8), sharey=True)
bins = np.logspace(0, np.log10(2e5), 36)
for ax, (name, samples) in zip(axes, batches.items()):
    ax.hist(sample_lengths(samples), bins=bins, color="tab:blue")
    ax.axvline(max_tokens_per_rank(cost), color="tab:red", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_title(name)
    ax.set_xlabel("tokens per sample")
axes[0].set_ylabel(f"samples (of {BATCH})")
axes[-1].text(max_tokens_per_rank(cost), axes[-1].get_ylim()[1] * 0.9, " one rank's\n memory", color="tab:red",
              fontsize=7, va="top")
fig.tight_layout()

# %% [markdown]
# ## 2. Plan one batch with DHP and the static baselines
# `static-ring:best` / `static-ulysses:best` try every degree that divides the rank count (for
# Ulysses, also the head count) and keep the best one, as a hand-tuned baseline would.
# `static-ring:32` is one fixed choice (four nodes per sequence group: the longest clips of this
# batch need more than two nodes of 64 GB NPUs).

# %%
STRATEGIES = ["dhp", "static-ring:best", "static-ulysses:best", "static-ring:32"]
samples = batches[MIX]
lengths, etas = sample_lengths(samples), sample_etas(samples)

plans: dict[str, Plan] = {}
for strategy in STRATEGIES:
    plans[strategy] = plan_batch(samples, NUM_RANKS, cost, strategy)

print(f"{MIX}, {BATCH} samples, {NUM_RANKS} ranks, {MODEL} on {HARDWARE} (simulated)")
print(f"{'strategy':<22}{'micro-batches':>14}{'groups':>8}{'degrees used':>22}{'step time s':>13}{'solve ms':>10}")
for strategy, plan in plans.items():
    t = step_time(plan, lengths, cost, etas)
    degs = sorted({g.degree for g in plan.groups}, reverse=True)
    print(f"{strategy:<22}{len(plan.micro_batches):>14}{len(plan.groups):>8}{str(degs):>22}"
          f"{t:>13.2f}{plan.solver['solve_ms']:>10.1f}")
base = min(step_time(p, lengths, cost, etas) for s, p in plans.items() if s != "dhp")
print(f"\nDHP speed-up over the best baseline: {base / step_time(plans['dhp'], lengths, cost, etas):.2f}x")

# %% [markdown]
# Every plan is a checked, JSON-serialisable contract. The checks below can fail: the plan's own
# estimate must agree with the simulator, every sample must be in exactly one group, and the JSON
# round trip must give the same plan.

# %%
for strategy, plan in plans.items():
    check_plan(plan, cost, lengths, num_samples=BATCH)
    assert Plan.from_json(plan.to_json()) == plan, strategy
    assert np.isclose(plan.est_step_time_s, step_time(plan, lengths, cost, etas), rtol=1e-9), strategy
    assert sorted(s for g in plan.groups for s in g.samples) == list(range(BATCH)), strategy
print(plans["dhp"].to_json()[:400], "...")

# %% [markdown]
# ## 3. Ranks x time
# Each micro-batch runs its groups side by side; a box spans the ranks of one group for its
# estimated time, labelled with its degree and number of sequences. The step ends with one gradient
# all-reduce over all ranks (grey). Ranks idle inside a micro-batch show as white gaps.

# %%
def draw_plan(ax, plan: Plan, cost: CostModel, title: str = "", key: bool = True) -> float:
    """The planner's ranks x time drawing, with the step's gradient all-reduce at the end (grey)."""
    return draw_plan_on(ax, plan, allreduce_time(cost, plan.num_ranks), title, key=key)


fig, axes = plt.subplots(len(plans), 1, figsize=(10, 2.3 * len(plans)), sharex=True, layout="constrained")
ends = []
for ax, (strategy, plan) in zip(axes, plans.items()):
    ends.append(draw_plan(ax, plan, cost, f"{strategy}: {plan.est_step_time_s:.1f} s, "
                                          f"{len(plan.micro_batches)} micro-batch(es)", key=False))
    assert np.isclose(ends[-1], plan.est_step_time_s), strategy  # the picture adds up to the estimate
    ax.label_outer()
axes[0].set_xlim(0, max(ends) * 1.02)
fig.colorbar(plt.cm.ScalarMappable(LogNorm(1, NUM_RANKS), "viridis"), ax=axes, label="group degree", shrink=0.6)

# %% [markdown]
# ## 4. What if? Sliders in code
# `what_if(...)` re-plans the same batch under changed settings and redraws DHP's plan beside the
# best static ring. Call it with other values (or, where `ipywidgets` is installed, use the
# interactive version at the end). `memory_gib` overrides the activation budget per rank.

# %%
def what_if(ranks: int = NUM_RANKS, memory_gib: float | None = None, model: str = MODEL, mix: str = MIX,
            hardware: str = HARDWARE, batch: int = BATCH, draw: bool = True) -> dict:
    """Re-plan `mix` with these settings; print and (optionally) draw DHP vs the best static ring."""
    c = CostModel.preset(model, hardware)
    if memory_gib is not None:
        c = c.replace(memory_budget=memory_gib * 2**30)
    smp = make_dataset(mix, batch, SEED)
    L, E = sample_lengths(smp), sample_etas(smp)
    out = {"ranks": ranks, "memory_gib": round(c.memory_budget / 2**30, 2), "model": model, "mix": mix}
    drawn = {}
    for strategy in ("dhp", "static-ring:best"):
        t0 = time.perf_counter()
        try:
            p = plan_batch(smp, ranks, c, strategy)
        except PlanningError as e:  # e.g. a sample longer than all ranks can hold
            out[strategy] = f"infeasible: {e}"
            continue
        out[strategy] = round(step_time(p, L, c, E), 3)
        out[strategy + " plan ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        drawn[strategy] = p
    if isinstance(out.get("dhp"), float) and isinstance(out.get("static-ring:best"), float):
        out["speed-up"] = round(out["static-ring:best"] / out["dhp"], 2)
    print(out)
    if draw and drawn:
        fig, axes = plt.subplots(1, len(drawn), figsize=(6 * len(drawn), 0.12 * ranks + 1.5), squeeze=False)
        for ax, (s, p) in zip(axes[0], drawn.items()):
            draw_plan(ax, p, c, f"{s}: {p.est_step_time_s:.1f} s")
        fig.suptitle(f"{mix}, {batch} samples, {ranks} ranks, {model}, {out['memory_gib']} GiB/rank", fontsize=9)
        fig.tight_layout()
        plt.show()
    return out


base_case = what_if()

# %% [markdown]
# More ranks: the batch spreads thinner, so fewer micro-batches and shorter steps.

# %%
scaling = [what_if(ranks=r, draw=r == 64) for r in (32, 64, 128)]
assert scaling[0]["dhp"] > scaling[2]["dhp"]  # 4x the ranks must shorten the step

# %% [markdown]
# Less memory per rank: long clips need more ranks each, and at some point no plan exists at all
# (the planner says which sample does not fit).

# %%
tight = what_if(memory_gib=8.0)
too_tight = what_if(memory_gib=0.25, draw=False)
assert str(too_tight["dhp"]).startswith("infeasible"), too_tight

# %% [markdown]
# Another model and another mix: a smaller model on the image-instruction mix, where most samples
# are short, so small groups (often a single rank) carry most of the batch.

# %%
other = what_if(model="internvl3-2b", mix="llava-mix")

# %% [markdown]
# ### Interactive sliders (optional)
# With `ipywidgets` installed this cell shows sliders bound to `what_if`; without it, nothing
# happens (the executed path never needs it).

# %%
try:
    import ipywidgets as widgets
except ImportError:
    widgets = None
    print("ipywidgets is not installed: call what_if(...) directly instead")
if widgets is not None:
    widgets.interact(what_if, ranks=widgets.IntSlider(value=NUM_RANKS, min=8, max=128, step=8),
                     memory_gib=widgets.FloatSlider(value=cost.memory_budget / 2**30, min=1.0, max=48.0),
                     model=list(CostModel.MODELS), mix=list(DATASETS), hardware=list(CostModel.HARDWARE),
                     batch=widgets.fixed(BATCH), draw=widgets.fixed(True))
