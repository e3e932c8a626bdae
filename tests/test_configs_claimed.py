"""Every YAML under experiments/configs/ is claimed by a runner that a test dry-runs.

`kind: train` files are dry-run by tests/test_train_configs.py, `kind: experiment` files by
tests/test_experiments.py; a file of any other kind would silently escape both.
"""

from pathlib import Path

import yaml

CONFIGS = Path(__file__).resolve().parents[1] / "experiments" / "configs"


def test_every_config_has_a_tested_kind():
    files = sorted(CONFIGS.glob("*.y*ml"))
    assert files, f"no configs under {CONFIGS}"
    kinds = {p.name: (yaml.safe_load(p.read_text()) or {}).get("kind") for p in files}
    unclaimed = {name: kind for name, kind in kinds.items() if kind not in ("train", "experiment")}
    assert not unclaimed, f"configs with no tested kind (want 'train' or 'experiment'): {unclaimed}"
