"""Experiment 5: estimator accuracy, measured: profile one-group executables on this machine's fake
CPU devices through the public profiler API, fit the cost model on a training split, and report the
relative error on held-out points (the paper's table: 4.1-7.9 % on Ascend 910B for 2B-8B models).

The profiling runs in a subprocess (the device count must be set before jax is imported). If the
profiler, the fitter or the executor is missing or fails, the result says "not measured" and why.
`refit_from: <an earlier e5 result JSON>` skips the profiling and refits that run's saved timings with
today's fitter (the label says so). Besides the profile's own held-out split (seed 0, against which
the model form was tuned) every result reports a fresh split (`fresh_split_seed`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from experiments.runner import REPO, describe_machine
from experiments.common import save_figure


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    where = describe_machine()
    if p["refit_from"]:
        return _refit(p, where)
    params = {k: p[k] for k in ("model_preset", "devices", "degrees", "lengths", "packs", "repeats",
                                "holdout_every", "base_model")}
    params["seed"] = seed
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        try:
            proc = subprocess.run([sys.executable, "-m", "experiments.profile_worker", str(out), json.dumps(params)],
                                  cwd=REPO, capture_output=True, text=True, timeout=p["timeout_s"])
        except subprocess.TimeoutExpired:
            return _not_measured(f"profiling took longer than {p['timeout_s']} s", where)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return _not_measured(f"profiler exited {proc.returncode}: {' | '.join(tail)}", where)
        prof = json.loads(out.read_text())
    return _analyse(prof, p, f"measured ({prof['machine']}; {where})", log)


def _refit(p: dict[str, Any], where: str) -> dict[str, Any]:
    """Today's fit of the timings an earlier e5 run saved (its machine, its measurements)."""
    from dhp_jax.planner import CostModel
    from dhp_jax.train.profile import fit_profile

    path = Path(p["refit_from"])
    path = path if path.is_absolute() else REPO / path
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return _not_measured(f"refit_from {str(path)!r} cannot be read: {e}", where)
    if not old.get("measurements") or not old.get("cost"):
        return _not_measured(f"refit_from {str(path)!r} holds no saved timings", where)
    cost, report = fit_profile(old["measurements"], CostModel.from_dict(old["cost"]), holdout_every=p["holdout_every"])
    prof = {"report": report, "measurements": old["measurements"], "cost": cost.to_dict(),
            "machine": f"{old.get('label', '?')} (saved timings, refit with today's code)", "profile_wall_s": old.get("profile_wall_s"),
            "model_preset": old.get("config", {}).get("model_preset", p["model_preset"])}
    label = (f"measured (timings of {old.get('created_utc', '?')}, commit {old.get('versions', {}).get('dhp_jax_commit')}, "
             f"{old.get('label', '?')}; refit with today's code)")
    return {**_analyse(prof, p, label, lambda s: None), "refit_from": str(p["refit_from"])}


def _errors_row(model: str, points: int, held: int, errs: Any, train_err: Any, label: str) -> dict[str, Any]:
    errs = np.asarray(errs) if len(errs) else np.asarray([np.nan])
    return {"model": model, "points": points, "held_out": held, "mean_rel_error": float(np.mean(errs)),
            "median_rel_error": float(np.median(errs)), "max_rel_error": float(np.max(errs)),
            "train_mean_rel_error": train_err, "label": label}


def _analyse(prof: dict[str, Any], p: dict[str, Any], label: str, log: Callable[[str], None]) -> dict[str, Any]:
    from dhp_jax.planner import CostModel
    from dhp_jax.train.profile import fit_profile

    rep = prof["report"]
    held = rep.get("held_out", [])
    rows = [{"degree": h["degree"], "lengths": h["lengths"], "measured_s": h["seconds"],
             "estimate_s": h["estimate_s"], "rel_error": h["rel_error"]} for h in held]
    model = prof.get("model_preset", p["model_preset"])
    table = [_errors_row(model, rep["num_points"], rep["num_held_out"], [r["rel_error"] for r in rows],
                         rep.get("train_mean_rel_error"), label)]
    base = CostModel.from_dict(prof["cost"])
    seed = int(p["fresh_split_seed"])
    _, fresh = fit_profile(prof["measurements"], base, holdout_every=p["holdout_every"], seed=seed)
    table.append(_errors_row(f"{model} (fresh split, seed {seed})", fresh["num_points"], fresh["num_held_out"],
                             [h["rel_error"] for h in fresh["held_out"]], fresh.get("train_mean_rel_error"), label))
    # The same fit on the degree-1 points alone: one device, no ring, so the cost model's compute terms
    # are tested without the fake devices' missing parallelism (they share the host's cores).
    one = [m for m in prof["measurements"] if m["degree"] == 1]
    if len(one) >= 2 * p["holdout_every"]:
        _, rep1 = fit_profile(one, base, holdout_every=p["holdout_every"])
        table.append(_errors_row(f"{model} (degree 1 only)", rep1["num_points"], rep1["num_held_out"],
                                 [h["rel_error"] for h in rep1["held_out"]], rep1.get("train_mean_rel_error"), label))
    for t in table:
        log(f"{t['model']}: held-out error mean {t['mean_rel_error']:.1%}, max {t['max_rel_error']:.1%} "
            f"over {t['held_out']} points")
    return {"label": label, "measured": True, "table": table, "rows": rows, "cost": prof["cost"],
            "measurements": prof["measurements"],
            "fit": rep.get("fit"), "profile_wall_s": prof["profile_wall_s"],
            "summary": [f"estimator held-out error on {prof['machine']}, {t['model']}: mean {t['mean_rel_error']:.1%}, "
                        f"max {t['max_rel_error']:.1%} ({t['held_out']} held-out of {t['points']} points)" for t in table]}


def _not_measured(reason: str, where: str) -> dict[str, Any]:
    return {"label": f"not measured ({where})", "measured": False, "reason": reason, "table": [], "rows": [],
            "summary": [f"estimator accuracy NOT measured: {reason}"]}


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    rows = result["rows"]
    if rows:
        m = np.asarray([r["measured_s"] for r in rows])
        e = np.asarray([r["estimate_s"] for r in rows])
        sc = ax.scatter(m * 1e3, e * 1e3, c=[r["degree"] for r in rows], cmap="viridis")
        lim = [min(m.min(), e.min()) * 1e3 * 0.9, max(m.max(), e.max()) * 1e3 * 1.1]
        ax.plot(lim, lim, "k--", lw=0.8)
        fig.colorbar(sc, ax=ax, label="degree")
        ax.set_xlabel("measured ms (held out)")
        ax.set_ylabel("estimated ms")
    else:
        ax.text(0.5, 0.5, "not measured:\n" + result.get("reason", "")[:200], ha="center", va="center",
                wrap=True, fontsize=7, transform=ax.transAxes)
    save_figure(fig, path, f"{result['name']}: {result['label']}"[:90], ax=ax, fontsize=7)
