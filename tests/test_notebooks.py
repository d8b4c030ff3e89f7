"""Execute every notebook in ``notebooks/`` end to end, as a user would run it.

Each notebook starts its own ``dc.LocalWorld`` (real gloo ranks on this machine) and must
run top to bottom without a cell error in about a minute. Notebooks are committed without
outputs; the executed copies are written to ``docs/_build/executed/`` (git-ignored), and
a docs build that runs afterwards renders those, with their plots.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tests need nbformat (the `test` extra)")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need nbclient (the `test` extra)")
pytest.importorskip("ipykernel", reason="notebook tests need ipykernel (the `test` extra)")
pytest.importorskip("matplotlib", reason="the notebooks plot with matplotlib (the `test` extra)")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXECUTED = ROOT / "docs" / "_build" / "executed"
KERNEL = "python3"  # the kernelspec ipykernel installs (`jupyter kernelspec list`)
CELL_TIMEOUT = 120  # seconds per cell


def test_notebooks_exist() -> None:
    assert NOTEBOOKS, f"no notebooks found in {ROOT / 'notebooks'}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; strip them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ)
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"  # plots land in the outputs
    paths = (str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    try:
        # a failing cell raises CellExecutionError with the cell's source and traceback
        client.execute(env=env)
    finally:
        EXECUTED.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, EXECUTED / path.name)
    seconds = time.perf_counter() - start
    print(f"{path.name}: executed in {seconds:.1f} s")
