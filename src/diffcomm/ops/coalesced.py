"""Coalesced collectives: one communication per dtype for a whole list of tensors.

``all_reduce_coalesced``, ``broadcast_coalesced``, ``all_gather_coalesced`` and
``reduce_scatter_coalesced`` take a list (or tuple) of tensors of any shapes and mixed
dtypes and return a list in the same order; element ``i`` equals the single-tensor op
applied to ``tensors[i]``, with the same gradient. Real models move many small tensors
(biases, layer-norm weights, statistics); one collective each pays the per-collective
latency many times over.

How: the tensors are grouped by dtype (in order of first appearance); each group is
**packed** into one flat buffer (``torch.cat`` of the flattened tensors, laid out so the
op becomes a plain dim-0 op on the buffer), **one** raw collective runs per buffer, and
the result is **split back with views** (``split`` + ``view`` / ``movedim``; only
``all_gather_coalesced`` copies, because the gathered buffer is rank-major and each
result must be tensor-major).

Gradient convention as for every collective (the objective is the sum of the per-rank
objectives): the backward of a coalesced op is its **dual coalesced op**, again one
communication per dtype:

Each op's class states its dual and the backward rule (the table is generated from them:
:func:`coalesced_markdown`, in ``docs/coalesced.md``); max/min/product route through
``all_reduce_coalesced``'s rule (the tie counts / zero counts share the gradients'
buffers: still one call per dtype, plus one product all_reduce per dtype for product).

The packing (``cat`` / ``split`` / ``view``) is ordinary differentiable torch, so the
autograd Functions only ever see flat buffers, one per dtype. Every rank runs the
same backward collectives: the gradient of a buffer covers every tensor packed into it,
with zeros where an output got no gradient or its input does not require grad.

Where they live: :mod:`diffcomm.ops.coalesced_reduce` (all_reduce / broadcast / reduce),
:mod:`diffcomm.ops.coalesced_gather` (all_gather / reduce_scatter), the packing and
validation in :mod:`diffcomm.ops.packing`. This module imports each op of the
``"coalesced"`` family by name, in the registry's order (tests/test_packaging.py checks
that every registered built-in op of the family is here).
"""

from __future__ import annotations

from .coalesced_gather import all_gather_coalesced as all_gather_coalesced
from .coalesced_gather import reduce_scatter_coalesced as reduce_scatter_coalesced
from .coalesced_reduce import _AllReduceList
from .coalesced_reduce import all_reduce_coalesced as all_reduce_coalesced
from .coalesced_reduce import broadcast_coalesced as broadcast_coalesced
from .coalesced_reduce import reduce_coalesced as reduce_coalesced
from .packing import debug_check as _debug_check
from .registry import FamilyView, markdown

#: The family's ops, in the registry's order: one ``name as name`` import above and one
#: entry here per op. The package face re-exports this module's ``__all__``
#: (``dc.all_reduce_coalesced``), and the command line reads this list as data, without
#: importing torch (:mod:`diffcomm.tools.op_names`). The family's table
#: (``COALESCED_OPS``, :func:`coalesced_markdown`) and the raw forward are attributes here.
__all__: list[str] = [
    "all_reduce_coalesced",
    "broadcast_coalesced",
    "reduce_coalesced",
    "all_gather_coalesced",
    "reduce_scatter_coalesced",
]

#: coalesced op name -> its registry entry, read off its class (a live view of the
#: ``"coalesced"`` family).
COALESCED_OPS = FamilyView("coalesced")


def coalesced_markdown() -> str:
    """The coalesced op -> adjoint table as Markdown (the docs include this)."""
    return markdown("coalesced")


#: The raw forward of ``all_reduce_coalesced`` (``(xs, op, pg) -> list``) and the debug-mode
#: cross-rank check of a tensor list, for op families built on them (the coalesced
#: ``diffcomm.parallel`` mappings).
raw_all_reduce_coalesced = _AllReduceList.run
check_lists_consistent = _debug_check
