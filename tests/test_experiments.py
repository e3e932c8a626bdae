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
    """Every experiment module under experiments/ is registered, and every registered kind has a config."""
    from experiments.runner import REGISTRY

    modules = {f"experiments.{p.stem}" for p in (REPO / "experiments").glob("exp_*.py")}
    assert modules == {mod for mod, _ in REGISTRY.values()}
    assert {load_config(p).kind for p in CONFIGS} == set(REGISTRY)
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
    # "not measured" (a profiler that crashed, a timeout) is a failure here, never a pass
    assert out["label"].startswith(("simulated", "measured")), out["label"]
    assert out.get("measured", True) is not False, out.get("reason")
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


def test_provenance_is_read_at_the_start_with_a_dirty_flag(tmp_path, monkeypatch):
    """The commit and dirty flag a result records are those of the code when the run started: a
    commit made while it runs (simulated by the module's run moving the state on) is not recorded."""
    import subprocess
    import types

    import experiments.runner as runner

    exp = load_config(CONFIGS[0], tiny=True)
    states = iter([{"commit": "aaaaaaa", "dirty": True}, {"commit": "bbbbbbb", "dirty": False}])
    monkeypatch.setattr(runner, "source_state", lambda repo=None: next(states))
    fake = types.SimpleNamespace(run=lambda params, seed, log: {"label": "simulated (stub)", "summary": ["x"],
                                                                "later": runner.source_state()})
    monkeypatch.setattr(runner, "_module", lambda kind: fake)
    res = run_experiment(exp, tmp_path, plot=False)
    assert (res["versions"]["dhp_jax_commit"], res["versions"]["dhp_jax_dirty"]) == ("aaaaaaa", True)
    assert res["later"]["commit"] == "bbbbbbb" and res["started_utc"] <= res["created_utc"]
    # the real state of a git checkout: clean, then dirty after an edit
    monkeypatch.undo()
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "a"], cwd=repo, check=True)
    clean = runner.source_state(repo)
    assert clean["commit"] and clean["dirty"] is False
    (repo / "a.py").write_text("x = 2\n")
    assert runner.source_state(repo) == {"commit": clean["commit"], "dirty": True}
    assert runner.source_state(tmp_path / "no-such-dir") == {"commit": None, "dirty": None}


def test_e5_refits_saved_timings_and_reports_a_fresh_split(tmp_path):
    """refit_from: today's fitter on the timings an earlier run saved (no profiling), labelled so;
    the fresh held-out split (a new seed) is reported next to the tuned one."""
    path = next(p for p in CONFIGS if load_config(p).kind == "estimator")
    exp = load_config(path, overrides={"refit_from": "experiments/results/e5_estimator.json"})
    res = run_experiment(exp, tmp_path, plot=False)
    assert res["measured"] and "refit with today's code" in res["label"]
    models = [t["model"] for t in res["table"]]
    assert models[0] == "tiny" and models[1] == f"tiny (fresh split, seed {exp.params['fresh_split_seed']})"
    assert all(0 < t["mean_rel_error"] < 1 for t in res["table"])
    bad = run_experiment(load_config(path, overrides={"refit_from": str(tmp_path / "none.json")}), tmp_path,
                         plot=False)
    assert bad["label"].startswith("not measured") and "cannot be read" in bad["reason"]


def test_report_tables_are_the_renderers_output_of_the_stored_results(tmp_path):
    """REPORT.md's tables regenerate byte for byte from experiments/results/*.json (so a change to a
    table spec that changes a published table shows up here), and an infeasible ablation row reads so."""
    import shutil

    from experiments import report

    copy = tmp_path / "REPORT.md"
    shutil.copy(report.REPORT, copy)
    assert len(report.update(copy)) >= 13
    assert copy.read_text() == report.REPORT.read_text()
    row = {"dataset": "openvid", "variant": "no packing", "infeasible": "no plan fits", "label": "simulated (x, y)"}
    table = report.RENDER["ablations"]({"rows": [row]})
    assert table.splitlines()[-1] == "| openvid | no packing | infeasible | — | — | — | simulated (x) |"


def test_each_parameter_lives_in_the_yaml_and_is_read():
    """The base config of each experiment is the one home of its parameters: the script keeps no
    defaults, every `p[...]` its `run` reads is a key of the base, and every key of the base is read."""
    import ast
    import importlib

    from experiments.runner import REGISTRY, base_params

    for kind, (module, base) in REGISTRY.items():
        mod = importlib.import_module(module)
        assert not hasattr(mod, "DEFAULTS"), f"{module} keeps defaults: move them into configs/{base}"
        tree = ast.parse(Path(mod.__file__).read_text())
        read = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "p":
                if isinstance(n.slice, ast.Constant):
                    read.add(n.slice.value)                                  # p["key"]
            elif isinstance(n, ast.comprehension) and isinstance(n.iter, ast.Tuple):
                read |= {c.value for c in n.iter.elts if isinstance(c, ast.Constant)}  # p[k] for k in (...)
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "p":
                raise AssertionError(f"{module}: p.{n.attr}(...) (a default beside the YAML?): read p[key]")
        keys = set(base_params(kind))
        assert read <= keys, f"{module} reads {sorted(read - keys)}, which configs/{base} does not give"
        assert keys <= read, f"configs/{base} gives {sorted(keys - read)}, which {module} never reads"
