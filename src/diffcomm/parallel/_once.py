"""``first_order``: the backward of an autograd Function that has no derivative of its own.

Why not torch's ``once_differentiable``: it adds its error node only when an incoming
gradient requires grad. With a loss *linear* in the Function's output the incoming
gradient is a constant, so under ``create_graph=True`` the gradient it returns simply
does not require grad: a gradient penalty built on it loses its term without any error
(and ``penalty.backward()`` alone fails with torch's generic "element 0 of tensors does
not require grad"). ``first_order`` attaches the error node to every gradient the
backward returns whenever the graph of the backward is being built (``create_graph=True``),
whatever the incoming gradient: any attempt to differentiate it again raises
:data:`MESSAGE`, naming the op.

Under a ``torch.func`` transform (``grad``, ``vjp``, ``vmap(grad)``) a constant gradient
cannot be made tracked (``requires_grad_`` is refused there); the marker then hangs on an
*anchor*: a scalar the Function took as an extra input, computed from its differentiable
inputs (``x.sum() * 0``), so the marker is recorded at every level that tracks them
(``grad(grad(f))``, ``torch.autograd`` over ``torch.func.grad``). A Function without an
anchor raises a clear error there instead of returning an unmarked gradient (which
``grad(grad(f))`` would silently differentiate to zero).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import _torch

__all__ = ["MESSAGE", "UNDER_TRANSFORM", "first_order"]

#: the error of every first-order-only backward of diffcomm (``{op}``, ``{hint}`` filled in)
MESSAGE = (
    "diffcomm: {op} has a first-order backward only: trying to differentiate twice a function "
    "that was marked with @once_differentiable (a gradient penalty or any double backward "
    "through it). {hint}"
)


class _Refuse(torch.autograd.Function):
    """Identity forward; its backward raises: the marker on a first-order gradient."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, message: str, anchor: Tensor | None = None) -> Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.message = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[None, None, None]:
        raise RuntimeError(ctx.message)


#: the refusal of a first-order backward without an anchor under a torch.func transform
UNDER_TRANSFORM = (
    "diffcomm: {op} has a first-order backward only, and no derivative of it can be marked "
    "under a torch.func transform (grad / vjp / vmap), which differentiates through every "
    "backward. Use torch.autograd (loss.backward(), torch.autograd.grad)."
)


def _mark(t: Any, message: str, anchor: Tensor | None, op: str) -> Any:
    if not isinstance(t, Tensor) or not (t.dtype.is_floating_point or t.dtype.is_complex):
        return t
    if t.requires_grad:
        return _Refuse.apply(t, message)
    if _torch.transforms_active():  # a torch.func transform: hang the marker on the anchor
        if anchor is None:
            raise RuntimeError(UNDER_TRANSFORM.format(op=op))
        return _Refuse.apply(t, message, anchor)
    # a constant incoming gradient (linear loss): make it tracked
    return _Refuse.apply(t.detach().requires_grad_(), message)


def first_order(
    op: str, hint: str = "", anchor: Callable[[Any], Tensor | None] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator of an autograd Function's ``backward`` (in place of
    ``once_differentiable``): the backward runs under ``no_grad``; when the backward graph
    is being built (``create_graph=True``) every gradient it returns carries a node whose
    backward raises :data:`MESSAGE` — so a double backward or a gradient penalty through
    ``op`` is an error, never a silently missing term.

    Args:
        op: the public op, for the message (``"parallel.ring_attention"``).
        hint: what to use instead (one sentence).
        anchor: ``anchor(ctx)``: the Function's anchor (see the module docstring), or
            ``None``; without it the backward refuses to run under a ``torch.func``
            transform, with a message naming ``op``.
    """
    message = MESSAGE.format(op=op, hint=hint).rstrip()

    def deco(backward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward)
        def wrapper(ctx: Any, *grads: Any) -> Any:
            building = torch.is_grad_enabled()
            a = anchor(ctx) if building and anchor is not None else None
            with torch.no_grad():
                out = backward(ctx, *grads)
            if not building:
                return out
            if isinstance(out, tuple):
                return tuple(_mark(t, message, a, op) for t in out)
            return _mark(out, message, a, op)

        return wrapper

    return deco
