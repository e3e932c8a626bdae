"""Fine-tuning data for `dhp train model.pretrained=DIR data.manifest=FILE`: a user's records, through
the checkpoint's processor and tokenizer (`dhp_jax.data.finetune`), as the trainer's batches.

At start every record is planned from its headers (token counts final, no pixel decoded); bad
records are skipped (`data.on_error=skip`, listed) or stop the run (`fail`). Step `s` takes batch
`s` of the seeded loader (`dhp_jax.data.loader.Loader`: epoch `s // batches_per_epoch`, each epoch
reshuffled by the seed), whose workers decode ahead; each sample's processor output becomes a
`Sample` of the family (`hf.sample_from_inputs`) that the planner plans and the executor runs.
A batch depends only on (data, seed, step), and the loader state of the next step is stored in
each checkpoint: a resumed run takes exactly the next batch.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np

from dhp_jax.data.sample import Sample, sample_etas, sample_lengths
from dhp_jax.data.sources import source_spec  # noqa: F401 (the trainer's name for it)


@dataclasses.dataclass
class FinetuneBatch:
    step: int
    samples: list[Sample]          # with payloads: what the executor runs (and the planner plans)
    source_samples: list[Sample]   # the same samples: the token counts are real, nothing is scaled
    lengths: np.ndarray
    etas: np.ndarray
    sample_ids: list[str]          # the records' ids (or file:line)
    data_wait_s: float             # how long this batch's decode was waited for

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def video_sampling(data_cfg: Any) -> Any:
    """The run's video sampling: `data.video_fps` or `data.video_frames`, else "auto" (the value
    `dhp plan --video-fps` / `--video-frames` gives the planner)."""
    fps, frames = getattr(data_cfg, "video_fps", None), getattr(data_cfg, "video_frames", None)
    if fps is not None and frames is not None:
        raise ValueError("data.video_fps and data.video_frames: give one, not both")
    if fps is not None:
        return {"fps": fps}
    return {"num_frames": frames} if frames is not None else "auto"


class FinetunePipeline:
    """`pipeline.batch(step) -> FinetuneBatch` in step order (another step restarts the loader there)."""

    def __init__(self, data_cfg: Any, checkpoint: str, hf_config: Any, seed: int):
        from dhp_jax.data.finetune import FinetuneData
        from dhp_jax.data.loader import Loader
        from dhp_jax.data.sources import iter_source

        spec, kind = source_spec(data_cfg)
        self.hf_config, self.on_error = hf_config, data_cfg.on_error
        self.data = FinetuneData(checkpoint, family=hf_config.family, video_sampling=video_sampling(data_cfg))
        self.scan_issues: list = []
        records = iter_source(spec, kind)
        self.planned = list(self.data.scan(records, on_error=data_cfg.on_error, issues=self.scan_issues))
        if not self.planned:
            raise ValueError(f"{spec}: no usable record ({len(self.scan_issues)} skipped: "
                             + "; ".join(str(e) for e in self.scan_issues[:3]) + ")")
        self.loader = Loader(self.data, self.planned, data_cfg.batch_size, seed=seed, workers=data_cfg.workers,
                             prefetch=data_cfg.prefetch, on_error=data_cfg.on_error)
        self._it = None
        self._next = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ positions
    def loader_state(self, step: int) -> dict[str, int]:
        """The loader state whose next batch is step `step`'s."""
        per = self.loader.batches_per_epoch()
        return {"seed": self.loader.seed, "epoch": step // per, "position": step % per}

    def check_state(self, state: dict, step: int) -> None:
        """A checkpoint's loader state must be the one of its step (else the data changed)."""
        if dict(state) != self.loader_state(step):
            raise ValueError(f"the checkpoint's loader state {dict(state)} is not this data's state at step {step} "
                             f"{self.loader_state(step)}: the data (its usable records: {len(self.planned)}) or "
                             f"data.batch_size changed since the run was saved")

    @property
    def issues(self) -> list:
        return self.scan_issues + self.loader.issues

    # ------------------------------------------------------------------ batches
    def _restart(self, step: int) -> None:
        if self._it is not None:
            self._it.close()
        self.loader.load_state_dict(self.loader_state(step))
        self._it, self._next = iter(self.loader), step

    def batch(self, step: int) -> FinetuneBatch:
        from dhp_jax.model.hf.sample import samples_from_items

        with self._lock:
            if step != self._next:
                self._restart(step)
            items = next(self._it)
            self._next = step + 1
            waited = self.loader.waits[-1] if self.loader.waits else 0.0
        if not items:
            raise ValueError(f"step {step + 1}: every sample of the batch failed to decode (see data_issues.tsv)")
        samples = samples_from_items(self.hf_config, items)
        return FinetuneBatch(step, samples, samples, sample_lengths(samples), sample_etas(samples),
                             [it["sample_id"] for it in items], float(waited))

    def planned_batch(self, step: int) -> list[Sample]:
        """Payload-free samples of exactly the records of step `step`'s batch, from their headers
        (no pixel decoded): what the planner sees of `batch(step)`."""
        st = self.loader_state(step)
        return [dataclasses.replace(self.planned[int(i)].to_sample(), sample_id=k)
                for k, i in enumerate(self.loader.batch_indices(st["epoch"], st["position"]))]

    def source_batch(self, step: int, batch_size: int | None = None) -> list[Sample]:
        """Payload-free samples of the records of step `step` (`batch_size` of them, from its epoch's order)."""
        st = self.loader_state(step)
        perm = np.random.default_rng([self.loader.seed, st["epoch"]]).permutation(len(self.planned))
        n = batch_size or self.loader.batch_size
        idx = np.resize(np.roll(perm, -st["position"] * self.loader.batch_size), n)
        return [dataclasses.replace(self.planned[int(i)].to_sample(), sample_id=k) for k, i in enumerate(idx)]

    def close(self) -> None:
        with self._lock:
            if self._it is not None:
                self._it.close()
                self._it, self._next = None, None


def plan_run(config: Any, steps: int | None = None) -> list:
    """The plans a fine-tuning run of `config` makes for its first `steps` steps (None: all), from
    the records' headers: the run's cost model, strategy, program prices and bucket ladder, in step
    order as the run's planner thread makes them; no pixel decoded, nothing compiled or run."""
    from dhp_jax.geometry.layout import GROWTH, LINEAR_CHUNK, MIN_BUCKET
    from dhp_jax.model.hf.config import read_config_json
    from dhp_jax.model.hf.families import parse_config
    from dhp_jax.train.plans import PlanSource, attach_programs, run_cost

    p = config.planner
    hf_config = parse_config(read_config_json(config.model.pretrained))
    # the run's head rule too: a Ulysses size the executed model splits (`run_cost`)
    source = PlanSource(config.num_ranks, cost=run_cost(config, hf_config.num_heads), strategy=p.strategy,
                        num_micro_batches=p.num_micro_batches, full_size=p.full_size)
    attach_programs(source, config.planner.compile_price_s, (config.min_bucket or MIN_BUCKET, GROWTH, LINEAR_CHUNK),
                    None)
    pipeline = FinetunePipeline(config.data, config.model.pretrained, hf_config, config.data.seed)
    plans = []
    try:
        for step in range(config.steps if steps is None else steps):
            samples = pipeline.planned_batch(step)
            batch = FinetuneBatch(step, samples, samples, sample_lengths(samples), sample_etas(samples),
                                  [str(x.source) for x in samples], 0.0)
            plans.append(source(step, batch))
    finally:
        pipeline.close()
    return plans

