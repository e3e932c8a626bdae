"""The import arrows of docs/DESIGN.md (section 3), enforced by an AST walk of every module (imports inside
functions included, since a lazy import is still an import).

`cli` -> `train` -> `sharding` -> `model`; `sharding`, `train`, `sim`, `npu_backend`, `experiments`
-> `planner` -> `geometry` -> `data` (`model` -> `geometry` too). `data` imports no other part; the
planner never imports `sim` or jax; the model never imports `sharding`; `npu_backend` never imports jax (not even through a module it
imports); the library never imports `experiments`. Inside the planner, its rooms (docs/DESIGN.md,
section 2) import only downwards: contract <- cost <- programs <- solvers <- the planner's top modules.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dhp_jax", "npu_backend", "experiments")
JAX_ROOTS = {"jax", "jaxlib", "flax", "optax", "orbax", "chex"}

# part -> the parts it may import (itself always; "base": dhp_jax/__init__, _lazy, checks, devices,
# typed_config)
ALLOWED = {
    "data": set(),
    "geometry": {"data"},
    "planner": {"geometry", "data"},
    "model": {"geometry", "data"},
    "sim": {"planner", "geometry", "data"},
    "sharding": {"model", "planner", "geometry", "data"},
    "train": {"sharding", "model", "planner", "geometry", "data"},
    "cli": {"train", "sharding", "model", "sim", "planner", "geometry", "data"},
    "npu_backend": {"model", "planner", "geometry", "data"},
    "experiments": {"cli", "train", "sharding", "model", "sim", "planner", "geometry", "data", "npu_backend"},
}
NO_JAX = ("data", "geometry", "planner", "sim", "npu_backend")  # pure Python/NumPy (torch for npu_backend)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


# A model family's folder (`dhp_jax/models/<family>/`) mixes layers; each file's name says its own:
# `jax_*` the model with jax, `hf_*` the model without it (both engines read it), `torch_*` the
# torch backend; every other file (the spec, its config rows, processor, chat tokens, memory terms)
# and the registry itself sit at the bottom with `data`.
FAMILY_FILE_PARTS = (("jax_", "model"), ("hf_", "model"), ("torch_", "npu_backend"))


def part_of(module: str) -> str:
    top, _, rest = module.partition(".")
    if top != "dhp_jax":
        return top
    sub = rest.split(".")[0]
    if sub == "models":
        leaf = module.split(".")[-1]
        return next((part for prefix, part in FAMILY_FILE_PARTS if leaf.startswith(prefix)), "data")
    if sub in ("", "_lazy", "checks", "devices", "typed_config"):
        return "base"
    if sub in ("cli", "bench", "__main__"):
        return "cli"
    return sub


@functools.lru_cache(maxsize=None)
def _lazy_table(package: str) -> dict[str, str]:
    """A package's `_LAZY = {name: module}` table (names its `__getattr__` imports on access)."""
    path = MODULES.get(package)
    if path is None or path.name != "__init__.py":
        return {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


@functools.lru_cache(maxsize=None)
def imports_of(module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in `module`, resolved to project modules where
    possible (`from pkg import name` -> pkg.name when that is a module or a lazy attribute)."""
    path = MODULES[module]
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            lazy = _lazy_table(target)
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:
                    out.append((sub, node.lineno))
                elif a.name in lazy:
                    out.append((lazy[a.name], node.lineno))
                else:
                    out.append((target, node.lineno))
    return out


def _project(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def test_every_module_parses_and_is_classified():
    assert len(MODULES) > 50
    assert {part_of(m) for m in MODULES} <= set(ALLOWED) | {"base"}


def test_base_helpers_import_no_part():
    # every part may import the base helpers, so they may import nothing of the project
    bad = [f"{m} imports {n}" for m in MODULES if part_of(m) == "base" and m != "dhp_jax"
           for n, _ in imports_of(m) if _project(n) and part_of(n) != "base"]
    assert not bad, bad


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_part_imports_only_what_design_allows(part):
    bad = []
    for mod in (m for m in MODULES if part_of(m) == part):
        for name, line in imports_of(mod):
            if not _project(name):
                continue
            other = part_of(name)
            if other not in (part, "base") and other not in ALLOWED[part]:
                bad.append(f"{MODULES[mod].relative_to(ROOT)}:{line} imports {name} ({part} -> {other})")
    assert not bad, "import arrows of docs/DESIGN.md broken:\n" + "\n".join(bad)


def _chain_to_jax(start: str) -> list[str] | None:
    """The import chain from `start` to a jax-family package, following project modules."""
    seen = {start: [start]}
    todo = [start]
    while todo:
        mod = todo.pop()
        for name, _ in imports_of(mod):
            if name.split(".")[0] in JAX_ROOTS:
                return seen[mod] + [name]
            if _project(name):
                # a package import runs its __init__; a dotted module also runs its parents'
                for target in {name, *(name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1))}:
                    if target in MODULES and target not in seen:
                        seen[target] = seen[mod] + [target]
                        todo.append(target)
    return None


@pytest.mark.parametrize("part", NO_JAX)
def test_pure_parts_never_reach_jax(part):
    bad = []
    for mod in (m for m in MODULES if part_of(m) == part):
        chain = _chain_to_jax(mod)
        if chain:
            bad.append(" -> ".join(chain))
    assert not bad, f"{part} must not import jax (directly or through another module):\n" + "\n".join(bad)


# the planner's rooms, lowest first; a room imports only rooms before it (and itself)
PLANNER_ROOMS = ("contract", "cost", "programs", "solvers", "top")
# the one upward import, a lazy one inside a function, with why
ROOM_EXCEPTIONS = {
    # fit_menu fits a menu to the groups of plans made for calibration batches
    ("dhp_jax.planner.programs.menu", "dhp_jax.planner.api"),
}


def planner_room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["dhp_jax", "planner"]:
        return None
    return parts[2] if len(parts) > 3 and parts[2] in PLANNER_ROOMS else "top"


def test_planner_rooms_import_only_downwards():
    bad = []
    for mod in (m for m in MODULES if planner_room(m)):
        rank = PLANNER_ROOMS.index(planner_room(mod))
        for name, line in imports_of(mod):
            other = planner_room(name)
            if other and PLANNER_ROOMS.index(other) > rank and (mod, name) not in ROOM_EXCEPTIONS:
                bad.append(f"{MODULES[mod].relative_to(ROOT)}:{line} imports {name} ({planner_room(mod)} -> {other})")
    assert not bad, "planner rooms import upwards:\n" + "\n".join(bad)


def test_the_contract_is_the_ground_floor():
    """Plans and attention kinds import nothing of the project outside the contract but `data`, the
    floor below every part (the memory check of a plan is the cost model's, `planner.cost.plan_check`)."""
    bad = [f"{MODULES[mod].relative_to(ROOT)}:{line} imports {name}"
           for mod in MODULES if mod.startswith("dhp_jax.planner.contract")
           for name, line in imports_of(mod)
           if name.split(".")[0] in PACKAGES and not name.startswith(("dhp_jax.planner.contract", "dhp_jax.data"))]
    assert not bad, "the contract imports above itself:\n" + "\n".join(bad)


def test_family_folders_are_split_by_layer():
    """The spec side of a family is data (no jax, no torch); its engine files are classified by name."""
    assert part_of("dhp_jax.models") == part_of("dhp_jax.models.internvl.spec") == "data"
    assert part_of("dhp_jax.models.qwen3_vl.jax_model") == part_of("dhp_jax.models.qwen_common.hf_config") == "model"
    assert part_of("dhp_jax.models.internvl.torch_model") == "npu_backend"
    specs = [m for m in MODULES if m.startswith("dhp_jax.models.") and m.endswith(".spec")]
    assert len(specs) >= 3, specs
    torch_free = [f"{m} imports {n}" for m in MODULES if part_of(m) == "data"
                  for n, _ in imports_of(m) if n.split(".")[0] == "torch"]
    assert not torch_free, torch_free


def test_walker_sees_function_level_and_lazy_imports():
    # `from dhp_jax.planner import CostModel` inside a method resolves through the lazy table
    assert "dhp_jax.planner.cost.model" in [n for n, _ in imports_of("dhp_jax.sim.cluster")]
    assert part_of("dhp_jax.cli") == part_of("dhp_jax.bench") == "cli" and part_of("dhp_jax._lazy") == "base"


def test_bench_targets_import_no_jax_before_their_devices_are_set():
    """`dhp bench TARGET --devices N` sets the fake CPU devices in `run`, which XLA reads when jax is
    first imported: a target module that imports jax at its top leaves every run on 1 device
    (`dhp bench memory --degrees 2` once stopped with "needs 2 devices, found 1")."""
    import subprocess
    import sys

    from dhp_jax.bench import TARGETS

    script = ("import importlib, sys\n"
              f"for m in {sorted(m for m, _ in TARGETS.values())!r}:\n"
              "    importlib.import_module(m)\n"
              "    assert 'jax' not in sys.modules, m + ' imports jax at import time'\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


EXECUTOR_MODULES = ("dhp_jax.sharding.executor", "npu_backend.executor")
MAX_CLASS_LINES = 300


def test_executors_are_composed_not_dispatched():
    """The executors stay small and are composed of parts: no executor class has more than
    `MAX_CLASS_LINES` lines of body, none picks a subclass in `__new__` (a factory picks the model
    adapter), and the sharding modules never import the executor back (no import circle)."""
    big, dispatch = [], []
    for mod in EXECUTOR_MODULES:
        for node in ast.parse(MODULES[mod].read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Executor"):
                if node.end_lineno - node.lineno > MAX_CLASS_LINES:
                    big.append(f"{mod}.{node.name}: {node.end_lineno - node.lineno} lines")
                dispatch += [f"{mod}.{node.name}.__new__" for f in node.body
                             if isinstance(f, ast.FunctionDef) and f.name == "__new__"]
    assert not big and not dispatch, big + dispatch
    back = [f"{m}:{line}" for m in MODULES if m.startswith("dhp_jax.sharding.") and m != "dhp_jax.sharding.executor"
            for name, line in imports_of(m) if name == "dhp_jax.sharding.executor"
            and m in ("dhp_jax.sharding.family_adapter", "dhp_jax.sharding.standin", "dhp_jax.sharding.compile_cache",
                      "dhp_jax.sharding.sharded_state", "dhp_jax.sharding.attention", "dhp_jax.sharding.prepared")]
    assert not back, f"the executor's parts import the executor: {back}"
