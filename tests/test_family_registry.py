"""Model families are `FamilySpec`s in a registry (`dhp_jax.models`): every part asks the spec, so a
family registered from outside the package (`tests/toy_family/`) trains through `dhp train` with
`model.family_module=`, and nothing outside a family's own folder branches on a family's name."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dhp_jax import models

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def test_the_builtin_families_are_registered_once_each():
    assert models.names()[:3] == ("qwen2_5_vl", "qwen3_vl", "internvl")
    spec = models.spec("internvl")
    assert models.register(spec) is spec                       # the same object again: a no-op
    import dataclasses
    with pytest.raises(ValueError, match="model family 'internvl' is already registered"):
        models.register(dataclasses.replace(spec, vision_rule="other"))
    with pytest.raises(ValueError, match="unknown model family 'qwen4'; known: qwen2_5_vl, qwen3_vl, internvl"):
        models.spec("qwen4")
    assert models.spec_for_type("internvl_chat") is spec      # a layout the family converts
    with pytest.raises(ValueError, match="family module 'no_such_module' cannot be imported"):
        models.load("no_such_module")


def test_model_names_find_their_own_family_and_no_other():
    """No family's name prefix begins another family's model name (Qwen2.5-VL's, Qwen3-VL's and
    Qwen3-VL-MoE's share "qwen"); the name lookup (`family_for_model`, for a name that is no stored
    model) gives each name its own family's vision rule, and a Qwen3-VL size the table does not
    list is refused by name instead of taking Qwen2.5-VL's rule."""
    from dhp_jax.data.vision import family_for_model

    names = {"qwen3_vl": ("qwen3-vl-2b-instruct", "Qwen3-VL-4B-Thinking", "qwen3-vl-8b-sft", "qwen3-vl-32b-instruct"),
             "qwen3_vl_moe": ("qwen3-vl-30b-a3b-instruct", "Qwen3-VL-235B-A22B-Thinking", "qwen3_vl_moe-tiny"),
             "qwen2_5_vl": ("Qwen2.5-VL-7B-Instruct", "qwen2.5-vl-72b", "Qwen2-VL-2B-Instruct", "qwen2_5_vl-tiny"),
             "internvl": ("InternVL3-8B", "internvl2.5-4b-mpo", "intern-vl-1b")}
    for family, listed in names.items():
        for name in listed:
            m = name.lower()
            assert any(m.startswith(p) for p in models.spec(family).name_prefixes), (family, name)
            for other in models.names():
                hit = [p for p in models.spec(other).name_prefixes if m.startswith(p)] if other != family else []
                assert not hit, f"{other}'s prefixes {hit} match {family}'s model {name!r}"
            assert family_for_model(name) == models.spec(family).vision_rule
    with pytest.raises(ValueError, match="cannot tell the vision family of model 'qwen3-vl-1b'"):
        family_for_model("qwen3-vl-1b")


def _family_literals(path: Path) -> list[str]:
    """`path:line` of each comparison, membership test, subscript or dict key in `path` whose
    operand is the string of a registered family's name (docstrings and messages are not branches)."""
    names = set(models.names())
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        operands = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            operands += [e for c in node.comparators if isinstance(c, (ast.Tuple, ast.List, ast.Set)) for e in c.elts]
        elif isinstance(node, ast.Dict):
            operands = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Subscript):
            operands = [node.slice]
        for o in operands:
            if isinstance(o, ast.Constant) and o.value in names:
                out.append(f"{path.relative_to(ROOT)}:{o.lineno} {o.value!r}")
    return out


def test_no_code_outside_a_family_folder_branches_on_a_family_name():
    """The target of the family layout: 0 branches on a family's name outside `dhp_jax/models/`."""
    files = [p for pkg in ("dhp_jax", "npu_backend") for p in sorted((ROOT / pkg).rglob("*.py"))
             if "models" not in p.relative_to(ROOT).parts[1:2]]
    bad = [hit for p in files for hit in _family_literals(p)]
    assert not bad, "family-name branches outside dhp_jax/models/:\n" + "\n".join(bad)


def _train(out: Path, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "dhp_jax", "train", *extra, "num_ranks=2", "devices.count=2", "steps=1",
                        "data.batch_size=4", "data.max_tokens=64", "min_bucket=64", "checkpoint.every=0",
                        "compare.enabled=false", "metrics.progress=false", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, env=env, cwd=out.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_a_family_registered_outside_the_package_trains_through_dhp_train(tmp_path):
    """`toy_vl` (tests/toy_family) is Qwen2.5-VL's hooks under another name and model type: its demo
    step through `dhp train` gives Qwen2.5-VL's loss to the bit, so every part reached it through
    its spec (a branch on "qwen2_5_vl" anywhere would have refused it or run other code)."""
    toy = _train(tmp_path / "toy", "model=tiny-toy_vl", "model.family_module=toy_family.spec")
    assert toy["model_config"]["name"] == "tiny-toy_vl" and toy["steps_run"] == 1
    base = _train(tmp_path / "base", "model=tiny-qwen2_5_vl")
    assert toy["loss_first"] == base["loss_first"] and toy["groups_by_degree"] == base["groups_by_degree"]


def test_an_unknown_family_module_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "dhp_jax", "train", "model=tiny-toy_vl", "model.family_module=toy_nope",
                        "--dry-run", "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=300,
                       env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "model.family_module" in last and "'toy_nope' cannot be imported" in last and "Traceback" not in r.stderr


def test_the_torch_backend_registers_the_family_module_a_run_named(tmp_path):
    """`npu_backend.train --init-from` a run of a family registered outside the package: the run's
    `model.family_module` is loaded as `dhp train` loaded it (`npu_backend.finetune.load_run_family`),
    and a module that is not importable is one error naming it. In a fresh interpreter, so that the
    toy family is not left registered in this one."""
    code = """
from dhp_jax import models
from npu_backend.finetune import load_run_family
from npu_backend.weights import WeightsError
load_run_family({"run_config": {"model": {"family_module": "toy_family.spec"}}}, "run")
print(models.spec("toy_vl").name)
try:
    load_run_family({"run_config": {"model": {"family_module": "toy_nope"}}}, "'/runs/x'")
except WeightsError as e:
    print(e)
"""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "toy_vl"
    assert lines[1].startswith("'/runs/x': the run's model.family_module: family module 'toy_nope' cannot be "
                               "imported"), lines
