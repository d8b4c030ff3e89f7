"""Argument normalisation and validation, shared by every op.

Every check here runs before any communication and raises a ``ValueError`` or
``TypeError`` whose message names the op, the argument, what was expected and what was
given, and this rank. Group resolution (``None | ProcessGroup | (DeviceMesh, axis)``)
lives here and nowhere else.
"""

from __future__ import annotations

import datetime
import math
import numbers
import struct
import warnings
from collections.abc import Sequence
from typing import Any, Literal, Union, overload

import torch
import torch.distributed as dist

from .. import _torch

GroupLike = Union[None, "dist.ProcessGroup", tuple[Any, int | str]]
#: a resolved process group (``None``: the default group), what :func:`resolve_group`
#: returns: the one alias of the package (``Any``: c10d's group types are not all typed)
PG = Any

REDUCE_OPS = ("sum", "avg", "max", "min", "product")
LINEAR_OPS = ("sum", "avg")

_REDUCE_OP_NAMES = {
    "sum": "sum",
    "avg": "avg",
    "mean": "avg",
    "max": "max",
    "min": "min",
    "product": "product",
    "prod": "product",
}


def _where() -> str:
    if dist.is_available() and dist.is_initialized() and not _torch.local_tensor_mode_on():
        return f" (rank {dist.get_rank()})"
    return ""


def arg_error(op: str, arg: str, expected: str, got: Any, cls: type[Exception] = ValueError):
    """Build the standard error: ``op(): argument expected ..., got ... (rank r)``."""
    return cls(f"diffcomm.{op}(): `{arg}` must be {expected}, got {got}{_where()}")


_C10D = _torch.C10D


def resolve_group(group: GroupLike, op: str = "op") -> dist.ProcessGroup | None:
    """Turn ``None``, a ``ProcessGroup`` or ``(DeviceMesh, axis)`` into a ProcessGroup.

    ``None`` stays ``None`` (torch's default group). Raises ``TypeError`` for anything else
    and ``RuntimeError`` when no process group is initialised.
    """
    if group is None and _C10D is not None and _C10D._default_pg is not None:
        return None  # the common case: the default group of an initialised world
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"diffcomm.{op}(): torch.distributed is not initialised; call diffcomm.init() "
            "(inside torchrun) or run the code through diffcomm.launch / diffcomm.LocalWorld"
        )
    if group is None:
        return None
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, tuple) and len(group) == 2:
        mesh, axis = group
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise arg_error(
                op, "group", "a (DeviceMesh, axis) pair", f"({type(mesh).__name__}, ...)", TypeError
            )
        names = mesh.mesh_dim_names or ()
        if isinstance(axis, str):
            if axis not in names:
                raise arg_error(op, "group", f"a mesh axis name in {tuple(names)}", repr(axis))
        elif isinstance(axis, int) and not isinstance(axis, bool):
            if not -mesh.ndim <= axis < mesh.ndim:
                raise arg_error(op, "group", f"a mesh axis index in [0, {mesh.ndim})", axis)
            axis = axis % mesh.ndim
        else:
            raise arg_error(op, "group", "a mesh axis name or index", type(axis).__name__, TypeError)
        return mesh.get_group(axis)
    if type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:
        # what dist.new_group returns on the ranks outside the group: the message said only
        # "got int", not that this rank is no member
        raise arg_error(
            op,
            "group",
            "a group this rank belongs to (call the op on the group's members only)",
            "torch's GroupMember.NON_GROUP_MEMBER, which dist.new_group returns on the ranks "
            "outside the group",
            TypeError,
        )
    raise arg_error(
        op, "group", "None, a ProcessGroup or a (DeviceMesh, axis) pair", type(group).__name__, TypeError
    )


def renamed_sizes(split_sizes: Any, sizes: Any, op: str) -> tuple[Any, str]:
    """``split_sizes``, or the old keyword ``sizes`` (with a ``DeprecationWarning``);
    returns the value and the keyword the caller used (error messages name it)."""
    if sizes is None:
        return split_sizes, "split_sizes"
    if split_sizes is not None:
        raise arg_error(
            op, "sizes", "omitted when `split_sizes` is given (it is its old name)", sizes, TypeError
        )
    warnings.warn(
        f"diffcomm.{op}(): the keyword `sizes` is renamed `split_sizes` (one name across ops); "
        "`sizes` keeps working for one release",
        DeprecationWarning,
        stacklevel=3,
    )
    return sizes, "sizes"


def check_tensor(x: Any, op: str, arg: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise arg_error(op, arg, "a torch.Tensor", type(x).__name__, TypeError)
    if type(x) is not torch.Tensor and is_dtensor(x):
        # A DTensor is one global tensor; diffcomm's ops act on each rank's own tensor.
        # Given one, torch's dispatch raised deep in the call (no sharding strategy for
        # the raw c10d op), naming neither the argument nor the way out.
        placements = tuple(getattr(x, "placements", ()))
        raise arg_error(
            op, arg, _dtensor_hint(placements), f"a DTensor with placements {placements}", TypeError
        )
    kind = data_kind(x)
    if kind is not None:
        want = "a dense tensor with data (strided layout, this rank's values)"
        raise arg_error(op, arg, want, kind, TypeError)
    return x


def _dtensor_hint(placements: tuple[Any, ...]) -> str:
    """What a refused DTensor's error says to pass instead (docs/convention.md, "Handing
    tensors to and from DTensor"). torch's DTensor reads the gradient of a ``Replicate()``
    tensor as the gradient of its one global value, where diffcomm sums the ranks'
    objectives: a plain ``x.to_local()`` of a replicated weight gave each rank its own
    share for the whole gradient, and ``DTensor.from_local(y, mesh, [Replicate()])`` of a
    core op's result (torch all-reduces its gradient) a gradient ``world`` times too large.
    """
    hint = (
        "a plain torch.Tensor (this rank's own data: diffcomm's ops act on per-rank tensors; "
        "pass `x.to_local()`, this rank's shard"
    )
    if any(p.is_replicate() for p in placements):
        want = ", ".join("Partial()" if p.is_replicate() else repr(p) for p in placements)
        hint += (
            f"; a replicated one as `x.to_local(grad_placements=[{want}])`, so that its "
            "gradient is the sum over ranks"
        )
    return hint + (
        "; rebuild a result with `DTensor.from_local` as Shard(dim), or as Replicate() only "
        "after a diffcomm.parallel mapping such as gather_from_region: torch all-reduces a "
        "Replicate() gradient, and after a core op it would be counted once per rank)"
    )


_STRIDED = torch.strided
_compiling = _torch.compiling


def plain_data(x: torch.Tensor) -> bool:
    """``x`` is a plain tensor whose memory holds its values: the common case, decided with
    a few attribute reads (the hot path asks it on every call)."""
    if type(x) is not torch.Tensor:
        return False
    if _compiling():  # traced: see data_kind
        return not x.is_sparse
    return x.layout is _STRIDED and not x.is_quantized and not x.is_nested


def data_kind(x: torch.Tensor) -> str | None:
    """What kind of tensor ``x`` is when its memory is not its values as diffcomm's
    transport reads them (``None``: it is; a DTensor is refused before this). Each was
    torch's error from deep inside the op, after some ranks had communicated (a quantized
    ``broadcast`` returned without error, its values never moved),
    or a crash of gloo reading a storage that is not there. While torch.compile traces, a
    FakeTensor stands for every tensor and dynamo refuses to read ``layout`` inside an
    autograd.Function (its strict mode): only a sparse tensor is refused there. A tensor on
    the meta device passes: it has no values and every op gives the meta result of the
    right shape (shape inference, e.g. torch.distributed.pipelining's stage shapes)."""
    if _compiling():
        return "a sparse tensor" if x.is_sparse else None
    if x.layout is not _STRIDED:
        name = str(x.layout).replace("torch.", "")
        return "a nested (jagged) tensor" if name == "jagged" else f"a tensor of layout {name}"
    if x.is_nested:
        return "a nested tensor"
    if x.is_quantized:
        return f"a quantized tensor ({x.dtype}; pass `x.dequantize()` or `x.int_repr()`)"
    if type(x) is not torch.Tensor and _torch.is_fake(x):
        return (
            "a FakeTensor (no values to communicate; diffcomm's ops trace under "
            "torch.compile, which runs them as functional collectives)"
        )
    return None


def check_int(v: Any, op: str, arg: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point():
            return int(v.item())
        raise arg_error(op, arg, "an int", f"{type(v).__name__} {v!r}", TypeError)
    return v


def check_rank(r: Any, op: str, arg: str, world: int) -> int:
    """A group-local rank in ``[0, world)``."""
    r = check_int(r, op, arg)
    if not 0 <= r < world:
        raise arg_error(op, arg, f"a group-local rank in [0, {world})", r)
    return r


def check_dim(x: torch.Tensor, dim: Any, op: str, arg: str = "dim") -> int:
    """Normalise ``dim`` against ``x.ndim`` (negative dims allowed)."""
    if type(dim) is int and 0 <= dim < x.ndim:  # the common case, decided without a call
        return dim
    dim = check_int(dim, op, arg)
    nd = x.ndim
    if nd == 0:
        raise arg_error(op, "x", "a tensor with at least one dimension", "a 0-dim tensor")
    if not -nd <= dim < nd:
        raise arg_error(op, arg, f"a dimension in [{-nd}, {nd}) for a {nd}-dim tensor", dim)
    return dim % nd


def normalize_op(op_arg: Any, opname: str, x: torch.Tensor | None = None) -> str:
    """Reduce op as one of ``sum, avg, max, min, product``; checks it suits ``x.dtype``."""
    if type(op_arg) is str and op_arg == "sum":  # the common case (legal for every dtype)
        return "sum"
    name: str | None = None
    if isinstance(op_arg, str):
        name = _REDUCE_OP_NAMES.get(op_arg.strip().lower())
    elif isinstance(op_arg, dist.ReduceOp) or type(op_arg).__name__ == "RedOpType":
        text = str(op_arg).split(".")[-1].lower()
        name = _REDUCE_OP_NAMES.get(text)
    if name is None:
        raise arg_error(
            opname, "op", f"one of {REDUCE_OPS} (any case) or a torch.distributed.ReduceOp", repr(op_arg)
        )
    if x is not None:
        if name in ("max", "min") and x.is_complex():
            raise arg_error(opname, "op", "sum/avg/product for a complex tensor (no order on C)", repr(name))
        if name == "avg" and not (x.is_floating_point() or x.is_complex()):
            raise arg_error(opname, "op", "sum/max/min/product for an integer or bool tensor", "'avg'")
        if name in ("avg", "product") and x.dtype is torch.complex32:
            # torch has no complex32 division or product: it raised its NotImplementedError
            # after the communication, on the ranks that divide (reduce: dst alone)
            raise arg_error(opname, "op", "'sum' for a complex32 tensor (reduce it in complex64)", repr(name))
    return name


_INT = {int}


def plain_ints(v: Any) -> bool:
    """``v`` is a list or tuple of plain ``int`` s (no bools, tensors or numpy ints): the
    common case of split sizes, checked without a Python loop."""
    return type(v) in (list, tuple) and set(map(type, v)) <= _INT


def check_split_sizes(
    split_sizes: Any, total: int, world: int, op: str, arg: str = "split_sizes", per_rank: bool = False
) -> list[int]:
    """Per-rank split sizes along a dim of size ``total``; ``None`` means an even split.
    ``per_rank``: sizes that differ between the simulated ranks of torch's
    ``LocalTensorMode`` (``SymInt`` s) are taken, each rank's checked (``all_to_all``,
    whose sizes are each rank's own); elsewhere they are a ``TypeError``."""
    if split_sizes is None:
        if type(total) is not int and not per_rank:  # (a SymInt: torch.compile or LocalTensorMode)
            check_one_size(total, op, "x", "the split dim")
        if total % world != 0:
            raise arg_error(
                op,
                "x",
                f"of a size along the split dim divisible by the group size {world} (or pass `{arg}`)",
                f"size {total}",
            )
        return [total // world] * world
    if plain_ints(split_sizes):
        sizes = list(split_sizes)  # plain ints (the common case): checked without a Python loop
    else:
        if isinstance(split_sizes, torch.Tensor):
            split_sizes = split_sizes.tolist()
        if not isinstance(split_sizes, Sequence) or isinstance(split_sizes, str):
            raise arg_error(op, arg, f"a list of {world} ints", type(split_sizes).__name__, TypeError)
        if (
            per_rank
            and _torch.local_tensor_mode_on()
            and any(isinstance(s, torch.SymInt) for s in split_sizes)
        ):
            return _per_rank_split_sizes(split_sizes, total, world, op, arg)
        sizes = []
        for s in split_sizes:  # a loop, not a comprehension: no closure cells on every call
            sizes.append(check_int(s, op, arg))
    if len(sizes) != world:
        raise arg_error(op, arg, f"a list of {world} ints (one per rank)", f"{len(sizes)} entries")
    if sizes and min(sizes) < 0:
        raise arg_error(op, arg, "non-negative sizes", sizes)
    if sum(sizes) != total:
        raise arg_error(
            op, arg, f"sizes summing to {total} (the size along the split dim)", f"{sizes} (sum {sum(sizes)})"
        )
    return sizes


def per_rank_sizes(n: Any) -> dict[int, int] | None:
    """Each simulated rank's value of the size ``n`` where it differs between them under
    torch's ``LocalTensorMode`` (a ``SymInt`` over torch's ``LocalIntNode``), else ``None``."""
    if type(n) is int or not _torch.local_tensor_mode_on():
        return None
    got = {r: _torch.local_int(n, r) for r in sorted(_torch.local_tensor_api().local_tensor_mode().ranks)}
    return got if len(set(got.values())) > 1 else None


def check_one_size(n: Any, op: str, arg: str, where: str) -> None:
    """A size of ``arg`` along ``where`` that must be the same on every rank (each rank's
    buffers are sized from its own): under torch's ``LocalTensorMode`` one that differs
    between the simulated ranks is this ValueError naming the op, not torch's error inside
    the per-rank computation (real and in-process ranks fail at the exchange: the ranks
    called the op with different shapes)."""
    got = per_rank_sizes(n)
    if got is not None:
        held = ", ".join(f"rank {r}: {v}" for r, v in got.items())
        raise arg_error(
            op,
            arg,
            f"of one size along {where} on every rank (each rank's buffers are sized from its own)",
            f"sizes that differ per simulated rank ({held})",
        )


def check_one_shape(x: torch.Tensor, op: str, arg: str = "x") -> None:
    """:func:`check_one_size` for every dim of ``x``."""
    for d, n in enumerate(x.shape):
        check_one_size(n, op, arg, f"dim {d}")


def _per_rank_split_sizes(split_sizes: Sequence[Any], total: Any, world: int, op: str, arg: str) -> list[Any]:
    """Split sizes holding one int per simulated rank (under torch's ``LocalTensorMode``:
    ``SymInt`` s over its ``LocalIntNode``, e.g. from ``LocalTensor.tolist()``): each
    simulated rank's sizes checked as plain ints against its own ``total``; kept as given
    (the backend's per-rank ``all_to_all`` reads each rank's)."""
    for r in sorted(_torch.local_tensor_api().local_tensor_mode().ranks):
        mine = [_torch.local_int(s, r) for s in split_sizes]
        check_split_sizes(mine, _torch.local_int(total, r), world, op, arg)
    return list(split_sizes)


def check_grad_dtype(x: torch.Tensor, op: str, arg: str = "x") -> None:
    """Only floating and complex tensors can carry gradients (torch enforces it too)."""
    if x.requires_grad and not (x.is_floating_point() or x.is_complex()):
        raise arg_error(op, arg, "a floating or complex tensor to require grad", str(x.dtype), TypeError)


def is_dtensor(x: torch.Tensor) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (imported only when a tensor
    subclass comes by)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed tensors
        return False
    return isinstance(x, DTensor)


@overload
def check_seconds(op: str, name: str, value: Any, optional: Literal[False]) -> float: ...
@overload
def check_seconds(op: str, name: str, value: Any, optional: bool) -> float | None: ...
def check_seconds(op: str, name: str, value: Any, optional: bool) -> float | None:
    """A number of seconds or a ``datetime.timedelta`` (what ``init_process_group`` takes;
    ``None`` too where ``optional``) for setting ``name`` of ``op`` (``"LocalWorld()"``),
    as a float of seconds: ``True`` (1 s) or ``"5"`` is a type error, never a timeout that
    silently differs from the one meant."""
    if value is None and optional:
        return None
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        want = "a number of seconds" + (" or None" if optional else "")
        raise TypeError(
            f"{op}: `{name}` must be {want}, got {type(value).__name__} {value!r} "
            "(a datetime.timedelta is taken too)"
        )
    if not float(seconds) > 0:
        none = " or None" if optional else ""
        raise ValueError(f"{op}: `{name}` must be > 0 seconds{none}, got {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"{op}: `{name}` must be a finite number of seconds, got {value!r}")
    return float(seconds)


def check_flag(op: str, name: str, value: Any) -> bool | None:
    """A bool or ``None`` (the environment's value) for setting ``name`` of ``op``: a
    string such as ``"no"`` is truthy and would silently switch the setting on."""
    if value is not None and not isinstance(value, bool):
        got = f"{type(value).__name__} {value!r}"
        raise TypeError(f"{op}: `{name}` must be a bool or None, got {got}")
    return value


def float_bits(value: float | None) -> int:
    """``value`` as the int64 of its float64 bits, to travel in an exchange of host ints
    (-1, no float's bits but a NaN's, for ``None``); :func:`float_of_bits` reads it back."""
    return -1 if value is None else struct.unpack("<q", struct.pack("<d", value))[0]


def float_of_bits(bits: int) -> float | None:
    return None if bits == -1 else struct.unpack("<d", struct.pack("<q", bits))[0]
