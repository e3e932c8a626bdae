"""Every test process sees 8 fake CPU devices: the flag must be set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
) + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
