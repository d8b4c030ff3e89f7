"""The differentiable collectives: their public home, and the op -> adjoint views.

Gradient convention: the objective is the **sum of the per-rank objectives**. Then every
collective is a linear map ``A`` on the concatenation of all ranks' tensors (max/min/
product are linearised at the point), and its backward is ``A^T``, built from the public
ops so double backward, ``torch.func`` and nested transforms work. Each op's dual and
backward rule are stated once, in its class; the table is generated from them
(:func:`duals_markdown`, in ``docs/convention.md``).

Each op has one home, its module: the public function (validation first, before any
communication, with the checks the ops share in :mod:`diffcomm.ops.validation`) and its
:class:`~diffcomm.ops.base.CommOp` subclass, which states the raw forward, the transpose
(the dual op), which arguments are dims, and the facts the registry reads
(:class:`~diffcomm.ops.registry.OpFacts`: family, place in the table, dual, argument map,
serial reference, output shape, test cases). This module imports each op of the
``"collective"`` family by name, in the registry's order (the docs' table): ``all_reduce``
(self-dual), ``broadcast`` / ``reduce``, ``all_gather`` / ``reduce_scatter``, ``gather`` /
``scatter``, ``all_to_all`` (self-dual); tests/test_packaging.py checks that every
registered built-in op of the family is here. An op a user's module defines is in the
views (:data:`OPS`, :data:`DUALS`), not an attribute here.

Rules that keep the SPMD program deadlock-free: backward rules never branch on
rank-local facts that could differ between ranks, and only call public diffcomm ops
(never raw backend calls), so every rank runs the same collectives in backward.
"""

from __future__ import annotations

from .all_gather import all_gather as all_gather
from .all_gather import raw_all_gather as raw_all_gather
from .all_gather import raw_reduce_scatter as raw_reduce_scatter
from .all_gather import reduce_scatter as reduce_scatter
from .all_reduce import WEIGHT_DTYPE as WEIGHT_DTYPE
from .all_reduce import all_reduce as all_reduce
from .all_reduce import product_parts as product_parts
from .all_reduce import product_weight as product_weight
from .all_reduce import raw_all_reduce as raw_all_reduce
from .all_to_all import all_to_all as all_to_all
from .all_to_all import raw_all_to_all as raw_all_to_all
from .broadcast_reduce import broadcast as broadcast
from .broadcast_reduce import reduce as reduce
from .gather_scatter import gather as gather
from .gather_scatter import scatter as scatter
from .registry import DualsView, FamilyView, dual, markdown

#: The family's ops, in the registry's order: one ``name as name`` import above and one
#: entry here per op. The package face re-exports this module's ``__all__``
#: (``dc.all_gather``), and the command line reads this first list as data, without
#: importing torch (:mod:`diffcomm.tools.op_names`).
__all__: list[str] = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
]
#: the family's tables, also on the package face (``dc.DUALS``); the raw forwards and the
#: product rule (``raw_all_reduce``, ``WEIGHT_DTYPE``, ``product_parts``, ...) and
#: :func:`duals_markdown` are attributes here, for the op families built on them
#: (``diffcomm.parallel``) and the docs, not on the face
__all__ += ["DUALS", "OPS", "dual"]

#: op name -> its :class:`~diffcomm.ops.registry.Entry` (public function, dual, rules in
#: words, the op class), read off the class: a live view of the registry's ``"collective"``
#: family (an op a user's module defines appears here too).
OPS = FamilyView("collective")

#: op name -> name of its adjoint (the table the tests walk and the docs are built from).
DUALS = DualsView("collective")


def duals_markdown() -> str:
    """The op -> adjoint table as Markdown (the docs include this)."""
    return markdown("collective")
