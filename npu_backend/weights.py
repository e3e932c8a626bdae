"""Weights between the flax parameter tree and the torch twin, both ways, checked against the config.

The flax tree (see `dhp_jax.model.mllm`) and `TorchMLLM` use the same names; a flax path
`layers_0/attn/q/kernel` is the torch parameter `layers.0.attn.q.weight`, transposed (flax kernels
are [in, out], torch Linear weights [out, in]). Arrays are plain NumPy here, so this module needs
no jax: pass `jax.device_get(params)` or a tree loaded from `.npz`. `load_jax_checkpoint` reads
the params of a `dhp train` checkpoint the same way, without jax.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from dhp_jax.model.mllm_config import RUN_ONLY_MODEL_FIELDS
from npu_backend.relayout import RecordError, unravel_record
from npu_backend.model import TorchMLLM


class WeightsError(ValueError):
    """Weights do not fit the model config; the message lists every missing, extra or misshapen entry."""


def _torch_name(flax_path: str) -> tuple[str, bool]:
    """flax 'a/b/c' -> (torch name, transpose?)."""
    parts = flax_path.split("/")
    out = []
    for p in parts[:-1]:
        m = re.fullmatch(r"(vision_layers|layers)_(\d+)", p)
        out.extend([m.group(1), m.group(2)] if m else [p])
    leaf = parts[-1]
    if leaf == "kernel":
        return ".".join(out + ["weight"]), True
    if leaf == "embedding":
        return ".".join(out + ["weight"]), False
    return ".".join(out + [leaf]), False  # bias, scale


def _flax_path(torch_name: str, is_embedding: bool) -> tuple[str, bool]:
    parts = torch_name.split(".")
    out: list[str] = []
    i = 0
    while i < len(parts) - 1:
        if parts[i] in ("layers", "vision_layers") and parts[i + 1].isdigit():
            out.append(f"{parts[i]}_{parts[i + 1]}")
            i += 2
        else:
            out.append(parts[i])
            i += 1
    leaf = parts[-1]
    if leaf == "weight":
        return "/".join(out + ["embedding" if is_embedding else "kernel"]), not is_embedding
    return "/".join(out + [leaf]), False


def flatten_tree(tree: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    """Nested dict -> {'a/b/c': ndarray}. Accepts a flax tree, with or without a 'params' wrapper."""
    if prefix == "" and set(tree) == {"params"}:
        tree = tree["params"]
    flat: dict[str, np.ndarray] = {}
    for k, v in tree.items():
        path = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            flat.update(flatten_tree(v, path))
        else:
            flat[path] = np.asarray(v)
    return flat


def unflatten_tree(flat: Mapping[str, np.ndarray]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, v in flat.items():
        node = tree
        *head, leaf = path.split("/")
        for p in head:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def load_flax_params(model: TorchMLLM, params: Mapping[str, Any]) -> None:
    """Copy a flax parameter tree into `model`; raise `WeightsError` if it does not match exactly.

    Every problem is collected first, so one message lists them all; nothing is copied unless
    everything matches.
    """
    flat = flatten_tree(params)
    state = dict(model.named_parameters())
    problems: list[str] = []
    planned: list[tuple[torch.nn.Parameter, np.ndarray]] = []
    seen: set[str] = set()
    for path, arr in sorted(flat.items()):
        name, transpose = _torch_name(path)
        if name not in state:
            problems.append(f"unexpected weight {path!r} (no such parameter in the model)")
            continue
        seen.add(name)
        arr = arr.T if transpose else arr
        target = state[name]
        if tuple(arr.shape) != tuple(target.shape):
            shown = tuple(arr.T.shape) if transpose else tuple(arr.shape)
            want = tuple(target.shape)[::-1] if transpose else tuple(target.shape)
            problems.append(f"weight {path!r} has shape {shown}, the config needs {want}")
            continue
        if not np.issubdtype(arr.dtype, np.floating):
            problems.append(f"weight {path!r} has dtype {arr.dtype}, expected floating point")
            continue
        planned.append((target, arr))
    for name in sorted(set(state) - seen):
        problems.append(f"missing weight {_flax_path(name, _is_embedding(model, name))[0]!r}")
    if problems:
        head = f"weights do not match the model config {getattr(model.config, 'name', '?')!r}: "
        raise WeightsError(head + "; ".join(problems[:12]) + (f"; ... ({len(problems)} problems)"
                                                              if len(problems) > 12 else ""))
    with torch.no_grad():
        for target, arr in planned:
            target.copy_(torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)))


def export_flax_params(model: TorchMLLM) -> dict[str, Any]:
    """The model's weights as a flax parameter tree of float32 NumPy arrays."""
    flat = {}
    for name, p in model.named_parameters():
        path, transpose = _flax_path(name, _is_embedding(model, name))
        a = p.detach().cpu().numpy()
        flat[path] = np.ascontiguousarray(a.T if transpose else a)
    return unflatten_tree(flat)


def grads_as_flax(model: TorchMLLM) -> dict[str, Any]:
    """The `.grad` of every parameter, in the flax tree layout (zeros where no grad)."""
    flat = {}
    for name, p in model.named_parameters():
        path, transpose = _flax_path(name, _is_embedding(model, name))
        g = p.grad.detach().cpu().numpy() if p.grad is not None else np.zeros(tuple(p.shape), np.float32)
        flat[path] = np.ascontiguousarray(g.T if transpose else g)
    return unflatten_tree(flat)


def save_npz(path: str, params: Mapping[str, Any]) -> None:
    """Save a flax-layout tree as `.npz` with 'a/b/c' keys (readable from JAX and torch alike)."""
    np.savez(path, **flatten_tree(params))


def load_npz(path: str) -> dict[str, Any]:
    with np.load(path) as z:
        return unflatten_tree({k: z[k] for k in z.files})


def _is_embedding(model: TorchMLLM, name: str) -> bool:
    return name == "embed.weight"


# ------------------------------------------------------------------ a `dhp train` checkpoint
@dataclasses.dataclass
class JaxCheckpoint:
    """The params of a `dhp train` checkpoint as a flax-layout tree of NumPy arrays."""

    path: Path               # the step directory read
    step: int                # steps the JAX run had taken
    data_position: int       # the index of the batch the JAX run would take next
    params: dict[str, Any]
    meta: dict               # the checkpoint's JSON record (model and run config, layout)


def checkpoint_step_dir(path: str | Path, step: int | None = None) -> Path:
    """The step directory of a run directory (its `checkpoints/`), a checkpoints directory or a
    step directory: `step`, else the latest complete one."""
    p = Path(path)
    if (p / "state").is_dir() and (p / "meta").is_dir():
        return p
    ck = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    steps = sorted(int(d.name) for d in ck.iterdir() if d.name.isdigit() and (d / "state").is_dir()) \
        if ck.is_dir() else []
    if not steps:
        raise WeightsError(f"no dhp train checkpoint in {str(p)!r} (a run directory, its checkpoints/ or a "
                           "step directory)")
    if step is None:
        return ck / str(steps[-1])
    if step not in steps:
        raise WeightsError(f"{str(ck)!r} has no checkpoint of step {step} (it has {steps})")
    return ck / str(step)


def load_jax_checkpoint(path: str | Path, step: int | None = None) -> JaxCheckpoint:
    """Read the fp32 master params of a `dhp train` checkpoint without jax: orbax stores the flat
    vector with tensorstore (zarr over OCDBT); the checkpoint's layout record (`FlatLayout.record`:
    the leaves in flat order, P and the padding of the rank count that wrote it; with tensor
    parallelism `TensorLayout.record`, also each device's share and how the shares join,
    `npu_backend.relayout.unravel_record`) cuts it into the flax tree, whatever t and device
    count wrote it. The Adam moments are not read (see docs/torch-backend.md)."""
    d = checkpoint_step_dir(path, step)
    try:
        meta = json.loads((d / "meta" / "metadata").read_text())
        tree_meta = json.loads((d / "state" / "_METADATA").read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{str(d)!r} is not a readable dhp train checkpoint: {e}") from None
    layout = meta.get("layout")
    if not layout:
        raise WeightsError(f"{str(d)!r} has no layout record (written by an older dhp_jax): resume it with "
                           "`dhp train --resume` for a step, whose checkpoint then has one")
    try:
        import tensorstore as ts
    except ImportError:
        raise WeightsError("reading a dhp train checkpoint needs tensorstore (pip install tensorstore)") from None
    driver = "zarr3" if tree_meta.get("use_zarr3") else "zarr"
    spec = {"driver": driver, "kvstore": {"driver": "ocdbt", "base": (d / "state").resolve().as_uri(),
                                          "path": "params"}}
    flat = np.asarray(ts.open(spec, open=True, read=True).result().read().result())
    try:    # t > 1: the master holds each device's share; the record's split rule joins them
        out = unravel_record(flat, layout)
    except RecordError as e:
        raise WeightsError(f"{str(d)!r}: {e}") from None
    return JaxCheckpoint(d, int(meta["step"]), int(meta["data_position"]), unflatten_tree(out), meta)


def check_model_config(meta: Mapping[str, Any], config: Any, where: str) -> None:
    """`WeightsError` naming every model field where the checkpoint's config and `config` differ
    (those that only change how a step runs, `RUN_ONLY_MODEL_FIELDS`, may differ)."""
    saved, mine = dict(meta.get("model_config", {})), config.to_dict()
    diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k) and k not in RUN_ONLY_MODEL_FIELDS)
    if diff:
        raise WeightsError(f"{where} is of another model than {mine.get('name')!r}: "
                           + ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs {mine.get(k)!r}" for k in diff[:8])
                           + f" (pick it with --mllm {saved.get('name')})")
