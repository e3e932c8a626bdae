"""The registered families' model side without jax (`dhp_jax.models`: each family's `hf_config`
module, `FamilySpec.hf_module`), read by both backends (`dhp_jax.model.hf` and the torch backend
`npu_backend.hf`): the model types each reads, its legacy checkpoint renames (as transformers' own
conversion mapping), its `parse` into an `HFConfig` and its conv weights' shapes.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, Callable, Mapping

from dhp_jax import models
from dhp_jax.data import hf_config
from dhp_jax.model.hf.config import HFConfig


def __getattr__(name: str):
    if name == "FAMILIES":
        return models.names()
    if name == "REGISTRY":
        return {n: family(n) for n in models.names()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class Family:
    """What the loaders need of a family: its model types, legacy renames, parser, conv shapes."""

    model_types: tuple[str, ...]
    renames: tuple[tuple[str, str], ...]
    parse: Callable[[Mapping[str, Any], Mapping[str, Any]], HFConfig]
    conv_shapes: Callable[[HFConfig], dict[str, tuple[int, ...]]]


def hf_module(name: str) -> ModuleType:
    """The family's model-side module without jax (`FamilySpec.hf_module`)."""
    return models.spec(name).engine_module("hf")


def family(name: str) -> Family:
    m = hf_module(name)
    return Family(tuple(m.MODEL_TYPES), tuple(m.LEGACY_RENAMES), m.parse, m.conv_shapes)


def parse_config(raw: Mapping[str, Any], where: str = "config.json") -> HFConfig:
    """HFConfig of a config.json dict (any published layout), read by `dhp_jax.data.hf_config.resolve`."""
    mt = str(raw.get("model_type"))
    spec = models.spec_for_type(mt)
    if spec is not None and mt in spec.config.layouts:
        raise ValueError(f"{where}: model_type {mt!r} (a checkpoint layout of {spec.name} that is not transformers') "
                         f"has no loader here; use the transformers-native release of the model "
                         f"(model_type {spec.name!r})")
    r = hf_config.resolve(raw, where)
    return hf_module(r["model_type"]).parse(dict(raw), r)
