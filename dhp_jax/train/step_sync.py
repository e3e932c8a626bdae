"""Per-step agreement and liveness across the processes of a run.

`StepSync.agree(step, digest)` exchanges every process's plan hash through the coordination
service's key-value store before the step's device work: a process that planned differently
is an error naming the step and the processes, and a process that never reports (dead, stuck)
is a timeout naming the step and the missing process. `StepSync.watch(step)` guards the device
work itself: a peer that dies inside a collective would leave the others blocked in C++ forever,
so a watchdog thread reports the step and the processes that did not finish it, then exits.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator

from dhp_jax.train.launch import DistributedError

WATCHDOG_EXIT_CODE = 75          # the process ended itself because a peer stopped answering


class PlanMismatchError(DistributedError):
    """The processes derived different plans for the same step."""


class StepTimeoutError(DistributedError):
    """A process did not report in time for a step (it died or is stuck)."""


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
