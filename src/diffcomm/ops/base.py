"""The base every differentiable communication op stands on: :class:`CommOp`.

An op states four things and the base derives the rest (JAX's ``ad.deflinear2`` and
batching rules, as one ``torch.autograd.Function`` family):

``run(x, *args)``
    the raw forward over the backend — **the one place the op launches communication**
    (an asynchronous variant wraps exactly this call). ``x`` is the only tensor argument;
    ``args`` are plain values (ints, strings, tuples, the resolved group). The base
    writes ``forward`` around it (same parameters), which names the op for the comms
    logger and the flight recorder while it runs.
``transpose(g, *args)``
    the adjoint applied to an output gradient ``g``, built from differentiable diffcomm
    ops (the dual op's Function), so double backward and nested transforms work.
``dims``
    positions in ``args`` that are tensor dimensions; the batching rule moves the vmap
    batch dim to the front and shifts these by one (one communication for the batch).
    ``elementwise = True`` instead keeps the batch dim where it is (the op acts on every
    element alike: all_reduce, broadcast, reduce).
``name`` / ``label(*args)``
    what the comms logger and the flight recorder call the op.
``shapes`` (optional)
    positions in ``args`` that are shapes of a tensor the op makes (sendrecv's received
    shape); the batching rule puts the batch size in front of them.

Generated from them: ``forward``, ``setup_context`` (the arguments kept on the autograd context),
``backward`` (``transpose`` of the gradient, with ``None`` for every non-tensor argument),
``jvp`` (the same linear op on the tangent), ``vmap`` (see ``dims``), the cheap eager
``apply`` and the jvp-free twin ``torch.compile`` traces (:func:`fn`).

An op may state ``jvp`` or ``vmap`` itself; the base then keeps that rule (``send`` /
``recv``: forward mode is an error, and the token of a batched send is not batched).
``x`` may also be a mere anchor (``recv``: an empty tensor that requires grad, so the
output has a ``grad_fn``; the data a posted receive already holds rides along in ``args``,
an input that gets no gradient) and ``transpose`` may return ``None`` for it; ``transpose``
may be one-sided (``send``'s receives what the peer's ``recv`` transpose sends).

Nonlinear reductions (max / min / product) are linear maps composed with an elementwise
weight ``w = dy/dx`` at the point. An op supports them with two hooks:
``linearize(args)`` returns the arguments of the linear op to use instead (``op="sum"``),
or ``None`` when ``args`` already describe a linear op; ``weight(x, y, *args)`` returns
``w``. Then backward is ``transpose(g, *linear_args) * conj(w)`` and the tangent is
``forward_linear(t * w)``; ``x`` and ``y`` are saved only for those ops.
"""

from __future__ import annotations

# Size: ~655 lines, over the ~600 guideline: the op base is one piece (the facts an op
# states, and forward, backward, jvp, vmap and the compile twin derived from them, with
# the fast path and the spmd_types path of ``apply``); split, each half would need the other.
from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import _torch
from .. import backend as B
from .._replication import spmd_types_checking
from ..backend import args as A
from ..backend.local_tensor import refuse
from ..diagnostics.logger import nest as _nest
from . import engine as _async
from . import registry as _registry
from .registry import OpFacts

__all__ = [
    "CommOp",
    "FastFunction",
    "ListOp",
    "apply",
    "call",
    "list_args",
    "fn",
    "only_on",
    "batch_first",
    "movedim0",
    "op_labels",
    "IdentityFunction",
]


class IdentityFunction(torch.autograd.Function):
    """An identity in forward (a view of the first input; the other inputs only ride
    along) that exists for its ``backward``: a subclass states only that (a mark on a
    gradient, an entry that states a typing rule). Not a communication op."""

    @staticmethod
    def forward(x: Tensor, *args: Any) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        pass


class FastFunction(torch.autograd.Function):
    """A ``torch.autograd.Function`` with a cheaper ``apply`` in plain eager mode.

    ``torch.autograd.Function.apply`` binds default arguments with ``inspect.signature``
    on every call (tens of microseconds). Our ``forward``s are always called with every
    argument positionally, so in eager mode without torch.func transforms we go straight
    to the C++ ``apply``; under transforms or torch.compile the full path is used.
    """

    #: torch's C++ ``apply`` bound to this class (``c_apply(*args)``; see :func:`apply`).
    c_apply: ClassVar[Any]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.c_apply = _c_apply.__get__(None, cls)

    @classmethod
    def apply(cls, *args: Any) -> Any:
        # Inside a traced frame dynamo handles ``X.apply(...)`` itself and never runs this
        # method. It only enters it as a frame of its own when eager code runs under an
        # active torch.compile (after a graph break), and it cannot trace ``super().apply``
        # ("AutogradFunctionVariable() is not a constant"): so run it eagerly (~1 us).
        # While spmd_types checks (it replaced ``Function.apply``; dc.spmd_check's own
        # wrapper is looked through), take the full path, where spmd_types types the op.
        if (
            _transforms_active()
            or _compiling()
            or (type(_FUNCTION_ATTRS["apply"]) is not classmethod and spmd_types_checking(_FUNCTION_ATTRS))
        ):
            return super().apply(*args)
        if _async.launching(cls):  # async_op=True, or an asynchronous op's backward
            return _async.launch_fn(cls, args)
        return _c_apply(cls, _unwrap_if_dead(args[0]), *args[1:])


_transforms_active = _torch.transforms_active
_c_apply = _torch.c_apply  # the C++ apply, called as (cls, *args)
_unwrap_if_dead = _torch.unwrap_if_dead

_fwad = torch.autograd.forward_ad
#: ``torch.autograd.Function``'s own attributes (a live view): while ``spmd_types`` checks
#: (``spmd_types.checker.typecheck()``), its ``apply`` is spmd_types' descriptor, not the
#: classmethod, and every apply takes that full path, where spmd_types reads the Function's
#: ``spmd_typecheck`` rule. One dict lookup and a type test on the hot path otherwise
#: (``spmd_types`` itself is never imported here).
_FUNCTION_ATTRS = torch.autograd.Function.__dict__
_compiling = _torch.compiling  # the one compile check (one frame; dynamo folds it to True)
_get_label, _set_label, _reset_label = B.LABEL.get, B.LABEL.set, B.LABEL.reset
_grad_enabled = torch.is_grad_enabled
_ASYNC_ACTIVE = _async.ACTIVE


def apply(fn_cls: Any, *args: Any, async_op: bool = False) -> Any:
    """Apply the op ``fn_cls`` to ``(x, *args)`` from a public function: **the** way an op
    is applied (inside its rules, :func:`call`).

    In plain eager mode this goes straight to the C++ ``apply`` (no ``inspect`` binding of
    defaults, no dynamo-disable wrapper around a classmethod: a few microseconds on every
    call). Under a torch.func transform or while dynamo traces, the full ``apply`` of the
    Function (its compile twin while compiling). The compile test comes first
    (:func:`diffcomm._torch.compiling`): while dynamo traces this frame it is a constant
    and the rest is never traced. ``async_op=True`` launches the op on the communication engine
    where that is possible (not under ``torch.func`` / ``torch.compile``: then it runs
    blocking); so does applying it inside the backward of an asynchronous op.
    """
    if async_op:
        if fn_cls.out_shape is None:  # never a silent blocking run
            raise TypeError(
                f"diffcomm.{fn_cls.name}(): async_op=True needs the op's output shape before it "
                f"communicates; {fn_cls.__qualname__} states no `out_shape`"
            )
        if _torch.local_tensor_mode_on():
            raise refuse(
                f"{fn_cls.name}(async_op=True)",
                "an asynchronous op runs on diffcomm's communication thread, and the "
                "simulated ranks have no transport to overlap (call it with async_op=False)",
            )
        with _async.async_if(True):
            return apply(fn_cls, *args)
    if _compiling() or _transforms_active() or type(_FUNCTION_ATTRS["apply"]) is not classmethod:
        return fn(fn_cls).apply(*args)
    if _ASYNC_ACTIVE[0] and _async.launching(fn_cls):
        return _async.launch_fn(fn_cls, args)
    x = _unwrap_if_dead(args[0])
    if x is not args[0]:  # a tensor that escaped a finished torch.func transform
        args = (x, *args[1:])
    return fn_cls.c_apply(*args)  # the tuple as it came: no list built for the call


def call(fn_cls: Any, *args: Any) -> Tensor:
    """Apply the op ``fn_cls`` to ``(x, *rest)`` inside a rule (a transpose, a tangent).

    When nothing needs recording — grad mode off (a backward without ``create_graph``),
    no torch.func transform, no forward-AD level, not tracing — the op's ``forward`` runs
    directly: the autograd node would never be used. Otherwise (double backward,
    ``torch.func``, ``torch.compile``) the full differentiable ``apply``. Inside the
    backward of an asynchronous op it is launched on the communication engine.
    """
    recording = _grad_enabled() or _transforms_active() or _fwad._current_level >= 0
    if recording or _compiling():
        return fn(fn_cls).apply(*args)  # while compiling: the twin
    if _ASYNC_ACTIVE[0] and _async.launching(fn_cls):  # an asynchronous op's backward: the dual
        return _async.launch_fn(fn_cls, args)
    return fn_cls.forward(*args)  # (the varargs tuple passed on whole: no list built)


class _Op(FastFunction, OpFacts):
    """What every op class shares, single or list: a subclass that defines ``transpose``
    gets its autograd rules written when the class is created (``_derive``, per kind of
    op); one that states a ``family`` is registered (:mod:`diffcomm.ops.registry`; the
    facts it may state are :class:`~diffcomm.ops.registry.OpFacts`)."""

    generate_vmap_rule = False
    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "transpose" in cls.__dict__:
            cls._derive(cls)
        if "family" in cls.__dict__:
            _registry.add(cls)

    @staticmethod
    def _derive(cls: Any) -> None:  # pragma: no cover - stated by CommOp and ListOp
        raise NotImplementedError


class CommOp(_Op):
    """Base of the communication ops' autograd Functions (see the module docstring).

    A subclass that defines ``transpose`` gets its autograd rules generated when the
    class is created; every rule refers to the op's own functions through closures (dynamo
    can call those, not look up a Function's class attributes). A subclass that states a
    ``family`` is registered (:mod:`diffcomm.ops.registry`; the facts it may state are
    :class:`~diffcomm.ops.registry.OpFacts`).
    """

    dims: ClassVar[tuple[int, ...]] = ()
    shapes: ClassVar[tuple[int, ...]] = ()
    elementwise: ClassVar[bool] = False

    @staticmethod
    def _derive(cls: Any) -> None:
        _derive_rules(cls)

    @staticmethod
    def label(*args: Any) -> str:  # pragma: no cover - replaced per op
        raise NotImplementedError

    @classmethod
    def shapes_for(cls, args: tuple[Any, ...]) -> Any:
        """``out_shape`` of the Function arguments ``args`` (the async engine's question)."""
        return cls.out_shape(*args)

    linearize: ClassVar[Any] = None
    weight: ClassVar[Any] = None


def nest_label(text: str) -> Any:
    """Enter op label ``text`` (the context variable the comms logger and the flight
    recorder read), nested under the label in force (``"outer -> text"``: an op's
    backward, or the dual it calls); returns the token for ``LABEL.reset``. The one place
    labels nest: every op's forward and backward, single and list, goes through it."""
    return _set_label(_nest(_get_label(), text))


#: ``label + " backward"`` per forward label, made once (the labels are a few dozen
#: strings; the table is emptied should a program make thousands).
_BACKWARD_TEXT: dict[str, str] = {}


def _backward_text(label: str) -> str:
    if len(_BACKWARD_TEXT) > 4096:
        _BACKWARD_TEXT.clear()
    text = _BACKWARD_TEXT[label] = label + " backward"
    return text


def _derive_rules(cls: Any) -> None:
    """Write ``forward`` / ``setup_context`` / ``backward`` / ``jvp`` / ``vmap`` and the
    compile twin."""
    transpose = cls.__dict__["transpose"].__func__
    run = cls.__dict__["run"].__func__
    params = run.__code__.co_varnames[: run.__code__.co_argcount]
    nones = (None,) * (len(params) - 1)  # every argument after the tensor
    name = cls.name
    label = cls.__dict__["label"].__func__ if "label" in cls.__dict__ else None
    linearize = cls.linearize
    weight = cls.weight
    dims = frozenset(cls.dims)
    shapes = frozenset(cls.shapes)
    elementwise = cls.elementwise
    cls.forward = staticmethod(_labelled_forward(run, params, name, label))
    backward_name = name + " backward"

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        args = inputs[1:]
        ctx.args = args
        ctx.linear = None
        if linearize is not None:
            lin = linearize(args)
            if lin is not None:
                ctx.linear = lin
                ctx.save_for_backward(inputs[0], output)
                ctx.save_for_forward(inputs[0], output)

    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        if _compiling():
            return _backward(ctx, g)
        if label is not None:  # inline: the hot path
            text = label(*ctx.args)
            text = _BACKWARD_TEXT.get(text) or _backward_text(text)
        else:
            text = backward_name
        token = nest_label(text)
        try:
            if ctx.linear is None:  # tuples joined, not (g, *args): that builds a list first
                return (transpose(*(g,) + ctx.args),) + nones
            return _backward(ctx, g)
        finally:
            _reset_label(token)

    def _backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        if ctx.linear is None:
            return (transpose(g, *ctx.args), *nones)
        x, y = ctx.saved_tensors
        w = weight(x, y, *ctx.args)
        return (transpose(g, *ctx.linear) * w.conj(), *nones)

    def jvp(ctx: Any, t: Tensor, *_: Any) -> Tensor:
        if ctx.linear is None:
            return call(cls, t, *ctx.args)
        x, y = ctx.saved_tensors
        return call(cls, t * weight(x, y, *ctx.args), *ctx.linear)

    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, *args: Any) -> tuple[Tensor, int]:
        if elementwise:  # the batch dim is just another dim: one collective
            return call(cls, x, *args), in_dims[0]
        bdim = in_dims[0]
        xb = x if bdim is None or bdim == 0 else x.movedim(bdim, 0)
        moved = tuple(a + 1 if i in dims else a for i, a in enumerate(args))
        if shapes:
            moved = tuple(torch.Size((xb.shape[0], *a)) if i in shapes else a for i, a in enumerate(moved))
        return call(cls, xb, *moved), 0

    cls.setup_context = staticmethod(setup_context)
    cls.backward = staticmethod(backward)
    if "jvp" not in cls.__dict__:  # a rule the op states itself is kept
        cls.jvp = staticmethod(jvp)
    if "vmap" not in cls.__dict__:
        cls.vmap = staticmethod(vmap)
    # while compiling, only the twin is applied (see fn); its forward is the bare run (no
    # label: dynamo traces it, and a compiled graph has no logger or flight recorder)
    jvp_free_twin(cls).forward = staticmethod(run)


def _labelled_forward(run: Any, params: tuple[str, ...], name: str, label: Any) -> Any:
    """``forward`` with ``run``'s exact parameters (autograd reads them): sets the op's
    label around ``run`` as :func:`nest_label` does, written out in the template (this is
    every op's hot path: a call less per forward, ~0.5% of the Python work of a
    forward+backward; not a context manager either). It runs only eagerly: while
    compiling, :func:`apply` and :func:`call` apply the op's twin, whose forward is
    ``run`` itself (so no compile check here)."""
    args = ", ".join(params)
    rest = ", ".join(params[1:])
    text = f"_label({rest})" if label is not None else "_name"
    src = (
        f"def forward({args}):\n"
        f"    text = {text}\n"
        f"    outer = _get()\n"  # nest_label, inline
        f"    token = _set(outer + ' -> ' + text if outer else text)\n"
        f"    try:\n"
        # a conjugate / negative view (``z.conj()``, or the gradient of a loss that reads
        # ``y.conj()``) keeps its lazy bit through ``contiguous()``, and the transport
        # reads the raw memory: resolved here, once for every op and every dual (``recv``'s
        # anchor may be ``None``)
        f"        if {params[0]} is not None and ({params[0]}.is_conj() or {params[0]}.is_neg()):\n"
        f"            {params[0]} = {params[0]}.resolve_conj().resolve_neg()\n"
        f"        out = _run({args})\n"
        # a view of a buffer the op made becomes an alias the user may change in place
        # (_torch.not_a_view); tested inline: most results are no view (no call at all)
        f"        if type(out) is _Tensor and out._base is not None:\n"
        f"            return _own(out, {params[0]})\n"
        f"        return out\n"
        f"    finally:\n"
        f"        _reset(token)\n"
    )
    scope = {
        "_run": run,
        "_own": _torch.not_a_view,
        "_Tensor": torch.Tensor,
        "_label": label,
        "_name": name,
        "_get": B.LABEL.get,
        "_set": B.LABEL.set,
        "_reset": B.LABEL.reset,
    }
    # named inside the package, so the flight recorder's call-site walk steps over it
    code = compile(src, f"{__file__}:<{name} forward>", "exec")
    exec(code, scope)  # a fixed template over the op's own parameter names
    forward = scope["forward"]
    # the eager forward (the twin's is ``run``): a frame of its own under compile only when
    # eager code runs after a graph break, where its host-side protocol (size exchanges
    # through numpy) is no graph to trace
    _torch.run_eagerly_under_compile(forward.__code__)
    forward.__qualname__ = f"{run.__qualname__.rsplit('.', 1)[0]}.forward"
    forward.__module__ = run.__module__
    forward.__doc__ = run.__doc__
    return forward


def jvp_free_twin(fn_cls: Any) -> Any:
    """``fn_cls`` with ``jvp`` reset to torch's default, reachable as ``fn_cls._compiled()``.

    Dynamo refuses to trace an autograd.Function that defines a custom ``jvp``
    ("Unsupported custom jvp"). A compiled graph needs only forward and backward, so while
    compiling, the public ops apply this twin (same forward / setup_context / backward /
    vmap). Backward rules keep applying the originals: dynamo traces them without grad,
    where the check does not apply. (A staticmethod, because dynamo can call one on an
    autograd.Function class but cannot look a class up in a dict or compare it.)
    """
    twin = type(f"{fn_cls.__name__}Traced", (fn_cls,), {"jvp": staticmethod(torch.autograd.Function.jvp)})
    fn_cls._compiled = staticmethod(lambda: twin)
    return twin


def fn(fn_cls: Any) -> Any:
    """The autograd Function a public op applies: ``fn_cls``, or while ``torch.compile``
    traces, its twin without the custom ``jvp`` (see :func:`jvp_free_twin`)."""
    if not _compiling():
        return fn_cls
    if not _only_grad_transforms():
        raise RuntimeError(
            "diffcomm: torch.func.jvp / jvp-based transforms (jacfwd, forward_ad) and vmap "
            "cannot run inside a torch.compile'd function: dynamo ignores a custom "
            "autograd.Function's jvp and vmap rules and traces its forward instead, which "
            "would give wrong tangents and unbatched collectives. Apply the transform outside "
            "the compiled function, or leave that function uncompiled "
            "(torch.func.grad / vjp inside torch.compile are fine)."
        )
    return fn_cls._compiled()


def _only_grad_transforms() -> bool:
    """No forward-AD level and no functorch transform, or a single ``grad``/``vjp`` level,
    is active (traceable).

    Levels count from 1 at the outermost transform, so a grad at level 1 is alone.
    (Dynamo can read the top level's kind and number, not walk the stack below it.)
    """
    if _torch.forward_ad_level() >= 0:  # inside fwAD.dual_level()
        return False
    return not _torch.transforms_active() or _torch.only_grad_transform()


# ------------------------------------------------------------------------ small helpers


def op_labels(name: str) -> dict[str, str]:
    """``{reduce op: "<name>(<reduce op>)"}``, made once per op: a label is asked for on
    every call (the flight recorder keys its call-site cache by it, and the same string
    object keeps its hash)."""
    return {r: f"{name}({r})" for r in A.REDUCE_OPS}


def movedim0(x: Tensor, dim: int) -> Tensor:
    return x if dim == 0 else x.movedim(dim, 0)


def batch_first(x: Tensor, bdim: int | None) -> Tensor:
    """Move the vmap batch dim to the front."""
    return x if bdim is None or bdim == 0 else x.movedim(bdim, 0)


def only_on(x: Tensor, keep: bool | Tensor) -> Tensor:
    """``x`` where ``keep`` (a bool, or a 0-dim bool tensor: one per simulated rank under
    ``LocalTensorMode``) else exact zeros — still connected to ``x``'s graph, so the
    backward of whatever produced ``x`` runs on every rank (the SPMD rule).

    ``masked_fill``, not ``torch.where``: under ``LocalTensorMode`` forward-mode AD of
    ``where`` crashes inside torch (a segfault, or "Cannot access data pointer of Tensor
    that doesn't have storage"), so ``jvp`` of ``reduce(op="min")`` could not run there.
    A tensor that cannot carry a gradient takes ``torch.where``: torch has no
    ``masked_fill`` for uint16/32/64, and ``reduce(op="max")`` of one raised torch's
    NotImplementedError after the communication."""
    mask = keep if isinstance(keep, Tensor) else torch.tensor(keep, device=x.device)
    if not (x.is_floating_point() or x.is_complex()):
        return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.masked_fill(~mask, 0)


# ======================================================================================
# ListOp: the base of the list-in, list-out ops (the coalesced collectives)
# ======================================================================================


class ListOp(_Op):
    """Base of the coalesced ops' autograd Functions: :class:`CommOp` for a list of tensors.

    The Function's arguments are ``(xs[0], *meta, *xs[1:])`` (a tensor first, as autograd
    and torch.func want; :func:`list_args` builds them): applied, like every op, with
    :func:`apply` (public functions) and :func:`call` (rules).
    A subclass states:

    ``nmeta``
        the number of non-tensor arguments (``meta``: op, dims, src, the group ...);
    ``run(xs, *meta)``
        the raw forward over the whole list: one communication per dtype, the outputs as a
        tuple of tensors (the one place the op launches communication);
    ``transpose(ctx, gs, idx, *meta)``
        the adjoint applied to the output gradients ``gs`` of the differentiable positions
        ``idx`` (zeros where an output got none), built from :func:`call` of the dual
        list op, so double backward and nested transforms work (``ctx`` holds the saved
        tensors of a nonlinear op);
    ``dims``
        the position in ``meta`` of the per-tensor dims tuple (vmap shifts it by one and
        moves every batch dim to the front: one call for the whole batch), or ``None``
        for an elementwise op (the batch dims stay where they are);
    ``same_shapes``
        outputs shaped like the inputs (no output metadata kept);
    ``name`` / ``label(*meta)``
        what the comms logger and the flight recorder call it.

    Nonlinear ops (all_reduce max/min/product) set ``nonlinear(meta)``: then the inputs and
    outputs are saved and ``transpose`` / ``tangent(ctx, ts, *meta)`` read them from
    ``ctx.saved_tensors``.

    Generated: ``forward`` (labelled), ``setup_context``, ``backward`` (every rank runs the
    same dual op: gradients for the floating/complex inputs only, a dtype fact equal on
    every rank), ``jvp`` (the same op on the tangents), ``vmap``, the cheap eager
    ``apply`` and the compile twin.
    """

    nmeta: ClassVar[int] = 0
    dims: ClassVar[int | None] = None
    same_shapes: ClassVar[bool] = False
    nonlinear: ClassVar[Any] = None

    @staticmethod
    def _derive(cls: Any) -> None:
        _derive_list_rules(cls)

    @classmethod
    def shapes_for(cls, args: tuple[Any, ...]) -> Any:
        """``out_shape(xs, *meta)`` of the Function arguments ``args`` (the async engine's
        question): a list of shapes."""
        meta, xs = _logical(cls.nmeta, args)
        return cls.out_shape(xs, *meta)

    @classmethod
    def apply(cls, *args: Any) -> Any:  # run eagerly under compile as FastFunction.apply
        if _transforms_active() or _compiling() or type(_FUNCTION_ATTRS["apply"]) is not classmethod:
            return super(FastFunction, cls).apply(*args)
        if _async.launching(cls):
            return _async.launch_fn(cls, args)
        n = cls.nmeta
        rest = [_unwrap_if_dead(a) for a in args[n + 1 :]]
        return _c_apply(cls, _unwrap_if_dead(args[0]), *args[1 : n + 1], *rest)


_torch.disable_methods_when_dynamo_loads("apply", FastFunction, ListOp)  # dynamo: never trace


def list_args(xs: Any, *meta: Any) -> tuple[Any, ...]:
    """A list op's Function arguments, ``(xs[0], *meta, *xs[1:])``, from its tensors and its
    non-tensor arguments: what :func:`apply` and :func:`call` take for a :class:`ListOp`
    (``apply(_AllReduceList, *list_args(tensors, op, pg))``)."""
    return (xs[0], *meta, *xs[1:])


def _logical(n: int, args: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(xs[0], *meta, *xs[1:])`` -> ``(meta, xs)``. Dynamo, tracing a nested ``apply``
    without grad, passes a ctx first to a ``forward`` with ``*args``: it is dropped."""
    if isinstance(args[0], torch.autograd.function.FunctionCtx):
        args = args[1:]
    return tuple(args[1 : n + 1]), (args[0], *args[n + 1 :])


def _zeros_for(meta: Any, ts: Any) -> list[Tensor]:
    """``None`` (no gradient / tangent) becomes zeros shaped like ``meta``."""
    return [torch.zeros(s, dtype=d, device=v) if t is None else t for t, (s, d, v) in zip(ts, meta)]


def _derive_list_rules(cls: Any) -> None:
    run = cls.__dict__["run"].__func__
    transpose = cls.__dict__["transpose"].__func__
    n = cls.nmeta
    name = cls.name
    label = cls.__dict__["label"].__func__ if "label" in cls.__dict__ else None
    dims_at = cls.dims
    same_shapes = cls.same_shapes
    nonlinear = cls.nonlinear
    tangent: Any = cls.__dict__["tangent"].__func__ if "tangent" in cls.__dict__ else None
    nones = (None,) * n

    def text(meta: tuple[Any, ...]) -> str:
        return label(*meta) if label is not None else name

    def forward(x0: Tensor, *args: Any) -> tuple[Tensor, ...]:
        meta, xs = _logical(n, (x0, *args))
        if _compiling():
            return tuple(run(xs, *meta))
        token = nest_label(text(meta))
        try:
            return tuple(run(xs, *meta))
        finally:
            _reset_label(token)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        meta, xs = _logical(n, inputs)
        ctx.args = meta
        ctx.meta = [(x.shape, x.dtype, x.device) for x in xs]
        ctx.out_meta = ctx.meta if same_shapes else [(y.shape, y.dtype, y.device) for y in output]
        ctx.nonlinear = nonlinear is not None and nonlinear(meta)
        if ctx.nonlinear:
            ctx.save_for_backward(*xs, *output)
            ctx.save_for_forward(*xs, *output)

    def backward(ctx: Any, *gs: Tensor) -> tuple[Any, ...]:
        idx = [i for i, (_, d, _) in enumerate(ctx.meta) if d.is_floating_point or d.is_complex]
        res: list[Any] = [None] * len(gs)
        if idx:
            g_in = _zeros_for([ctx.out_meta[i] for i in idx], [gs[i] for i in idx])
            if _compiling():
                outs = transpose(ctx, g_in, idx, *ctx.args)
            else:
                token = nest_label(text(ctx.args) + " backward")
                try:
                    outs = transpose(ctx, g_in, idx, *ctx.args)
                finally:
                    _reset_label(token)
            for i, g in zip(idx, outs):
                res[i] = g
        return (res[0], *nones, *res[1:])

    def jvp(ctx: Any, *ts: Any) -> tuple[Tensor, ...]:
        tangents = _zeros_for(ctx.meta, _logical(n, ts)[1])
        if ctx.nonlinear:
            return tuple(tangent(ctx, tangents, *ctx.args))
        return tuple(call(cls, *list_args(tangents, *ctx.args)))

    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        meta, xs = _logical(n, args)
        bdims = _logical(n, in_dims)[1]
        if dims_at is None:  # elementwise: the batch dims are just more elements
            return call(cls, *list_args(xs, *meta)), bdims
        xb = []
        for x, d in zip(xs, bdims):
            if d is None:
                xb.append(x.unsqueeze(0).expand(info.batch_size, *x.shape))
            else:
                xb.append(x if d == 0 else x.movedim(d, 0))
        meta = tuple(tuple(d + 1 for d in m) if i == dims_at else m for i, m in enumerate(meta))
        return call(cls, *list_args(xb, *meta)), (0,) * len(xs)

    def c_apply(*args: Any) -> Any:  # apply's eager path: every list tensor unwrapped
        return _c_apply(cls, *args[: n + 1], *[_unwrap_if_dead(a) for a in args[n + 1 :]])

    cls.forward = staticmethod(forward)
    cls.setup_context = staticmethod(setup_context)
    cls.backward = staticmethod(backward)
    cls.jvp = staticmethod(jvp)
    cls.vmap = staticmethod(vmap)
    cls.c_apply = staticmethod(c_apply)
    jvp_free_twin(cls)
