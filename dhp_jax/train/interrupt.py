"""Ctrl-C during `dhp train`: stop within seconds, at a point where the train state is whole.

A step's update donates the old state's buffers, so a `KeyboardInterrupt` raised between the
update's dispatch and the new state's binding would leave no state to checkpoint. While a run is
in `deferred()` (a step's device work and its hooks), SIGINT only records the request and the run
stops after that step; anywhere else (waiting for a plan, waiting for a compile) it raises
`KeyboardInterrupt` right away. A second Ctrl-C raises at once wherever the run is (`forced`: the
state may then be mid-update). XLA cannot cancel a compile: the process that stops must not wait
for the compiles still running on worker threads (`dhp train` ends with `os._exit`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Callable, Iterator


class RunInterrupted(Exception):
    """Ctrl-C stopped a run; `step` is the last finished step, `checkpoint` its checkpoint (or None)."""

    def __init__(self, step: int, total: int, checkpoint: str | None, detail: str = ""):
        self.step, self.total, self.checkpoint, self.detail = step, total, checkpoint, detail
        super().__init__(f"interrupted after step {step} of {total}"
                         + (f" (checkpoint {checkpoint})" if checkpoint else "") + (f"; {detail}" if detail else ""))


class SigintGuard:
    """Installs the SIGINT handler described above for the `with` block (main thread only; elsewhere
    it does nothing and Python's default applies)."""

    def __init__(self) -> None:
        self.requested = 0          # Ctrl-C presses seen
        self.forced = False         # raised inside a deferred region: the state may be mid-update
        self._defer = 0
        self._previous: Any = None

    def __enter__(self) -> "SigintGuard":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested += 1
        if self._defer and self.requested == 1:
            print("\ndhp train: Ctrl-C: stopping after this step (Ctrl-C again: at once, without saving it)",
                  file=sys.stderr, flush=True)
            return                  # the run checks `requested` once the step is over
        self.forced = bool(self._defer)
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise the deferred request, if any (call at a point where the state is whole)."""
        if self.requested:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._defer += 1
        try:
            yield
        finally:
            self._defer -= 1

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        """Inside a deferred region: a stretch where stopping at once is safe (a compile wait)."""
        saved, self._defer = self._defer, 0
        try:
            self.check()
            yield
        finally:
            self._defer = saved


@contextlib.contextmanager
def held_sigint() -> Iterator[None]:
    """A Ctrl-C inside the block is held and raised as `KeyboardInterrupt` at its end (main thread
    only): for imports of C extensions (jax), which a `KeyboardInterrupt` raised mid-way can leave
    half-initialised, crashing the process as it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


def wait_polling(fn: Callable[..., Any], args: tuple, poll: Callable[[float], None] | None,
                 every_s: float = 0.25) -> Any:
    """`fn(*args)` on a daemon thread while this (main) thread waits and calls `poll(elapsed_s)` every
    `every_s` (a compile's progress on the bar); a Ctrl-C ends the wait at once, whatever `fn` is
    doing, and leaves `fn` to finish on its own. The result or exception comes back here."""
    import time

    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # handed back to the waiting thread
            box["error"] = e

    t0 = time.perf_counter()
    thread = threading.Thread(target=target, name="dhp-step-compile", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(every_s)
        if poll is not None and thread.is_alive():
            poll(time.perf_counter() - t0)
    if "error" in box:
        raise box["error"]
    return box.get("value")
