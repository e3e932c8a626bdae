"""Backend selection with torch_npu absent, installed-but-broken (no CANN), and (mocked) present."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from npu_backend import device as dev

BROKEN = 'raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")\n'
PRESENT = textwrap.dedent("""
    import types, torch
    torch.npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 8,
                                      set_device=lambda d: None)
""")


@pytest.fixture
def fake_torch_npu(tmp_path, monkeypatch):
    """Install a fake `torch_npu` package with the given body on sys.path; undo everything after."""

    def install(body: str) -> None:
        pkg = tmp_path / "torch_npu"
        pkg.mkdir()
        (pkg / "__init__.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))

    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    yield install
    sys.modules.pop("torch_npu", None)
    if hasattr(torch, "npu"):
        delattr(torch, "npu")


def test_absent_falls_back_to_cpu_gloo_without_warning():
    lines: list[str] = []
    choice = dev.select_device(env={}, warn=lines.append)
    assert dev.probe_torch_npu().state == "absent"
    assert (choice.kind, choice.backend) == ("cpu", "gloo")
    assert choice.device(3) == torch.device("cpu")
    assert lines == [] and choice.note is None


def test_broken_torch_npu_gives_one_line_and_falls_back(fake_torch_npu):
    fake_torch_npu(BROKEN)
    lines: list[str] = []
    choice = dev.select_device(env={}, warn=lines.append)
    assert (choice.kind, choice.backend) == ("cpu", "gloo")
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "libhccl.so" in lines[0] and "CANN" in lines[0] and "Falling back" in lines[0]
    # Forcing the NPU with a broken torch_npu is an error that names the cause.
    with pytest.raises(dev.DeviceError, match="libhccl.so"):
        dev.select_device(env={dev.ENV_VAR: "npu"}, warn=lines.append)


def test_mocked_present_npu_selects_hccl(fake_torch_npu):
    fake_torch_npu(PRESENT)
    choice = dev.select_device(env={}, warn=lambda line: pytest.fail(f"unexpected warning {line}"))
    assert (choice.kind, choice.backend) == ("npu", "hccl")
    # The environment variable overrides the detected NPU.
    forced = dev.select_device(env={dev.ENV_VAR: "cpu"})
    assert (forced.kind, forced.backend) == ("cpu", "gloo")


def test_env_override_errors_are_clear():
    with pytest.raises(dev.DeviceError, match="DHP_TORCH_DEVICE='tpu' is not one of"):
        dev.select_device(env={dev.ENV_VAR: "tpu"})
    with pytest.raises(dev.DeviceError, match="torch.cuda.is_available"):
        dev.select_device(env={dev.ENV_VAR: "cuda"})
    with pytest.raises(dev.DeviceError, match="not installed"):
        dev.select_device(env={dev.ENV_VAR: "npu"})


def _fake_installed_torch_npu(root) -> None:
    """A broken torch_npu *installed* like the real wheel: package + dist-info declaring the
    `torch.backends` entry point that torch auto-loads on `import torch`."""
    pkg = root / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(BROKEN)
    info = root / "torch_npu-2.13.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.13.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")


def test_broken_installed_extension_trap_in_a_fresh_process(tmp_path):
    """The trap `npu_backend/device.py` guards against (docs/DESIGN.md, section 6), reproduced: with auto-load on (torch's default) `import torch`
    fails; importing npu_backend first turns auto-load off and selection falls back to CPU with
    one warning line."""
    _fake_installed_torch_npu(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=120)

    trap = run("import torch")
    assert trap.returncode != 0 and "Failed to load the backend extension: torch_npu" in trap.stderr
    out = run("from npu_backend.device import select_device; import os; c = select_device(); "
              "print(c.kind, c.backend, os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'])")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "gloo", "0"]
    warn_lines = [ln for ln in out.stderr.splitlines() if "torch_npu" in ln]
    assert len(warn_lines) == 1 and "libhccl.so" in warn_lines[0]
