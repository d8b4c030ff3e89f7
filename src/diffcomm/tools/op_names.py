"""diffcomm's own op names, read from the op classes' source without importing torch.

``python -m diffcomm check --help`` lists the ops and a bad ``--ops`` is refused at once,
before torch is imported (seconds). Both need the names the registry will hold, so they
are read where the registry reads them, the op classes: every class of the package that
states ``name = "..."`` and ``family = "..."`` in its body as constants (the facts
:class:`diffcomm.ops.registry.OpFacts` describes), ordered as the registry orders a family
(by ``order``, then by definition). Nothing lists the ops a second time;
tests/tools/test_cli.py checks these names against the registry's cases.
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

__all__ = ["FAMILY_ORDER", "builtin_ops"]

#: the families in the order ``check`` runs them (its standard suite's order)
FAMILY_ORDER = ("collective", "p2p", "coalesced", "mapping")

_PACKAGE = Path(__file__).resolve().parents[1]


#: a top-level class block: from its ``class`` line to the next unindented line
_CLASS = re.compile(r"^class \w+.*?(?=^\S|\Z)", re.M | re.S)
#: a fact its body states as a constant: ``    name = "all_gather"``, ``    order = 30``
_FACT = re.compile(r"^    (name|family|order) = (\"[^\"\n]*\"|[0-9.]+)[ \t]*(?:#.*)?$", re.M)


def builtin_ops() -> dict[str, list[str]]:
    """family -> the public names of diffcomm's own ops of it, in the registry's order
    (families in :data:`FAMILY_ORDER`)."""
    found: dict[str, list[tuple[float, str, int, str]]] = {f: [] for f in FAMILY_ORDER}
    for path in sorted(_PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "    family = " not in text:  # cheap: read only the modules that define op classes
            continue
        for block in _CLASS.finditer(text):
            facts = {k: ast.literal_eval(v) for k, v in _FACT.findall(block.group())}
            family, name, order = facts.get("family"), facts.get("name"), facts.get("order", math.inf)
            if isinstance(family, str) and isinstance(name, str) and family in found:
                found[family].append((float(order), str(path), block.start(), name.rpartition(".")[2]))
    return {f: [name for *_, name in sorted(ops)] for f, ops in found.items()}
