"""Pick the torch device and collective backend: Ascend NPU + HCCL, CUDA + NCCL, CPU + gloo, or (asked
for by name only) an XLA device of torch_xla + gloo on host copies (`npu_backend.xla`).

torch auto-loads device extensions on `import torch`; with torch_npu installed but Ascend's CANN
libraries absent that makes `import torch` itself fail. So this module turns the auto-load off
before torch is imported and imports torch_npu itself, inside a try, to report one clear line and
fall back instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable, Mapping

# Must precede the first `import torch` of the process (see the module docstring).
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

ENV_VAR = "DHP_TORCH_DEVICE"
_KINDS = ("npu", "cuda", "cpu", "xla")
_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo", "xla": "xlahost"}


class DeviceError(RuntimeError):
    """The requested device cannot be used (e.g. DHP_TORCH_DEVICE=npu without a working torch_npu)."""


@dataclasses.dataclass(frozen=True)
class DeviceChoice:
    """Where one rank runs: `kind` in {"npu", "cuda", "cpu", "xla"}, its collective `backend`, and why."""

    kind: str
    backend: str
    reason: str
    note: str | None = None  # one-line warning, e.g. torch_npu present but broken

    def device(self, local_rank: int = 0) -> torch.device:
        """The torch device for a process with this local rank on its node."""
        if self.kind == "cpu":
            return torch.device("cpu")
        if self.kind == "xla":      # one XLA client per process, holding the rank's device
            from npu_backend import xla

            return xla.device()
        return torch.device(self.kind, local_rank)


@dataclasses.dataclass(frozen=True)
class NpuProbe:
    """Result of trying torch_npu: `state` is "absent", "broken" or "ok"; `detail` says why."""

    state: str
    detail: str = ""
    available: bool = False


def probe_torch_npu() -> NpuProbe:
    """Try to import torch_npu and ask whether an NPU is usable; never raises."""
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        return NpuProbe("absent", "torch_npu is not installed")
    try:
        importlib.import_module("torch_npu")
    except Exception as e:  # ImportError (libhccl.so ...), OSError, RuntimeError from CANN init
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return NpuProbe("broken", f"{type(e).__name__}: {first}")
    npu = getattr(torch, "npu", None)
    if npu is None or not callable(getattr(npu, "is_available", None)):
        return NpuProbe("broken", "torch_npu imported but torch.npu is missing")
    try:
        available = bool(npu.is_available())
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return NpuProbe("broken", f"torch.npu.is_available() failed: {type(e).__name__}: {first}")
    return NpuProbe("ok", "torch_npu loaded", available)


def select_device(env: Mapping[str, str] | None = None,
                  warn: Callable[[str], Any] | None = None) -> DeviceChoice:
    """Choose the device and backend for this process.

    Order: `DHP_TORCH_DEVICE` (npu / cuda / cpu / xla) if set; else a working torch_npu with a visible
    NPU -> ("npu", "hccl"); else CUDA -> ("cuda", "nccl"); else ("cpu", "gloo"). An installed
    but broken torch_npu (CANN libraries missing) is reported in one line through `warn`
    (default: stderr) and skipped. XLA is never picked unless forced: ("xla", "xlahost"), the
    torch_xla device (its PJRT_DEVICE) with collectives on gloo over host copies (`npu_backend.xla`).
    Forcing a device that is not usable raises `DeviceError`.
    """
    env = os.environ if env is None else env
    warn = warn if warn is not None else (lambda line: print(line, file=sys.stderr))
    forced = env.get(ENV_VAR, "").strip().lower() or None
    if forced is not None and forced not in _KINDS:
        raise DeviceError(f"{ENV_VAR}={env[ENV_VAR]!r} is not one of {', '.join(_KINDS)}")

    if forced == "cpu":
        return DeviceChoice("cpu", "gloo", f"{ENV_VAR}=cpu")
    if forced == "xla":
        from npu_backend import xla

        ok, detail = xla.available()
        if not ok:
            raise DeviceError(f"{ENV_VAR}=xla but {detail}")
        pjrt = env.get("PJRT_DEVICE") or "torch_xla's default"
        return DeviceChoice("xla", xla.BACKEND, f"{ENV_VAR}=xla, torch_xla {detail}, PJRT_DEVICE {pjrt}")

    note = None
    if forced in (None, "npu"):
        probe = probe_torch_npu()
        if probe.state == "ok" and probe.available:
            why = f"{ENV_VAR}=npu" if forced else "torch_npu loaded and an NPU is visible"
            return DeviceChoice("npu", "hccl", why)
        if forced == "npu":
            raise DeviceError(f"{ENV_VAR}=npu but no usable Ascend NPU: {probe.detail}"
                              + ("" if probe.state != "ok" else " (torch.npu.is_available() is False)"))
        if probe.state == "broken":
            note = (f"torch_npu is installed but cannot load ({probe.detail}); are the Ascend CANN "
                    f"libraries installed and set_env.sh sourced? Falling back.")
            warn(note)

    cuda_ok = torch.cuda.is_available()
    if forced == "cuda":
        if not cuda_ok:
            raise DeviceError(f"{ENV_VAR}=cuda but torch.cuda.is_available() is False")
        return DeviceChoice("cuda", "nccl", f"{ENV_VAR}=cuda", note)
    if cuda_ok:
        return DeviceChoice("cuda", "nccl", "CUDA is available", note)
    return DeviceChoice("cpu", "gloo", "no NPU or CUDA device", note)


def set_current_device(choice: DeviceChoice, local_rank: int) -> torch.device:
    """Bind this process to its accelerator (one rank per device) and return the device."""
    dev = choice.device(local_rank)
    if choice.kind == "npu":
        torch.npu.set_device(dev)  # type: ignore[attr-defined]
    elif choice.kind == "cuda":
        torch.cuda.set_device(dev)
    return dev
