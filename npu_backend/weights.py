"""Weights between the flax parameter tree and the torch twin, both ways, checked against the config.

The flax tree (see `dhp_jax.model.mllm`) and `TorchMLLM` use the same names; a flax path
`layers_0/attn/q/kernel` is the torch parameter `layers.0.attn.q.weight`, transposed (flax kernels
are [in, out], torch Linear weights [out, in]). Arrays are plain NumPy here, so this module needs
no jax: pass `jax.device_get(params)` or a tree loaded from `.npz`.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np
import torch

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
