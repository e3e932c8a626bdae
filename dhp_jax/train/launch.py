"""Launch-environment resolution for multi-process JAX (`dhp train`): who this process is, where the
coordinator is, and the `jax.distributed` start.

Every process runs the same program (multi-controller JAX). `resolve` finds the coordinator
address, the process count and this process's id from flags or the environment (DHP_*, JAX_*
or SLURM); `initialize` starts `jax.distributed` (gloo collectives on CPU).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping, Sequence


class DistributedError(RuntimeError):
    """Multi-process set-up or agreement failed; the message names the step and the processes."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where the coordinator is and who this process is; `source` says where that came from."""

    coordinator: str
    num_processes: int
    process_id: int
    source: str
    local_device_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_processes < 1:
            raise DistributedError(f"num_processes must be >= 1, got {self.num_processes} ({self.source})")
        if not 0 <= self.process_id < self.num_processes:
            raise DistributedError(f"process_id {self.process_id} is outside 0..{self.num_processes - 1} "
                                   f"({self.source})")
        host, sep, port = self.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise DistributedError(f"coordinator address {self.coordinator!r} is not HOST:PORT ({self.source})")


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a SLURM node list: 'n[01-03,07],gpu-a' -> n01 n02 n03 n07 gpu-a."""
    items, depth, cur = [], 0, ""
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise DistributedError(f"SLURM node list {nodelist!r}: unbalanced ']'")
        cur += ch
    if depth:
        raise DistributedError(f"SLURM node list {nodelist!r}: unbalanced '['")
    items.append(cur)
    hosts: list[str] = []
    for item in filter(None, items):
        hosts.extend(_expand_host(item, nodelist))
    if not hosts:
        raise DistributedError(f"SLURM node list {nodelist!r} names no host")
    return hosts


def _expand_host(item: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        return [item]
    values = []
    for part in m.group(1).split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise DistributedError(f"SLURM node list {whole!r}: bad range {part!r}")
        if not dash:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise DistributedError(f"SLURM node list {whole!r}: range {part!r} runs backwards")
        values.extend(str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1))   # keep zero padding
    head, tail = item[:m.start()], item[m.end():]
    return [h for v in values for h in _expand_host(head + v + tail, whole)]


def slurm_port(job_id: str) -> int:
    """The coordinator port of a SLURM job (the same rule as jax's own SLURM detection)."""
    return int(job_id) % 4096 + 61440


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise DistributedError(f"environment variable {key}={env[key]!r} is not an integer") from None


def resolve(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
            env: Mapping[str, str] | None = None) -> DistributedConfig | None:
    """The multi-process set-up of this process, or None for a single-process run.

    Precedence: explicit flags, then DHP_COORDINATOR / DHP_NUM_PROCESSES / DHP_PROCESS_ID, then
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, then SLURM (SLURM_STEP_NODELIST
    or SLURM_JOB_NODELIST, SLURM_NTASKS, SLURM_PROCID; port DHP_COORDINATOR_PORT or derived from
    SLURM_JOB_ID). Each field is taken from the first source that has it; a partial set-up is
    an error naming what is missing.
    """
    env = os.environ if env is None else env
    found: dict[str, tuple[Any, str]] = {}

    def offer(field: str, value: Any, source: str) -> None:
        if value is not None and field not in found:
            found[field] = (value, source)

    offer("coordinator", coordinator, "flag --coordinator")
    offer("num_processes", num_processes, "flag --num-processes")
    offer("process_id", process_id, "flag --process-id")
    for prefix, addr_key in (("DHP", "DHP_COORDINATOR"), ("JAX", "JAX_COORDINATOR_ADDRESS")):
        if addr_key in env:
            offer("coordinator", env[addr_key], addr_key)
        for field, key in (("num_processes", f"{prefix}_NUM_PROCESSES"), ("process_id", f"{prefix}_PROCESS_ID")):
            if key in env:
                offer(field, _int(env, key), key)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS") > 1:
        offer("num_processes", _int(env, "SLURM_NTASKS"), "SLURM_NTASKS")
        offer("process_id", _int(env, "SLURM_PROCID"), "SLURM_PROCID")
        if nodelist:
            head = expand_nodelist(nodelist)[0]      # the coordinator runs on the first node
            if "DHP_COORDINATOR_PORT" in env:
                port = _int(env, "DHP_COORDINATOR_PORT")
            elif "SLURM_JOB_ID" in env:
                port = slurm_port(env["SLURM_JOB_ID"])
            else:
                raise DistributedError("SLURM run without SLURM_JOB_ID: set DHP_COORDINATOR_PORT")
            offer("coordinator", f"{head}:{port}", "SLURM node list")
    if not found:
        return None
    n = found.get("num_processes", (None, ""))[0]
    if n == 1 and "coordinator" not in found:
        return None
    missing = [f for f in ("coordinator", "num_processes", "process_id") if f not in found]
    if missing:
        have = ", ".join(f"{f} from {src}" for f, (_, src) in found.items())
        raise DistributedError(f"incomplete multi-process set-up: {', '.join(missing)} not given "
                               f"(have {have}); pass --coordinator HOST:PORT --num-processes N --process-id I "
                               f"or set DHP_COORDINATOR, DHP_NUM_PROCESSES, DHP_PROCESS_ID")
    local = None
    if env.get("JAX_LOCAL_DEVICE_IDS"):
        try:
            local = tuple(int(x) for x in env["JAX_LOCAL_DEVICE_IDS"].split(","))
        except ValueError:
            raise DistributedError(f"JAX_LOCAL_DEVICE_IDS={env['JAX_LOCAL_DEVICE_IDS']!r} is not a comma-separated "
                                   f"list of device ids") from None
    return DistributedConfig(coordinator=str(found["coordinator"][0]), num_processes=int(found["num_processes"][0]),
                             process_id=int(found["process_id"][0]),
                             source=", ".join(sorted({src for _, src in found.values()})), local_device_ids=local)


def initialize(cfg: DistributedConfig, *, timeout_s: int = 300, cpu_collectives: str = "gloo") -> None:
    """Start `jax.distributed` for `cfg` (call once, before any jax device is touched).

    CPU collectives across processes need an implementation (gloo); it is set before the
    backend starts. The heartbeat timeout is tied to `timeout_s` so that the coordination
    service also notices a dead process in bounded time.
    """
    import jax

    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    try:
        jax.distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id,
                                   local_device_ids=list(cfg.local_device_ids) if cfg.local_device_ids else None,
                                   initialization_timeout=int(timeout_s),
                                   heartbeat_timeout_seconds=max(10, int(timeout_s)))
    except Exception as e:     # the runtime raises its own error types; say what we tried
        raise DistributedError(f"process {cfg.process_id} of {cfg.num_processes} could not start jax.distributed "
                               f"with the coordinator at {cfg.coordinator} (timeout {timeout_s} s, set-up from "
                               f"{cfg.source}): {type(e).__name__}: {e}") from None


def describe(cfg: DistributedConfig | None, devices: Sequence[Any] | None = None) -> str:
    """One line for logs: which process this is and what it sees."""
    if cfg is None:
        return "single process"
    local = ""
    if devices is not None:
        import jax

        mine = [d.id for d in devices if d.process_index == jax.process_index()]
        local = f"; local devices {mine} of {len(devices)}"
    return (f"process {cfg.process_id} of {cfg.num_processes}, coordinator {cfg.coordinator} "
            f"(from {cfg.source}){local}")
