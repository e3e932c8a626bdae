"""The memory bench: compiled bytes vs the memory model, of one group program and of a whole step.

Runs `python -m dhp_jax bench memory --json` (one group program per model, degree and tokens) and
`python -m dhp_jax bench memory --step --json` (every program of a step, in dispatch order, for
plans with 2 and 3 micro-batches) in subprocesses (each asks for its own number of fake CPU
devices, which must be set before jax starts) and keeps both outputs in one result,
`experiments/results/memory_bench.json`; `experiments.report` renders its tables.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Callable


def _bench(args: list[str], log: Callable[[str], None]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "dhp_jax", "bench", "memory", "--json", *args]
    log(" ".join(cmd[1:]))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def run(p: dict[str, Any], *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    del seed                                                        # nothing random: compiled sizes
    common = ["--hardware", p["hardware"], "--state-shards", str(p["state_shards"])]
    common += ["--extrapolate"] if p["extrapolate"] else []
    models = [arg for m in p["models"] for arg in ["--model", m]]
    program = _bench([*models,
                      "--degrees", ",".join(map(str, p["degrees"])), "--tokens", ",".join(map(str, p["tokens"])),
                      *common, *([] if p["fits"] else ["--no-fits"])], log)
    step = _bench(["--step", "--rows", ";".join(f"{m},{d},{t}" for m, d, t in p["step_rows"]),
                   "--micro-batches", ",".join(map(str, p["micro_batches"])), *common], log)
    worst = max(program["rows"], key=lambda r: abs(r["rel_error"]))
    worst_step = max(step["rows"], key=lambda r: abs(r["rel_error"]))
    summary = [f"group program: worst model error {worst['rel_error']:+.1%} over {len(program['rows'])} rows "
               f"({worst['model']}, degree {worst['degree']}, {worst['tokens']} tokens)",
               f"whole step: worst model error {worst_step['rel_error']:+.1%} over {len(step['rows'])} rows "
               f"({worst_step['model']}, degree {worst_step['degree']}, {worst_step['tokens']} tokens, "
               f"{worst_step['micro_batches']} micro-batches)"]
    for r in step["rows"]:
        if r["model"] == "internvl3-8b":
            total = r["compiled_step_bytes"] + r["state_bytes"]
            summary.append(f"internvl3-8b degree {r['degree']}, {r['tokens']} tokens, {r['micro_batches']} "
                           f"micro-batches: step peak {r['compiled_step_bytes'] / 1e9:.1f} GB + state "
                           f"{r['state_bytes'] / 1e9:.1f} GB = {total / 1e9:.1f} GB of {r['usable_bytes'] / 1e9:.1f} "
                           f"GB usable: {'fits' if r['fits'] else 'does NOT fit'}")
    return {"label": f"measured: {program['label']}", "step_label": f"measured: {step['label']}", "hardware": program["hardware"],
            "remat": program["remat"], "compute_dtype": program["compute_dtype"], "rows": program["rows"],
            "fits": program.get("fits"), "step_rows": step["rows"], "summary": summary}


def plot(result: dict[str, Any], path: Any) -> None:
    """Compiled vs modelled bytes: the group programs (left), the whole steps with the state (right)."""
    import matplotlib.pyplot as plt

    from experiments.common import save_figure

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    got = [r["compiled_bytes"] / 1e9 for r in result["rows"]]
    a.scatter(got, [r["model_bytes"] / 1e9 for r in result["rows"]], s=12)
    top = max(got) * 1.05
    a.plot([0, top], [0, top], "k:", lw=1)
    a.set(xlabel="compiled GB per device", ylabel="memory.group_program_bytes GB", title="group program")
    rows = result["step_rows"]
    x = range(len(rows))
    b.bar([i - 0.2 for i in x], [(r["compiled_step_bytes"] + r["state_bytes"]) / 1e9 for r in rows], 0.4,
          label="compiled step peak + state")
    b.bar([i + 0.2 for i in x], [(r["model_step_bytes"] + r["model_state_bytes"]) / 1e9 for r in rows], 0.4,
          label="memory.device_step_bytes + state")
    b.axhline(rows[0]["usable_bytes"] / 1e9, color="k", ls="--", lw=1, label="usable")
    b.set_xticks(list(x), [f"{r['model']}\nd={r['degree']} {r['tokens'] // 1024}k x{r['micro_batches']}" for r in rows],
                 fontsize=7)
    b.set(ylabel="GB per device", title="whole step")
    b.legend(fontsize=7)
    save_figure(fig, path, "memory: compiled vs modelled bytes per device")
