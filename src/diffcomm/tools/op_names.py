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
_CLASS = re.compile(r"^class (\w+)(?:\(([^)]*)\))?.*?(?=^\S|\Z)", re.M | re.S)
#: a fact its body states as a constant: ``    name = "all_gather"``, ``    order = 30``
_FACT = re.compile(r"^    (name|family|order) = (\"[^\"\n]*\"|[0-9.]+)[ \t]*(?:#.*)?$", re.M)
#: a base that gives its subclasses their family (``cls.family = "mapping"`` in its
#: ``__init_subclass__``: the mappings' base)
_GIVES = re.compile(r"^        +cls\.family = (\"[^\"\n]*\")", re.M)


_Classes = dict[str, tuple[list[str], dict[str, object], int]]


def _fact(classes: _Classes, cls: str, key: str, seen: frozenset[str] = frozenset()) -> object:
    """``key`` as class ``cls`` states it, else as its first base in the module that does."""
    bases, facts, _ = classes[cls]
    if key in facts:
        return facts[key]
    for base in bases:
        if base in classes and base not in seen:
            got = _fact(classes, base, key, seen | {cls})
            if got is not None:
                return got
    return None


def builtin_ops() -> dict[str, list[str]]:
    """family -> the public names of diffcomm's own ops of it, in the registry's order
    (families in :data:`FAMILY_ORDER`). A class's family is its own, else one a base class
    of the same module states or gives its subclasses."""
    found: dict[str, list[tuple[float, str, int, str]]] = {f: [] for f in FAMILY_ORDER}
    for path in sorted(_PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "family = " not in text:  # cheap: read only the modules that define op classes
            continue
        classes: _Classes = {}
        for block in _CLASS.finditer(text):
            body = block.group()
            facts: dict[str, object] = {k: ast.literal_eval(v) for k, v in _FACT.findall(body)}
            gives = _GIVES.search(body)
            if gives and "family" not in facts:
                facts["family"] = ast.literal_eval(gives.group(1))
            bases = [b.strip() for b in (block.group(2) or "").split(",") if b.strip()]
            classes[block.group(1)] = (bases, facts, block.start())

        for cls, (_bases, facts, start) in classes.items():
            family, name = _fact(classes, cls, "family"), facts.get("name")
            order = facts.get("order", math.inf)
            if isinstance(family, str) and isinstance(name, str) and family in found:
                assert isinstance(order, (int, float))
                found[family].append((float(order), str(path), start, name.rpartition(".")[2]))
    return {f: [name for *_, name in sorted(ops)] for f, ops in found.items()}
