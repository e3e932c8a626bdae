"""Draw a plan as ranks x time: one rectangle per group per micro-batch (matplotlib).

`draw_plan` draws onto an axis (notebooks put several plans in one figure); `plot_plan` writes a
PNG with the Agg backend (`dhp plan --plot`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def rank_runs(ranks: Sequence[int]) -> list[tuple[int, int]]:
    """(first rank, count) of each run of consecutive ranks; a group may span separate runs."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([r, 1])
    return [(a, n) for a, n in runs]


def draw_plan(ax: Any, plan: Any, allreduce_s: float = 0.0, title: str = "", key: bool = True) -> float:
    """Draw `plan` on `ax` as ranks (y) x estimated time (x); returns the end time drawn.

    Micro-batches run back to back (dashed lines end them), then the gradient all-reduce
    (`allreduce_s`, grey). Colour = group degree on a log scale from 1 to all ranks, so plans on
    the same ranks compare; solid lines are node boundaries. A group whose ranks are not one
    consecutive run draws one block per run, each labelled. A colour bar and a legend say all this
    (`key=False` leaves them out, for a figure of several plans that draws one key for all).
    """
    # lazy: matplotlib is an optional dependency, needed only to draw
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    cmap, norm = plt.get_cmap("viridis"), LogNorm(1, max(2, plan.num_ranks))
    step = plan.est_step_time_s or sum(mb.est_makespan_s for mb in plan.micro_batches)
    t0 = 0.0
    for mb in plan.micro_batches:
        for g in mb.groups:
            runs = rank_runs(g.ranks)
            labelled = g.est_time_s > 0.06 * step and (g.degree >= 3 or plan.num_ranks <= 16)
            for i, (first, n) in enumerate(runs):
                ax.add_patch(Rectangle((t0, first - 0.5), g.est_time_s, n, facecolor=cmap(norm(g.degree)),
                                       edgecolor="white", lw=0.8))
                if labelled:  # every block of a wrapped group says which group it is
                    part = f" ({i + 1}/{len(runs)})" if len(runs) > 1 else ""
                    text = f"d={g.degree}{part}" + (f"\n{len(g.samples)} seq" if n >= 2 or len(runs) == 1 else "")
                    ax.text(t0 + g.est_time_s / 2, first + (n - 1) / 2, text,
                            ha="center", va="center", fontsize=6, color="white")
        t0 += mb.est_makespan_s
        ax.axvline(t0, color="black", lw=0.6, ls="--")
    if allreduce_s > 0:
        ax.add_patch(Rectangle((t0, -0.5), allreduce_s, plan.num_ranks, facecolor="lightgrey"))
    end = t0 + allreduce_s
    rpn = plan.ranks_per_node or plan.num_ranks
    for r in range(rpn, plan.num_ranks, rpn):
        ax.axhline(r - 0.5, color="black", linewidth=0.6)
    ax.set_xlim(0, max(end, 1e-9) * 1.02)
    ax.set_ylim(plan.num_ranks - 0.5, -0.5)
    ax.set_xlabel("estimated time (s)")
    ax.set_ylabel("rank")
    if not key:
        return end
    bar = plt.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, pad=0.01, fraction=0.03)
    degrees = sorted({g.degree for mb in plan.micro_batches for g in mb.groups})
    bar.set_ticks(degrees)
    bar.set_ticklabels([str(d) for d in degrees])
    bar.minorticks_off()
    bar.set_label("group degree (colour)", fontsize=8)
    handles = [Line2D([], [], color="black", lw=0.6, ls="--", label="end of a micro-batch")]
    if allreduce_s > 0:
        handles.append(Patch(facecolor="lightgrey", label="gradient all-reduce"))
    if rpn < plan.num_ranks:
        handles.append(Line2D([], [], color="black", lw=0.6, ls="-", label=f"node boundary ({rpn} ranks a node)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(handles), fontsize=7,
              frameon=False)
    ax.set_title(title or f"{plan.strategy}: {len(plan.micro_batches)} micro-batch(es), {plan.num_ranks} ranks",
                 fontsize=9)
    return end


def plot_plan(plan: Any, path: str | Path, title: str = "", allreduce_s: float = 0.0) -> None:
    """Write a PNG of `draw_plan` for one plan."""
    import matplotlib  # lazy: optional dependency

    matplotlib.use("Agg")
    # lazy: matplotlib is optional and slow to import
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, max(3.0, min(12.0, plan.num_ranks * 0.12))))
    draw_plan(ax, plan, allreduce_s, title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
