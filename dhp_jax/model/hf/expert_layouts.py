"""How checkpoints store a mixture-of-experts layer's experts, without jax or torch (both engines and
the streaming loader read it).

transformers holds a sparse layer's experts fused: `mlp.experts.gate_up_proj` [E, 2 I, d] (each
expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, d, I]. Published checkpoints
store them in one of `EXPERT_LAYOUTS` (a family's model-side module names its own, `EXPERT_LAYOUT`):
"fused" as transformers holds them; "fused_transposed" (Qwen3-VL-MoE's releases: [E, d, 2 I] and
[E, I, d]); "per_expert" (Qwen3-MoE's: one Linear per expert, `mlp.experts.{e}.gate_proj.weight`
[I, d], `up_proj` [I, d], `down_proj` [d, I]). Both engines' savers write a family's own layout
through `to_published`, so the JAX and the torch engine save the same files.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import numpy as np

EXPERT_LAYOUTS = ("fused", "fused_transposed", "per_expert")
MATRICES = ("gate_proj", "up_proj", "down_proj")
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def layout_of(family_module: Any) -> str:
    """The published expert layout of a family's model-side module (`EXPERT_LAYOUT`, else "fused")."""
    return getattr(family_module, "EXPERT_LAYOUT", "fused")


def per_expert_name(name: str) -> tuple[str, int, str] | None:
    """(the layer's `...mlp.experts` prefix, expert e, matrix) of a per-expert weight's name
    (`...mlp.experts.{e}.{gate,up,down}_proj.weight`), else None."""
    parts = name.split(".")
    if (len(parts) >= 5 and parts[-1] == "weight" and parts[-4] == "experts" and parts[-3].isdigit()
            and parts[-2] in MATRICES):
        return ".".join(parts[:-3]), int(parts[-3]), parts[-2]
    return None


def check_complete(prefix: str, have: Callable[[int, str], bool], n: int, where: str) -> None:
    """Every matrix of experts 0 .. n-1 of a layer is there, else an error naming the first missing."""
    missing = [f"{prefix}.{e}.{m}.weight" for e in range(n) for m in MATRICES if not have(e, m)]
    if missing:
        raise ValueError(f"{where}: expert weights missing, e.g. {missing[0]} ({len(missing)} missing)")


def fuse(prefix: str, mats: Mapping[tuple[int, str], Any], n: int, where: str = "checkpoint"
         ) -> Iterator[tuple[str, np.ndarray]]:
    """A layer's per-expert matrices {(e, matrix): array} as transformers' two fused weights."""
    check_complete(prefix, lambda e, m: (e, m) in mats, n, where)
    yield f"{prefix}.gate_up_proj", np.stack([np.concatenate([np.asarray(mats[e, "gate_proj"]),
                                                              np.asarray(mats[e, "up_proj"])], 0) for e in range(n)])
    yield f"{prefix}.down_proj", np.stack([np.asarray(mats[e, "down_proj"]) for e in range(n)])


def split(name: str, w: Any) -> dict[str, Any]:
    """A fused weight (`gate_up_proj` or `down_proj`) as its per-expert Linear weights."""
    out: dict[str, Any] = {}
    if name.endswith(".gate_up_proj"):
        prefix, inter = name[:-len(".gate_up_proj")], w.shape[1] // 2
        for e in range(w.shape[0]):
            out[f"{prefix}.{e}.gate_proj.weight"] = w[e, :inter]
            out[f"{prefix}.{e}.up_proj.weight"] = w[e, inter:]
    else:
        prefix = name[:-len(".down_proj")]
        for e in range(w.shape[0]):
            out[f"{prefix}.{e}.down_proj.weight"] = w[e]
    return out


def is_fused(name: str) -> bool:
    return name.endswith((GATE_UP, DOWN))


def to_published(weights: Mapping[str, Any], layout: str) -> dict[str, Any]:
    """{name: array} of transformers' state dict (the experts fused, `GATE_UP` [E, 2 I, d], `DOWN`
    [E, d, I]) with every sparse layer's experts in the published `layout` (one of `EXPERT_LAYOUTS`),
    the other weights as they are; what the savers of both engines write. "fused_transposed" keeps
    a fused weight whose transpose has its own shape (2 I = d, or I = d) as transformers holds it:
    every loader (transformers' `Transpose(check_dims=True)`, the engines') reads a weight of the
    module's shape untransposed, so only that is read back right."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert layout {layout!r} is not one of {EXPERT_LAYOUTS}")
    out: dict[str, Any] = {}
    for name, w in weights.items():
        if layout == "fused" or not is_fused(name):
            out[name] = w
        elif layout == "fused_transposed":
            a = np.asarray(w)
            out[name] = a if a.shape[1] == a.shape[2] else np.ascontiguousarray(np.swapaxes(a, 1, 2))
        else:
            out.update((k, np.ascontiguousarray(v)) for k, v in split(name, np.asarray(w)).items())
    return out
