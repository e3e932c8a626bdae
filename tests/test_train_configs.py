"""Every `kind: train` YAML (experiments/configs/ and the packaged demo) loads and dry-runs (no step, no compile)."""

from pathlib import Path

import pytest
import yaml

from dhp_jax.train.train_config import DEMO_CONFIG, load_config
from dhp_jax.train.trainer import dry_run

CONFIGS = Path(__file__).resolve().parents[1] / "experiments" / "configs"
PACKAGED = Path(__file__).resolve().parents[1] / "dhp_jax" / "train" / "configs"
TRAIN_YAMLS = sorted(p for d in (CONFIGS, PACKAGED) for p in d.glob("*.y*ml")
                     if (yaml.safe_load(p.read_text()) or {}).get("kind") == "train")


def test_the_demo_is_among_them():
    assert DEMO_CONFIG == PACKAGED / "demo.yaml" and DEMO_CONFIG in TRAIN_YAMLS


@pytest.mark.parametrize("path", TRAIN_YAMLS, ids=lambda p: p.name)
def test_train_config_loads_and_dry_runs(path):
    cfg = load_config(path)
    report = dry_run(cfg)
    assert report["batch_samples"] == cfg.data.batch_size
    assert report["max_sample_tokens"] <= cfg.data.max_tokens
    assert sum(len(mb) for mb in report["degrees"]) >= 1
    assert "Run:" in path.read_text().split("kind:")[0]  # the header says the command that runs it


def test_dhp_train_sets_up_8_cpu_devices_itself():
    """`dhp train` in a fresh process (no XLA_FLAGS) gets the 8 fake devices the demo asks for."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    out = subprocess.run([sys.executable, "-m", "dhp_jax", "train", "--dry-run", "--json"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["devices"] == "8 x cpu" and report["num_ranks"] == 8
