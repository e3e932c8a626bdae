"""`dhp analyze`: the data profile against an independent count, the simulation against direct
planner calls, the CLI (text, JSON, plot, bad lines) and no jax import."""

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from dhp_jax.cli import main
from dhp_jax.data import read_manifest
from dhp_jax.sim.analyze import analyze


@pytest.fixture
def manifest(tmp_path):
    Image.new("RGB", (640, 480)).save(tmp_path / "a.jpg")
    Image.new("RGB", (300, 900)).save(tmp_path / "b.png")
    rng = np.random.default_rng(0)
    lines = []
    for i in range(60):
        conv = [{"from": "human", "value": "<image>\nQ" * (i % 3 + 1)}, {"from": "gpt", "value": "answer " * (i % 7)}]
        if i % 4 == 0:
            rec = {"image": "a.jpg", "conversations": conv}
        elif i % 4 == 1:
            rec = {"image": ["b.png", "gone.jpg"], "image_sizes": [[300, 900], [800, 600]], "conversations": conv}
        elif i % 4 == 2:
            rec = {"video": "v.mp4", "duration": 1 + float(rng.lognormal(2.0, 1.0)), "fps": 30,
                   "resolution": "640x360", "conversations": conv}
        else:
            rec = {"text": "word " * int(rng.integers(1, 3000))}
        lines.append(json.dumps(rec))
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_profile_matches_direct_count(manifest):
    rep = analyze(manifest, "qwen3-vl-8b", ranks=8, batch=16, num_batches=1, hardware="a100")
    ss = read_manifest(manifest, "qwen3-vl-8b")
    mods = {m: sum(g.num_tokens for s in ss for g in s.segments if g.modality == m) for m in ("text", "image", "video")}
    total = np.array([s.num_tokens for s in ss])
    d = rep["data"]
    assert d["samples"] == 60 and d["tokens"] == total.sum() and d["vision"] == "qwen3-vl-8b"
    assert d["length"]["median"] == np.median(total) and d["length"]["max"] == total.max()
    for m in mods:
        assert d["token_share"][m] == pytest.approx(mods[m] / total.sum(), rel=1e-12)
    assert d["sample_kinds"] == {"text_only": 15, "with_image": 30, "with_video": 15}
    assert d["missing_images"] == 15 and d["images_read"] == 15
    h = rep["histogram"]
    assert sum(r["samples"] for r in h) == 60
    assert sum(r["text_tokens"] + r["image_tokens"] + r["video_tokens"] for r in h) == total.sum()
    for r in h:
        assert r["samples"] == np.sum((np.maximum(total, 1) >= r["lo"]) & (total < r["hi"]))


def test_simulation_matches_planner(manifest):
    from dhp_jax.planner import CostModel, plan_batch
    from dhp_jax.sim import step_time
    rep = analyze(manifest, "internvl3-2b", ranks=8, batch=16, num_batches=2, seed=5, hardware="a100")
    assert rep["data"]["vision"] == "internvl3-2b"
    ss = read_manifest(manifest, vision="internvl3-2b")
    L = np.array([s.num_tokens for s in ss])
    E = np.array([s.bidirectional_share for s in ss])
    cost = CostModel.preset("internvl3-2b", "a100")
    rng = np.random.default_rng(5)
    sim = rep["simulation"]
    for b in range(2):
        idx = rng.choice(len(L), size=16, replace=False)
        for s in ("dhp", "static-ring:best", "static-ulysses:best"):
            t = step_time(plan_batch(L[idx], 8, cost, s, etas=E[idx]), L[idx], cost, E[idx])
            assert sim["strategies"][s]["step_time_s"][b] == pytest.approx(t, rel=1e-12)
    base = min(sim["strategies"][s]["mean_step_time_s"] for s in ("static-ring:best", "static-ulysses:best"))
    assert sim["speedup_vs_best_baseline"] == pytest.approx(base / sim["strategies"]["dhp"]["mean_step_time_s"])


def test_cli_text_json_plot(manifest, tmp_path, capsys):
    png = tmp_path / "out.png"
    assert main(["analyze", manifest, "--ranks", "8", "--batch", "16", "--batches", "1", "--json",
                 "--plot", str(png), "--hardware", "a100"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["simulation"]["ranks"] == 8 and png.stat().st_size > 1000
    assert main(["analyze", manifest, "--ranks", "8", "--batch", "16", "--batches", "1", "--hardware", "a100"]) == 0
    text = capsys.readouterr().out
    assert "token share" in text and "speed-up over the best baseline" in text and "simulated" in text
    assert main(["analyze", "msrvtt", "--mix-samples", "64", "--ranks", "8", "--batch", "16", "--batches", "1",
                 "--model", "internvl3-2b", "--hardware", "a100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["vision"] == "internvl3-2b"


def test_cli_bad_lines(manifest, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(manifest).read() + '{"image": "a.jpg", "width": "wide", "height": 3}\n')
    # qwen3-vl-2b: the default qwen3-vl-8b's state, sharded over 8 ranks, does not fit them
    assert main(["analyze", str(bad), "--ranks", "8", "--batch", "8", "--batches", "1", "--model", "qwen3-vl-2b"]) == 2
    assert "line 61: field 'width'" in capsys.readouterr().err      # errors go to stderr
    assert main(["analyze", str(bad), "--skip-bad", "--ranks", "8", "--batch", "8", "--batches", "1", "--json",
                 "--model", "qwen3-vl-2b"]) == 0
    d = json.loads(capsys.readouterr().out)["data"]
    assert d["skipped"] == 1 and d["samples"] == 60 and "line 61" in d["errors"][0]
    assert main(["analyze", str(tmp_path / "nope.jsonl")]) == 2


def test_analyze_does_not_import_jax(manifest):
    code = ("import sys; from dhp_jax.sim.analyze import analyze; "
            f"analyze({manifest!r}, 'qwen3-vl-2b', ranks=8, batch=8, num_batches=1); "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
