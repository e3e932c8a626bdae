"""Typed configs from YAML: dataclasses whose fields check and convert the values they are given,
dotted `key=value` overrides, and unknown keys named with the valid ones. One loader for the train
configs (`dhp_jax.train.train_config`) and the experiment configs (`experiments/runner.py`).
Imports nothing from the project.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the file or the key."""


def read_yaml(path: str | os.PathLike) -> Mapping[str, Any]:
    """The top-level mapping of a YAML file; ConfigError naming the file otherwise."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {str(path)!r}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"config {str(path)!r} must be a YAML mapping")
    return data


def annotation_of(default: Any) -> Any:
    """The field type a plain default value implies (for configs declared as a dict of defaults)."""
    for tp in (bool, int, float, str, list, dict):
        if type(default) is tp:
            return tp
    return Any


def dataclass_of(name: str, defaults: Mapping[str, Any]) -> type:
    """A dataclass with one field per default, typed by `annotation_of` (defaults deep-copied)."""
    return dataclasses.make_dataclass(name, [(k, annotation_of(v), dataclasses.field(
        default_factory=lambda v=v: copy.deepcopy(v))) for k, v in defaults.items()])


def _section_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _field_type(cls: type, name: str) -> Any:
    tp = next(f.type for f in dataclasses.fields(cls) if f.name == name)
    return typing.get_type_hints(cls)[name] if isinstance(tp, str) else tp


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one YAML value against a field's annotation; name the key on failure."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return coerce(value, args[0], key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if tp is Any:
        return value
    if tp is list or typing.get_origin(tp) is list:
        if isinstance(value, list):
            return value
        raise ConfigError(f"{key} must be a list, got {value!r}")
    if tp is dict or typing.get_origin(tp) is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise ConfigError(f"{key} must be a mapping, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported field type {tp!r}")  # pragma: no cover - schema bug


def apply(obj: Any, data: Mapping[str, Any], prefix: str = "") -> None:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}")
    fields = _section_fields(type(obj))
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"unknown config key {full!r}; valid keys"
                              f"{' in ' + prefix.rstrip('.') if prefix else ''}: {', '.join(sorted(fields))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current) and not isinstance(value, Mapping) and getattr(current, "SCALAR_KEY", None):
            # a section that a single value may set (`model: tiny` sets model.preset)
            apply(current, {current.SCALAR_KEY: value}, full + ".")
        elif dataclasses.is_dataclass(current):
            apply(current, value, full + ".")
        else:
            setattr(obj, key, coerce(value, _field_type(type(obj), key), full))


def valid_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key a config or an override may set."""
    out = []
    for f in dataclasses.fields(cls):
        default = getattr(cls(), f.name)
        if dataclasses.is_dataclass(default):
            out.extend(valid_keys(type(default), f"{prefix}{f.name}."))
        else:
            out.append(prefix + f.name)
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """`optim.learning_rate=1e-3` -> (["optim", "learning_rate"], 0.001)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value
