"""Config -> run -> result files: the one path every experiment takes.

A config is a YAML file with `kind: experiment`, `experiment: <registry name>`, a `seed`, the
experiment's parameters at top level and a `tiny:` block of overrides for a seconds-long variant.
The YAML is the one home of the parameters: each experiment has a base config (`REGISTRY`) that
gives every parameter its script reads, and its value and type; another config of the same
experiment (e2 of e1, e7_flexsp of e7_optimality) starts from the base and states what differs.
The runner checks every key against the base (unknown keys are errors naming the key and listing
the valid ones), runs it, and writes `<name>.json` (config, seed, versions, machine, rows) and
`<name>.png` (matplotlib, Agg backend).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from dhp_jax.typed_config import ConfigError, apply, dataclass_of, parse_override as _parse_override, read_yaml

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "experiments" / "configs"
RESULTS_DIR = REPO / "experiments" / "results"

# registry name -> (module under experiments/ defining run(params, seed, log) -> dict and
# plot(result, path), its base config under experiments/configs/)
REGISTRY: dict[str, tuple[str, str]] = {
    "end_to_end": ("experiments.exp_end_to_end", "e1_end_to_end.yaml"),
    "scaling": ("experiments.exp_scaling", "e3_scaling.yaml"),
    "overhead": ("experiments.exp_overhead", "e4_overhead.yaml"),
    "estimator": ("experiments.exp_estimator", "e5_estimator.yaml"),
    "case_study": ("experiments.exp_case_study", "e6_case_study.yaml"),
    "optimality": ("experiments.exp_optimality", "e7_optimality.yaml"),
    "ablations": ("experiments.exp_ablations", "e8_ablations.yaml"),
    "sensitivity": ("experiments.exp_sensitivity", "e9_bandwidth.yaml"),
    "tail_sweep": ("experiments.exp_tail_sweep", "e10_tail_sweep.yaml"),
    "attention_choice": ("experiments.exp_attention_choice", "e11_attention_choice.yaml"),
    "compiles": ("experiments.exp_compiles", "e12_compiles.yaml"),
    "tensor_parallel": ("experiments.exp_tensor_parallel", "e13_tensor_parallel.yaml"),
    "moe": ("experiments.exp_moe", "e14_moe.yaml"),
    "memory": ("experiments.exp_memory", "memory_bench.yaml"),
    "memory_families": ("experiments.exp_memory_families", "memory_families.yaml"),
}

RESERVED = ("kind", "experiment", "seed", "name", "tiny")


@dataclasses.dataclass
class Experiment:
    name: str  # result file stem
    kind: str  # registry name
    seed: int
    params: dict[str, Any]
    source: str  # config path (or "<dict>")
    tiny: bool = False


def _module(kind: str) -> Any:
    if kind not in REGISTRY:
        raise ConfigError(f"unknown experiment {kind!r}; known: {sorted(REGISTRY)}")
    return importlib.import_module(REGISTRY[kind][0])


def base_params(kind: str) -> dict[str, Any]:
    """Every parameter of experiment `kind` with its value: the top level of its base config."""
    if kind not in REGISTRY:
        raise ConfigError(f"unknown experiment {kind!r}; known: {sorted(REGISTRY)}")
    path = CONFIG_DIR / REGISTRY[kind][1]
    raw = read_yaml(path)
    if raw.get("experiment") != kind:
        raise ConfigError(f"{path}: the base config of {kind!r} runs experiment {raw.get('experiment')!r}")
    return {k: v for k, v in raw.items() if k not in RESERVED}


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` with the value parsed as YAML (so `ranks=[8,16]` gives a list)."""
    path, value = _parse_override(text)
    return ".".join(path), value


def load_config(path: str | Path | Mapping[str, Any], *, tiny: bool = False,
                overrides: Mapping[str, Any] | None = None) -> Experiment:
    """Read and check a config; apply the `tiny:` block (if `tiny`) and then `overrides`."""
    if isinstance(path, Mapping):
        raw, source = dict(path), "<dict>"
    else:
        source = str(path)
        raw = dict(read_yaml(path))
    if raw.get("kind") != "experiment":
        raise ConfigError(f"{source}: `kind` must be 'experiment', got {raw.get('kind')!r}")
    if "experiment" not in raw:
        raise ConfigError(f"{source}: missing key 'experiment' (one of {sorted(REGISTRY)})")
    kind = raw["experiment"]
    defaults = base_params(kind)
    params = dataclass_of(f"{kind}_params", defaults)()  # typed by the base: a value of the wrong type is named

    def apply_block(block: Mapping[str, Any], where: str) -> None:
        unknown = [k for k in block if k not in RESERVED and k not in defaults]
        if unknown:
            raise ConfigError(f"{source}: unknown key {unknown[0]!r} in {where}; valid keys: "
                              f"{sorted(defaults) + ['seed', 'name']}")
        try:
            apply(params, {k: v for k, v in block.items() if k not in RESERVED})
        except ConfigError as e:
            raise ConfigError(f"{source} ({where}): {e}") from None

    apply_block(raw, "config")
    tiny_block = raw.get("tiny")
    if tiny_block is not None and not isinstance(tiny_block, dict):
        raise ConfigError(f"{source}: `tiny` must be a mapping of overrides")
    seed = raw.get("seed", 0)
    if tiny:
        if not tiny_block:
            raise ConfigError(f"{source}: has no `tiny:` block")
        apply_block(tiny_block, "tiny")
        seed = tiny_block.get("seed", seed)
    if overrides:
        ov = dict(overrides)
        seed = ov.pop("seed", seed)
        apply_block(ov, "overrides")
    if not isinstance(seed, int):
        raise ConfigError(f"{source}: seed must be an integer, got {seed!r}")
    name = raw.get("name") or (Path(source).stem if source != "<dict>" else kind)
    return Experiment(name=name + ("_tiny" if tiny else ""), kind=kind, seed=seed, params=dataclasses.asdict(params),
                      source=source, tiny=tiny)


def source_state(repo: str | Path = REPO) -> dict[str, Any]:
    """The code a run uses: {"commit": short HEAD, "dirty": whether tracked or new (not ignored) files
    differ from it}; None for both outside a git checkout (an installed copy)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                              text=True, timeout=5)
        if head.returncode != 0 or not head.stdout.strip():
            return {"commit": None, "dirty": None}
        status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True,
                                timeout=30)
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
        return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """What the measured numbers were measured on."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    # The load average matters: this machine is shared, so measured times include contention.
    return {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "system": platform.system(),
            "machine": platform.machine(), "python": platform.python_version(), "loadavg_1_5_15": load}


def describe_machine() -> str:
    m = machine()
    return f"{m['cpu']}, {m['cpu_count']} cores"


def versions() -> dict[str, str | None]:
    """Versions of Python and the main packages (the code's own commit: `source_state`, read at the start)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("numpy", "scipy", "yaml", "matplotlib"):
        try:
            mod = importlib.import_module(pkg)
            out[pkg] = getattr(mod, "__version__", None) or "installed"
        except ImportError:
            out[pkg] = None
    try:
        from importlib.metadata import version
        out["dhp_jax"] = version("dhp-jax")
    except Exception:  # not installed as a distribution: the commit above still identifies it
        out["dhp_jax"] = None
    return out


def run_experiment(exp: Experiment, out_dir: str | Path | None = None, *, plot: bool = True,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run one experiment, write `<name>.json` (+ `.png`) into `out_dir`, return the result dict."""
    mod = _module(exp.kind)
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    # the code this run is made of: read before it starts (a commit made during a long run is not it)
    source = source_state(REPO)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0 = time.perf_counter()
    body = mod.run(exp.params, seed=exp.seed, log=log or (lambda s: None))
    wall = time.perf_counter() - t0
    vers = {"python": None, "dhp_jax_commit": source["commit"], "dhp_jax_dirty": source["dirty"], **versions()}
    result = {
        "experiment": exp.kind, "name": exp.name, "config_file": _rel(exp.source), "tiny": exp.tiny,
        "seed": exp.seed, "config": exp.params, "versions": vers, "machine": machine(),
        "started_utc": started, "wall_s": round(wall, 3),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **body,
    }
    (out / f"{exp.name}.json").write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    if plot and hasattr(mod, "plot"):
        import matplotlib
        matplotlib.use("Agg")
        mod.plot(result, out / f"{exp.name}.png")
    return result


def _rel(source: str) -> str:
    try:
        return str(Path(source).resolve().relative_to(REPO))
    except ValueError:
        return source


def _json_default(x: Any) -> Any:
    import numpy as np
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def config_files() -> list[Path]:
    """Every `kind: experiment` config under experiments/configs/ (trainer configs are skipped)."""
    files = []
    for p in sorted(CONFIG_DIR.glob("*.yaml")):
        try:
            raw = read_yaml(p)
        except ConfigError:
            files.append(p)  # let load_config report it
            continue
        if raw.get("kind") == "experiment":
            files.append(p)
    return files
