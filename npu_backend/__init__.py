"""Torch executor of the same `Plan`: torch_npu + HCCL on Ascend, NCCL on CUDA, gloo on CPU.

Names load lazily, so `import npu_backend` imports no torch. Importing the package turns torch's
device-extension auto-load off first (unless the caller chose a value): with torch_npu installed
but no CANN libraries, auto-load makes `import torch` itself fail; `npu_backend.device` then
imports torch_npu inside a try and falls back with one clear line.
"""

import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from dhp_jax._lazy import lazy_attributes  # noqa: E402

_LAZY = {
    "select_device": "npu_backend.device",
    "DeviceChoice": "npu_backend.device",
    "DeviceError": "npu_backend.device",
    "RingComm": "npu_backend.ring",
    "ring_attention": "npu_backend.ring",
    "TorchMLLM": "npu_backend.model",
    "TorchFamilyModel": "npu_backend.hf",
    "load_family": "npu_backend.hf",
    "load_flax_params": "npu_backend.weights",
    "export_flax_params": "npu_backend.weights",
    "WeightsError": "npu_backend.weights",
    "TorchPlanExecutor": "npu_backend.executor",
    "StepError": "npu_backend.executor",
    "TensorParallel": "npu_backend.tensor_parallel",
    "run_world": "npu_backend.launch",
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
__all__ = list(_LAZY)
