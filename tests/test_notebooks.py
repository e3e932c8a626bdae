"""Execute every notebook under notebooks/ top to bottom (jupytext .py -> notebook -> nbclient).

The paired `.py` files (jupytext "percent" format) are the committed source; the test builds the
notebook in memory, runs it in a fresh `python3` kernel with the notebook folder as working
directory and fails on the first cell that raises. The kernel inherits this process's environment
(tests/conftest.py sets 8 fake CPU devices; notebook 02 also sets them itself before importing jax).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["01_planner_tour", "02_sub_meshes_on_cpu", "03_paper_figures"]
CELL_TIMEOUT_S = 240


def execute(nb: nbformat.NotebookNode, cwd: Path) -> float:
    """Run `nb` in place in a fresh kernel; returns wall seconds. Raises CellExecutionError on error."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    env.pop("MPLBACKEND", None)  # the kernel's inline backend, whatever the calling shell set
    env.pop("DHP_RESULTS_DIR", None)  # notebook 03 must read the committed results
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})
    t0 = time.perf_counter()
    client.execute(env=env)
    return time.perf_counter() - t0


def test_every_notebook_is_listed():
    found = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    assert found == NAMES, f"notebooks/ holds {found}; this test executes {NAMES}"


@pytest.mark.parametrize("name", NAMES)
def test_source_is_canonical_percent_format(name):
    """jupytext writes the file back unchanged (bar its version stamp): syncing a paired .ipynb
    will not rewrite the committed .py, so its diffs stay the author's."""
    src = (NOTEBOOKS / f"{name}.py").read_text()
    out = jupytext.writes(jupytext.reads(src, fmt="py:percent"), fmt="py:percent")
    stamp = ("#       format_version:", "#       jupytext_version:")
    assert [ln for ln in out.splitlines() if not ln.startswith(stamp)] == src.splitlines()


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, tmp_path):
    src = NOTEBOOKS / f"{name}.py"
    nb = jupytext.read(src, fmt="py:percent")
    assert len(nb.cells) > 3, f"{src} parsed into {len(nb.cells)} cells: not a percent-format notebook?"
    assert any(c.cell_type == "markdown" for c in nb.cells)
    seconds = execute(nb, NOTEBOOKS)
    nbformat.write(nb, tmp_path / f"{name}.ipynb")  # kept by pytest for a look after a failure
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    print(f"\n{name}: executed {sum(c.cell_type == 'code' for c in nb.cells)} code cells in {seconds:.1f} s")


def test_a_failing_cell_fails_the_run():
    """The harness itself must be able to fail: a raising cell stops the run with its error."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"),
                                         nbformat.v4.new_code_cell("raise ValueError('boom from cell 2')"),
                                         nbformat.v4.new_code_cell("never = True")])
    with pytest.raises(CellExecutionError, match="boom from cell 2"):
        execute(nb, NOTEBOOKS)
    assert "outputs" not in nb.cells[2] or not nb.cells[2].outputs
