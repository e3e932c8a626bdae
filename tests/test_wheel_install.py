"""`dhp train` works when installed from a wheel: the demo config and the cost profile it names are
package data. The wheel is built from a copy of this checkout, installed (no dependencies: they come
from the system site-packages) into a fresh venv outside the repository, and run from there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, cwd, env, timeout=300):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _see_this_interpreters_packages(py: Path, cwd: Path, env: dict) -> None:
    """`--system-site-packages` gives the new venv the *base* interpreter's packages: when this suite
    itself runs inside a venv (where the dependencies were installed), the new venv would miss them.
    A .pth file adds this interpreter's site directories after the new venv's own, so the wheel
    installed there is still the one imported (asserted below)."""
    import site

    if sys.prefix == sys.base_prefix:
        return
    dirs = [d for d in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(d)]
    target = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd, env).stdout.strip()
    # addsitedir (not a bare path line) also runs the .pth files there, as the venv's own start-up does
    Path(target, "_outer_site_packages.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))


@pytest.mark.slow
def test_wheel_in_fresh_venv_runs_dhp_train_dry_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS", "JAX_PLATFORMS")}
    env["PIP_NO_INDEX"] = "1"                   # nothing is downloaded
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    src = tmp_path / "src"                      # build from a copy: no build/ or egg-info in the checkout
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
          str(tmp_path / "dist"), str(src)], tmp_path, env)
    wheel = next((tmp_path / "dist").glob("dhp_jax-*.whl"))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], tmp_path, env)
    py = venv / "bin" / "python"
    _see_this_interpreters_packages(py, tmp_path, env)
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", str(wheel)], tmp_path, env)
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run([str(py), "-c", "import dhp_jax.train.train_config as c; print(c.__file__); print(c.DEMO_CONFIG)"],
                 work, env).stdout.split()
    assert all(p.startswith(str(venv)) for p in where), where     # the wheel's files, not the checkout's
    out = _run([str(venv / "bin" / "dhp"), "train", "--dry-run", "--json"], work, env)
    report = json.loads(out.stdout)
    assert report["name"] == "demo" and report["devices"].startswith("8 x cpu"), report
    import yaml

    demo = yaml.safe_load((ROOT / "dhp_jax" / "train" / "configs" / "demo.yaml").read_text())
    assert report["batch_samples"] == demo["data"]["batch_size"] and sum(len(mb) for mb in report["degrees"]) >= 1
    print("wheel install:", wheel.name, "->", report)
