"""A function shipped to the ranks by value keeps the user's file and line: in the flight
recorder's call sites (hence the desync diagnosis) and in rank tracebacks, with the
source line shown - for a function defined in ``__main__`` (see also
``test_debugging_page.py``, which runs a script), in a notebook cell (code whose file
exists only in ``linecache``) and in a module shipped by value.

Each case runs twice: with the installed cloudpickle, and with its code reducer renaming
every file to ``<dynamic-code>`` as cloudpickle 3.x does (so both majors are covered
whichever is installed)."""

from __future__ import annotations

import importlib
import linecache
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch

import diffcomm as dc
from diffcomm import LocalWorld
from diffcomm.runtime import shipping as _ship

CELL = textwrap.dedent(
    """\
    def cell_fn(fail):
        y = dc.all_reduce(torch.ones(2))
        if fail:
            raise ValueError("the user's own error")
        return dc.flight_recorder()[-1]["site"], y.tolist()
    """
)


@pytest.fixture(params=["installed", "renames like 3.x"])
def cloudpickle_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "renames like 3.x":
        real = _ship._REDUCE_CODE

        def renaming(code: Any) -> Any:
            make, args = real(code)[:2]
            args = tuple("<dynamic-code>" if a is code.co_filename else a for a in args)
            assert "<dynamic-code>" in args
            return make, args

        monkeypatch.setattr(_ship, "_REDUCE_CODE", renaming)
    yield request.param


def _cell(tmp_path: Path) -> Callable[..., Any]:
    """``cell_fn`` as a notebook defines it: in ``__main__``, from a file that is not on
    disk, its lines in ``linecache`` (what IPython does for every cell)."""
    filename = str(tmp_path / "ipykernel_4242" / "cell7.py")  # never written
    linecache.cache[filename] = (len(CELL), None, CELL.splitlines(keepends=True), filename)
    ns: dict[str, Any] = {"__name__": "__main__", "dc": dc, "torch": torch}
    exec(compile(CELL, filename, "exec"), ns)
    return ns["cell_fn"]


def test_a_notebook_cell_keeps_its_file_line_and_source(
    world2: LocalWorld, tmp_path: Path, cloudpickle_kind: str
) -> None:
    fn = _cell(tmp_path)
    filename = fn.__code__.co_filename
    sites = world2.run(fn, False)
    assert [s for s, _ in sites] == [f"{filename}:2"] * 2
    with pytest.raises(dc.RankError) as info:
        world2.run(fn, True)
    for r in (0, 1):
        tb = info.value.failures[r]
        assert f'File "{filename}", line 4, in cell_fn' in tb, tb
        assert 'raise ValueError("the user\'s own error")' in tb, tb
        assert "<dynamic-code>" not in tb


def test_a_module_shipped_by_value_keeps_its_file_nested_code_too(
    world2: LocalWorld, tmp_path: Path, cloudpickle_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"mymod_{tmp_path.name}"  # one module per case: a fresh import each time
    src = tmp_path / f"{name}.py"
    src.write_text(
        textwrap.dedent(
            """\
            import torch
            import diffcomm as dc


            def outer(fail):
                def inner():
                    dc.all_reduce(torch.ones(3))
                    if fail:
                        raise KeyError("inner")
                    return dc.flight_recorder()[-1]["site"]
                return [inner() for _ in range(1)][0]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module(name)
    cloudpickle.register_pickle_by_value(mod)
    try:
        # by value: the ranks could not import it (its folder is gone from their path)
        sys.path.remove(str(tmp_path))
        assert world2.run(mod.outer, False) == [f"{src}:7"] * 2
        with pytest.raises(dc.RankError) as info:
            world2.run(mod.outer, True)
        tb = info.value.failures[1]
        assert f'File "{src}", line 9, in inner' in tb and 'raise KeyError("inner")' in tb, tb
        assert f'File "{src}", line 11, in outer' in tb, tb
    finally:
        cloudpickle.unregister_pickle_by_value(mod)
        sys.modules.pop(name)


def test_shipping_leaves_by_reference_functions_and_plain_values_alone() -> None:
    payload = _ship.dumps((print, textwrap.dedent, [1, "a"], {"k": torch.ones(2)}))
    fn, ref, plain, tensors = _ship.loads(payload)
    assert fn is print and ref is textwrap.dedent and plain == [1, "a"]
    assert torch.equal(tensors["k"], torch.ones(2))


def test_a_real_notebook_cell_in_a_kernel_names_its_cell_and_line(tmp_path: Path) -> None:
    """The same through a real IPython kernel (nbclient), as a notebook user runs it."""
    nbformat = pytest.importorskip("nbformat", reason="needs nbformat (the `test` extra)")
    nbclient = pytest.importorskip("nbclient", reason="needs nbclient (the `test` extra)")
    pytest.importorskip("ipykernel", reason="needs ipykernel (the `test` extra)")
    cells = [
        "import torch\nimport diffcomm as dc\nworld = dc.LocalWorld(2, progress=False)",
        CELL,
        "sites = world.run(cell_fn, False)\n"
        "try:\n"
        "    world.run(cell_fn, True)\n"
        "except dc.RankError as exc:\n"
        "    tb = exc.failures[1]\n"
        "world.close()\n"
        "print(repr(sites[0][0]))\n"
        "print(tb)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3")
    client.execute(env=env, cwd=str(tmp_path))
    out = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    site, _, tb = out.partition("\n")
    cell_file = site.strip("'").rsplit(":", 1)[0]
    assert site.strip("'").endswith(":2") and "<dynamic-code>" not in out, out
    assert f'File "{cell_file}", line 4, in cell_fn' in tb, out
    assert 'raise ValueError("the user\'s own error")' in tb, out  # the cell's own line


def _defined_in(filename: str) -> Callable[[], Any]:
    """A function that all-reduces and returns the flight recorder's last call site,
    compiled as if it were in ``filename`` (shipped by value: defined in ``__main__``)."""
    src = "def f():\n    dc.all_reduce(torch.ones(2))\n    return dc.flight_recorder()[-1]['site']\n"
    ns: dict[str, Any] = {"__name__": "__main__", "dc": dc, "torch": torch}
    exec(compile(src, filename, "exec"), ns)
    return ns["f"]


def test_an_op_called_from_diffcomm_itself_does_not_hide_the_next_users_site(
    world2: LocalWorld, tmp_path: Path
) -> None:
    # an all_reduce whose every frame is diffcomm's (none of the user's) is sited at the
    # rank's boot frame (`python -c`, <string>:1); the recorder remembered that depth, and a
    # user's all_reduce from a function at the same depth was named <string>:1 too (the
    # user's frame below the boot frame skipped)
    internal = _defined_in(os.path.join(os.path.dirname(dc.__file__), "_probe_internal.py"))
    user = _defined_in(str(tmp_path / "user_code.py"))
    world2.run(internal)
    assert world2.run(user) == [f"{tmp_path / 'user_code.py'}:2"] * 2
