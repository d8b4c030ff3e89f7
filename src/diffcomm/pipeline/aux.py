"""Auxiliary losses of a pipeline stage (an MoE's load-balancing loss).

Only the last stage computes the loss (``loss_fn``), and a stage sends one tensor on, so
an auxiliary loss made inside an earlier stage — ``ExpertParallelMoE.aux_loss`` — had no
way into the objective: the router trained without it, with no error.
:func:`add_aux_loss` attaches it to the stage's output (Megatron-LM's
``MoEAuxLossAutoScaler``): the output is unchanged, and its backward also runs the
auxiliary loss's backward, with the weight :class:`~diffcomm.pipeline.PipelineRunner`
gives each micro-batch's loss (``1 / n_micro``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._replication import objective_term
from ..backend import args as A
from ..backend.in_process import per_rank

__all__ = ["add_aux_loss"]

#: the weight of the running micro-batch's loss: ``1 / n_micro`` inside a
#: :meth:`PipelineRunner.step`, else 1 (a rank's own in an in-process world)
_SCALE: list[float] = [1.0]
per_rank(_SCALE)


class _WithAux(torch.autograd.Function):
    """``y`` unchanged; backward: ``y``'s gradient, and ``scale`` for ``aux``."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, y: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.aux = (aux.shape, aux.dtype, aux.device)  # type: ignore[attr-defined]
        ctx.scale = scale  # type: ignore[attr-defined]
        return y.view_as(y)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: Tensor) -> tuple[Tensor, Tensor, None]:
        shape, dtype, device = ctx.aux  # type: ignore[attr-defined]
        return g, torch.full(shape, ctx.scale, dtype=dtype, device=device), None  # type: ignore[attr-defined]

    @staticmethod
    def spmd_typecheck(outputs: Tensor, *, y: Tensor, aux: Tensor, scale: float) -> None:
        """spmd_types' rule (read only by its checker, ``spmd_types.checker.typecheck()``):
        the output is ``y`` (its type passes through); ``aux`` is a term of the objective,
        so, as spmd_types types a loss at ``backward()``, it must be ``I`` (replicated
        objective) or ``P`` / ``V`` (this rank's share of a sum over the ranks, diffcomm's
        sum convention: an ``ExpertParallelMoE.aux_loss``); an ``R`` aux (summed by a
        sum-convention all_reduce, whose backward sums its gradient over the ranks again)
        is refused."""
        import importlib

        st = importlib.import_module("spmd_types")
        rules = importlib.import_module("spmd_types.rules")
        if st.has_local_type(aux):
            for axis, t in st.get_local_type(aux).items():
                if t is st.R:
                    raise st.SpmdTypeError(
                        f"diffcomm.pipeline.add_aux_loss: argument 'aux' is R on axis {axis}: a "
                        "term of the objective must be I or P (as a loss at backward()); its "
                        "backward would sum its gradient over the ranks once more (an all_reduce "
                        "with dst=R, or diffcomm's sum-convention all_reduce). Reduce it with "
                        "dst=I (parallel.reduce_from_region), or attach this rank's share "
                        "unreduced."
                    )
        rules.ignore(aux)  # (its value does not reach the output)
        rules.einsum("...->...", y, linear_in=(0,), out=outputs)


def add_aux_loss(y: Tensor, aux: Tensor) -> Tensor:
    """Attach the auxiliary loss ``aux`` to the activation ``y``: return ``y`` (same values)
    whose backward also differentiates ``aux``.

    Inside a pipeline stage (``return add_aux_loss(y, 0.01 * moe.aux_loss)``) the objective
    becomes the step loss plus the **mean over micro-batches** of ``aux`` — each
    micro-batch's ``aux`` weighted as its loss is (``1 / n_micro``), as serially
    ``mean_m(loss_fn(out_m, t_m) + aux_m)``. The returned step loss does not include it
    (add it up yourself to report it). Outside a runner's step the weight is 1: the
    serial model written with the same call differentiates ``loss + aux``. The weight
    holds no factor the loss is multiplied by after the forward: attach ``aux`` times it
    too. Under a ``GradScaler`` that scales the loss (in ``loss_fn``, or
    ``scaler.scale(loss).backward()``) attach ``scaler.scale(aux)``: an unscaled ``aux``
    has its gradient divided by the scale at ``unscale_``. Accumulating ``k`` backwards
    of ``loss / k`` by hand, attach ``aux / k``.

    Args:
        y: the stage's output (any shape; it must reach the loss for ``aux`` to count, as
            the backward through ``y`` runs ``aux``'s): floating-point (or complex) when
            ``aux`` requires grad, a ``TypeError`` otherwise (an integer ``y`` has no
            backward: ``aux``'s gradient was ``None``, silently).
        aux: a one-element floating-point tensor (an ``ExpertParallelMoE``'s ``aux_loss``
            is this rank's share of the group's; summed over the expert-parallel ranks it
            is the serial one, diffcomm's sum convention).

    Returns:
        ``y``'s values, shape ``y.shape``.

    Gradient:
        ``y``: the incoming gradient, unchanged; ``aux``: the micro-batch's loss weight
        (``1 / n_micro`` in :meth:`PipelineRunner.step`, else 1).

    Example::

        class Stage(nn.Module):          # an earlier stage holding an MoE
            def forward(self, x):
                y = self.moe(self.pre(x))
                return add_aux_loss(y, 0.01 * self.moe.aux_loss)
    """
    op = "pipeline.add_aux_loss"
    y = A.check_tensor(y, op, "y")
    aux = A.check_tensor(aux, op, "aux")
    if not aux.is_floating_point():
        raise A.arg_error(op, "aux", "a floating-point tensor", aux.dtype, TypeError)
    if aux.numel() != 1:
        raise A.arg_error(op, "aux", "one element (a scalar loss)", f"shape {tuple(aux.shape)}")
    if not aux.requires_grad:  # nothing to differentiate (e.g. under torch.no_grad)
        return y
    if not (y.is_floating_point() or y.is_complex()):
        # an integer output (token ids for the next stage's embedding) carries no gradient:
        # its backward never runs, and aux's gradient was None, with no error
        raise A.arg_error(
            op,
            "y",
            "a floating-point tensor when `aux` requires grad (an integer activation has no "
            "backward to carry aux's: attach it to a floating-point one)",
            y.dtype,
            TypeError,
        )
    objective_term(aux)  # dc.spmd_check: a term of the objective (else a no-op)
    return _WithAux.apply(y, aux, _SCALE[0])
