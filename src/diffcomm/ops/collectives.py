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
from .all_gather import raw_all_gather, raw_reduce_scatter
from .all_gather import reduce_scatter as reduce_scatter
from .all_reduce import WEIGHT_DTYPE, product_parts, product_weight, raw_all_reduce
from .all_reduce import all_reduce as all_reduce
from .all_to_all import all_to_all as all_to_all
from .all_to_all import raw_all_to_all
from .broadcast_reduce import broadcast as broadcast
from .broadcast_reduce import reduce as reduce
from .gather_scatter import gather as gather
from .gather_scatter import scatter as scatter
from .registry import DualsView, FamilyView, dual, markdown

__all__ = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
    "DUALS",
    "OPS",
    "dual",
    "duals_markdown",
    # the raw forwards and the product rule, for the op families built on them (parallel)
    "raw_all_reduce",
    "raw_all_gather",
    "raw_reduce_scatter",
    "raw_all_to_all",
    "WEIGHT_DTYPE",
    "product_parts",
    "product_weight",
]

#: op name -> its :class:`~diffcomm.ops.registry.Entry` (public function, dual, rules in
#: words, the op class), read off the class: a live view of the registry's ``"collective"``
#: family (an op a user's module defines appears here too).
OPS = FamilyView("collective")

#: op name -> name of its adjoint (the table the tests walk and the docs are built from).
DUALS = DualsView("collective")


def duals_markdown() -> str:
    """The op -> adjoint table as Markdown (the docs include this)."""
    return markdown("collective")
