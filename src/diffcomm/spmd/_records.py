"""The records of ``dc.spmd_check``: the gradient-kind cells (union-find), one tensor's
record, the error carrier out of operators, and the user's line (``_site``). No check
state lives here (that is :mod:`diffcomm.spmd.check`)."""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .._replication import PARTIAL, SPMDTypeError, T

# ======================================================================================
# gradient-kind cells (union-find)
# ======================================================================================


class _Epoch(threading.local):
    """The backward passes (that freed their graph) this rank has run (``n``): a cell fixed
    before the last one belongs to a graph whose backward already ran, and constrains
    nothing any more. One count per thread, as a rank's check runs on its own thread
    (``SPMDCheck.thread``): the ranks of an in-process world are threads of one process,
    and one count for all of them let a rank's backward retire the kinds another rank had
    fixed since its own (a clash missed on that rank alone)."""

    n = 0


_EPOCH = _Epoch()
_TENSOR_BASE = torch.Tensor.__mro__[1]  # the C tensor class whose methods are the operators


class _Cell:
    """The gradient kind shared by a set of replicated values (``None``: not fixed yet)."""

    __slots__ = ("parent", "kind", "why", "epoch", "mean", "copy_at")

    def __init__(self, kind: str | None = None, why: str = "", mean: bool = False) -> None:
        self.parent: _Cell | None = None
        self.kind = kind
        self.why = why
        self.epoch = _EPOCH.n  # the backward passes run before it was made
        #: made by all_reduce(op="avg") of per-rank values: a loss holding it is the mean of
        #: the per-rank objectives (as a varying loss is their sum), not a replicated objective
        self.mean = mean
        #: where a replicated activation met a varying weight (``"linear at f.py:12"``): the
        #: place a missing copy_to_region belongs
        self.copy_at: str | None = None

    def root(self) -> _Cell:
        c = self
        while c.parent is not None:
            c = c.parent
        if c is not self:  # path compression
            x = self
            while x.parent is not None and x.parent is not c:
                x.parent, x = c, x.parent
        return c


#: products with a weight, where a replicated activation needs copy_to_region (as ``_ops``'s
#: ``_WEIGHTED``; the other ops' clashes get the per-rank-use message)
_WEIGHTED_OPS = frozenset(
    ("linear", "matmul", "mm", "bmm", "einsum", "embedding", "conv1d", "conv2d", "rmatmul")
)


def _conflict(op: str, site: str, need: str, have: _Cell, need_why: str) -> SPMDTypeError:
    if have.kind == PARTIAL:  # a sum-convention op made it; a replicated-objective use here
        text = (
            f"its gradient must be replicated here ({need_why}), but it is partial: "
            f"{have.why}. Under this replicated objective, replace that op by its "
            "diffcomm.parallel mapping (the error names it), or keep this value varying"
        )
    elif op not in _WEIGHTED_OPS:  # not a matmul with a weight: a per-rank use of the value
        text = (
            f"its gradient must be partial here ({need_why}), but it is replicated: "
            f"{have.why}. A replicated-objective value cannot meet a varying one (its "
            "gradient would differ by rank): if each rank's use of it is that rank's own part of "
            "the objective (a per-rank loss, a slice or mask by rank), make the value with the "
            "sum-convention op (dc.all_reduce / dc.all_gather, whose backward sums the ranks' "
            "gradients); otherwise make the other operand replicated (e.g. dropout on the "
            "default RNG stream, not a model-parallel one)"
        )
    else:
        text = (
            f"its gradient must be partial here ({need_why}), but it is replicated: "
            f"{have.why}. A replicated-objective value cannot meet a varying one (its "
            "gradient would differ by rank): a replicated activation entering a matmul with a "
            "varying weight needs parallel.copy_to_region first (spmd_types: convert(x, src=I, "
            "dst=R)); otherwise make the other operand replicated (e.g. dropout on the default RNG "
            "stream, not a model-parallel one), or use the sum-convention op"
        )
    return SPMDTypeError(
        f"diffcomm.spmd_check: {op} at {site}: a replicated value's gradient kind clashes: {text}."
    )


# ======================================================================================
# records
# ======================================================================================


class _Escape(BaseException):
    """Carries an :class:`SPMDTypeError` out of a Tensor method, which may be an operator
    (``a * b`` dispatches ``TensorBase.mul``): torch turns a ``TypeError`` raised inside an
    operator into ``NotImplemented`` (then Python's own "unsupported operand" error). The
    check's ``__exit__`` raises the error it carries, so outside the block it is the
    :class:`SPMDTypeError`."""

    def __init__(self, error: SPMDTypeError) -> None:
        super().__init__(str(error))
        self.error = error


class _Rec:
    """One tensor's type under one check."""

    __slots__ = (
        "t",
        "cell",
        "shard",
        "why",
        "param",
        "auto",
        "acc",
        "strict",
        "rep",
        "rep_elem",
        "copy_at",
        "reduced",
        "weight",
        "drift",
        "zero",
    )

    def __init__(self, t: T, cell: _Cell | None = None, shard: int | None = None, why: str = "") -> None:
        self.t = t
        self.cell = cell
        self.shard = shard  # the sharded dim of a varying parameter
        self.why = why  # where a partial / varying value came from
        self.param: str | None = None  # the name of a parameter
        self.auto = False  # a parameter typed by default (a layer that owns it may retype it)
        #: a partial gradient that also holds an already reduced gradient (accumulated onto
        #: it): where that reduction was; summing it again multiplies that part by the world
        self.acc: str | None = None
        #: a partial gradient of a replicated (or partial) objective: its sum over ranks is
        #: the gradient, so averaging it is wrong (why, for the message)
        self.strict: str | None = None
        #: a varying value holding a replicated additive term (where it was added): a sum
        #: over ranks counts that term world-size times
        self.rep: str | None = None
        #: that replicated term is an element of its own (stacked / concatenated beside the
        #: per-rank ones), so it survives elementwise maps (``pow``) and norms
        self.rep_elem = False
        #: a partial gradient made where a replicated activation met a varying weight: the
        #: op and line where copy_to_region belongs
        self.copy_at: str | None = None
        #: a replicated value that already holds the ranks' values combined (in words): the
        #: result of a communication op over the group (a reduction, a gather, a broadcast),
        #: a value plain ops made from one, or a gradient of a replicated objective (whole on
        #: every rank). Summing it again counts what it holds world-size times, with or
        #: without a gradient; a replicated value that holds none of these and requires no
        #: grad may be summed (``W * x``: arithmetic on equal values)
        self.reduced: str | None = None
        #: a varying value that is a varying weight seen through value-preserving ops (a
        #: cast, a copy, a view, a scaling by a replicated factor: ``w.float()``,
        #: ``w.to(x.dtype)``, ``(w * s).T``): a replicated activation meeting it in a matmul
        #: is the entry of a column-parallel region, as with the weight itself
        self.weight = False
        #: a replicated parameter updated in place with per-rank data (where, in words):
        #: its replicas differ, until overwritten with replicated data (a broadcast copied in)
        self.drift: str | None = None
        #: all zeros by construction, whatever the ranks' data (made by ``zeros`` /
        #: ``zeros_like`` / ``full(.., 0)``, zeroed in place by ``zero_`` / ``fill_(0)`` /
        #: ``_foreach_zero_``, or a copy, cast or view of such a value): decided from the ops
        #: and their constant arguments, never from the values, so every rank decides alike.
        #: A gradient so marked holds nothing of an earlier backward; a masked or added
        #: operand so marked adds nothing to a partial value
        self.zero = False


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPMD_DIR = os.path.dirname(os.path.abspath(__file__))
#: the planted-bug corpus (diffcomm.testing.spmd_corpus): its lines are the user's lines
_CORPUS = os.path.join(os.path.dirname(_SPMD_DIR), "testing", "spmd_corpus.py")
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_FUNCTORCH = os.path.join(_TORCH, "_functorch") + os.sep  # torch.func's own code
_SPMD_TYPES = os.sep + "spmd_types" + os.sep  # spmd_types' own frames are not the user's line


def _is_user_file(fn: str) -> bool:
    """Whether code in file ``fn`` is the user's (not diffcomm's, torch's or spmd_types')."""
    if (
        fn.startswith(_TORCH)
        or (fn.startswith(_PKG) and fn != _CORPUS)
        or (_SPMD_TYPES in fn and "site-packages" in fn)
    ):
        return False
    return "<" not in fn or fn.startswith("<ipython") or fn == "<string>"


def _user_frame() -> tuple[Any, int]:
    """The user's frame (the first outside diffcomm and torch) above the caller, and how
    many frames up it is (``warnings.warn``'s ``stacklevel`` in the caller); ``(None, 0)``
    when there is none."""
    f: Any = sys._getframe(1)
    up = 1
    while f is not None:
        if _is_user_file(f.f_code.co_filename):
            return f, up
        f, up = f.f_back, up + 1
    return None, 0


def _op_by_user(f: Any) -> bool:
    """Whether the op whose call reached frame ``f`` was called by the user's code (and not
    by torch.func's own machinery or by diffcomm, which name their ops themselves)."""
    while f is not None:
        fn = f.f_code.co_filename
        if _is_user_file(fn):
            return True
        if fn.startswith(_FUNCTORCH) or (fn.startswith(_PKG) and fn != _CORPUS):
            return False
        f = f.f_back
    return False


def _site() -> str:
    """The user's file:line (the first frame outside diffcomm and torch)."""
    f, _ = _user_frame()
    return "<unknown>" if f is None else f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


def _fname(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)
    return name.strip("_") if name.startswith("__") else name


def _reflected(func: Any) -> bool:
    """``func`` is an operator torch defines in Python (``Tensor.__rsub__``,
    ``__rtruediv__``, ``__rpow__``, ``__rmatmul__``, ``__floordiv__``): torch turns a
    ``TypeError`` raised inside it into ``NotImplemented``, as for the C operators."""
    return getattr(func, "__qualname__", "").startswith("Tensor.__")


# ======================================================================================
# the check's internal plans and entries
# ======================================================================================


@dataclass
class _Param:
    """A parameter the check typed: held until the block ends (the gradient check)."""

    param: Any
    name: str
    rec: _Rec


@dataclass(frozen=True)
class _Owner:
    """The layer that holds a parameter: the parameter's dotted name from it, and the fix
    of a partial gradient that layer offers (its ``sync_replicated_grads()``). The entry
    holds the parameter (the check keys it by ``id()``: held, no other parameter can take
    that id while the check runs)."""

    name: str
    sync: str | None
    param: Any = None


@dataclass
class _OpPlan:
    """What a typed op on the checked group found before it ran (``op_before``), read when
    its outputs are typed (``op_after``)."""

    name: str
    rule: Any  # the op's Rule (its nonlinear variant for max / min / product)
    outs: list[T]  # the output type of each input
    site: str
    grad: bool  # an input requires grad
    shares: list[_Cell | None]  # per input: the cell an avg reduction of a replicated input shares
    mean: bool  # an op="avg" reduction of per-rank (not partial) values: a mean objective


@dataclass
class _PassThrough:
    """A typed op on another group: its outputs take their inputs' types (per element)."""

    recs: list[tuple[str, Any, _Rec]]  # (argument, tensor, record) per tensor input
    grad: bool
