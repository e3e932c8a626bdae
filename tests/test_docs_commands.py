"""Every command and snippet of README.md, experiments/REPORT.md, CONTRIBUTING.md and docs/ runs, or is checked as far as
one machine allows. How each is checked (`how` below):

- run: executed as written (cheap: `dhp plan`, `dhp plan --freeze-vision --json`,
  `dhp analyze openvid ...`, `python -m experiments.report` on a copy of REPORT.md, every
  ```python block of README.md and of the reference pages under docs/ (`PY_DOCS`) in a fresh process);
- parsed: the command line is parsed by the real argument parser of the program (`dhp`,
  `torchrun` with `npu_backend.train`'s own parser, `experiments.run`, `experiments.torch_vs_jax`),
  and for `dhp train` the config is loaded with its overrides and the multi-process flags
  resolved, for `experiments.run` each config loaded: a wrong flag, a config of the wrong kind or a
  bad override fails here; `python -c` one-liners are compiled. Running them is what other tests do (training, profiling, torchrun,
  the tiny experiments), at test sizes;
- skipped, with the reason: installs (`test_wheel_install.py` installs a wheel), `pytest` itself,
  `jupyter lab` (the notebooks are executed by `test_notebooks.py`).

Placeholders: `my.yaml` / `cfg.yaml` stand for a train config (the packaged demo), `N` for a
number, shell variables for sample values; `[...]` marks options, which are checked too.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "experiments" / "REPORT.md", *sorted((ROOT / "docs").glob("*.md"))] + \
    ([ROOT / "CONTRIBUTING.md"] if (ROOT / "CONTRIBUTING.md").exists() else [])
SHELL_VARS = {"SLURM_JOB_ID": "4242", "NODE_RANK": "0", "MASTER": "hostA", "JOB_ID": "4242"}
SKIP = {"pip": "an install (test_wheel_install.py builds and installs a wheel)",
        "python -m pip": "an install (test_wheel_install.py builds and installs a wheel; .ci/run runs these)",
        "jupyter": "opens an editor (test_notebooks.py executes every notebook)",
        "python -m pytest": "the test suite itself",
        "python -m venv": "creates a virtual environment",
        "source": "activates a virtual environment"}
RUN = {"dhp plan", "dhp plan --freeze-vision --json", "dhp analyze openvid --model internvl3-8b"}
# the pages whose ```python blocks run as written (docs/DESIGN.md illustrates; these are for copying)
REFERENCE_PAGES = ("cli.md", "training.md", "plan.md", "executor.md", "experiments.md", "torch-backend.md",
                   "README.md")
PY_DOCS = [ROOT / "README.md", *(ROOT / "docs" / name for name in REFERENCE_PAGES)]


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def _commands() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for block in _blocks(path, "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\$(\w+)", lambda m: SHELL_VARS[m.group(1)], line)
                for part in line.split("&&"):
                    words = shlex.split(part, comments=True)
                    if words and words[-1] == "&":
                        words = words[:-1]
                    if words:
                        # (a python -c one-liner keeps its quoting: its code is one word)
                        out.append((path.name, shlex.join(words) if words[:2] == ["python", "-c"] else " ".join(words)))
    return out


COMMANDS = _commands()


def _argv(cmd: str) -> list[str]:
    cmd = re.sub(r"\[(-[^\]]*)\]", r"\1", cmd)       # [--json] -> --json: options are checked too
    demo = str(ROOT / "dhp_jax" / "train" / "configs" / "demo.yaml")
    subst = {"N": "3", "my.yaml": demo, "cfg.yaml": demo}
    return [subst.get(w, w) for w in shlex.split(cmd)]


def _check_dhp(argv: list[str], tmp_path, capsys) -> str:
    from dhp_jax import cli

    if " ".join(["dhp", *argv]) in RUN:
        os.chdir(tmp_path)
        assert cli.main(argv) == 0
        return "run"
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = cli._parser(command).parse_args(argv)
    except SystemExit as e:                           # --help prints and exits 0; a bad flag exits 2
        assert e.code == 0, capsys.readouterr().err
        return "run (--help)"
    if args.command == "train":
        from dhp_jax.train.train_cli import _split_args
        from dhp_jax.train.train_config import load_config
        from dhp_jax.train.distributed import resolve

        path, overrides = _split_args(list(args.args))
        overrides += [f"planner.strategy={args.strategy}"] * bool(args.strategy)
        overrides += [f"planner.plan_file={args.plan_file}"] * bool(args.plan_file)
        load_config(path, overrides).validate()
        resolve(args.coordinator, args.num_processes, args.process_id, env={})
    return "parsed"


def _check_torchrun(argv: list[str]) -> str:
    pytest.importorskip("torch")
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv)
    assert args.module and args.training_script == "npu_backend.train", argv
    from npu_backend.train import build_parser

    build_parser().parse_args(args.training_script_args)
    return "parsed"


def _check_python_module(argv: list[str], tmp_path) -> str:
    module, rest = argv[2], argv[3:]
    if module == "experiments.report":
        from experiments import report

        copy = tmp_path / "REPORT.md"
        shutil.copy(ROOT / "experiments" / "REPORT.md", copy)
        assert report.update(copy) and copy.read_text().count("<!-- table:") >= 9
        return "run (on a copy of REPORT.md)"
    if module == "experiments.run":
        from experiments.run import build_parser
        from experiments.runner import config_files, load_config, parse_override

        args = build_parser().parse_intermixed_args(rest)
        overrides = dict(parse_override(a) for a in args.configs if "=" in a)
        paths = [p for p in args.configs if "=" not in p] + ([str(p) for p in config_files()] if args.all else [])
        assert paths
        for p in paths:
            load_config(p, tiny=args.tiny, overrides=overrides)
        return "parsed"
    if module == "experiments.readme_runs":
        from experiments import readme_runs

        out = tmp_path / "benchmarks.md"       # the cheapest of its runs, end to end
        assert readme_runs.main(rest + ["--only", "example ex", "--out", str(out)]) == 0
        text = out.read_text()
        assert "- commit: `" in text and "- machine: " in text and "| `dhp example ex --family " in text, text
        return "run (its cheapest command)"
    if module == "npu_backend.xla_env":      # builds a 7 GB venv: tests/test_npu_xla.py uses it where built
        from npu_backend.xla_env import build_parser

        build_parser().parse_args(rest)
        return "parsed"
    if module == "experiments.torch_vs_jax":
        from experiments.torch_vs_jax import build_parser

        build_parser().parse_args(rest)
        return "parsed"
    raise AssertionError(f"no check for python -m {module}: add one to this test")


@pytest.mark.parametrize("doc, cmd", COMMANDS, ids=[f"{d}: {c[:60]}" for d, c in COMMANDS])
def test_documented_command(doc, cmd, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for prefix, reason in SKIP.items():
        if cmd.startswith(prefix):
            pytest.skip(reason)
    argv = _argv(cmd)
    if argv[0] == "srun":
        argv = argv[1:]
    if argv[0] == "dhp":
        how = _check_dhp(argv[1:], tmp_path, capsys)
    elif argv[0] == "torchrun":
        how = _check_torchrun(argv[1:])
    elif argv[:2] == ["python", "-m"]:
        how = _check_python_module(argv, tmp_path)
    elif argv[:2] == ["python", "-c"]:   # a one-liner on files an earlier command wrote: compiled only
        compile(argv[2], f"{doc}: python -c", "exec")
        how = "parsed"
    else:
        raise AssertionError(f"{doc}: no check for {cmd!r}: add one to this test")
    print(f"{doc}: {how}: {cmd}")


def test_the_pages_show_commands():
    docs = {d for d, _ in COMMANDS}
    assert {"README.md", "CLUSTER.md", "cli.md", "training.md", "torch-backend.md", "experiments.md"} <= docs
    for name in REFERENCE_PAGES:     # the README's reference links point at pages that exist
        assert (ROOT / "docs" / name).is_file(), name
        assert f"docs/{name}" in (ROOT / "README.md").read_text() or name == "README.md", name
    assert any(c.startswith("srun dhp train devices.platform=gpu") for _, c in COMMANDS)   # the SLURM line


PY_BLOCKS = [(page, i) for page in PY_DOCS if page.exists() for i in range(len(_blocks(page, "python")))]


@pytest.mark.parametrize("page, index", PY_BLOCKS, ids=[f"{p.relative_to(ROOT)}#{i}" for p, i in PY_BLOCKS])
def test_python_snippet_runs_as_written(page, index, tmp_path):
    """Each ```python block of README.md and the reference pages, alone, in a fresh interpreter
    outside the repository."""
    code = _blocks(page, "python")[index]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"{page.name} python block {index}:\n{code}\n{out.stderr[-3000:]}"


def test_report_latencies_are_labelled_as_assumptions():
    """No source the project cites gives per-message latencies: REPORT.md's preset table says so."""
    rows = [r for r in (ROOT / "experiments" / "REPORT.md").read_text().splitlines()
            if r.startswith("|") and re.search(r"\d+ us\b", r)]
    assert rows, "the preset table lists the message latencies"
    for r in rows:
        source = r.rstrip(" |").rsplit("|", 1)[-1]
        assert "assumption" in source and "datasheet" not in source and "arXiv" not in source.split("(")[0], r


def test_measured_figures_name_their_commit_and_machine():
    """docs/benchmarks.md, where the README's measured figures live, is the file
    `python -m experiments.readme_runs` writes: stamped with a commit and a machine, with a row for
    each of the README's commands; and the suite's closing line is read from a pytest log."""
    from experiments import readme_runs

    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert text.startswith("# Measured: the README's commands") and "`python -m experiments.readme_runs`" in text
    assert re.search(r"- commit: `[0-9a-f]{7,}", text) and "- machine: " in text and " cores" in text
    commands = readme_runs.readme_commands()
    assert ["train"] in commands and any(c[:1] == ["example"] for c in commands), commands
    for cmd in commands:            # every `dhp` line of the README, measured at the commit named
        assert f"| `dhp {' '.join(cmd)}` | 0 |" in text, cmd
    log = "....\n= 784 passed, 7 skipped in 892.80s (0:14:52) =\n"
    assert readme_runs.suite_line(log) == "784 passed, 7 skipped in 892.80s (0:14:52)"
    # .ci/run may run the XLA test file after the suite: the suite's line is the one with most tests
    assert readme_runs.suite_line(log + "....\n4 passed in 70.92s (0:01:10)\n") == "784 passed, 7 skipped in 892.80s (0:14:52)"
    with pytest.raises(ValueError, match="no pytest summary line"):
        readme_runs.suite_line("collected 0 items\n")
