"""diffcomm's own op names, read as data: the command line lists them without importing torch.

``python -m diffcomm check --help`` lists the ops and a bad ``--ops`` is refused at once,
before torch is imported (seconds). Each op family's home lists its ops once, as the
first literal ``__all__`` list of its source (in the registry's order, each bound by its
``name as name`` import above it); this module reads that list with
:func:`ast.literal_eval`, without importing the home (no module walk, no reading of class
bodies). A later ``__all__ += [...]`` in a home adds its other names (tables, helpers),
which are not ops. tests/test_packaging.py checks the lists against the registry.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

__all__ = ["FAMILY_ORDER", "HOMES", "builtin_ops", "family_ops"]

#: the families in the order ``check`` runs them (its standard suite's order)
FAMILY_ORDER = ("collective", "p2p", "coalesced", "mapping")

#: family -> the source of its home (relative to the package), whose first ``__all__``
#: lists the family's ops
HOMES = {
    "collective": "ops/collectives.py",
    "p2p": "ops/p2p.py",
    "coalesced": "ops/coalesced.py",
    "mapping": "parallel/mappings.py",
}

_PACKAGE = Path(__file__).resolve().parents[1]

#: the first line of a module-level ``__all__ = [`` / ``__all__: list[str] = [``
_ALL = re.compile(r"__all__\s*(?::[^=]*)?=\s*\[")


def family_ops(family: str) -> list[str]:
    """The public names of diffcomm's own ops of ``family``, in the registry's order: the
    first ``__all__ = [...]`` (or ``__all__: list[str] = [...]``) of its home's source.

    Only that statement is parsed (from its first line to the line that completes it), not
    the whole module: ``check --help`` reads four homes, one of them 800 lines long.

    Raises:
        ValueError: ``family`` is not one of :data:`FAMILY_ORDER`.
        RuntimeError: the home has no literal ``__all__`` list of strings (a broken home).
    """
    if family not in HOMES:
        raise ValueError(f"family: expected one of {', '.join(FAMILY_ORDER)}, got {family!r}")
    path = _PACKAGE / HOMES[family]
    lines = path.read_text(encoding="utf-8").splitlines()
    for start, line in enumerate(lines):
        if _ALL.match(line) is None:
            continue
        for end in range(start + 1, len(lines) + 1):
            try:
                (node,) = ast.parse("\n".join(lines[start:end])).body
            except SyntaxError:
                continue
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            names = ast.literal_eval(value) if isinstance(value, ast.List) else None
            if isinstance(names, list) and all(isinstance(n, str) for n in names):
                return names
            break
        break
    raise RuntimeError(f"{path}: no literal `__all__ = [...]` list of the {family!r} family's ops")


def builtin_ops() -> dict[str, list[str]]:
    """family -> the public names of diffcomm's own ops of it, in the registry's order
    (families in :data:`FAMILY_ORDER`), read from the homes' sources (no import)."""
    return {f: family_ops(f) for f in FAMILY_ORDER}
