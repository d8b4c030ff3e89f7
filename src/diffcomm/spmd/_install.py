"""What ``dc.spmd_check`` installs while a check is active, and removes when the last one
exits: the typed forwards of every class that states a rule, the module pre-hook, the
optimizer step pre-hook, ``dc.get_rank`` returning a :class:`RankInt`, the user-Function
``apply`` (rules for a user's own autograd Functions: :func:`register_function`), and the
reading of spmd_types' ``assert_type``. The active checks (``_ACTIVE``) live here; the
check itself is :class:`diffcomm.spmd.check.SPMDCheck`."""

# Size: ~710 lines, over the ~600 guideline: every patch a check installs, and the rules
# of the Functions it types through them (a user's, torch.distributed.nn's, debug mode's
# check of a user rule), in one place.

from __future__ import annotations

import importlib
import inspect
import sys
import threading
import warnings
from collections.abc import Iterable
from dataclasses import replace as _dc_replace
from typing import Any

import torch
from torch import Tensor

from .. import _replication as T_
from .. import _torch
from .._replication import PARTIAL, REPLICATED, LayerRule, R, Rule, SPMDTypeError, T, V
from ..ops import engine as E
from ..ops.base import CommOp, ListOp
from ._ops import SEEDED_BY_RANK, RankGenerator, RankInt, _rank_dependent
from ._records import _Param, _Rec, _site, _user_frame

_ACTIVE: list[Any] = []  # the active checks (SPMDCheck), outermost first
_PATCHED: dict[type, tuple[Any, Any]] = {}  # class -> (original forward, its __dict__ entry)
_PATCHED_ATTRS: list[tuple[Any, str, Any]] = []  # (module, name, original value)
_LOCK = threading.Lock()
_HOOK: Any = None
_OPT_HOOK: list[Any] = [None]  # the optimizer step pre-hook (check_grads before every step)


# ======================================================================================
# installing the typed forwards and the module hook
# ======================================================================================


def _subclasses(cls: type) -> Iterable[type]:
    s: type
    for s in cls.__subclasses__():
        yield s
        yield from _subclasses(s)


def _op_name(cls: type, qualified: bool = False) -> str:
    """The op's ``name`` (a CommOp's), else the class's (a plain autograd Function)."""
    name = getattr(cls, "name", "")
    if isinstance(name, str) and name:
        return name
    if qualified:
        return f"{cls.__module__.removeprefix('diffcomm.')}.{cls.__name__}"
    return cls.__name__.lstrip("_")


def typed_functions() -> list[type]:
    """Every autograd Function class of diffcomm that states a :class:`Rule` (``spmd``)."""
    importlib.import_module("diffcomm.parallel")
    seen: dict[type, None] = {}
    for c in _subclasses(torch.autograd.Function):
        if isinstance(c.__dict__.get("spmd"), Rule) and c.__module__.startswith("diffcomm"):
            seen[c] = None
    return list(seen)


def typed_layers() -> list[type]:
    """Every ``nn.Module`` class of diffcomm that states a :class:`LayerRule` (``spmd``)."""
    importlib.import_module("diffcomm.parallel")
    return [
        c
        for c in dict.fromkeys(_subclasses(torch.nn.Module))
        if isinstance(c.__dict__.get("spmd"), LayerRule) and c.__module__.startswith("diffcomm")
    ]


def _param_names(cls: type, orig: Any) -> tuple[str, ...]:
    if issubclass(cls, CommOp | ListOp):
        run = cls.__dict__["run"].__func__
        return run.__code__.co_varnames[: run.__code__.co_argcount]
    return tuple(inspect.signature(orig).parameters)


def _make_forward(cls: type, orig: Any, rule: Rule) -> Any:
    names = _param_names(cls, orig)
    is_list = issubclass(cls, ListOp)
    nmeta = getattr(cls, "nmeta", 0)
    has_ctx = bool(names) and names[0] == "ctx"

    def forward(*args: Any) -> Any:
        checks = [c for c in _ACTIVE if not c.off]
        if not checks:
            return orig(*args)
        return _run_typed(checks, cls, rule, names, is_list, nmeta, has_ctx, args, lambda: orig(*args))

    forward.__wrapped__ = orig  # type: ignore[attr-defined]
    forward._spmd_spec = (names, is_list, nmeta, has_ctx)  # type: ignore[attr-defined]
    return forward


def _run_typed(
    checks: list[Any],  # SPMDCheck (spmd.check imports this module)
    cls: type,
    rule: Rule,
    names: tuple[str, ...],
    is_list: bool,
    nmeta: int,
    has_ctx: bool,
    args: tuple[Any, ...],
    call: Any,
) -> Any:
    """Check ``rule`` on ``args`` (``cls.forward``'s arguments), run ``call()`` with the
    inner ops untyped, type its outputs."""
    if is_list:  # (x0, *meta, *xs[1:]); names = (xs, *meta)
        bound = dict(zip(names[1:], args[1 : nmeta + 1]))
        tensors = [(f"{names[0]}[{i}]", t) for i, t in enumerate((args[0], *args[nmeta + 1 :]))]
    else:
        a = args[1:] if has_ctx and len(args) == len(names) else args
        pn = names[1:] if has_ctx else names
        bound = dict(zip(pn, a))
        pos = rule.tensors if rule.tensors is not None else (0,)
        tensors = [(pn[i], a[i]) for i in pos if i < len(a) and isinstance(a[i], Tensor)]
    plans = [(c, c.op_before(cls, rule, bound, tensors)) for c in checks]
    for c in checks:
        c.inside += 1
    try:
        out = call()
    finally:
        for c in checks:
            c.inside -= 1
    ins = {id(t) for _, t in tensors}
    if isinstance(out, Tensor):
        if id(out) in ins:
            out = out.view_as(out)
        outs: list[Any] = [out]
    else:
        out = tuple(o.view_as(o) if isinstance(o, Tensor) and id(o) in ins else o for o in out)
        outs = list(out) if rule.outputs is not None else [o for o in out if isinstance(o, Tensor)]
    for c, plan in plans:
        c.op_after(plan, outs)
    return out


def _typed_launch(orig: Any) -> Any:
    """``_LaunchFn.forward`` (an asynchronous op launched on the engine): typed by the
    launched op's rule; its AsyncTensor outputs carry the types (``wait`` passes them on)."""

    def forward(ctx: Any, cls: type, args: tuple[Any, ...], pos: tuple[int, ...], *tensors: Tensor) -> Any:
        checks = [c for c in _ACTIVE if not c.off]
        fwd = cls.__dict__.get("forward")
        spec = getattr(getattr(fwd, "__func__", fwd), "_spmd_spec", None)
        if not checks or spec is None:
            return orig(ctx, cls, args, pos, *tensors)
        names, is_list, nmeta, has_ctx = spec
        rule = cls.__dict__["spmd"]
        launch_it = lambda: orig(ctx, cls, args, pos, *tensors)
        return _run_typed(checks, cls, rule, names, is_list, nmeta, has_ctx, args, launch_it)

    return forward


def _install() -> None:
    global _HOOK
    for cls in typed_functions():
        entry = cls.__dict__["forward"]
        orig = entry.__func__ if isinstance(entry, staticmethod) else entry
        _PATCHED[cls] = (orig, entry)
        setattr(cls, "forward", staticmethod(_make_forward(cls, orig, cls.__dict__["spmd"])))  # noqa: B010
    # the asynchronous ops' mechanism: the launch is typed by the launched op's rule, and
    # AsyncTensor.wait() passes the type on to the finished tensor
    launch = E._LaunchFn
    entry = launch.__dict__["forward"]
    _PATCHED[launch] = (entry.__func__, entry)
    setattr(launch, "forward", staticmethod(_typed_launch(entry.__func__)))  # noqa: B010
    wait_entry = E.AsyncTensor.__dict__["wait"]
    _PATCHED[E.AsyncTensor] = (wait_entry, wait_entry)

    def wait(self: Any) -> Any:
        out = wait_entry(self)
        if out is not self:
            for c in _ACTIVE:
                r = self.__dict__.get(c.key)
                if r is not None:
                    out.__dict__[c.key] = r
        return out

    setattr(E.AsyncTensor, "wait", wait)  # noqa: B010 - a method replaced for the check
    T_.HOOK[0] = _Hooks
    from ..runtime import world as W

    diffcomm = sys.modules[__name__.split(".")[0]]  # the package (dc.get_rank), imported already

    _PATCHED_ATTRS.append((diffcomm, "get_rank", vars(diffcomm).get("get_rank", W.get_rank)))
    _patch_rank_reader(W, "get_rank")
    setattr(diffcomm, "get_rank", W.get_rank)  # noqa: B010  # (the same reader)
    # torch.distributed's ways of reading the rank too: rows sliced with them were
    # replicated to the check, so a data-parallel step that never reduced its gradients
    # passed (the replicas drift)
    import torch.distributed as dist

    _patch_rank_reader(dist, "get_rank")
    if dist.is_available():
        from torch.distributed import distributed_c10d as c10d
        from torch.distributed.device_mesh import DeviceMesh

        _patch_rank_reader(c10d, "get_rank")  # the same function, imported by name elsewhere
        _patch_rank_reader(dist.ProcessGroup, "rank")  # group.rank()
        for name in ("get_rank", "get_local_rank", "get_coordinate"):  # DeviceMesh's
            _patch_rank_reader(DeviceMesh, name)
    _patch_raw_all_reduce()

    def pre_hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        for c in _ACTIVE:
            if not c.off:
                c.module_pre(module, args)

    _HOOK = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)

    def step_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        # no wrong gradient reaches an optimizer step inside the block
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for c in _ACTIVE:
            if not c.off and c._check_grads:
                c.check_grads(params)

    _PATCHED_ATTRS.append((torch.autograd.Function, "apply", torch.autograd.Function.__dict__["apply"]))
    torch.autograd.Function.apply = _UserApply(torch.autograd.Function.__dict__["apply"])  # type: ignore[method-assign,assignment]

    # a default generator seeded from the rank draws per-rank values (varying)
    orig_seed = torch.manual_seed
    _PATCHED_ATTRS.append((torch, "manual_seed", orig_seed))

    def manual_seed(seed: Any) -> Any:
        SEEDED_BY_RANK[0] = _rank_dependent((seed,))
        return orig_seed(seed)

    manual_seed.__doc__ = orig_seed.__doc__
    torch.manual_seed = manual_seed
    # (the same function as torch.random.manual_seed: a seed set there, unseen, was judged by
    # comparing the initial seed with this rank's own at the entry: per-rank values, so a seed
    # equal to one rank's entry seed typed that rank's draws varying alone)
    _PATCHED_ATTRS.append((torch.random, "manual_seed", torch.random.manual_seed))
    torch.random.manual_seed = manual_seed
    orig_nondet = torch.seed  # a non-deterministic seed: different on every rank
    _PATCHED_ATTRS.append((torch, "seed", orig_nondet))

    def seed() -> int:
        SEEDED_BY_RANK[0] = True
        return orig_nondet()

    seed.__doc__ = orig_nondet.__doc__
    torch.seed = seed
    # a torch.Generator made inside the check remembers whether it was seeded from the rank
    _PATCHED_ATTRS.append((torch, "Generator", torch.Generator))
    torch.Generator = RankGenerator  # type: ignore[misc]

    if "spmd_types.runtime" in sys.modules:  # its annotations are read (never imported here)
        _patch_assert_type(sys.modules["spmd_types.runtime"], sys.modules.get("spmd_types"))

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _OPT_HOOK[0] = register_optimizer_step_pre_hook(step_pre_hook)


# ======================================================================================
# user autograd Functions: a typing rule, or an error naming the Function
# ======================================================================================

#: the group of a user Function's rule that names none: the checked group
_CHECKED_GROUP = object()
#: user Function class -> (its rule, typed argument names, forward's names) (register_function)
_USER_RULES: dict[type, tuple[Rule, tuple[str, ...]]] = {}
_GRAD_KINDS = (None, PARTIAL, REPLICATED)


def _forward_names(cls: type) -> tuple[tuple[str, ...], bool]:
    """``cls.forward``'s parameter names (without ``ctx``) and whether it takes ``ctx``."""
    fn = inspect.getattr_static(cls, "forward")
    fn = getattr(fn, "__func__", fn)
    names = tuple(inspect.signature(fn).parameters)
    base_setup = _torch.base_setup_context()
    own_setup = inspect.getattr_static(cls, "setup_context") is not base_setup
    has_ctx = bool(names) and not own_setup  # forward(ctx, ...) unless setup_context takes ctx
    return (names[1:] if has_ctx else names), has_ctx


def _validated(cls: type, rule: Any, args: Iterable[str] | None) -> tuple[Rule, tuple[str, ...]]:
    """``rule`` checked against ``cls.forward`` (TypeError naming the Function and the
    argument), with its tensor positions and group resolved."""
    who = f"diffcomm.spmd.register_function({cls.__name__})"
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(
            f"diffcomm.spmd.register_function: `cls` must be a torch.autograd.Function class, got {cls!r}"
        )
    if not isinstance(rule, Rule):
        raise TypeError(f"{who}: `rule` must be a diffcomm.spmd.Rule, got {type(rule).__name__}")
    names, _ = _forward_names(cls)

    def types(what: str, values: Iterable[Any], none_ok: bool = False) -> None:
        for v in values:
            if not (isinstance(v, T) or (none_ok and v is None)):
                raise TypeError(
                    f"{who}: `{what}` holds {v!r}, outside the vocabulary (diffcomm.spmd.R, V, P"
                    + (", or None" if none_ok else "")
                    + ")"
                )

    types("rule.maps", [*rule.maps.keys(), *rule.maps.values()])
    types("rule.refuse", rule.refuse.keys())
    types("rule.outputs", rule.outputs or (), none_ok=True)
    for what, kind in (("rule.out_grad", rule.out_grad), ("rule.in_grad", rule.in_grad)):
        if kind not in _GRAD_KINDS:
            raise TypeError(
                f"{who}: `{what}` is {kind!r}, expected diffcomm.spmd.PARTIAL, REPLICATED or None"
            )
    if args is not None:
        typed = tuple(args)
        for a in typed:
            if a not in names:
                raise TypeError(f"{who}: argument `{a}` is not an argument of {cls.__name__}.forward {names}")
        rule = _dc_replace(rule, tensors=tuple(names.index(a) for a in typed))
    else:
        for i in rule.tensors or (0,):
            if not 0 <= i < len(names):
                raise TypeError(
                    f"{who}: `rule.tensors` names argument {i}; {cls.__name__}.forward takes {names}"
                )
    if isinstance(rule.group, str):
        if rule.group in names:
            pass
        elif rule.group == "pg":  # the default, not named by the Function: the checked group
            rule = _dc_replace(rule, group=lambda b: _CHECKED_GROUP)
        else:
            raise TypeError(
                f"{who}: argument `{rule.group}` (rule.group) is not an argument of "
                f"{cls.__name__}.forward {names}"
            )
    return rule, names


def register_function(cls: type, rule: Rule, *, args: Iterable[str] | None = None) -> type:
    """Give a user ``torch.autograd.Function`` a typing rule for ``dc.spmd_check``.

    The rule is stated in the vocabulary of diffcomm's own ops (:class:`Rule`): accepted
    input type -> output type, what its backward needs of a replicated output's gradient
    (``out_grad``) and gives a replicated input (``in_grad``). Inside a check the
    Function's forward runs untyped and its outputs are typed by the rule; a differentiable
    user Function with no rule is an :class:`SPMDTypeError` naming it.

    Args:
        cls: the Function class.
        rule: its rule; ``rule.group`` names the ``forward`` argument holding the process
            group (left at its default and not an argument: the checked group).
        args: the names of the typed tensor arguments of ``forward`` (default: the first,
            or ``rule.tensors``).

    Returns:
        ``cls`` (so it also serves as ``cls = register_function(cls, rule)``).

    Raises:
        TypeError: naming the Function and the argument, now (not at the first checked
            call), for an argument ``forward`` does not take or a type outside the
            vocabulary.

    Example::

        class CopyToTP(torch.autograd.Function):   # Megatron's _CopyToModelParallelRegion
            @staticmethod
            def forward(ctx, x):
                return x
            @staticmethod
            def backward(ctx, g):
                return dc.all_reduce(g)

        dc.spmd.register_function(
            CopyToTP, dc.spmd.Rule({R: R}, out_grad=PARTIAL, in_grad=REPLICATED), args=("x",)
        )
    """
    _USER_RULES[cls] = _validated(cls, rule, args)
    return cls


def _user_rule(cls: type) -> tuple[Rule, tuple[str, ...]] | None:
    hit = _USER_RULES.get(cls)
    if hit is None and isinstance(cls.__dict__.get("spmd"), Rule):  # stated on the class
        hit = _USER_RULES[cls] = _validated(cls, cls.__dict__["spmd"], None)
    if hit is None and cls.__module__ == _TORCH_NN:
        hit = _torch_nn_rule(cls)
        if hit is not None:
            _USER_RULES[cls] = hit
    return hit


#: torch's own differentiable collectives: their forward's raw collective is typed, but
#: not their backward (the sum convention, as diffcomm.compat's), so a replicated loss
#: through them passed with gradients world-size times too large. Each is typed by the rule
#: of the diffcomm op it is (class -> that op's module and class, the typed argument); the
#: others (a tensor list as varargs: _Scatter, _Reduce_Scatter, _AlltoAll) get no rule
#: and are refused by name, as a user Function without one is.
_TORCH_NN = "torch.distributed.nn.functional"
_TORCH_NN_RULES = {
    "_AllReduce": ("all_reduce", "_AllReduce", "tensor"),
    "_AllGather": ("all_gather", "_AllGather", "tensor"),
    "_AllGatherBase": ("all_gather", "_AllGather", "input_tensor"),
    "_Broadcast": ("broadcast_reduce", "_Broadcast", "tensor"),
    "_Reduce": ("broadcast_reduce", "_Reduce", "tensor"),
    "_Gather": ("gather_scatter", "_Gather", "tensor"),
    "_AlltoAllSingle": ("all_to_all", "_AllToAll", "input"),
}


def _torch_nn_rule(cls: type) -> tuple[Rule, tuple[str, ...]] | None:
    row = _TORCH_NN_RULES.get(cls.__name__)
    if row is None:
        return None
    op = getattr(importlib.import_module(f"diffcomm.ops.{row[0]}"), row[1])
    return _validated(cls, _dc_replace(op.spmd, group="group"), (row[2],))


def _is_user_function(cls: type) -> bool:
    mod = getattr(cls, "__module__", "") or ""
    if mod == _TORCH_NN:
        return True
    return not (mod.startswith(("torch.", "diffcomm.", "spmd_types")) or cls in _PATCHED)


def _untyped(bound: Any) -> Any:
    """``bound`` run with every check of this thread off: under a torch.func transform a
    Function's ``forward`` runs one interpreter level down, where the transform no longer
    shows, on unwrapped tensors whose types are not their wrappers'."""

    def apply(*args: Any, **kwargs: Any) -> Any:
        checks = [c for c in _ACTIVE if c.thread == threading.get_ident()]
        for c in checks:
            c.inside += 1
        try:
            return bound(*args, **kwargs)
        finally:
            for c in checks:
                c.inside -= 1

    return apply


def untyped_under_transform(op: str) -> None:
    """Warn that code under a torch.func transform is not checked: once per check block
    of this thread, at the first diffcomm op (or plain op of the user's) met under one.

    Why it is not typed: under ``torch.func.grad`` / ``vjp`` / ``jacrev`` / ``vmap`` the
    values are functorch wrappers, made and unwrapped by the transform (a parameter's type
    is not its wrapper's), and the gradient is taken inside the transform, not by
    ``Tensor.backward`` / ``torch.autograd.grad``, where the check reads the objective. A
    pass through such code would look like a verdict; the warning says it is none."""
    me = threading.get_ident()
    checks = [c for c in _ACTIVE if c.thread == me and not (c.inside or c.in_backward or c.transform_warned)]
    if not checks:
        return
    for c in checks:
        c.transform_warned = True
    frame, up = _user_frame()
    warnings.warn(
        f"diffcomm.spmd_check: {op} at {_site()} runs under a torch.func transform "
        "(torch.func.grad, vjp, jacrev, jvp or vmap), and code under torch.func is not checked: "
        "its tensors are functorch wrappers, which carry no replication types, and its gradients "
        "are taken inside the transform, not by Tensor.backward or torch.autograd.grad, where "
        "the check reads the objective; a wrong collective or mapping in it (dc.all_reduce where "
        "reduce_from_region belongs: gradients world-size times too large) passes unseen. To "
        "check this code, run it with loss.backward() in the check, outside torch.func "
        "(docs/spmd_types.md, Limits).",
        UserWarning,
        stacklevel=up if frame is not None else 2,
    )


class _WholeGrad(torch.autograd.Function):
    """Debug mode: an identity before a user Function whose rule gives a replicated input
    a replicated gradient (``in_grad=REPLICATED``), whose backward checks that promise: the
    gradient the Function's backward gave is equal on every rank."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, who: str, pg: Any) -> Tensor:
        ctx.who, ctx.pg = who, pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        from ..parallel._check import check_replicated

        hint = (
            "its rule (dc.spmd.register_function) says in_grad=REPLICATED: every rank gets "
            "the whole gradient. A backward that does not sum the ranks' shares (a copy "
            "into the tensor-parallel region whose backward forgot its all_reduce) breaks "
            "that promise, and dc.spmd_check trusts the rule: fix the backward, or the rule."
        )
        check_replicated(g, f"{ctx.who} backward", "the gradient of its replicated input", hint, ctx.pg)
        return g, None, None


def _whole_grads_checked(
    check: Any, cls: type, rule: Rule, names: tuple[str, ...], args: tuple[Any, ...]
) -> Any:
    """``args`` with, in debug mode, each replicated tensor that a user Function's rule
    gives a replicated gradient routed through :class:`_WholeGrad` (else as they are)."""
    from .._config import DEBUG

    if rule.in_grad != REPLICATED or not DEBUG.get() or not torch.is_grad_enabled():
        return args
    bound = dict(zip(names, args))
    group = rule.group(bound) if callable(rule.group) else bound.get(rule.group)
    if group is _CHECKED_GROUP:
        group = check.pg
    elif not check._is_group(group):
        return args
    pos = set(rule.tensors if rule.tensors is not None else (0,))
    return tuple(
        _WholeGrad.apply(a, cls.__qualname__, group)
        if i in pos and isinstance(a, Tensor) and a.requires_grad and check.rec(a).t is R
        else a
        for i, a in enumerate(args)
    )


class _UserApply:
    """``torch.autograd.Function.apply`` while a check is active: a user Function is typed
    by its rule (its forward's own ops untyped), or refused with its name."""

    def __init__(self, orig: Any) -> None:
        self._orig = orig
        self._diffcomm_wraps = orig  # not spmd_types' checker (_replication.spmd_types_checking)

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if cls is None and obj is not None:
            cls = type(obj)
        bound = self._orig.__get__(obj, cls)
        if _torch.transforms_active():  # torch.func: nothing typed (docs/spmd_types.md, Limits)
            if cls is not None and _ACTIVE and not cls.__module__.startswith("torch."):
                untyped_under_transform(_op_name(cls, qualified=not issubclass(cls, CommOp | ListOp)))
            return _untyped(bound)
        if cls is None or not _is_user_function(cls):
            return bound
        checks = [c for c in _ACTIVE if not c.off]
        if not checks:
            return bound

        def apply(*args: Any, **kwargs: Any) -> Any:
            hit = _user_rule(cls)
            if hit is None and callable(getattr(cls, "spmd_typecheck", None)) and "spmd_types" in sys.modules:
                return checks[-1].spmd_types_function(cls, bound, args, kwargs)
            if hit is None:
                if torch.is_grad_enabled() and any(
                    isinstance(a, Tensor) and a.requires_grad for a in (*args, *kwargs.values())
                ):
                    raise SPMDTypeError(
                        f"diffcomm.spmd_check: {cls.__qualname__} at {_site()}: a differentiable "
                        "autograd Function with no typing rule (its forward and backward may "
                        "communicate, so its types cannot be inferred from its inside). Give it one: "
                        f"dc.spmd.register_function({cls.__name__}, dc.spmd.Rule(...)) "
                        "(docs/spmd_types.md, 'Rules for your own autograd Functions')."
                    )
                return bound(*args, **kwargs)
            rule, names = hit
            call = lambda: bound(*_whole_grads_checked(checks[-1], cls, rule, names, args), **kwargs)
            return _run_typed(checks, cls, rule, names, False, 0, False, args, call)

        return apply


def _patch_assert_type(runtime: Any, package: Any) -> None:
    """``spmd_types.assert_type`` while a check is active: also read by the check."""
    orig = runtime.assert_type

    def assert_type(tensor: Any, *types: Any, **kwargs: Any) -> Any:
        out = orig(tensor, *types, **kwargs)
        for c in _ACTIVE:
            if not c.off:
                for t in tensor if isinstance(tensor, list | tuple) else (tensor,):
                    if isinstance(t, Tensor):
                        c.annotated(t)
        return out

    assert_type.__doc__ = orig.__doc__
    for mod in (runtime, package):
        if mod is not None and getattr(mod, "assert_type", None) is orig:
            _PATCHED_ATTRS.append((mod, "assert_type", orig))
            setattr(mod, "assert_type", assert_type)  # noqa: B010


class _Hooks:
    """What :data:`diffcomm._replication.HOOK` holds while a check is active."""

    @staticmethod
    def varying(x: Tensor) -> Tensor:
        for c in _ACTIVE:
            if not c.off:
                x.__dict__[c.key] = _Rec(V, why=f"a per-rank value (a layout's shard) at {_site()}")
        return x

    @staticmethod
    def varying_params(module: torch.nn.Module, group: Any) -> None:
        for c in _ACTIVE:
            if c.off or not c._is_group(group):
                continue
            for name, p in module.named_parameters():
                old = p.__dict__.get(c.key)
                if old is None or old.param is None or old.auto or old.t is not V:
                    r = _Rec(V, why=f"this rank's own parameter {name}")
                    r.param = name
                    p.__dict__[c.key] = r
                    c._params[id(p)] = _Param(p, name, r)

    @staticmethod
    def objective_term(aux: Tensor) -> None:
        for c in _ACTIVE:
            if not c.off:
                c._aux_terms.append((c.rec(aux), _site()))


def _patch_rank_reader(owner: Any, name: str) -> None:
    """``owner.name`` (a function or method that reads the rank) returning a
    :class:`RankInt` (a tuple of them: a mesh coordinate) while a check is active."""
    orig = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    _PATCHED_ATTRS.append((owner, name, orig))

    def reader(*a: Any, **k: Any) -> Any:
        out = orig(*a, **k)
        if isinstance(out, tuple):
            return tuple(RankInt(i) if type(i) is int else i for i in out)
        return RankInt(out) if type(out) is int else out

    reader.__doc__ = getattr(orig, "__doc__", None)
    setattr(owner, name, reader)


def _patch_raw_all_reduce() -> None:
    """``torch.distributed.all_reduce`` (in place, not differentiable: a user's gradient
    reduction, ``dist.all_reduce(p.grad)``) types its tensor as diffcomm's all_reduce would:
    a partial or varying value over the checked group becomes replicated, under the same
    reduction rules (a gradient that already holds a reduced part summed again, a
    replicated objective's gradient averaged, a replicated term summed). Untyped tensors
    (diffcomm's own raw calls) and other groups are left alone."""
    import torch.distributed as dist

    orig = dist.all_reduce
    _PATCHED_ATTRS.append((dist, "all_reduce", orig))

    def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(tensor, *args, **kwargs)
        for c in _ACTIVE:
            r = tensor.__dict__.get(c.key) if isinstance(tensor, Tensor) else None
            if c.off or r is None or r.t is R:
                continue
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            if not c._is_group(group):
                continue
            op = kwargs.get("op", args[0] if args else dist.ReduceOp.SUM)
            site = _site()
            c._check_summed(
                "torch.distributed.all_reduce",
                "tensor",
                r,
                op == dist.ReduceOp.SUM,
                op == dist.ReduceOp.AVG,
                site,
            )
            done = _Rec(R, why=f"the output of torch.distributed.all_reduce at {site}")
            done.reduced = f"the result of torch.distributed.all_reduce at {site}"
            tensor.__dict__[c.key] = done
        return out

    all_reduce.__wrapped__ = orig  # type: ignore[attr-defined]
    dist.all_reduce = all_reduce


def _uninstall() -> None:
    global _HOOK
    SEEDED_BY_RANK[0] = None
    for cls, (_, entry) in _PATCHED.items():
        setattr(cls, "wait" if cls is E.AsyncTensor else "forward", entry)
    _PATCHED.clear()
    for mod, attr, value in reversed(_PATCHED_ATTRS):
        setattr(mod, attr, value)
    _PATCHED_ATTRS.clear()
    T_.HOOK[0] = None
    if _HOOK is not None:
        _HOOK.remove()
        _HOOK = None
    if _OPT_HOOK[0] is not None:
        _OPT_HOOK[0].remove()
        _OPT_HOOK[0] = None


def _outer_typedness_for_tests() -> dict[str, Any]:
    """What is installed now (the zero-cost test reads it)."""
    return {"patched": dict(_PATCHED), "hook": _HOOK, "active": list(_ACTIVE)}
