"""`dhp bench manifest`: manifest lines parsed per second (median of repeats), no image files read.

The benchmark writes a synthetic manifest (LLaVA single/multi-image records with sizes, video
records, text-only conversations) to a temporary folder, then streams it with `iter_manifest`.
Image files are absent, so each image costs a failed `stat` (the missing-file check) but no
Pillow read: the case of a manifest that carries its sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np

from dhp_jax.data.manifest import ManifestStats, iter_manifest

_QUESTIONS = ("What is happening in this video?", "Describe the image in detail.",
              "What color is the bus on the left?", "Summarise the clip in one sentence.",
              "Read the text on the sign.")
_ANSWERS = ("A man rides a bicycle along the river while people watch from the bank.",
            "The bus is red and white with an advertisement on its back.",
            "Two dogs chase a ball across a grassy field on a sunny afternoon.")


def write_synthetic_manifest(path: str, num_lines: int, seed: int = 0) -> None:
    """A mixed manifest: 50% single-image, 10% multi-image, 25% video, 15% text-only records."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice(4, size=num_lines, p=[0.5, 0.1, 0.25, 0.15])
    sizes = ((640, 480), (500, 375), (1024, 768), (1280, 720), (336, 336))
    with open(path, "w") as f:
        for i, kind in enumerate(kinds):
            q, a = _QUESTIONS[i % len(_QUESTIONS)], _ANSWERS[i % len(_ANSWERS)]
            conv = [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
            if kind == 0:
                w, h = sizes[i % len(sizes)]
                rec = {"id": i, "image": f"images/{i:08d}.jpg", "width": w, "height": h}
                conv[0]["value"] = "<image>\n" + q
            elif kind == 1:
                k = 2 + i % 3
                rec = {"id": i, "image": [f"images/{i:08d}_{j}.jpg" for j in range(k)],
                       "image_sizes": [list(sizes[(i + j) % len(sizes)]) for j in range(k)]}
                conv[0]["value"] = "<image>" * k + "\n" + q
            elif kind == 2:
                rec = {"id": i, "video": f"videos/{i:08d}.mp4", "duration": round(float(rng.lognormal(1.8, 0.8)), 2),
                       "fps": 30, "resolution": "1280x720"}
                conv[0]["value"] = "<video>\n" + q
            else:
                rec = {"id": i}
                conv = conv * 3
            rec["conversations"] = conv
            f.write(json.dumps(rec) + "\n")


def measure(path: str, repeats: int, vision: str) -> dict:
    """Lines/s of `iter_manifest` over `repeats` full passes."""
    rates, cpu_rates = [], []
    for _ in range(repeats):
        stats = ManifestStats()
        t0, c0 = time.perf_counter(), time.process_time()
        n = 0
        for _s in iter_manifest(path, vision, stats=stats):
            n += 1
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        rates.append(stats.lines / dt)
        cpu_rates.append(stats.lines / dc)
    # Wall-clock rates suffer when other processes share the cores; the rate per CPU second of
    # this process is reported beside them.
    return {"lines": stats.lines, "samples": n, "missing_images": stats.missing_images,
            "lines_per_s_median": statistics.median(rates), "lines_per_s_all": rates,
            "lines_per_cpu_s_median": statistics.median(cpu_rates),
            "load_average_1min": os.getloadavg()[0],
            "json_parser": _json_backend(), "vision": vision}


def _json_backend() -> str:
    try:
        import orjson  # noqa: F401
        return "orjson"
    except ImportError:
        return "json (stdlib)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lines", type=int, default=200_000, help="lines in the synthetic manifest")
    parser.add_argument("--repeats", type=int, default=5, help="full passes; the median is reported")
    parser.add_argument("--vision", default="qwen-vl", help="vision family: qwen-vl, internvl, llava")
    parser.add_argument("--manifest", default=None, help="time this manifest instead of a synthetic one")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    if args.lines < 1 or args.repeats < 1:
        raise SystemExit("--lines and --repeats must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.manifest
        if path is None:
            path = os.path.join(tmp, "synthetic.jsonl")
            write_synthetic_manifest(path, args.lines)
        result = measure(path, args.repeats, args.vision)
    result.update({"measured_on": f"{platform.machine()} CPU, {os.cpu_count()} cores (this machine)",
                   "manifest": args.manifest or f"synthetic, {args.lines} lines"})
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"manifest: {result['manifest']}  vision: {args.vision}  JSON parser: {result['json_parser']}")
        print(f"lines/s (median of {args.repeats}): {result['lines_per_s_median']:,.0f}  "
              f"[{', '.join(f'{r:,.0f}' for r in result['lines_per_s_all'])}]")
        print(f"lines per CPU second (median): {result['lines_per_cpu_s_median']:,.0f}  "
              f"(1-min load average {result['load_average_1min']:.1f} on {os.cpu_count()} cores)")
        print(f"samples: {result['samples']}  missing image files (sizes given): {result['missing_images']}")
    return 0
