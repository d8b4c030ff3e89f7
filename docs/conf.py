"""Sphinx configuration for diffcomm's documentation.

Build (warnings are errors, as in CI)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

Pages are MyST Markdown, notebooks are rendered by myst-nb (not executed here: CI runs
them with nbclient in ``tests/test_notebooks.py``), the API reference comes from the
Google-style docstrings (autodoc + napoleon), and the op -> adjoint table is generated
from the code by the local extension ``_ext/diffcomm_docs.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent / "src"))  # the package itself (also works without `pip install -e`)

import diffcomm  # noqa: E402

project = "diffcomm"
author = "the diffcomm authors"
copyright = "the diffcomm authors"
release = diffcomm.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_nb",  # MyST Markdown pages + .ipynb (brings myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "diffcomm_docs",  # docs/_ext: generated tables, notebooks copied in
]

root_doc = "index"
exclude_patterns = [
    "_build",
    "_ext",
    "_generated/*.md",  # tables pulled into pages with {include}, not pages themselves
    "Thumbs.db",
    ".DS_Store",
    "**.ipynb_checkpoints",
]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# -- MyST / myst-nb ---------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # CI executes the notebooks separately (tests/test_notebooks.py)
nb_output_stderr = "remove"  # progress/warning noise of executed copies stays out of the page
nb_merge_streams = True

# -- autodoc / napoleon -----------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"undoc-members": False, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as fields, not objects that autodoc may document again
napoleon_custom_sections = ["Gradient", "Shapes"]  # every collective names its adjoint; layers their shapes

# -- HTML -------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"diffcomm {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}
html_sidebars = {"**": ["sidebar-nav-bs"]}
html_static_path: list[str] = []
