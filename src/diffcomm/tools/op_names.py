"""diffcomm's own op names, as literals: the command line reads them without importing torch.

``python -m diffcomm check --help`` lists the ops and a bad ``--ops`` is refused at once,
before torch is imported (seconds). The lists below are the registry's built-in ops,
family by family, in each family's ``order`` (the order ``check`` runs them);
tests/test_packaging.py checks them against the registry (and the families' homes), so a
new built-in op that is missing here is named there.
"""

from __future__ import annotations

__all__ = ["FAMILY_ORDER", "BUILTIN_OPS", "builtin_ops"]

#: the families in the order ``check`` runs them (its standard suite's order)
FAMILY_ORDER = ("collective", "p2p", "coalesced", "mapping")

#: family -> diffcomm's own ops of it, in the registry's order (literals, space-separated)
BUILTIN_OPS: dict[str, tuple[str, ...]] = {
    family: tuple(names.split())
    for family, names in {
        "collective": "all_reduce broadcast reduce all_gather reduce_scatter gather scatter all_to_all",
        "p2p": "send recv sendrecv shift ppermute",
        "coalesced": """all_reduce_coalesced broadcast_coalesced reduce_coalesced all_gather_coalesced
            reduce_scatter_coalesced""",
        "mapping": """copy_to_region reduce_from_region scatter_to_region gather_from_region
            scatter_to_sequence gather_from_sequence reduce_scatter_to_sequence all_gather_from_sequence
            all_to_all_region""",
    }.items()
}


def builtin_ops() -> dict[str, list[str]]:
    """family -> the public names of diffcomm's own ops of it, in the registry's order
    (families in :data:`FAMILY_ORDER`)."""
    return {f: list(BUILTIN_OPS[f]) for f in FAMILY_ORDER}
