"""`dhp bench data`: samples/s and tokens/s of the loader (decode + process + tokenize) on this
machine, for generated images and short videos through a family's processor files."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from dhp_jax.data.example import write_example_data, write_processor_files
from dhp_jax.data.finetune import FinetuneData
from dhp_jax.data.loader import Loader
from dhp_jax.data.sources import iter_source


def measure(family: str, samples: int, batch: int, workers: int, batches: int, data_dir: str | None = None,
            checkpoint: str | None = None, step_s: float = 0.0, max_side: int = 300, published: bool = False) -> dict:
    """Throughput (`step_s` = 0: the consumer takes batches as fast as they come) or, with a
    simulated step time, the consumer's wait per step once the loader runs ahead."""
    with tempfile.TemporaryDirectory(prefix="dhp-bench-data-") as tmp:
        if checkpoint is None:
            checkpoint = os.path.join(tmp, "checkpoint")
            write_processor_files(checkpoint, family, published=published)
        manifest = data_dir or write_example_data(os.path.join(tmp, "data"), num_samples=samples, max_side=max_side)
        data = FinetuneData(checkpoint)
        t0 = time.perf_counter()
        planned = list(data.scan(iter_source(manifest)))
        plan_s = time.perf_counter() - t0
        loader = Loader(data, planned, batch, seed=0, workers=workers, prefetch=2 * workers)
        it = iter(loader)
        next(it)  # the first batch includes the pool's start-up
        n = tokens = 0
        cpu0, t0 = time.process_time(), time.perf_counter()
        loader.waits.clear()
        for _ in range(batches):
            for s in next(it):
                n += 1
                tokens += s["num_tokens"]
            if step_s:
                time.sleep(step_s)  # the train step the loader has to keep ahead of
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"family": data.family, "samples": n, "tokens": tokens, "planned_samples": len(planned),
            "plan_samples_per_s": len(planned) / plan_s, "samples_per_s": n / wall, "tokens_per_s": tokens / wall,
            "cpu_s_per_wall_s": cpu / wall, "step_s": step_s, "max_side": max_side, "published": published,
            "wait_ms_median": 1e3 * float(np.median(loader.waits)), "wait_ms_max": 1e3 * max(loader.waits), "workers": workers, "batch": batch,
            "loadavg": os.getloadavg()[0], "cpus": os.cpu_count()}


def configure(parser: argparse.ArgumentParser) -> None:
    from dhp_jax import models

    parser.add_argument("--family", default=models.names()[0], choices=models.names())
    parser.add_argument("--checkpoint", default=None, help="a checkpoint's processor files (default: the example's)")
    parser.add_argument("--data", default=None, help="a manifest/shards/dataset (default: generated example data)")
    parser.add_argument("--samples", type=int, default=48, help="generated samples (a third are videos)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=12, help="batches timed after the first")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-side", type=int, default=300, help="largest generated image side (videos: half)")
    parser.add_argument("--published", action="store_true",
                        help="the released models' processor settings instead of the tiny example's")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="simulated train step: report the data wait per step instead of raw throughput")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    r = measure(args.family, args.samples, args.batch, args.workers, args.batches, args.data, args.checkpoint,
                args.step_ms / 1e3, args.max_side, args.published)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"data loader, {r['family']}{' (published processor settings)' if r['published'] else ''}, "
              f"media up to {r['max_side']} px: {r['samples_per_s']:.1f} samples/s, {r['tokens_per_s']:,.0f} tokens/s "
              f"({r['workers']} workers, batch {r['batch']}, {r['samples']} samples timed; "
              f"{r['cpu_s_per_wall_s']:.2f} CPU s per s; load average {r['loadavg']:.1f} on {r['cpus']} CPUs)")
        print(f"planning from headers: {r['plan_samples_per_s']:.0f} samples/s ({r['planned_samples']} samples)")
        if r["step_s"]:
            print(f"data wait per {1e3 * r['step_s']:.0f} ms step: median {r['wait_ms_median']:.2f} ms, "
                  f"max {r['wait_ms_max']:.2f} ms")
    return 0
