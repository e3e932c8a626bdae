"""`python -m npu_backend.xla_env`: build the xla environment once per machine (a venv in the user cache).

torch_xla's newest release pairs with its own torch release (`PINS`, the `xla` extra of
pyproject.toml), older than the torch of the `torch` and `npu` extras, so the XLA device runs from
a venv of its own: `PINS` plus what `npu_backend` imports besides torch (`RUNTIME`), without jax,
and without the project itself: run the repository from that venv's python with PYTHONPATH set to
the checkout (tests/test_npu_xla.py does so). `READY` is written last, so a venv that has it is
complete. Exit status 0: ready; 1: the build failed or ran past `--timeout` (the partial venv is
removed, and a line says why).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PINS = ("torch==2.9.0", "torch_xla==2.9.0")      # a matching pair (pyproject.toml's `xla` extra)
RUNTIME = ("numpy>=1.26", "scipy>=1.11", "highspy>=1.7", "pyyaml>=6", "ml_dtypes")
READY = "dhp-xla-ready.json"


def default_venv() -> Path:
    """$DHP_XLA_VENV, else <user cache>/dhp-jax/xla-venv (the cache: $XDG_CACHE_HOME or ~/.cache)."""
    if os.environ.get("DHP_XLA_VENV"):
        return Path(os.environ["DHP_XLA_VENV"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "dhp-jax" / "xla-venv"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ready(venv: Path | None = None) -> dict | None:
    """The build record of a complete xla venv of today's `PINS`, or None."""
    venv = default_venv() if venv is None else venv
    try:
        rec = json.loads((venv / READY).read_text())
    except (OSError, ValueError):
        return None
    return rec if venv_python(venv).exists() and rec.get("pins") == list(PINS) else None


def build(venv: Path, timeout: float, say=print) -> dict:
    """Create `venv` with `PINS` + `RUNTIME` within `timeout` seconds; RuntimeError (one line) if not."""
    t0 = time.monotonic()
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)

    def run(cmd: list[str], what: str) -> None:
        left = timeout - (time.monotonic() - t0)
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=max(left, 1.0))
        except subprocess.TimeoutExpired:
            shutil.rmtree(venv, ignore_errors=True)
            raise RuntimeError(f"{what} did not finish within the {timeout:.0f} s budget "
                               f"(torch and torch_xla are ~7 GB of wheels)") from None
        if out.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{what} failed (exit {out.returncode}): {tail}")

    run([sys.executable, "-m", "venv", str(venv)], f"python -m venv {venv}")
    # --no-compile: no bytecode for the ~7 GB of wheels up front (the modules a run imports are
    # compiled on first import); it saves CPU where the build runs beside the test suite
    run([str(venv_python(venv)), "-m", "pip", "install", "-q", "--no-compile", *PINS, *RUNTIME],
        f"pip install {' '.join(PINS)}")
    check = ("import torch, torch_xla; print(torch.__version__, torch_xla.__version__)")
    probe = subprocess.run([str(venv_python(venv)), "-c", check], capture_output=True, text=True,
                           env=dict(os.environ, PJRT_DEVICE="CPU"), timeout=300)
    if probe.returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        raise RuntimeError(f"torch_xla does not import in {venv}: "
                           + (probe.stderr.strip().splitlines() or ["?"])[-1])
    torch_v, xla_v = probe.stdout.split()[-2:]
    size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink())
    rec = {"pins": list(PINS), "torch": torch_v, "torch_xla": xla_v, "build_s": round(time.monotonic() - t0, 1),
           "bytes": size}
    (venv / READY).write_text(json.dumps(rec, indent=1))
    say(f"xla env: {venv} (torch {torch_v}, torch_xla {xla_v}, {size / 1e9:.1f} GB) built in {rec['build_s']} s")
    return rec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m npu_backend.xla_env", description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", type=Path, default=None, help=f"where (default {default_venv()})")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.add_argument("--rebuild", action="store_true", help="build again even if the venv is ready")
    p.add_argument("--python-path", action="store_true", help="print the venv's python and exit (1 if not ready)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    venv = args.venv or default_venv()
    rec = ready(venv)
    if args.python_path:
        if rec is None:
            print(f"xla env: {venv} is not built (python -m npu_backend.xla_env)", file=sys.stderr)
            return 1
        print(venv_python(venv))
        return 0
    if rec is not None and not args.rebuild:
        print(f"xla env: {venv} is ready (torch {rec['torch']}, torch_xla {rec['torch_xla']})")
        return 0
    try:
        build(venv, args.timeout)
    except RuntimeError as e:
        print(f"xla env: not built: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
