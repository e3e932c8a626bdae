"""A newcomer's mistakes end in one clear line, never a traceback, and leave nothing behind; the
small things a newcomer reads (bench output, the Gantt, packaged profiles) say what they mean.

All in-process and cheap: no step runs, nothing is compiled.
"""

import re
import subprocess
import sys

import pytest

from dhp_jax.cli import main


def _one_line_error(capsys, prog: str) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"dhp {prog}: "), lines
    return lines[0]


@pytest.mark.parametrize("argv, prog", [
    (["plan", "--dataset", "{missing}", "--batch", "16", "--ranks", "8"], "plan"),
    (["simulate", "--dataset", "{missing}", "--nodes", "1", "--steps", "1"], "simulate"),
])
def test_a_missing_manifest_is_one_line(argv, prog, tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert main([a.replace("{missing}", str(missing)) for a in argv]) == 2
    line = _one_line_error(capsys, prog)
    assert str(missing) in line and "not found" in line


def test_train_dry_run_with_a_missing_manifest_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    out = tmp_path / "run"
    assert main(["train", f"data.dataset={missing}", "--dry-run", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("dhp train: config error: data.dataset=") and str(missing) in last and "not found" in last
    assert not out.exists()


# `dhp train ARGS` in a fresh interpreter: stderr, and whether jax was imported before it ended
TRAIN = """
import sys
from dhp_jax.cli import main
rc = main(sys.argv[1:])
print(rc, "jax" in sys.modules)
"""


def _train_error(*args: str) -> str:
    """The one line a refused `dhp train` says; it must end before jax is imported."""
    r = subprocess.run([sys.executable, "-c", TRAIN, "train", *args], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"], (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_a_checkpoint_path_that_does_not_exist_is_said_first(tmp_path):
    """Named as missing, before the data flags it also lacks are asked for."""
    line = _train_error(f"model.pretrained={tmp_path / 'nope'}", "--out", str(tmp_path / "run"))
    assert line == (f"dhp train: config error: model.pretrained={str(tmp_path / 'nope')!r}: "
                    f"{str(tmp_path / 'nope')!r} does not exist; give a checkpoint directory written by "
                    f"save_pretrained (the folder that holds config.json)"), line
    assert not (tmp_path / "run").exists()


def test_a_manifest_that_is_a_directory_names_the_file_to_give(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("")
    line = _train_error(f"model.pretrained={tmp_path / 'ck'}", f"data.manifest={tmp_path / 'data'}")
    assert line == (f"dhp train: config error: data.manifest={str(tmp_path / 'data')!r}: {str(tmp_path / 'data')!r} "
                    f"is a directory, expected a .jsonl file (it holds train.jsonl: e.g. "
                    f"data.manifest={tmp_path / 'data' / 'train.jsonl'})"), line


def test_a_cut_config_json_names_the_file_and_the_line(tmp_path):
    """A published config.json cut short (a copy that stopped): the file, the line the parser gave
    up on, and what to do; not the parser's bare message."""
    import json

    from dhp_jax.data.model_configs import model_config

    text = json.dumps(model_config("qwen3-vl-2b"), indent=2)
    cut = text[: len(text) * 2 // 3]
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text(cut)
    try:
        json.loads(cut)
    except json.JSONDecodeError as e:
        at = e.lineno
    line = _train_error(f"model.pretrained={tmp_path / 'ck'}", "data.manifest=m.jsonl")
    assert line == (f"dhp train: config error: model.pretrained={str(tmp_path / 'ck')!r}: {tmp_path / 'ck'}/config.json: "
                    f"not valid JSON at line {at} (the file may be cut short); copy or save the checkpoint again"), line
    assert at > 1


def test_resume_of_no_run_creates_nothing(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["train", "--resume", "--out", str(out), "metrics.progress=false"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--resume: no checkpoint in" in err.strip().splitlines()[-1]
    assert not out.exists()                  # no checkpoints/, no jax-cache/


def test_packaged_cost_profile_by_name(tmp_path, monkeypatch):
    from dhp_jax.planner.cli_args import cost_model, packaged_profiles
    from dhp_jax.train.train_config import load_config
    from dhp_jax.train.plans import make_cost

    monkeypatch.chdir(tmp_path)                # away from the checkout: only the package is there
    assert "tiny-cpu8" in packaged_profiles()
    by_name = cost_model("tiny-cpu8")
    assert by_name.compute_lanes is not None and by_name == cost_model("tiny-cpu8.json")
    cfg = load_config(overrides=["planner.cost_profile=tiny-cpu8", "planner.full_size=false"])
    assert cfg.planner.cost_profile == "tiny-cpu8"
    assert make_cost(cfg.planner.cost_profile, "x", "cpu", ranks_per_node=8) == by_name
    with pytest.raises(ValueError, match="packaged profiles, named without a path: .*tiny-cpu8"):
        cost_model("tiny-cpu9.json")


def test_bench_planner_says_load_and_whether_each_target_is_met(monkeypatch, capsys):
    from dhp_jax.planner import bench

    monkeypatch.setattr(bench, "TARGETS_MS", {(8, 32): 1e-9, (16, 64): 1e9})
    assert main(["bench", "planner", "--sizes", "8:32,16:64", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"load average \d+\.\d\d, \d+\.\d\d, \d+\.\d\d \(1, 5, 15 min; \d+ CPUs\)", out), out
    rows = {int(line.split()[0]): line for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)}
    assert "NOT met" in rows[8] and rows[16].rstrip().endswith(": met")
    assert "target not met at 8 ranks" in out


def test_gantt_has_a_legend_and_labels_each_block_of_a_wrapped_group():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan
    from dhp_jax.planner.plot import draw_plan

    # a degree-4 group on ranks 0, 1, 4, 5: two separate blocks
    plan = Plan(8, (MicroBatch((Group((0, 1, 4, 5), 4, (0, 1), est_time_s=1.0), Group((2, 3), 2, (2,), est_time_s=1.0),
                                Group((6, 7), 2, (3,), est_time_s=1.0)), est_makespan_s=1.0),), ranks_per_node=4)
    fig, ax = plt.subplots()
    draw_plan(ax, plan, allreduce_s=0.2)
    texts = [t.get_text() for t in ax.texts]
    assert sum(t.startswith("d=4 (1/2)") for t in texts) == 1 and sum(t.startswith("d=4 (2/2)") for t in texts) == 1
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "gradient all-reduce" in labels and any("node boundary" in x for x in labels)
    assert any(a.get_ylabel().startswith("group degree") for a in fig.axes if a is not ax)   # the colour bar
    plt.close(fig)


def test_bench_imports_only_the_chosen_target():
    """`dhp bench planner` imports the planner's bench alone (no other target's module, no jax), and a
    target's options and help come from its own module when it is chosen."""
    code = ("import sys; from dhp_jax.cli import _parser; "
            "a = _parser('bench').parse_args(['bench', 'planner', '--repeats', '2', '--json']); "
            "assert a.repeats == 2 and a.json, a; "
            "assert 'jax' not in sys.modules and 'dhp_jax.bench.compiles' not in sys.modules, 'other targets imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    out = subprocess.run([sys.executable, "-m", "dhp_jax", "bench", "compiles", "--help"], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    assert "--ranks-per-process" in out
