"""Fake CPU devices for jax: the one place that sets `--xla_force_host_platform_device_count`.

XLA reads the flag when jax initialises its CPU backend, so it must be set before jax is imported
(in this process) or in the environment of a child process. Imports nothing from the project.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, MutableMapping

FLAG = "--xla_force_host_platform_device_count"


def cpu_devices_env(count: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default: this process's) in which jax sees `count` CPU devices."""
    out = dict(os.environ if env is None else env)
    _set(out, count)
    return out


def force_cpu_devices(count: int) -> bool:
    """Ask XLA for `count` fake host devices in this process; effective (True) only if jax has not
    been imported yet."""
    if "jax" in sys.modules:
        return False
    _set(os.environ, count)
    return True


def _set(env: MutableMapping[str, str], count: int) -> None:
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(FLAG)]
    env["XLA_FLAGS"] = " ".join(flags + [f"{FLAG}={int(count)}"])
    env.setdefault("JAX_PLATFORMS", "cpu")
