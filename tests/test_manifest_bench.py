"""`dhp bench manifest` runs end to end on a tiny synthetic manifest (speed is not asserted here)."""

import json

from dhp_jax.cli import main
from dhp_jax.data import read_manifest
from dhp_jax.data.manifest_bench import write_synthetic_manifest


def test_bench_manifest_small(capsys):
    assert main(["bench", "manifest", "--lines", "2000", "--repeats", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lines"] == out["samples"] == 2000
    assert len(out["lines_per_s_all"]) == 2 and out["lines_per_s_median"] > 0
    assert out["missing_images"] > 0                       # sizes given, files absent: counted


def test_synthetic_manifest_kinds(tmp_path):
    path = tmp_path / "s.jsonl"
    write_synthetic_manifest(str(path), 400, seed=1)
    ss = read_manifest(path)
    kinds = {(any(g.modality == "image" for g in s.segments), any(g.modality == "video" for g in s.segments))
             for s in ss}
    assert kinds == {(True, False), (False, True), (False, False)}
