"""The family memory bench: the memory model vs the compiled group programs of the three Hugging Face
families (InternVL, Qwen2.5-VL, Qwen3-VL at published sizes), degrees x tokens.

Runs `python -m dhp_jax bench memory --families MODEL --rows-file FILE --json` once per model in a
subprocess (each asks for 8 fake CPU devices before jax starts), appending every measured row to
`experiments/results/memory_families.rows.jsonl` as it comes. A run resumes from that file: a
(model, degree, tokens, depth) already measured is not compiled again (the compiled bytes depend on
the engine's family program, not on the memory model), and a run stopped by `timeout_s` keeps what it
measured; the rows not measured are listed as not run. Each row is measured at each remat of
`remats` ("none", "layer"; a row without a "remat" key predates the remat column: "none"). The model columns are priced again here
from each row's compiled parameter count with the current memory model
(`dhp_jax.sharding.family_memory.modelled`), so the table is the current model vs the compiled bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROWS_FILE = Path(__file__).parent / "results" / "memory_families.rows.jsonl"


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _remat(row: dict[str, Any]) -> str:
    return row.get("remat", "none")


def _reprice(row: dict[str, Any], raw: dict[str, Any], depth: list[int]) -> dict[str, Any]:
    from dhp_jax.model.hf.config import with_depth
    from dhp_jax.sharding.family_memory import modelled

    remat = _remat(row)
    if "added" in row:                       # a layer row: the difference of two programs
        extra = [depth[0] + 1, depth[1]] if row["added"] == "llm_layer" else [depth[0], depth[1] + 1]
        want = (modelled(with_depth(raw, *extra), row["params"], row["degree"], row["tokens"], remat=remat)
                - modelled(with_depth(raw, *depth), row["base_params"], row["degree"], row["tokens"], remat=remat))
    else:
        want = modelled(with_depth(raw, *depth), row["params"], row["degree"], row["tokens"], remat=remat)
    return {**row, "remat": remat, "model_bytes": int(want), "ratio": round(want / row["compiled_bytes"], 4)}


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    del seed                                                        # nothing random: compiled sizes
    from dhp_jax.sharding.family_memory import BASE, load_model_config

    rows_file = Path(p["rows_file"] or ROWS_FILE)
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    if p["fresh"] and rows_file.exists():          # measure everything again (the tiny variant)
        rows_file.unlink()
    depth = list(BASE)
    checks = [tuple(c) for c in p["layer_checks"]]
    remats = list(p["remats"])
    deadline = time.monotonic() + float(p["timeout_s"])
    # the fake CPU devices, asked for before the subprocess imports jax (`dhp bench memory` imports it
    # before it reads --devices)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={max(p['degrees'])}"])}
    for spec, remat in ((spec, remat) for spec in p["models"] for remat in remats):
        name, _ = load_model_config(spec)
        mine = [r for r in _read(rows_file) if r["model"] == name and _remat(r) == remat]
        have = {(r["degree"], r["tokens"]) for r in mine if "added" not in r}
        checked = {(r["degree"], r["tokens"]) for r in mine if "added" in r}
        grid = [(d, s) for d in p["degrees"] for s in p["tokens"] if (d, s) not in have]
        todo_checks = [c for c in checks if c not in checked]
        if not grid and not todo_checks:
            log(f"{name} remat {remat}: every row already measured ({rows_file.name})")
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            log(f"{name}: no time left (timeout_s {p['timeout_s']})")
            continue
        # one subprocess per degree, for what is missing at that degree
        for d in sorted({d for d, _ in grid} | {a for a, _ in todo_checks}):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            cmd = [sys.executable, "-m", "dhp_jax", "bench", "memory", "--json", "--families", spec,
                   "--degrees", str(d), "--tokens", ",".join(str(s) for dd, s in grid if dd == d),
                   "--layer-checks", ";".join(f"{a},{b}" for a, b in todo_checks if a == d),
                   "--rows-file", str(rows_file), "--remat", remat]
            log(" ".join(cmd[1:]))
            try:
                subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env)
            except subprocess.TimeoutExpired:
                log(f"{name} degree {d}: stopped at timeout_s; the rows measured so far are kept")
    rows, layer_rows = [], []
    for spec in p["models"]:
        name, raw = load_model_config(spec)
        seen = set()
        for r in _read(rows_file):
            if r["model"] != name:
                continue
            key = (_remat(r), r["degree"], r["tokens"], r.get("added"))
            if key in seen:
                continue
            seen.add(key)
            (layer_rows if "added" in r else rows).append(_reprice(r, raw, depth))
    measured = {(r["model"], r["remat"], r["degree"], r["tokens"]) for r in rows}
    names = [load_model_config(s)[0] for s in p["models"]]
    not_run = [{"model": m, "remat": x, "degree": d, "tokens": s} for m in names for x in remats
               for d in p["degrees"] for s in p["tokens"] if (m, x, d, s) not in measured]
    ratios = [r["ratio"] for r in rows + layer_rows]
    summary = [f"{len(rows)} of {len(rows) + len(not_run)} (model, remat, degree, tokens) rows measured at {depth[0]} LLM "
               f"layers and {depth[1]} encoder blocks; model/compiled from {min(ratios, default=0):.3f} to "
               f"{max(ratios, default=0):.3f} (rows and per-layer rows)"]
    for r in layer_rows:
        summary.append(f"{r['model']} remat {r['remat']} degree {r['degree']}, {r['tokens']} tokens: one more {r['added']} adds "
                       f"{r['compiled_bytes'] / 1e6:.0f} MB compiled, {r['model_bytes'] / 1e6:.0f} MB modelled "
                       f"({r['ratio']:.3f})")
    return {"label": f"measured: XLA memory_analysis of the family group program (abstract params, fp32, remat "
                     f"{' and '.join(remats)}, "
                     f"{depth[0]} LLM layers + {depth[1]} encoder blocks, 8 fake CPU devices) vs "
                     "`group_program_bytes` of the same shape",
            "depth": depth, "rows": rows, "layer_rows": layer_rows, "not_run": not_run,
            "full_depth_bound": [min(ratios), max(ratios)] if ratios else None,
            "rows_file": str(rows_file.name), "summary": summary}


def plot(result: dict[str, Any], path: Any) -> None:
    """Model / compiled bytes per row, by model and remat."""
    import matplotlib.pyplot as plt

    from experiments.common import save_figure

    fig, ax = plt.subplots(figsize=(8, 4))
    series = sorted({(r["model"], r.get("remat", "none")) for r in result["rows"]})
    for m, remat in series:
        rs = [r for r in result["rows"] if r["model"] == m and r.get("remat", "none") == remat]
        ax.scatter([f"d{r['degree']} {r['tokens'] // 1024}k" for r in rs], [r["ratio"] for r in rs],
                   label=f"{m} ({remat})", s=18, marker="o" if remat == "none" else "^")
    ax.axhspan(0.9, 1.1, color="0.9", zorder=0)
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set(ylabel="model / compiled bytes", title="family group programs")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelsize=7, rotation=45)
    save_figure(fig, path, "memory: family programs, model vs compiled")
