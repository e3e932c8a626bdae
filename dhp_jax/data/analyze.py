"""What DHP would do for a dataset: token-length profile and simulated step times per strategy.

`analyze(source, model, ranks, batch)` streams a JSONL manifest (or draws a built-in mix), keeps
per-sample token counts only (text / image / video tokens and eta, a few bytes a sample), builds a
token-length histogram with modality shares, then draws `num_batches` global batches by seed and
prices the plans of "dhp" and the best static baselines with the simulator. Pure NumPy: no jax.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import numpy as np

from dhp_jax.data.manifest import ManifestStats, iter_manifest
from dhp_jax.data.sample import Sample
from dhp_jax.data.vision import family_for_model

DEFAULT_STRATEGIES = ("dhp", "static-ring:best", "static-ulysses:best")


@dataclasses.dataclass
class TokenProfile:
    """Per-sample token counts of a dataset (int64[K] each) and bidirectional shares (float64[K])."""

    text: np.ndarray
    image: np.ndarray
    video: np.ndarray
    eta: np.ndarray

    @property
    def total(self) -> np.ndarray:
        return self.text + self.image + self.video

    @classmethod
    def from_samples(cls, samples: Sequence[Sample] | Any) -> "TokenProfile":
        """Collect counts while iterating (works on a stream: only the counts are kept)."""
        cols: list[list[Any]] = [[], [], [], []]
        for s in samples:
            t = i = v = 0
            for g in s.segments:
                if g.modality == "text":
                    t += g.num_tokens
                elif g.modality == "image":
                    i += g.num_tokens
                else:
                    v += g.num_tokens
            for col, x in zip(cols, (t, i, v, s.bidirectional_share)):
                col.append(x)
        return cls(*(np.asarray(c, dtype=np.int64) for c in cols[:3]), np.asarray(cols[3], dtype=np.float64))


def summary(profile: TokenProfile) -> dict[str, Any]:
    """Length statistics, token shares by modality and sample counts by kind."""
    total = profile.total
    n = int(total.size)
    if n == 0:
        raise ValueError("the dataset has no samples to analyze")
    tok = float(total.sum())
    return {
        "samples": n,
        "tokens": int(tok),
        "length": {"mean": float(total.mean()), "median": float(np.median(total)),
                   "p90": float(np.percentile(total, 90)), "p99": float(np.percentile(total, 99)),
                   "min": int(total.min()), "max": int(total.max())},
        "token_share": {"text": float(profile.text.sum() / tok) if tok else 0.0,
                        "image": float(profile.image.sum() / tok) if tok else 0.0,
                        "video": float(profile.video.sum() / tok) if tok else 0.0},
        "sample_kinds": {"text_only": int(np.sum((profile.image == 0) & (profile.video == 0))),
                         "with_image": int(np.sum(profile.image > 0)),
                         "with_video": int(np.sum(profile.video > 0))},
    }


def histogram(profile: TokenProfile) -> list[dict[str, Any]]:
    """Samples binned by total length on a powers-of-two ladder, with each bin's modality tokens.

    Bin b holds lengths in [2^b, 2^(b+1)) (bin 0 also holds length 0).
    """
    total = profile.total
    b = np.floor(np.log2(np.maximum(total, 1))).astype(np.int64)
    rows = []
    for k in range(int(b.min()), int(b.max()) + 1):
        m = b == k
        rows.append({"lo": int(2 ** k), "hi": int(2 ** (k + 1)), "samples": int(m.sum()),
                     "text_tokens": int(profile.text[m].sum()), "image_tokens": int(profile.image[m].sum()),
                     "video_tokens": int(profile.video[m].sum())})
    return rows


def simulate(profile: TokenProfile, model: str, hardware: str, ranks: int, batch: int, num_batches: int,
             seed: int, strategies: Sequence[str] = DEFAULT_STRATEGIES, ranks_per_node: int = 8) -> dict[str, Any]:
    """Step time of each strategy on `num_batches` batches drawn by `seed` (simulated, not measured).

    Batches are drawn without replacement inside a batch when the data has enough samples. A
    strategy that cannot plan a batch (a sample longer than all ranks hold) is reported as failed.
    ":best" baselines pick their best degree per batch, which favours them over one fixed degree.
    """
    from dhp_jax.planner import CostModel, PlanningError, plan_batch
    from dhp_jax.sim import step_time

    cost = CostModel.preset(model, hardware, ranks_per_node=ranks_per_node)
    rng = np.random.default_rng(seed)
    total, eta = profile.total, profile.eta
    K = total.size
    per: dict[str, dict[str, Any]] = {s: {"step_time_s": [], "solve_ms": [], "error": None, "solver": []}
                                      for s in strategies}
    for _ in range(num_batches):
        idx = rng.choice(K, size=batch, replace=batch > K)
        L, E = total[idx], eta[idx]
        for s in strategies:
            r = per[s]
            if r["error"]:
                continue
            try:
                plan = plan_batch(L, ranks, cost, s, etas=E)
            except PlanningError as e:
                r["error"] = str(e)
                continue
            r["step_time_s"].append(step_time(plan, L, cost, E))
            r["solve_ms"].append(float(plan.solver.get("solve_ms", 0.0)))
            r["solver"].append({k: v for k, v in plan.solver.items() if k in ("degree", "num_micro_batches")})
    out: dict[str, Any] = {"model": model, "hardware": hardware, "ranks": ranks, "ranks_per_node": ranks_per_node,
                           "batch": batch, "num_batches": num_batches, "seed": seed,
                           "kind": f"simulated with CostModel.preset({model!r}, {hardware!r})", "strategies": {}}
    for s, r in per.items():
        ok = not r["error"] and r["step_time_s"]
        out["strategies"][s] = {
            "mean_step_time_s": float(np.mean(r["step_time_s"])) if ok else None,
            "step_time_s": r["step_time_s"] if ok else [],
            "median_solve_ms": float(np.median(r["solve_ms"])) if ok else None,
            "choices": r["solver"] if ok else [],
            "error": r["error"],
        }
    base = {s: v["mean_step_time_s"] for s, v in out["strategies"].items()
            if s != "dhp" and v["mean_step_time_s"] is not None}
    dhp = out["strategies"].get("dhp", {}).get("mean_step_time_s")
    if base and dhp:
        best = min(base, key=base.get)
        out["best_baseline"] = best
        out["speedup_vs_best_baseline"] = base[best] / dhp
    return out


def load_profile(source: str, vision: str, *, skip_bad: bool = False, image_root: str | None = None,
                 tokenizer: str | None = None, mix_samples: int = 8192,
                 seed: int = 0) -> tuple[TokenProfile, dict[str, Any]]:
    """Token profile of a manifest path (streamed) or of a built-in mix (`mix_samples` drawn)."""
    from dhp_jax.data.datasets import DATASETS, make_dataset
    if source in DATASETS and not os.path.isfile(source):
        prof = TokenProfile.from_samples(make_dataset(source, mix_samples, seed, vision=vision))
        return prof, {"source": source, "kind": "built-in mix", "samples_drawn": mix_samples}
    if not os.path.isfile(source):
        raise FileNotFoundError(f"manifest {source!r} not found (and not a built-in mix: {', '.join(DATASETS)})")
    stats = ManifestStats()
    prof = TokenProfile.from_samples(iter_manifest(source, vision, skip_bad=skip_bad, image_root=image_root,
                                                   tokenizer=tokenizer, stats=stats))
    info = {"source": source, "kind": "manifest", **dataclasses.asdict(stats)}
    return prof, info


def analyze(source: str, model: str = "qwen3-vl-8b", ranks: int = 64, batch: int = 512, *,
            hardware: str = "ascend-910b", vision: str | None = None, num_batches: int = 3, seed: int = 0,
            skip_bad: bool = False, image_root: str | None = None, tokenizer: str | None = None,
            strategies: Sequence[str] = DEFAULT_STRATEGIES, ranks_per_node: int = 8,
            mix_samples: int = 8192) -> dict[str, Any]:
    """The full report as a JSON-ready dict: data profile, histogram, simulated step times."""
    for name, v in (("ranks", ranks), ("batch", batch), ("num_batches", num_batches)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    vision = vision or family_for_model(model)
    prof, info = load_profile(source, vision, skip_bad=skip_bad, image_root=image_root, tokenizer=tokenizer,
                              mix_samples=mix_samples, seed=seed)
    return {"data": {**info, "vision": vision, **summary(prof)}, "histogram": histogram(prof),
            "simulation": simulate(prof, model, hardware, ranks, batch, num_batches, seed, strategies,
                                   ranks_per_node)}
