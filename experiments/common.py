"""Helpers shared by the experiments: strategy grids over shared batches, labels, plot styling."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from dhp_jax.planner.compare import Comparison
from dhp_jax.sim.cluster import Cluster
from dhp_jax.sim.simulate import SimRun, make_batches, simulate

STATIC = ("static-ring:best", "static-ulysses:best")
LABELS = {"dhp": "DHP (any degree)", "static-ring:best": "static ring CP (best)",
          "static-ulysses:best": "static Ulysses (best)", "flexsp": "FlexSP-style pow2 MILP",
          "milp": "exact MILP"}


def simulated_label(cluster: Cluster) -> str:
    return f"simulated ({cluster.hardware} preset, {cluster.model}, {cluster.nodes}x{cluster.ranks_per_node} ranks)"


def run_strategies(cluster: Cluster, dataset: str, strategies: Sequence[str], *, batch: int, steps: int,
                   seed: int, log: Callable[[str], None] = lambda s: None,
                   plan_options: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, SimRun]:
    """Simulate every strategy on the very same batches (one draw) and cost model."""
    batches = make_batches(dataset, batch, steps, seed, cluster.vision)
    cost = cluster.cost_model()
    runs = {}
    for s in strategies:
        opts = dict((plan_options or {}).get(s, {}))
        run = simulate(cluster, batches, s, cost=cost, plan_options=opts)
        run.dataset = dataset
        runs[s] = run
        log(f"{cluster.model:>15} {dataset:>10} {cluster.num_ranks:>5} ranks  {s:<22} "
            f"{run.mean_step_s:8.3f} s/step  plan {np.median(run.plan_wall_ms):7.1f} ms")
    return runs


def best_static(runs: Mapping[str, SimRun]) -> tuple[str, float]:
    """The fastest static baseline (mean step time), as (strategy, seconds)."""
    best = Comparison(dict(runs)).best_static([s for s in runs if s in STATIC])
    if best is None:
        raise ValueError("no static baseline among the strategies run")
    return best, runs[best].mean_step_s


def static_degree(run: SimRun) -> str:
    """The degree a static run used, e.g. '<8>x4' (one degree, 4 groups)."""
    degs = {d for step in run.degrees for mb in step for d in mb}
    groups = {len(mb) for step in run.degrees for mb in step}
    return "/".join(f"<{d}>" for d in sorted(degs)) + "x" + "/".join(str(g) for g in sorted(groups))


def degree_multiset(degrees: Sequence[int]) -> str:
    """[8, 6, 6, 4] -> '8x1, 6x2, 4x1' (the paper's case-study notation: degree x group count)."""
    vals, counts = np.unique(np.asarray(degrees), return_counts=True)
    return ", ".join(f"{v}x{c}" for v, c in sorted(zip(vals.tolist(), counts.tolist()), reverse=True))


def save_figure(fig: Any, path: Any, title: str, *, ax: Any = None, fontsize: int = 9, legend: bool = False) -> None:
    """Title a figure (on `ax`, else as the figure's suptitle), lay it out, write it to `path` and
    close it: the common end of every experiment's plot."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig.suptitle(title, fontsize=fontsize)
    else:
        ax.set_title(title, fontsize=fontsize)
        if legend:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
