"""Parameter names: a transformers checkpoint's flat `{name: weight}` <-> our nested parameter tree.

The tree follows the transformers module path of every weight (`model.language_model.layers.0.
self_attn.q_proj.weight` is `tree["model"]["language_model"]["layers"]["0"]["self_attn"]["q_proj"]
["kernel"]`), and only the leaf changes, by one rule for all families:

- `X.weight` of an Embedding (`embed_tokens`, `pos_embed`): `X.embedding` [V, d], as stored;
- `X.weight` of rank 1 (a norm): `X.scale`;
- `X.weight` of rank 2 (a Linear [out, in]): `X.kernel` = weight.T [in, out];
- `X.weight` of rank > 2 (a patch Conv [out, C, (T,) P, P]): `X.kernel` = weight.reshape(out, -1).T,
  so a flattened patch row (C, T, P, P order, as the Qwen processors emit it) times the kernel is
  the convolution; the family gives the conv shapes back (`conv_shapes`);
- `X.bias` -> `X.bias`; any other leaf (`cls_token`, `lambda_1`, ...) keeps its name and shape.

Older checkpoint layouts are renamed first, as transformers' own conversion mapping does (e.g.
Qwen2.5-VL's original `visual.*` / `model.layers.*`, InternVL's `language_model.model.*`).
Saving goes the other way (`saved_weights`): the names are those transformers' own
`save_pretrained` writes, a family's `SAVED_RENAMES` (which revert its conversion mapping).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import numpy as np

from dhp_jax.model.hf import expert_layouts

EMBEDDING_MODULES = ("embed_tokens", "pos_embed")


def rename(name: str, renames: Iterable[tuple[str, str]]) -> str:
    """Apply a family's legacy-layout renames (regex, replacement), first match only."""
    for pattern, repl in renames:
        new, n = re.subn(pattern, repl, name, count=1)
        if n:
            return new
    return name


def saved_weights(weights: Mapping[str, Any], family_module: Any, moe: bool) -> dict[str, Any]:
    """{name: array} as both engines' savers write a family's checkpoint, from transformers' state
    dict `weights` (module names, the experts fused): a mixture of experts' experts (`moe`) in the
    layout of the family's releases (`expert_layouts.to_published`), then every name as
    transformers' `save_pretrained` of the family's model writes it (the family's model-side
    module's `SAVED_RENAMES`, first match; none: the module names). The loaders read either layout
    (`LEGACY_RENAMES`)."""
    if moe:
        weights = expert_layouts.to_published(weights, expert_layouts.layout_of(family_module))
    renames = getattr(family_module, "SAVED_RENAMES", ())
    out = {rename(name, renames): w for name, w in weights.items()}
    if len(out) != len(weights):
        raise ValueError(f"{getattr(family_module, '__name__', family_module)}.SAVED_RENAMES maps two weights to "
                         f"one name")
    return out


def leaf_rule(name: str, ndim: int) -> tuple[list[str], bool]:
    """(tree path, transposed) of a checkpoint weight of rank `ndim`, by the module docstring's
    rule: a transposed leaf is weight.reshape(weight.shape[0], -1).T, any other the weight as stored."""
    parts = name.split(".")
    if parts[-1] == "weight":
        module = parts[-2] if len(parts) > 1 else ""
        if module in EMBEDDING_MODULES:
            return parts[:-1] + ["embedding"], False
        if ndim == 1:
            return parts[:-1] + ["scale"], False
        return parts[:-1] + ["kernel"], True
    return parts, False


def leaf_from_weight(name: str, w: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(tree path, array) of one checkpoint weight, by the module docstring's rule."""
    path, transposed = leaf_rule(name, w.ndim)
    return path, (w.reshape(w.shape[0], -1).T if transposed else w)


def leaf_shape(name: str, shape: tuple[int, ...]) -> tuple[list[str], tuple[int, ...]]:
    """(tree path, leaf shape) of a checkpoint weight of `shape`: `leaf_from_weight` on shapes alone."""
    path, transposed = leaf_rule(name, len(shape))
    return path, ((int(np.prod(shape[1:], dtype=np.int64)), int(shape[0])) if transposed else tuple(shape))


def weight_from_leaf(path: list[str], x: Any, conv_shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, Any]:
    """(checkpoint name, array) of one tree leaf: the inverse of `leaf_from_weight`."""
    leaf, module = path[-1], ".".join(path[:-1])
    if leaf in ("embedding", "scale"):
        return module + ".weight", x
    if leaf == "kernel":
        name = module + ".weight"
        if name in conv_shapes:
            return name, x.T.reshape(conv_shapes[name])
        return name, x.T
    return ".".join(path), x


def tree_from_weights(named: Iterable[tuple[str, Any]], renames: Iterable[tuple[str, str]] = (),
                      skip: Iterable[str] = (), convert=lambda a: a, leaf=leaf_from_weight) -> dict:
    """The nested parameter tree of a checkpoint's (name, weight) pairs; `convert` turns each leaf
    into the stored array (e.g. a device array of the compute dtype), `skip` lists names left out
    (a tied lm_head); `leaf(name, weight) -> (path, leaf)` places a weight (`leaf_from_weight`)."""
    renames, skip = list(renames), set(skip)
    tree: dict = {}
    for name, w in named:
        name = rename(name, renames)
        if name in skip:
            continue
        path, value = leaf(name, w)
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        if path[-1] in node:
            raise ValueError(f"checkpoint weight {name!r} appears twice")
        node[path[-1]] = convert(value)
    return tree


def weights_from_tree(tree: Mapping, conv_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """{checkpoint name: array} of a parameter (or gradient) tree."""
    out: dict[str, Any] = {}

    def walk(node: Mapping, path: list[str]) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping):
                walk(value, path + [key])
            else:
                name, w = weight_from_leaf(path + [key], value, conv_shapes)
                out[name] = w

    walk(tree, [])
    return out
