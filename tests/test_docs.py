"""The documentation builds with warnings as errors, exactly as CI builds it.

``python -m sphinx -W --keep-going -j auto -b html docs <out>`` in a subprocess: every docstring
the API reference pulls in must be valid reStructuredText (Google style, napoleon), every
page and notebook must parse, every cross-reference must resolve, and the op -> adjoint
table is generated from the code during the build.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BUILD_BUDGET_S = 120  # the build takes ~15-30 s; fail loudly if it balloons

_MISSING = [m for m in ("sphinx", "pydata_sphinx_theme", "myst_nb") if importlib.util.find_spec(m) is None]


@pytest.mark.skipif(
    bool(_MISSING),
    reason=f"docs build needs {', '.join(_MISSING)} (install the `test` extra: pip install -e '.[test]')",
)
def test_docs_build_without_warnings(tmp_path: Path) -> None:
    out = tmp_path / "html"
    # -j auto: pages read and written in parallel (one process per core); the HTML is the
    # same as a serial build's (diff -r of the two differs only in the pickled doctrees)
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-j", "auto", "-b", "html"]
    cmd += [str(DOCS), str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, (
        f"sphinx failed (exit {proc.returncode}):\n{proc.stderr[-8000:]}\n{proc.stdout[-2000:]}"
    )
    assert seconds < BUILD_BUDGET_S, f"docs build took {seconds:.0f} s (budget {BUILD_BUDGET_S} s)"

    convention = (out / "convention.html").read_text()
    from diffcomm.ops import registry as R

    for name, op in R.family("collective", ()).items():  # the generated op -> dual table is in the page
        assert (
            f'<code class="docutils literal notranslate"><span class="pre">{name}</span></code>' in convention
        )
        assert op.backward_text.split(" ")[0] in convention
    api = (out / "api.html").read_text()
    for fn in (
        "diffcomm.ops.collectives.all_reduce",
        "diffcomm.ops.collectives.all_to_all",
        "diffcomm.runtime.world.LocalWorld",
    ):
        assert f'id="{fn}"' in api, f"{fn} missing from the API reference"
    coalesced = (out / "coalesced.html").read_text()
    for name in R.family("coalesced", ()):  # the generated coalesced table and the API entries
        assert f'<span class="pre">{name}</span>' in coalesced
        assert f'id="diffcomm.ops.coalesced.{name}"' in api, f"{name} missing from the API reference"
    rendered_from = _ext().notebooks()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert (out / "_generated" / "notebooks" / f"{nb.stem}.html").exists(), (
            f"notebook {nb.name} not rendered"
        )
        page = (out / "_generated" / "notebooks" / f"{nb.stem}.html").read_text()
        # never silently without outputs: a page built from the output-free notebook says so
        executed = rendered_from[nb.name].parent == _ext().EXECUTED
        assert ("<strong>without outputs</strong>" in page) != executed, nb.name


def _ext() -> ModuleType:  # the docs' local extension (docs/_ext/diffcomm_docs.py)
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import diffcomm_docs
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    return diffcomm_docs


def test_a_notebook_rendered_without_running_it_carries_a_note(tmp_path: Path) -> None:
    import json

    ext = _ext()
    src = sorted((ROOT / "notebooks").glob("*.ipynb"))[0]
    nb = json.loads(ext.not_executed_copy(src))
    original = json.loads(src.read_text())
    assert nb["cells"][0] == original["cells"][0]  # the title stays first
    assert nb["cells"][1]["cell_type"] == "markdown" and "without outputs" in nb["cells"][1]["source"]
    assert "tests/test_notebooks.py" in nb["cells"][1]["source"]
    assert nb["cells"][2:] == original["cells"][1:]


def _documented(api: str) -> set[tuple[str, str]]:
    """(module, name) of everything ``docs/api.md`` documents: each ``automodule`` as
    (module, ""), its ``:members:`` (its ``__all__`` when the list is bare), and each
    ``autofunction`` / ``autoclass`` / ``autoexception``."""
    import importlib
    import re

    found: set[tuple[str, str]] = set()
    for module, options in re.findall(r"\.\. automodule:: ([\w.]+)\n((?:   :[^\n]*\n)*)", api):
        found.add((module, ""))
        members = re.search(r":members:(.*)", options)
        if members is not None:
            listed = [m.strip() for m in members.group(1).split(",") if m.strip()]
            names = listed or list(importlib.import_module(module).__all__)
            found.update((module, n) for n in names)
    for path in re.findall(r"\.\. auto(?:function|class|exception):: ([\w.]+)", api):
        module, _, name = path.rpartition(".")
        found.add((module, name))
    return found


def test_api_page_documents_every_public_name() -> None:
    """Every name of ``diffcomm.__all__`` is in docs/api.md: a submodule by its
    ``automodule``, a function, class or table where its module's members are listed."""
    import diffcomm

    documented = _documented((ROOT / "docs" / "api.md").read_text())
    missing = []
    for name in diffcomm.__all__:
        value = getattr(diffcomm, name)
        if isinstance(value, ModuleType):
            ok = (value.__name__, "") in documented
        else:
            ok = ("diffcomm", name) in documented or any(
                getattr(sys.modules.get(module), n, None) is value for module, n in documented if n == name
            )
        if not ok:
            missing.append(name)
    assert not missing, f"docs/api.md does not document {missing}"
