"""Gradient checks for SPMD code: the dot-product (adjoint) test and a distributed gradcheck.

Both are SPMD: call them on every rank of the group, with the same arguments' shapes,
exactly as you call a collective. They communicate through raw (non-differentiable)
backend ops only, so they add nothing to the graphs they check.
"""

from __future__ import annotations

# Size: ~660 lines, over the ~600 guideline: the kit's two gradient checks share their
# probes (strided layouts, in-place watch, the one-sum verdict); split, each would import
# the other's helpers.
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwd_ad
from torch import Tensor

from .. import _torch
from .. import backend as B
from .._errors import CrossRankMismatchError
from ..backend import args as A
from ..backend.in_process import current_rank
from ..parallel._check import check_replicated

__all__ = ["check_adjoint", "gradcheck"]

_OBJECTIVES = ("sum", "replicated")


def _default_rtol(dtype: torch.dtype) -> float:
    real = torch.empty((), dtype=dtype).real.dtype if dtype.is_complex else dtype
    if real == torch.float64:
        return 1e-10
    if real == torch.float32:
        return 1e-4
    return 1e-2


def _inner(a: Tensor, b: Tensor) -> Tensor:
    """Real inner product ``Re <a, b>`` in float64 (complex: ``Re sum(conj(a) * b)``)."""
    if a.is_complex() or b.is_complex():
        return torch.vdot(a.reshape(-1).to(torch.complex128), b.reshape(-1).to(torch.complex128)).real
    return (a.to(torch.float64) * b.to(torch.float64)).sum()


def strided(t: Tensor) -> Tensor:
    """``t``'s values in a non-contiguous layout (every other element of a larger buffer;
    also the case runner's, :mod:`.cases`)."""
    return torch.stack([t, torch.zeros_like(t)], -1).select(-1, 0)


def _sum_over_ranks(values: Sequence[float] | Tensor, pg: Any) -> Tensor:
    t = torch.as_tensor(values, dtype=torch.float64).reshape(-1).to(B.get_backend().comm_device(pg))
    with B.label("diffcomm.testing (sum over ranks)"):
        return B.get_backend().all_reduce(t, "sum", pg).cpu()


def _gather_rows(row: Tensor, pg: Any) -> Tensor:
    t = row.to(torch.float64).reshape(1, -1).to(B.get_backend().comm_device(pg))
    with B.label("diffcomm.testing (exchange)"):
        return B.get_backend().all_gather(t, pg).cpu()


def _check_y_shape(ax: Tensor, y: Tensor) -> None:
    if tuple(ax.shape) != tuple(y.shape):
        raise A.arg_error("testing.check_adjoint", "y", f"of op(x)'s shape {tuple(ax.shape)}", tuple(y.shape))


def _changed(now: Tensor, before: Tensor) -> Tensor:
    """Whether ``now`` differs from ``before`` (a 0-dim bool tensor, not read here: under
    LocalTensorMode it holds one value per rank; NaN equals NaN)."""
    if now.shape != before.shape or now.dtype != before.dtype:
        return torch.ones((), dtype=torch.bool)
    same = (
        (now == before) | (now.isnan() & before.isnan())
        if now.is_floating_point() or now.is_complex()
        else now == before
    )
    return ~same.all()


class GradientWatch:
    """Keeps a copy of every gradient the backward nodes of a graph receive, to tell
    afterwards whether one of them changed it in place (autograd may hand the same
    gradient tensor to several backwards, so such a backward corrupts another's gradient
    even when its own result is right). Built on the outputs before the backward runs;
    holding the gradients also keeps autograd from accumulating into them in place.
    (Also the serial comparison's, :mod:`.serial`.)"""

    def __init__(self, roots: Sequence[Tensor]) -> None:
        self.received: list[tuple[Tensor, Tensor]] = []
        self._handles: list[Any] = []
        seen: set[int] = set()
        stack = [r.grad_fn for r in roots if isinstance(r, Tensor) and r.grad_fn is not None]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if hasattr(node, "variable"):  # AccumulateGrad: a leaf's, it computes nothing
                continue
            self._handles.append(node.register_prehook(self._record))
            stack.extend(f for f, _ in node.next_functions if f is not None)

    def _record(self, grads: tuple[Tensor | None, ...]) -> None:
        for g in grads:
            if isinstance(g, Tensor):
                self.received.append((g, g.detach().clone()))

    def changed(self) -> Tensor:
        """Whether a backward changed a gradient it received (a 0-dim bool tensor, not
        read here); removes the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        flags = [_changed(g.detach(), before) for g, before in self.received]
        return torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool)


def _other_derivatives(op: Callable[[Tensor], Tensor], x: Tensor, y: Tensor) -> list[Tensor | None]:
    """``A x`` as forward mode computes it (the tangent of ``op`` at ``x`` in the direction
    ``x``) and as the double backward does (the derivative of ``A^T y`` in ``y`` along
    ``x``). ``None`` for one that cannot be computed: an op without a forward-mode
    rule (an ``autograd.Function`` without ``jvp``), or whose backward is not differentiable
    in its gradient: using it then raises, no silent wrong number. Forward mode is not
    tried in an in-process world (which refuses it) or under LocalTensorMode. Every rank
    runs the same program, so every rank skips alike."""
    out: list[Tensor | None] = [None, None]
    if current_rank() is None and not _torch.local_tensor_mode_on():
        try:
            with torch.enable_grad(), fwd_ad.dual_level():
                tangent = fwd_ad.unpack_dual(op(fwd_ad.make_dual(x.clone(), x.clone()))).tangent
            out[0] = None if tangent is None else tangent.detach()
        except NotImplementedError:
            pass
    xg, yg = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    with torch.enable_grad():
        ax = op(xg)
        if ax.requires_grad:
            (aty,) = torch.autograd.grad(ax, xg, yg.to(ax.dtype), create_graph=True, allow_unused=True)
            if aty is not None and aty.requires_grad:
                (a,) = torch.autograd.grad(aty, yg, x.to(aty.dtype), allow_unused=True)
                out[1] = None if a is None else a.detach()
    return out


def _one_tensor(out: Any, arg: str) -> Tensor:
    """What ``op`` / ``dual_op`` returned, which must be one tensor (a linear map of one)."""
    if not isinstance(out, Tensor):
        raise A.arg_error(
            "testing.check_adjoint",
            arg,
            "a function returning one tensor (wrap an op with several outputs to return one)",
            f"a function returning {type(out).__name__}",
            TypeError,
        )
    return out


def check_adjoint(
    op: Callable[[Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    dual_op: Callable[[Tensor], Tensor] | None = None,
    group: A.GroupLike = None,
    *,
    rtol: float | None = None,
    atol: float = 0.0,
) -> float:
    """The dot-product test of a linear SPMD op: ``sum_r <A x_r, y_r> == sum_r <x_r, A^T y_r>``.

    ``A`` is the linear map ``op`` makes on the concatenation of all ranks' tensors; its
    transpose is what autograd computes (the vjp of ``op`` at ``x`` with cotangent ``y``,
    i.e. the sum-of-per-rank-objectives convention of the core collectives), or
    ``dual_op(y)`` when given. The sums over ranks (both sides, and the sizes of ``x``
    and ``y``) go through one raw all_reduce of a few float64 scalars. Call on every rank.

    Args:
        op: the (linear) op, ``x -> A x``; run on every rank.
        x: this rank's input (random, float64 recommended).
        y: this rank's cotangent, shape of ``op(x)`` (random).
        dual_op: the claimed adjoint ``y -> A^T y``; ``None``: autograd's vjp.
        group: the group the inner products are summed over.
        rtol: relative tolerance (default: 1e-10 for float64, 1e-4 for float32, 1e-2
            otherwise).
        atol: absolute tolerance.

    Returns:
        The relative error ``|lhs - rhs| / max(|lhs|, |rhs|)`` (0 when both are 0).

    Raises:
        AssertionError: with both numbers, when ``|lhs - rhs| > atol + rtol * max(|lhs|, |rhs|)``
            (with x and y as given, or both laid out non-contiguously); or when ``op``
            changed its ``x``, or the backward (``dual_op``) its ``y``, in place; or (without
            ``dual_op``) when autograd's forward-mode tangent ``jvp(op, x, x)`` or its double
            backward ``d(A^T y)/dy [x]`` is not ``A x`` (each where it can be computed).
            It does not check that ``op``'s forward is right: compare it with a reference.
        ValueError: ``y``'s shape differs from ``op(x)``'s; or ``x`` (or ``y``) is zero on
            every rank, where the test is vacuous (both sides are 0 for any backward), on
            every rank alike (decided from the sums over ranks; zero on some ranks only is
            a real test).

    Example::

        def test_all_gather_adjoint(world2):
            def f():
                x, y = torch.randn(3, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
                return check_adjoint(dc.all_gather, x, y)
            assert max(world2.run(f)) < 1e-12
    """
    x = A.check_tensor(x, "testing.check_adjoint", "x")
    y = A.check_tensor(y, "testing.check_adjoint", "y")
    pg = A.resolve_group(group, "testing.check_adjoint")
    # The kit's own copies: what op / dual_op do to the tensors they are given cannot
    # change the sums below. Two passes: as given, and with the same values of x and y
    # laid out non-contiguously (a forward or backward wrong only for a strided tensor is
    # a classic silent bug; a test's x and y are almost always contiguous).
    xd, yd = x.detach().clone(), y.detach().clone()
    axs: list[Tensor] = []
    atys: list[Tensor] = []
    # per pass: whether op changed its x, and whether the backward (or dual_op) changed
    # its y, in place; tensors, never read on this rank (summed over ranks below)
    touched: list[Tensor] = []
    for x_in, y_in in ((xd.clone(), yd.clone()), (strided(xd), strided(yd))):
        if dual_op is None:
            xg = x_in.requires_grad_(True)
            with torch.enable_grad():
                ax = _one_tensor(op(xg), "op")
                _check_y_shape(ax, y)
                cot = yd.to(ax.dtype, copy=True) if not axs else strided(yd.to(ax.dtype))
                watch = GradientWatch([ax])
                aty: Tensor | None = None
                if ax.requires_grad:
                    (aty,) = torch.autograd.grad(ax, xg, grad_outputs=cot, allow_unused=True)
            touched += [_changed(xg.detach(), xd), watch.changed()]
            atys.append(torch.zeros_like(x) if aty is None else aty.detach())
        else:
            with torch.no_grad():
                ax = _one_tensor(op(x_in), "op")
                _check_y_shape(ax, y)
                aty = _one_tensor(dual_op(y_in), "dual_op")
            if tuple(aty.shape) != tuple(x.shape):
                raise A.arg_error(
                    "testing.check_adjoint",
                    "dual_op",
                    f"to return x's shape {tuple(x.shape)}",
                    tuple(aty.shape),
                )
            touched += [_changed(x_in, xd), _changed(y_in, yd)]
            atys.append(aty.detach())
        axs.append(ax.detach())
    # Summed as a tensor, read after the sum: equal on every rank, so one program for all
    # under torch's LocalTensorMode too, where a per-rank .item() cannot be read. The sizes
    # of x and y (sums of |entries|) ride along in the same sum: one zero on every rank
    # makes both sides 0 whatever the backward (a vacuous pass), which only the sums over
    # ranks tell (zero on some ranks is still a real test), and so every rank refuses
    # alike. So do the in-place flags: every rank fails alike, with no rank left waiting.
    sides = [_inner(a, yd) for a in axs] + [_inner(xd, a) for a in atys]
    sizes = [t.abs().to(torch.float64).sum() for t in (xd, yd)]
    flags = [f.to(torch.float64) for f in touched]
    total = _sum_over_ranks(torch.stack([*sides, *sizes, *flags]), pg).tolist()
    lhs, lhs_nc, rhs, rhs_nc, x_size, y_size = total[:6]
    x_changed, y_changed = total[6] + total[8], total[7] + total[9]
    zero = [name for name, size in (("x", x_size), ("y", y_size)) if size == 0.0]
    if zero:
        which = " and ".join(f"`{name}`" for name in zero)
        raise ValueError(
            f"diffcomm.testing.check_adjoint(): the dot-product test is vacuous: {which} "
            f"{'is' if len(zero) == 1 else 'are'} zero on every rank, so sum_r <A x_r, y_r> and "
            "sum_r <x_r, A^T y_r> are both 0 whatever A^T is; pass random values (e.g. torch.randn)"
        )
    backward = "dual_op modified its input y" if dual_op is not None else "the backward of op modified y"
    for count, what in (
        (x_changed, "op modified its input x"),
        (y_changed, f"{backward}, its incoming gradient,"),
    ):
        if count > 0:
            raise AssertionError(
                f"diffcomm.testing.check_adjoint: {what} in place (on {int(count)} of the ranks' "
                "calls); an op must leave its input, and a backward its incoming gradient, unchanged "
                "(autograd may pass the same gradient tensor to another backward)"
            )
    rtol = _default_rtol(x.dtype) if rtol is None else rtol
    err = 0.0
    how_nc = " (with x and y non-contiguous: the same values, strided)"
    lhs_name, rhs_name = "sum_r <A x_r, y_r>", "sum_r <x_r, A^T y_r>"
    for one, other, right, how in (
        (lhs, rhs, rhs_name, ""),
        (lhs, lhs_nc, lhs_name, f"{how_nc}: op(x) itself differs for a strided x"),
        (lhs_nc, rhs_nc, rhs_name, how_nc),
    ):
        scale = max(abs(one), abs(other))
        err = max(err, abs(one - other) / scale if scale > 0 else 0.0)
        if not abs(one - other) <= atol + rtol * scale:
            rel = abs(one - other) / scale
            raise AssertionError(
                f"diffcomm.testing.check_adjoint: {lhs_name} = {one!r} but {right} = {other!r}{how} "
                f"(relative error {rel:.3g}, rtol {rtol:g}, atol {atol:g}); A^T from "
                f"{'dual_op' if dual_op is not None else 'autograd (vjp of op)'}"
            )
    if dual_op is not None:
        return err
    # autograd's other two derivatives of a linear op must be A too: the forward-mode
    # tangent in the direction x, and the derivative of A^T y in y along x (the double
    # backward); either wrong while the backward is right passed the sides above. Checked
    # once those passed (an op changing its input or gradient in place is reported above).
    names = (
        ("sum_r <jvp(op, x, x)_r, y_r>", "the forward-mode (jvp) rule of op is wrong"),
        ("sum_r <d(A^T y)/dy [x]_r, y_r>", "the double backward of op is wrong"),
    )
    # per derivative: its side, and 1 where this rank could compute it (one fixed-size sum,
    # so every rank communicates alike; compared where every rank could)
    nil, one = torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)
    ad = [
        v for a in _other_derivatives(op, xd, yd) for v in ((nil, nil) if a is None else (_inner(a, yd), one))
    ]
    totals = _sum_over_ranks(torch.stack(ad), pg).tolist()
    world = B.get_backend().world_size(pg)
    for (right, how), other, count in zip(names, totals[0::2], totals[1::2]):
        if count < world:
            continue
        scale = max(abs(lhs), abs(other))
        err = max(err, abs(lhs - other) / scale if scale > 0 else 0.0)
        if not abs(lhs - other) <= atol + rtol * scale:
            raise AssertionError(
                f"diffcomm.testing.check_adjoint: {lhs_name} = {lhs!r} but {right} = {other!r}: {how} "
                f"(relative error {abs(lhs - other) / scale:.3g}, rtol {rtol:g}, atol {atol:g})"
            )
    return err


def _flatten_outputs(out: Any) -> tuple[Tensor, ...]:
    outs = out if isinstance(out, tuple | list) else (out,)
    for o in outs:
        if not isinstance(o, Tensor):
            raise TypeError(f"diffcomm.testing.gradcheck(): `fn` must return tensors, got {type(o).__name__}")
    return tuple(outs)


def _weights(outs: Sequence[Tensor], seed: int) -> list[Tensor]:
    """Fixed random cotangents (1 for a scalar), so a non-scalar output checks its Jacobian."""
    ws = []
    for k, o in enumerate(outs):
        if o.dim() == 0:
            ws.append(torch.ones((), dtype=torch.float64))
        else:
            g = torch.Generator().manual_seed(seed + 7919 * k)
            ws.append(torch.randn(o.shape, generator=g, dtype=torch.float64))
    return ws


def _warn_unlisted_replicated(
    inputs: Sequence[Any], diff: list[int], rep: set[int], numels: list[list[int]], pg: Any, op: str
) -> None:
    """Warn about a differentiable input equal on every rank but not in ``replicated``:
    under ``objective="replicated"`` it is then each rank's own variable, which reverses
    the verdict for a replicated activation (a correct tensor-parallel program fails, one
    missing ``copy_to_region`` passes). One small exchange per such input."""
    for i_pos, i in enumerate(diff):
        if i in rep or any(n[i_pos] != numels[0][i_pos] for n in numels):
            continue
        try:
            check_replicated(inputs[i].detach(), op, f"inputs[{i}]", "", pg)
        except CrossRankMismatchError:
            continue  # per-rank data: each rank's own variable, as unlisted
        warnings.warn(
            f"diffcomm.{op}(objective='replicated'): inputs[{i}] is the same on every rank but not "
            f"in `replicated`, so it is checked as each rank's own variable; if it stands for one "
            f"value held by every rank (a replicated activation or weight), pass replicated=[{i}, ...]",
            UserWarning,
            stacklevel=3,
        )


#: why :func:`gradcheck` cannot run under torch's ``LocalTensorMode``
_PROBE_WHY = (
    "each probe moves one element of one rank's input while the others stay put, and "
    "compares with that rank's gradient: it branches on this rank as a Python int, which "
    "one program holds once for every simulated rank (check_adjoint runs under the mode)"
)


def gradcheck(
    fn: Callable[..., Any],
    inputs: Tensor | Sequence[Any],
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    group: A.GroupLike = None,
    objective: str = "sum",
    replicated: Sequence[int] = (),
    seed: int = 0,
) -> bool:
    """Finite differences across ranks in lockstep vs. the gradients autograd computes.

    The global objective is ``J = sum_k <out_k, w_k>`` over ``fn``'s outputs with fixed
    random weights ``w_k`` (1 for a scalar output), combined over ranks per ``objective``:

    * ``"sum"`` (the core collectives' convention): ``J = sum_r J_r``; ``w`` differs
      between ranks.
    * ``"replicated"`` (tensor parallelism, :mod:`diffcomm.parallel`): ``fn``'s outputs
      must be equal on every rank, ``J`` is their common value; ``w`` is the same on
      every rank.

    Every rank loops over the same sequence of probes (sizes are exchanged first): one
    element of one differentiable input of **one rank** is moved by ``+-eps`` (all other
    ranks evaluate unperturbed), ``J`` is evaluated on every rank and summed by a raw
    all_reduce, and the central difference is compared with that rank's analytic
    gradient. Inputs listed in ``replicated`` are one variable held by every rank: they
    are perturbed on all ranks at once and compared with ``sum_r grad_r`` (``"sum"``) or
    with every rank's gradient (``"replicated"``). Cost: two evaluations per element of
    every rank's differentiable inputs — keep them small.

    Args:
        fn: ``fn(*inputs)`` -> tensor or tuple of tensors; SPMD (run on every rank).
        inputs: a tensor or a sequence; the tensors with ``requires_grad=True`` are
            checked, and must be float64. Non-tensors and other tensors are passed as is.
        eps: finite-difference step.
        atol, rtol: a probe fails when ``|analytic - numeric| > atol + rtol * |numeric|``.
        group: the group the objective is summed over.
        objective: ``"sum"`` or ``"replicated"`` (see above).
        replicated: indices into ``inputs`` of the tensors that are the same on every rank
            and stand for one variable. Under ``objective="replicated"``, an input that is
            the same on every rank but not listed gets a ``UserWarning`` (it is checked as
            each rank's own variable, which reverses the verdict for a replicated activation).
        seed: seed of the weights ``w``.

    Returns:
        ``True`` (like ``torch.autograd.gradcheck``).

    Raises:
        AssertionError: on every rank, naming the rank(s), input and index of the first
            mismatches with the analytic and numerical values.
        ValueError / TypeError: bad arguments (non-float64 input, unknown objective, the
            ranks disagreeing on the inputs, no input requiring grad or only empty ones:
            nothing to check).

    Example::

        def test_my_op_gradient(world2):
            def f():
                x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
                return gradcheck(lambda t: dc.all_gather(t, dim=1).sin(), (x,))
            assert world2.run(f) == [True, True]
    """
    op = "testing.gradcheck"
    inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    if objective not in _OBJECTIVES:
        raise A.arg_error(op, "objective", f"one of {_OBJECTIVES}", repr(objective))
    diff = [i for i, t in enumerate(inputs) if isinstance(t, Tensor) and t.requires_grad]
    for i in diff:
        if inputs[i].dtype != torch.float64:
            raise A.arg_error(
                op,
                f"inputs[{i}]",
                "float64 (finite differences need it; use .double())",
                str(inputs[i].dtype),
            )
    rep = {A.check_int(i, op, "replicated") % max(len(inputs), 1) for i in replicated}
    for i in rep:
        if i not in diff:
            raise A.arg_error(op, "replicated", "indices of inputs that require grad", sorted(rep))
    pg = A.resolve_group(group, op)
    if _torch.local_tensor_mode_on():
        from ..backend.local_tensor import refuse

        raise refuse(op, _PROBE_WHY)
    backend = B.get_backend()
    world, rank = backend.world_size(pg), backend.rank(pg)

    # ---- sizes: every rank's number of elements per differentiable input ------------
    for row in ([len(inputs), len(diff), len(rep)], [*diff, *sorted(rep)]):
        agreed = _gather_rows(torch.tensor(row, dtype=torch.float64), pg)
        if not bool((agreed == agreed[0]).all()):
            raise A.arg_error(
                op,
                "inputs",
                "the same arguments on every rank (count, which require grad, which are replicated)",
                f"{agreed.tolist()} (one row per rank)",
            )
    if not diff:  # the ranks agree on it (compared just above): every rank refuses alike
        raise A.arg_error(
            op,
            "inputs",
            "at least one tensor with requires_grad=True (the ones checked; with none, nothing is)",
            "no input requiring grad",
        )
    numels_rows = _gather_rows(torch.tensor([inputs[i].numel() for i in diff], dtype=torch.float64), pg)
    numels = numels_rows.to(torch.int64).tolist()
    if not any(any(row) for row in numels):
        raise A.arg_error(
            op,
            "inputs",
            "a differentiable input with an element on some rank (with none, nothing is checked)",
            "every differentiable input empty on every rank",
        )
    for i_pos, i in enumerate(diff):
        if i in rep and any(numels[q][i_pos] != numels[0][i_pos] for q in range(world)):
            raise A.arg_error(
                op,
                f"inputs[{i}]",
                "the same size on every rank (it is replicated)",
                [n[i_pos] for n in numels],
            )

    if objective == "replicated" and world > 1:
        _warn_unlisted_replicated(inputs, diff, rep, numels, pg, op)

    base = [
        t.detach().clone(memory_format=torch.contiguous_format) if isinstance(t, Tensor) else t
        for t in inputs
    ]

    def objective_value(args: list[Any]) -> float:
        outs = _flatten_outputs(fn(*args))
        local = sum(
            (_inner(o.detach(), w) for o, w in zip(outs, weights)), torch.zeros((), dtype=torch.float64)
        )
        total = _sum_over_ranks([local.item()], pg).item()
        return total if objective == "sum" else total / world

    # ---- analytic gradients at the base point -----------------------------------------
    # twice: with the inputs as given (contiguous copies) and with the same values laid
    # out non-contiguously, the gradients reaching fn's outputs strided too (a backward
    # wrong only for a strided tensor is a classic silent bug); one more forward and
    # backward, next to the 2 evaluations per element of the probes. Each pass also tells
    # whether fn changed an input, or a backward its incoming gradient, in place.
    weights: list[Tensor] = []
    analytic: list[Tensor] = []
    analytic_nc: list[Tensor] = []
    touched = 0  # bit 1: fn changed an input in place; bit 2: a backward its incoming gradient
    for layout in (0, 1):
        lay = (lambda t: t) if layout == 0 else strided
        xs = [
            lay(t.detach().clone(memory_format=torch.contiguous_format)) if isinstance(t, Tensor) else t
            for t in inputs
        ]
        for i in diff:
            xs[i].requires_grad_(True)

        def give(g: Tensor, lay: Callable[[Tensor], Tensor] = lay) -> Tensor:
            return lay(g.clone())

        with torch.enable_grad():
            outs = _flatten_outputs(fn(*xs))
            if layout == 0:
                weights = _weights(outs, seed + (1_000_003 * rank if objective == "sum" else 0))
                if objective == "replicated":
                    for k, o in enumerate(outs):
                        hint = "With objective='replicated', fn must return the replicated loss."
                        try:
                            check_replicated(
                                o, f"{op}(objective='replicated')", f"output {k} of fn", hint, pg
                            )
                        except CrossRankMismatchError as exc:
                            raise AssertionError(str(exc)) from None
            for o in outs:
                if o.requires_grad:
                    o.register_hook(give)
            watch = GradientWatch(outs)
            j_local = sum((_inner(o, w) for o, w in zip(outs, weights)), torch.zeros((), dtype=torch.float64))
            leaves = [xs[i] for i in diff]
            grads = (
                torch.autograd.grad(j_local, leaves, allow_unused=True)
                if j_local.requires_grad
                else [None] * len(leaves)
            )
        if any(
            isinstance(t, Tensor) and bool(_changed(t.detach(), inputs[i].detach())) for i, t in enumerate(xs)
        ):
            touched |= 1
        if bool(watch.changed()):
            touched |= 2
        got = [torch.zeros_like(leaf) if g is None else g.detach() for leaf, g in zip(leaves, grads)]
        for i_pos, i in enumerate(diff):
            if i in rep and objective == "sum":
                summed = _sum_over_ranks(got[i_pos].reshape(-1), pg)
                got[i_pos] = summed.reshape(got[i_pos].shape).to(got[i_pos].dtype)
        (analytic if layout == 0 else analytic_nc).extend(got)

    # ---- numerical gradients, one probe at a time, in lockstep --------------------------
    numeric = [torch.zeros(a.shape, dtype=a.dtype) for a in analytic]
    probe_args = [
        t.clone(memory_format=torch.contiguous_format) if isinstance(t, Tensor) else t for t in base
    ]
    with torch.no_grad():
        for i_pos, i in enumerate(diff):
            owners = [None] if i in rep else list(range(world))
            for q in owners:
                n = numels[0 if q is None else q][i_pos]
                mine = q is None or q == rank
                flat = probe_args[i].view(-1)
                for k in range(n):
                    orig = flat[k].item() if mine else 0.0
                    values = []
                    for step in (eps, -eps):
                        if mine:
                            flat[k] = orig + step
                        values.append(objective_value(probe_args))
                        if mine:
                            flat[k] = orig
                    if mine:
                        numeric[i_pos].view(-1)[k] = (values[0] - values[1]) / (2 * eps)

    # ---- compare on each rank, then agree on one verdict ------------------------------
    count, worst, first = 0, 0.0, None
    for i_pos, i in enumerate(diff):
        n = numeric[i_pos].reshape(-1)
        bads = []
        for layout, a in enumerate((analytic[i_pos].reshape(-1), analytic_nc[i_pos].reshape(-1))):
            bads.append((layout, a, ~((a - n).abs() <= atol + rtol * n.abs())))  # NaN fails
        bad = bads[0][2] | bads[1][2]
        if bool(bad.any()):
            count += int(bad.sum())
            worst = max(worst, *(float((a - n)[b].abs().max()) for _, a, b in bads if bool(b.any())))
            if first is None:
                k = int(bad.nonzero()[0, 0])
                layout, a, _ = next(x for x in bads if bool(x[2][k]))
                idx = torch.unravel_index(torch.tensor(k), inputs[i].shape) if inputs[i].dim() else ()
                first = (i, k, float(a[k]), float(n[k]), [int(v) for v in idx], layout)
    local = torch.full((15,), -1.0, dtype=torch.float64)
    local[0], local[1], local[14] = count, worst, touched
    if first is not None:
        local[2], local[3], local[4], local[5] = first[0], first[1], first[2], first[3]
        local[6] = len(first[4])
        local[7 : 7 + min(6, len(first[4]))] = torch.tensor(first[4][:6], dtype=torch.float64)
        local[13] = first[5]
    table = _gather_rows(local, pg)
    for bit, what in (
        (1, "fn modified an input in place"),
        (2, "a backward modified its incoming gradient in place"),
    ):
        ranks = [q for q in range(world) if int(table[q, 14]) & bit]
        if ranks:
            raise AssertionError(
                f"diffcomm.testing.gradcheck(objective={objective!r}): {what} on rank(s) {ranks}; "
                "a function must leave its inputs, and a backward its incoming gradient, unchanged "
                "(autograd may pass the same gradient tensor to another backward)"
            )
    failed = [q for q in range(world) if table[q, 0] > 0]
    if failed:
        lines = []
        for q in failed:
            r = table[q].tolist()
            index = tuple(int(v) for v in r[7 : 7 + int(r[6])])
            how = " (inputs and gradients non-contiguous: the same values, strided)" if r[13] == 1 else ""
            lines.append(
                f"rank {q}: {int(r[0])} element(s) differ (max abs error {r[1]:.3g}); first: "
                f"inputs[{int(r[2])}]{list(index)} (flat {int(r[3])}): analytic{how} {r[4]!r}, "
                f"numerical {r[5]!r}"
            )
        where = "replicated inputs are compared on every rank; " if rep else ""
        raise AssertionError(
            f"diffcomm.testing.gradcheck(objective={objective!r}): analytic and numerical gradients "
            f"differ on rank(s) {failed} ({where}eps={eps:g}, atol={atol:g}, rtol={rtol:g}):\n  "
            + "\n  ".join(lines)
        )
    return True
