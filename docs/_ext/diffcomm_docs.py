"""Local Sphinx extension: pages generated from the code at build time.

On ``builder-inited`` (before Sphinx looks for source files) it writes, under
``docs/_generated/`` (git-ignored):

* ``duals.md`` — the op -> adjoint table, from :func:`diffcomm.ops.collectives.duals_markdown`
  (``registry.markdown("collective")``: each op's class states its dual and the rules in
  words; the same registry the tests walk), included by ``convention.md``;
* ``p2p.md`` and ``coalesced.md`` — the same for the ``"p2p"`` and ``"coalesced"``
  families, included by ``p2p.md`` and ``coalesced.md``;
* ``mappings.md`` — the replicated-objective mappings, from the registry's ``"mapping"``
  family (``registry.markdown("mapping")``, the same table as
  :data:`diffcomm.parallel.MAPPINGS`);
* ``spmd_table.md`` and ``spmd_corpus.md`` — the replication-typing table (the ``spmd``
  rule on every op, mapping and layer class: :func:`diffcomm.spmd.check.typing_table`)
  and the planted-bug corpus (:data:`diffcomm.testing.spmd_corpus.BUGS`), included by
  ``spmd_types.md``;
* ``spmd_types_table.md`` — every rule-bearing Function's rule in diffcomm's types and in
  spmd_types' (the translation its ``spmd_typecheck`` applies), included by
  ``with_spmd_types.md``;
* ``notebooks/*.ipynb`` — copies of ``notebooks/*.ipynb`` (Sphinx only reads sources
  inside ``docs/``). If ``tests/test_notebooks.py`` has left an executed copy newer than
  the source in ``docs/_build/executed/``, that copy is used, so the rendered pages show
  real outputs; otherwise the committed (output-free) notebook is rendered with a note
  at the top saying so (and the build log says which), never silently without outputs.

Files are rewritten only when their content changes, so incremental builds stay fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent.parent
ROOT = DOCS.parent
GENERATED = DOCS / "_generated"
EXECUTED = DOCS / "_build" / "executed"  # written by tests/test_notebooks.py


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)


def _table_page(source: str, markdown: str) -> str:
    return f"<!-- generated from {source} by docs/_ext/diffcomm_docs.py; do not edit -->\n\n{markdown}\n"


def duals_page() -> str:
    from diffcomm.ops.collectives import duals_markdown

    return _table_page(
        "the op classes of diffcomm.ops.collectives (registry family 'collective')", duals_markdown()
    )


def p2p_page() -> str:
    from diffcomm.ops.p2p import p2p_markdown

    return _table_page("the op classes of diffcomm.ops.p2p (registry family 'p2p')", p2p_markdown())


def coalesced_page() -> str:
    from diffcomm.ops.coalesced import coalesced_markdown

    return _table_page(
        "the op classes of diffcomm.ops.coalesced (registry family 'coalesced')", coalesced_markdown()
    )


def mappings_page() -> str:
    import diffcomm.parallel  # noqa: F401 - importing registers the "mapping" family
    from diffcomm.ops import registry

    return _table_page(
        "the op classes of diffcomm.parallel (registry family 'mapping')", registry.markdown("mapping")
    )


def notebooks() -> dict[str, Path]:
    """Notebook name -> the file to render (an executed copy when a fresh one exists)."""
    out: dict[str, Path] = {}
    for src in sorted((ROOT / "notebooks").glob("*.ipynb")):
        ran = EXECUTED / src.name
        fresh = ran.exists() and ran.stat().st_mtime >= src.stat().st_mtime
        out[src.name] = ran if fresh else src
    return out


NOT_EXECUTED_NOTE = (
    "```{note}\n"
    "This page shows the notebook as committed, **without outputs**: the docs were built "
    "without running it first. `python -m pytest tests/test_notebooks.py` runs every "
    "notebook (about a minute each); a docs build after it shows the outputs and plots.\n"
    "```"
)


def not_executed_copy(src: Path) -> bytes:
    """``src`` with :data:`NOT_EXECUTED_NOTE` as a markdown cell after its title cell."""
    nb = json.loads(src.read_text())
    cells = nb["cells"]
    at = 1 if cells and cells[0]["cell_type"] == "markdown" else 0
    cell: dict[str, Any] = {"cell_type": "markdown", "metadata": {}, "source": NOT_EXECUTED_NOTE}
    if (nb.get("nbformat"), nb.get("nbformat_minor", 0)) >= (4, 5):
        cell["id"] = "not-executed"  # cell ids exist from nbformat 4.5 on
    cells.insert(at, cell)
    return (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode()


def spmd_table_page() -> str:
    from diffcomm.spmd.check import typing_table

    return _table_page(
        "the spmd rules on the op, mapping and layer classes (diffcomm.spmd.check)", typing_table()
    )


def spmd_corpus_page() -> str:
    from diffcomm.testing.spmd_corpus import corpus_markdown

    return _table_page("diffcomm.testing.spmd_corpus.BUGS", corpus_markdown())


def spmd_types_table_page() -> str:
    """Every rule-bearing Function's rule in diffcomm's types and in spmd_types' (the
    same ``Rule`` object, translated by ``diffcomm._replication.describe_for_spmd_types``,
    the translation its ``spmd_typecheck`` applies), included by ``with_spmd_types.md``."""
    from diffcomm._replication import describe_for_spmd_types
    from diffcomm.spmd.check import _op_name, typed_functions

    rows = []
    for cls in typed_functions():
        rule = cls.__dict__["spmd"]
        fwd = rule.describe()[0]
        rows.append((f"`{_op_name(cls, qualified=True)}`", fwd, describe_for_spmd_types(rule)))
    rows.sort(key=lambda r: (r[0].count("."), r[0]))
    lines = ["| Function | diffcomm's rule (R / V / P) | spmd_types' rule (I / R / V / P) |", "|---|---|---|"]
    lines += ["| " + " | ".join(x.replace("|", "\\|") for x in r) + " |" for r in rows]
    return _table_page(
        "the spmd rules of diffcomm's Functions, as diffcomm._replication.SpmdTypesRule translates them",
        "\n".join(lines),
    )


def generate(app: Any = None) -> None:
    _write(GENERATED / "spmd_types_table.md", spmd_types_table_page().encode())
    _write(GENERATED / "spmd_table.md", spmd_table_page().encode())
    _write(GENERATED / "spmd_corpus.md", spmd_corpus_page().encode())
    _write(GENERATED / "duals.md", duals_page().encode())
    _write(GENERATED / "coalesced.md", coalesced_page().encode())
    _write(GENERATED / "p2p.md", p2p_page().encode())
    _write(GENERATED / "mappings.md", mappings_page().encode())
    wanted = notebooks()
    nb_dir = GENERATED / "notebooks"
    for name, path in wanted.items():
        executed = path.parent == EXECUTED
        _write(nb_dir / name, path.read_bytes() if executed else not_executed_copy(path))
    unrun = sorted(name for name, path in wanted.items() if path.parent != EXECUTED)
    if unrun and app is not None:
        from sphinx.util import logging

        logging.getLogger(__name__).info(
            f"diffcomm: notebooks rendered without outputs ({', '.join(unrun)}); run "
            "`python -m pytest tests/test_notebooks.py` before the build to show them"
        )
    if nb_dir.exists():
        for stale in nb_dir.glob("*.ipynb"):
            if stale.name not in wanted:
                stale.unlink()


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", generate)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
