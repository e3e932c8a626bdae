"""A loader that decodes ahead in background threads, in a seeded order, resumable at any batch.

Order: epoch e visits the planned samples in `default_rng([seed, e]).permutation(n)`, cut into
batches of `batch_size` (the last partial batch of an epoch is kept). Workers decode and process
batches ahead of the consumer; at most `prefetch` batches are in flight or waiting (a bounded
queue), so memory does not grow with the data. Batches come out in order whatever the workers'
timing, so a run is deterministic. `state_dict()` is the position of the next batch the consumer
will receive (not of what was prefetched): a loader restored from it yields exactly that batch.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import time
from typing import Any, Iterator, Sequence

import numpy as np

from dhp_jax.data.finetune import DataError, FinetuneData, Planned


class Loader:
    def __init__(self, data: FinetuneData, planned: Sequence[Planned], batch_size: int, seed: int = 0,
                 workers: int = 2, prefetch: int = 4, on_error: str = "skip"):
        if batch_size < 1 or workers < 1 or prefetch < 1:
            raise ValueError("batch_size, workers and prefetch must be >= 1")
        if not planned:
            raise ValueError("no samples to load")
        self.data, self.planned = data, list(planned)
        self.batch_size, self.seed, self.workers, self.prefetch = batch_size, seed, workers, prefetch
        self.on_error = on_error
        self.epoch, self.position = 0, 0  # position: batches of `epoch` already handed out
        self.issues: list[DataError] = []
        self.wait_s = 0.0  # time the consumer spent waiting for batches, in all
        self.waits: collections.deque = collections.deque(maxlen=1024)  # the latest batches' waits

    # --- order ---------------------------------------------------------------------------------
    def batches_per_epoch(self) -> int:
        return -(-len(self.planned) // self.batch_size)

    def batch_indices(self, epoch: int, position: int) -> np.ndarray:
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.planned))
        return perm[position * self.batch_size:(position + 1) * self.batch_size]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"loader state was saved with seed {state['seed']}, this loader has {self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    # --- work ------------------------------------------------------------------------------------
    def _load(self, idx: np.ndarray) -> list[dict[str, Any]]:
        out = []
        for i in idx:
            p = self.planned[int(i)]
            try:
                inputs = self.data.materialize(p)
            except DataError as e:
                if self.on_error == "fail":
                    raise
                self.issues.append(e)
                continue
            out.append({"sample_id": p.sample_id, "num_tokens": p.num_tokens, "inputs": inputs})
        return out

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        """Batches (lists of {"sample_id", "num_tokens", "inputs"}) forever, epoch after epoch.
        A sample whose media fail to decode is dropped from its batch and listed in `issues`."""
        pending: collections.deque = collections.deque()
        nxt = (self.epoch, self.position)
        with cf.ThreadPoolExecutor(self.workers, thread_name_prefix="dhp-data") as pool:
            try:
                while True:
                    while len(pending) < self.prefetch:
                        e, pos = nxt
                        pending.append((nxt, pool.submit(self._load, self.batch_indices(e, pos))))
                        nxt = (e, pos + 1) if pos + 1 < self.batches_per_epoch() else (e + 1, 0)
                    (e, pos), fut = pending.popleft()
                    t0 = time.perf_counter()
                    batch = fut.result()
                    waited = time.perf_counter() - t0
                    self.wait_s += waited
                    self.waits.append(waited)
                    self.epoch, self.position = (e, pos + 1) if pos + 1 < self.batches_per_epoch() else (e + 1, 0)
                    yield batch
            finally:
                for _, f in pending:
                    f.cancel()
