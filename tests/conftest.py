"""Every test process sees 8 fake CPU devices: the flag must be set before jax is imported."""

import os

from dhp_jax.devices import cpu_devices_env

os.environ.update(cpu_devices_env(8))
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
