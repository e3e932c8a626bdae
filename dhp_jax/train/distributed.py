"""Multi-process JAX for `dhp train`: `jax.distributed` set-up and the per-step agreement checks.

Every process runs the same program (multi-controller JAX). `resolve` finds the coordinator
address, the process count and this process's id from flags or the environment (DHP_*, JAX_*
or SLURM); `initialize` starts `jax.distributed` (gloo collectives on CPU). During training,
`StepSync.agree(step, digest)` exchanges every process's plan hash through the coordination
service's key-value store before the step's device work: a process that planned differently
is an error naming the step and the processes, and a process that never reports (dead, stuck)
is a timeout naming the step and the missing process. `StepSync.watch(step)` guards the device
work itself: a peer that dies inside a collective would leave the others blocked in C++ forever,
so a watchdog thread reports the step and the processes that did not finish it, then exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

WATCHDOG_EXIT_CODE = 75          # the process ended itself because a peer stopped answering


class DistributedError(RuntimeError):
    """Multi-process set-up or agreement failed; the message names the step and the processes."""


class PlanMismatchError(DistributedError):
    """The processes derived different plans for the same step."""


class StepTimeoutError(DistributedError):
    """A process did not report in time for a step (it died or is stuck)."""


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


def _client() -> Any:
    from jax._src import distributed     # the coordination-service client jax.distributed started

    client = distributed.global_state.client
    if client is None:
        raise DistributedError("jax.distributed is not initialized in this process")
    return client


def _is_deadline(e: Exception) -> bool:
    text = str(e)
    return "DEADLINE_EXCEEDED" in text or "timed out" in text.lower() or "Deadline" in text


class StepSync:
    """Per-step agreement (plan hash) and liveness checks across the processes of a run."""

    def __init__(self, timeout_s: float, process_id: int | None = None, num_processes: int | None = None,
                 client: Any = None, prefix: str = "dhp", on_stuck: Callable[[str], None] | None = None) -> None:
        import jax

        if timeout_s <= 0:
            raise DistributedError(f"step timeout must be > 0 s, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.process_id = jax.process_index() if process_id is None else int(process_id)
        self.num_processes = jax.process_count() if num_processes is None else int(num_processes)
        self.client = client if client is not None else (_client() if self.num_processes > 1 else None)
        self.prefix = prefix
        self._on_stuck = on_stuck or _exit_stuck

    @property
    def peers(self) -> list[int]:
        return [p for p in range(self.num_processes) if p != self.process_id]

    def _key(self, kind: str, step: int, proc: int) -> str:
        return f"{self.prefix}/{kind}/{step}/{proc}"

    def _reported(self, kind: str, step: int) -> dict[int, str]:
        out = {}
        for p in range(self.num_processes):
            try:
                out[p] = self.client.key_value_try_get(self._key(kind, step, p))
            except Exception:   # NOT_FOUND: not reported (yet)
                pass
        return out

    def agree(self, step: int, digest: str) -> dict[int, str]:
        """Publish this process's plan digest for `step`; wait for every peer's; all must be equal.

        Returns {process: digest}. Raises `StepTimeoutError` naming the step and the processes
        that did not report within the timeout, `PlanMismatchError` naming the differing ones.
        """
        if self.num_processes == 1:
            return {0: digest}
        try:
            self.client.key_value_set(self._key("plan", step, self.process_id), digest)
        except Exception as e:
            raise StepTimeoutError(f"step {step}: process {self.process_id} cannot reach the coordination service, "
                                   f"which process 0 hosts ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                                   f"missing at step {step}: process 0 (died, or the network failed)") from None
        deadline = time.monotonic() + self.timeout_s
        digests = {self.process_id: digest}
        for p in self.peers:
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                digests[p] = self.client.blocking_key_value_get(self._key("plan", step, p), left_ms)
            except Exception as e:
                got = self._reported("plan", step)
                missing = [q for q in range(self.num_processes) if q not in got]
                why = (f"did not report its plan within {self.timeout_s:g} s" if _is_deadline(e)
                       else f"could not be reached ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
                raise StepTimeoutError(
                    f"step {step}: process {p} {why}; processes missing at step {step}: {missing} "
                    f"(of {self.num_processes}); a process died or is stuck") from None
        if len(set(digests.values())) > 1:
            by_hash: dict[str, list[int]] = {}
            for p, d in sorted(digests.items()):
                by_hash.setdefault(d, []).append(p)
            detail = "; ".join(f"processes {ps} planned {d}" for d, ps in by_hash.items())
            raise PlanMismatchError(f"step {step}: the processes derived different plans ({detail}); every process "
                                    f"must see the same batch, config and cost model")
        if step >= 2:   # every peer has read step-2's keys once it has published step-1's
            with contextlib.suppress(Exception):
                self.client.key_value_delete(self._key("plan", step - 2, self.process_id))
        return digests

    def done(self, step: int) -> None:
        """Record that this process finished `step` (the watchdog of slower peers reads it)."""
        if self.num_processes > 1:
            self.client.key_value_set(self._key("done", step, self.process_id), "1")
            if step >= 2:
                with contextlib.suppress(Exception):
                    self.client.key_value_delete(self._key("done", step - 2, self.process_id))

    def missing(self, step: int) -> list[int]:
        """Processes that have not recorded `step` as done (this one included if it has not)."""
        if self.num_processes == 1:
            return []
        try:
            got = self._reported("done", step)
        except Exception:
            return [p for p in self.peers]
        return [p for p in range(self.num_processes) if p not in got]

    @contextlib.contextmanager
    def watch(self, step: int) -> Iterator[None]:
        """Guard the device work of `step`: if it has not finished within the timeout, report the
        step and the processes that did not finish it, then end this process (`on_stuck`)."""
        if self.num_processes == 1:
            yield
            return
        finished = threading.Event()

        def watchdog() -> None:
            if finished.wait(self.timeout_s):
                return
            missing = [p for p in self.missing(step) if p != self.process_id]
            msg = (f"dhp train: step {step}: process {self.process_id} waited {self.timeout_s:g} s for the step's "
                   f"device work; processes that did not finish step {step}: {missing or 'none known'} "
                   f"(a process died or is stuck inside a collective); ending this process")
            self._on_stuck(msg)

        thread = threading.Thread(target=watchdog, name=f"dhp-step-{step}-watchdog", daemon=True)
        thread.start()
        try:
            yield
        finally:
            finished.set()
        self.done(step)


def _exit_stuck(message: str) -> None:
    # The main thread is blocked inside a runtime call that cannot be interrupted from Python;
    # ending the process is the only way not to hang forever.
    print(message, file=sys.stderr, flush=True)
    os._exit(WATCHDOG_EXIT_CODE)


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
