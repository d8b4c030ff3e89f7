"""Execute every notebook in ``notebooks/`` end to end, as a user would run it.

Each notebook starts its own ``dc.LocalWorld`` (real gloo ranks on this machine) and must
run top to bottom without a cell error in about a minute. Notebooks are committed without
outputs; the executed copies are written to ``docs/_build/executed/`` (git-ignored), and
a docs build that runs afterwards renders those, with their plots.

The selected notebooks run two at a time (each in its own kernel, as a user's), started
by the first notebook test: one notebook mostly keeps one core busy (its kernel, then its
ranks, in turn), so on two cores the second runs in the other's idle time.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tests need nbformat (the `test` extra)")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need nbclient (the `test` extra)")
pytest.importorskip("ipykernel", reason="notebook tests need ipykernel (the `test` extra)")
pytest.importorskip("matplotlib", reason="the notebooks plot with matplotlib (the `test` extra)")
KernelManager = pytest.importorskip("jupyter_client.manager").KernelManager

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXECUTED = ROOT / "docs" / "_build" / "executed"
KERNEL = "python3"  # the kernelspec ipykernel installs (`jupyter kernelspec list`)
CELL_TIMEOUT = 120  # seconds per cell
AT_ONCE = 2  # notebooks executing side by side


def test_notebooks_exist() -> None:
    assert NOTEBOOKS, f"no notebooks found in {ROOT / 'notebooks'}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; strip them before committing"


def _execute(path: Path) -> float:
    """Run the notebook at ``path`` top to bottom in a fresh kernel; write the executed copy
    to ``EXECUTED``; the seconds it took. A failing cell raises ``CellExecutionError``
    with the cell's source and traceback."""
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
    EXECUTED.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # the kernel's own stderr (its start-up banner and warnings) goes to a log beside the
    # executed copy: a kernel started between two tests' capture windows would otherwise
    # print to the terminal (cell errors come through the messaging protocol, not stderr)
    # IPC sockets in a directory of their own, not TCP ports: a port picked free and bound
    # by the kernel a moment later was once taken in between (another kernel, a rank's
    # connection): "Address already in use", the kernel died before it answered
    with (
        tempfile.TemporaryDirectory(prefix="dcnb") as ipc,
        open(EXECUTED / f"{path.stem}.kernel.log", "wb") as log,
    ):
        client.km = KernelManager(kernel_name=KERNEL, transport="ipc", ip=os.path.join(ipc, "k"))
        try:
            client.execute(env=env, stderr=log)
        finally:
            nbformat.write(nb, EXECUTED / path.name)
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def notebook_runs(request: pytest.FixtureRequest) -> Iterator[dict[Path, Future[float]]]:
    """Every selected notebook's run, started at once, ``AT_ONCE`` at a time, in order."""
    selected = [
        item.callspec.params["path"]
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.originalname == "test_notebook_runs"
        and item.path == request.path
    ]
    with ThreadPoolExecutor(max_workers=AT_ONCE, thread_name_prefix="notebook") as pool:
        runs = {path: pool.submit(_execute, path) for path in selected}
        yield runs
        for run in runs.values():  # a test that stopped early (-x) leaves none running
            run.cancel()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, notebook_runs: dict[Path, Future[float]]) -> None:
    seconds = notebook_runs[path].result()  # re-raises the run's CellExecutionError
    print(f"{path.name}: executed in {seconds:.1f} s")
