"""Differentiable point-to-point communication: send/recv, sendrecv, ppermute, shift.

Gradient convention: as for the collectives, the objective is the **sum of the per-rank
objectives**. Every op here is a linear map on the concatenation of all ranks' tensors
(a permutation of blocks, with zeros where nothing arrives), so its backward is the
transpose — the same communication run in the opposite direction:

* ``send`` / ``recv``: ``x`` travels from the sender to ``dst`` (the sender gets a 0-dim
  token); backward: ``recv``'s backward sends the gradient to ``src``, where the token's
  backward receives it.
* ``sendrecv(x, dst, src)``: backward ``sendrecv(grad, dst=src, src=dst)``.
* ``ppermute(x, perm)``: rank ``r`` receives from ``s`` where ``(s, r)`` is in ``perm``
  (zeros if none); backward ``ppermute(grad, inverse pairs)``.
* ``shift(x, offset)``: rank ``r`` receives from ``r - offset`` (mod n); backward
  ``shift(grad, -offset)``.

Every op is a :class:`~diffcomm.ops.base.CommOp` (``run`` + ``transpose``; its facts -
dual, argument map, serial reference, test cases - stated in its class), so backward,
forward mode and batching come from the one base. The symmetric ops (``sendrecv``,
``ppermute``, ``shift``) run as **one** batched isend/irecv (deadlock-free whatever the
order of ranks), and their transposes call the dual ops, so double backward,
``torch.func.grad/vjp/jvp/vmap``, ``jacrev`` and ``jacfwd`` all work.

``send``/``recv`` are the one-sided pair pipelines need. The wire protocol under them
lives in :mod:`diffcomm.ops.wire`: sends are asynchronous (c10d's blocking send is a
rendezvous, so two neighbours that both "send, then receive" — a 1F1B pipeline's steady
state — would deadlock); shape, dtype and ``requires_grad`` travel in a small header, so
``recv`` needs no ``shape`` and a mismatch is a :class:`~diffcomm.CrossRankMismatchError`
naming both ranks; ``recv`` returns a tensor that requires grad exactly when the sent
tensor did (floating or complex), so a pipeline boundary never loses or invents
``requires_grad``.

Limits (documented in ``docs/p2p.md``): ``recv``'s backward is a side effect that no
local gradient needs, so run the receiver's backward with ``loss.backward()`` /
``torch.autograd.backward`` (``torch.autograd.grad(loss, inputs)`` and ``torch.func``
prune it and leave the sender waiting); double backward and forward mode through
``send``/``recv`` raise ``NotImplementedError`` — use ``sendrecv``/``ppermute``/``shift``.

Where they live: ``send`` / ``recv`` (and the posted receives, ``irecv`` /
``post_grad_recv``, and the pipeline runner's private entries, ``send_owned``,
``irecv_fused``, ``is_send_node``, ``check_tag``, ``send_no_grad``,
``NoGradient``: attributes here, not exported) in :mod:`diffcomm.ops.send_recv`;
``sendrecv`` / ``shift`` / ``ppermute`` in :mod:`diffcomm.ops.exchanges`. This module is
their public home, with the registry's views of the ``"p2p"`` family: it imports each op
of the family by name, in the registry's order (tests/test_packaging.py checks that every
registered built-in op of the family is here); an op a user's module defines is in the
views, not an attribute here.
"""

from __future__ import annotations

from .exchanges import ppermute as ppermute
from .exchanges import sendrecv as sendrecv
from .exchanges import shift as shift
from .registry import DualsView, FamilyView, markdown
from .send_recv import NoGradient as NoGradient
from .send_recv import RecvHandle, irecv, post_grad_recv
from .send_recv import check_tag as check_tag
from .send_recv import irecv_fused as irecv_fused
from .send_recv import is_send_node as is_send_node
from .send_recv import recv as recv
from .send_recv import send as send
from .send_recv import send_no_grad as send_no_grad
from .send_recv import send_owned as send_owned
from .wire import MAX_NDIM as MAX_NDIM
from .wire import MAX_TAG as MAX_TAG
from .wire import wait_sends

#: The family's ops, in the registry's order: one ``name as name`` import above and one
#: entry here per op. The package face re-exports this module's ``__all__`` (``dc.send``),
#: and the command line reads this first list as data, without importing torch
#: (:mod:`diffcomm.tools.op_names`).
__all__: list[str] = [
    "send",
    "recv",
    "sendrecv",
    "shift",
    "ppermute",
]
#: the posted receives and ``wait_sends``, also on the package face. ``check_tag``,
#: ``irecv_fused``, ``is_send_node``, ``NoGradient``, ``send_no_grad`` and ``send_owned``
#: (imported above) are the pipeline runner's private entries, not exported; the family's
#: tables (``OPS``, ``DUALS``, :func:`p2p_markdown`) and the wire's limits (``MAX_TAG``,
#: ``MAX_NDIM``) are attributes here (``dc.p2p.DUALS``), not on the face (``dc.DUALS`` is
#: the collectives')
__all__ += ["irecv", "RecvHandle", "post_grad_recv", "wait_sends"]


# ======================================================================================
# the op -> adjoint views (each op's facts are stated in its class)
# ======================================================================================

#: p2p op name -> its registry entry, read off its class (a live view of the ``"p2p"`` family).
OPS = FamilyView("p2p")

#: p2p op name -> name of its adjoint.
DUALS = DualsView("p2p")


def p2p_markdown() -> str:
    """The p2p op -> adjoint table as Markdown (the docs include this)."""
    return markdown("p2p")
