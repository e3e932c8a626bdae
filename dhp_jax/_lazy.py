"""Lazy package attributes: `from dhp_jax.planner import plan_batch` imports only what it names."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping


def lazy_attributes(package: str, table: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return `__getattr__` / `__dir__` for a package whose public names live in submodules."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        # the package's own names (its module dict), not this helper module's
        return sorted(set(table) | set(vars(sys.modules[package])))

    return __getattr__, __dir__
