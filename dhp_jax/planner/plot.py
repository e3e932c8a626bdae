"""Draw a plan as ranks x time: one rectangle per group per micro-batch (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_plan(plan: Any, path: str | Path, title: str = "") -> None:
    """Write a PNG: x = estimated time (micro-batches back to back), y = rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(10, max(3.0, min(12.0, plan.num_ranks * 0.12))))
    cmap = plt.get_cmap("tab20")
    t0 = 0.0
    for m, mb in enumerate(plan.micro_batches):
        for gi, g in enumerate(mb.groups):
            colour = cmap((m * 7 + gi) % 20)
            # a group's ranks may be scattered across nodes: draw each contiguous run
            runs, start = [], g.ranks[0]
            for a, b in zip(g.ranks, g.ranks[1:] + (None,)):
                if b != a + 1:
                    runs.append((start, a))
                    start = b
            for lo, hi in runs:
                ax.add_patch(Rectangle((t0, lo), g.est_time_s, hi - lo + 1, facecolor=colour, edgecolor="black",
                                       linewidth=0.3))
            if g.degree >= 2 or plan.num_ranks <= 16:
                ax.text(t0 + g.est_time_s / 2, g.ranks[0] + g.degree / 2, str(g.degree), ha="center", va="center",
                        fontsize=8)
        t0 += mb.est_makespan_s
        ax.axvline(t0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlim(0, max(t0, 1e-9) * 1.02)
    ax.set_ylim(plan.num_ranks, 0)
    rpn = plan.ranks_per_node or plan.num_ranks
    for r in range(rpn, plan.num_ranks, rpn):
        ax.axhline(r, color="black", linewidth=0.6)
    ax.set_xlabel("estimated time (s); dashed lines end micro-batches; numbers are group degrees")
    ax.set_ylabel("rank (solid lines: node boundaries)")
    ax.set_title(title or f"{plan.strategy}: {len(plan.micro_batches)} micro-batch(es), {plan.num_ranks} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
