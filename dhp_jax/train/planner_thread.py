"""Plan step t+1 while step t runs: a producer thread, a bounded queue, a measured consumer wait.

The producer builds each batch (payload arrays) and its plan in a background thread, at most
`lookahead` steps ahead. The planner is deterministic (no wall-clock limits), so every process
that ran this thread on the same data would compute the same plan. The consumer records how long
each `next()` blocked: in steady state the queue is full and the wait is ~0.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Iterator

from dhp_jax.planner.contract.plan import Plan


@dataclasses.dataclass
class PlannedBatch:
    step: int
    batch: Any               # what `make_batch(step)` returned (a pipeline `Batch`)
    plan: Plan
    plan_s: float            # producer time spent in `make_plan` (CPU seconds of planning)
    build_s: float           # producer time spent building the batch
    wait_s: float = 0.0      # consumer time blocked in `next()` for this item
    prepared: Any = None     # what `prepare(batch, plan)` made of it (None: no `prepare`, or it raised)


_DONE = object()


class StepPlanningFailed(RuntimeError):
    """Building or planning the batch of (0-based) `step` raised; the original is `__cause__`."""

    def __init__(self, step: int, error: BaseException):
        super().__init__(f"planning step {step + 1} failed: {type(error).__name__}: {error}")   # 1-based, as the user reads it
        self.step = step


class PlannerThread:
    """Iterator over `PlannedBatch` for steps `start, start+1, ..., stop-1`.

    `make_batch(step)` and `make_plan(step, batch)` run in the thread. An exception there is
    re-raised in the consumer at the step it concerns, with the step named. `prepare(batch, plan)`
    (optional) runs in the thread next to the plan: the step's `PreparedStep`
    (`PlanExecutor.prepare`), the one preparation of the plan that every consumer takes
    (`PlannedBatch.prepared`). `after_plan(item)` (optional) runs in the thread once the planned
    batch is queued: work the step will need, done ahead of it, such as compiling the plan's
    programs. Both must be work the consumer would otherwise do itself, so an exception in either
    is dropped (`prepared` stays None): the consumer meets it again in place.
    """

    def __init__(self, make_batch: Callable[[int], Any], make_plan: Callable[[int, Any], Plan],
                 start: int, stop: int, lookahead: int = 2,
                 after_plan: Callable[[PlannedBatch], Any] | None = None,
                 prepare: Callable[[Any, Plan], Any] | None = None):
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        self._make_batch, self._make_plan, self._after_plan = make_batch, make_plan, after_plan
        self._prepare = prepare
        self._start, self._stop = start, stop
        self._queue: queue.Queue = queue.Queue(maxsize=lookahead)
        self._stop_event = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="dhp-planner", daemon=True)
        self.waits: list[float] = []
        self._started = False

    def start(self) -> "PlannerThread":
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def _put(self, item: Any) -> bool:
        while not self._stop_event.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        for step in range(self._start, self._stop):
            if self._stop_event.is_set():
                return
            try:
                t0 = time.perf_counter()
                batch = self._make_batch(step)
                t1 = time.perf_counter()
                plan = self._make_plan(step, batch)
                t2 = time.perf_counter()
            except BaseException as e:  # handed to the consumer, which raises it at this step
                self._put(StepPlanningFailed(step, e))
                self._put(e)
                return
            item = PlannedBatch(step, batch, plan, plan_s=t2 - t1, build_s=t1 - t0)
            if self._prepare is not None:
                try:
                    item.prepared = self._prepare(batch, plan)
                except Exception:  # the consumer prepares the plan itself and raises it there
                    pass
            if not self._put(item):
                return
            if self._after_plan is not None:
                try:
                    self._after_plan(item)
                except Exception:  # the consumer does this work itself and raises it there
                    pass
        self._put(_DONE)

    def __iter__(self) -> Iterator[PlannedBatch]:
        return self

    def __next__(self) -> PlannedBatch:
        self.start()
        t0 = time.perf_counter()
        item = self._queue.get()
        wait = time.perf_counter() - t0
        if item is _DONE:
            self._queue.put(_DONE)  # stay exhausted
            raise StopIteration
        if isinstance(item, StepPlanningFailed):
            cause = self._queue.get()
            self.close()
            raise item from cause
        item.wait_s = wait
        self.waits.append(wait)
        return item

    def close(self) -> None:
        self._stop_event.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def __enter__(self) -> "PlannerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
