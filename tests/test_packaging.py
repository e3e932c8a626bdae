"""Declared dependencies are the ones the code imports: nothing declared and unused, nothing used and undeclared."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMPORT_NAME = {"pyyaml": "yaml", "orbax-checkpoint": "orbax", "pillow": "PIL"}   # distribution -> module


def _imported_top_modules() -> set[str]:
    names: set[str] = set()
    for part in ("dhp_jax", "npu_backend", "experiments"):
        for path in (ROOT / part).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module.split(".")[0])
    return names


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_every_declared_dependency_is_imported():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    dists = [re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in deps]
    used = _imported_top_modules()
    unused = [d for d in dists if IMPORT_NAME.get(d, d.replace("-", "_")) not in used]
    assert not unused, f"declared in pyproject.toml but imported nowhere: {unused}"
