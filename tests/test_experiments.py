"""Every `kind: experiment` config under experiments/configs/ runs in its tiny variant and writes a
result JSON (config, seed, versions, machine, labels) and a PNG; config errors name the key."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from experiments.report import render  # noqa: E402
from experiments.runner import ConfigError, config_files, load_config, parse_override, run_experiment  # noqa: E402

CONFIGS = config_files()


def test_there_is_a_config_for_every_experiment():
    kinds = {load_config(p).kind for p in CONFIGS}
    assert kinds == {"end_to_end", "scaling", "overhead", "estimator", "case_study", "optimality", "ablations",
                     "sensitivity", "compiles"}
    assert len(CONFIGS) >= 8  # experiment 1 and 2 share a runner, with two configs


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_header_names_the_command(path):
    head = path.read_text().splitlines()[:8]
    assert head[0].startswith("#")
    rel = path.relative_to(REPO)
    assert any(f"python -m experiments.run {rel}" in line for line in head), head


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_tiny_variant_runs_and_writes_results(path, tmp_path):
    exp = load_config(path, tiny=True)
    res = run_experiment(exp, tmp_path)
    out = json.loads((tmp_path / f"{exp.name}.json").read_text())
    assert (tmp_path / f"{exp.name}.png").stat().st_size > 1000
    assert out["config"] == json.loads(json.dumps(exp.params)) and out["seed"] == exp.seed and out["tiny"]
    assert out["versions"]["numpy"] and out["machine"]["cpu_count"] >= 1
    assert out["label"].startswith(("simulated", "measured", "not measured"))
    assert out["summary"], "every experiment states its headline"
    for row in out.get("rows", []):
        if "label" in row:
            assert row["label"].startswith(("simulated", "measured")), row["label"]
    assert res["name"] == exp.name
    table = render(exp.name, tmp_path)  # the REPORT.md table renders from the JSON
    assert ("| " in table or "Not measured" in table) and out["label"] in table


def test_overrides_and_errors(tmp_path):
    path = REPO / "experiments/configs/e6_case_study.yaml"
    exp = load_config(path, tiny=True, overrides=dict([parse_override("datasets=[msrvtt]"), ("seed", 3)]))
    assert exp.params["datasets"] == ["msrvtt"] and exp.seed == 3
    with pytest.raises(ConfigError, match="unknown key 'bogus'.*valid keys"):
        load_config(path, overrides={"bogus": 1})
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: experiment\nexperiment: nope\n")
    with pytest.raises(ConfigError, match="unknown experiment 'nope'"):
        load_config(bad)
    bad.write_text("kind: train\n")
    with pytest.raises(ConfigError, match="kind"):
        load_config(bad)
    bad.write_text("kind: experiment\nexperiment: scaling\n")
    with pytest.raises(ConfigError, match="no `tiny:` block"):
        load_config(bad, tiny=True)
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("novalue")


def test_run_cli_all_tiny_rejects_bad_override(capsys):
    from experiments.run import main
    assert main(["experiments/configs/e6_case_study.yaml", "--tiny", "--no-plot", "bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err
