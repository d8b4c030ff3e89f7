"""What the coalesced ops share besides their autograd rules: packing a list of tensors
into one flat buffer per dtype and back, and the list's validation (before any
communication) with the debug-mode cross-rank check. :mod:`diffcomm.ops.coalesced` holds the
list ops and the public functions.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _config
from .._errors import CrossRankMismatchError
from .._torch import compiling, local_tensor_mode_on
from ..backend import args as A
from ..backend.args import PG
from ..backend.buffers import joined
from .validation import current_backend as _b
from .validation import records_grad, untyped
from .validation import world as _world

# --------------------------------------------------------------------------------------
# packing (inside the Functions' forward: no autograd nodes per tensor)
# --------------------------------------------------------------------------------------


def by_dtype(ts: Sequence[Tensor]) -> list[list[int]]:
    """Positions of ``ts`` grouped by dtype, groups in order of first appearance."""
    first = ts[0].dtype
    if all(t.dtype == first for t in ts):
        return [list(range(len(ts)))]
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(ts):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def flatten(ts: Sequence[Tensor]) -> Tensor:
    """A new contiguous 1-D buffer holding ``ts`` one after another (never an input).

    One ``torch.cat`` over the tensors, 1-D ones as they are (the common case: biases,
    norm weights; a flattening view per tensor costs more than the copy itself)."""
    if len(ts) == 1:
        return ts[0].reshape(-1).clone()
    return joined([t if t.ndim == 1 else t.reshape(-1) for t in ts])


def pack(ts: Sequence[Tensor], groups: list[list[int]]) -> list[Tensor]:
    """One new contiguous buffer per dtype group (the caller owns it)."""
    if len(groups) == 1:
        return [flatten(ts)]
    return [flatten([ts[i] for i in g]) for g in groups]


def unpack_like(xs: Sequence[Tensor], groups: list[list[int]], bufs: Sequence[Tensor]) -> list[Tensor]:
    """Outputs shaped like the inputs ``xs``: views of the buffers, detached (see
    :func:`unpack`)."""
    return unpack([x.shape for x in xs], groups, bufs)


def packed(raw: Any, xs: Sequence[Tensor], *args: Any, **kwargs: Any) -> list[Tensor]:
    """A raw coalesced op applied to ``xs``: packed into one buffer per dtype,
    ``raw(buffers, *args, **kwargs)`` called once, split back into views shaped like ``xs``."""
    groups = by_dtype(xs)
    return unpack_like(xs, groups, raw(pack(xs, groups), *args, **kwargs))


def unpack(shapes: Sequence[Sequence[int]], groups: list[list[int]], bufs: Sequence[Tensor]) -> list[Tensor]:
    """Split each buffer back into tensors of ``shapes``: views of the buffer (one
    ``split`` per buffer), detached so autograd sees independent outputs (each may be
    modified in place)."""
    out: list[Any] = [None] * len(shapes)
    for g, buf in zip(groups, bufs):
        sizes = [math.prod(shapes[i]) for i in g]
        for i, piece in zip(g, buf.split(sizes)):
            shape = shapes[i]
            out[i] = (piece if len(shape) == 1 else piece.view(shape)).detach()
    return out


def moved(xs: Sequence[Tensor], dims: Sequence[int]) -> list[Tensor]:
    return [x if d == 0 else x.movedim(d, 0) for x, d in zip(xs, dims)]


def back(ys: Sequence[Tensor], dims: Sequence[int]) -> list[Tensor]:
    return [(y if d == 0 else y.movedim(0, d)).detach() for y, d in zip(ys, dims)]


# ======================================================================================
# validation (before any communication) and the debug-mode cross-rank check
# ======================================================================================


def check_list(tensors: Any, op: str) -> list[Tensor]:
    """The list, validated: non-empty, dense tensors, one device, no integer tensor
    asked for grad. (One cheap pass: this runs on every call, for hundreds of tensors.)"""
    if isinstance(tensors, Tensor) or not isinstance(tensors, list | tuple):
        raise A.arg_error(op, "tensors", "a list or tuple of tensors", type(tensors).__name__, TypeError)
    if len(tensors) == 0:
        raise A.arg_error(op, "tensors", "a non-empty list of tensors", "an empty list")
    first = tensors[0].device if isinstance(tensors[0], Tensor) else None
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            A.check_tensor(t, op, f"tensors[{i}]")  # raises the standard message
        if t.requires_grad and not (t.is_floating_point() or t.is_complex()):
            A.check_grad_dtype(t, op, f"tensors[{i}]")
        if t.device != first:
            raise A.arg_error(
                op,
                "tensors",
                "tensors on one device (one buffer per dtype is communicated)",
                f"tensors[0] on {first} and tensors[{i}] on {t.device}",
            )
        if not A.plain_data(t):  # a DTensor, a sparse, quantized or meta tensor: refused
            A.check_tensor(t, op, f"tensors[{i}]")  # (other subclasses pass: values read)
    return list(tensors)


def check_op(op_arg: Any, ts: Sequence[Tensor], opname: str) -> str:
    """The reduce op, checked against every dtype present (once per dtype)."""
    name = A.normalize_op(op_arg, opname)
    if name == "sum":
        return name  # legal for every dtype
    seen: set[torch.dtype] = set()
    for i, t in enumerate(ts):
        if t.dtype in seen:
            continue
        seen.add(t.dtype)
        try:
            A.normalize_op(name, opname, t)
        except ValueError as err:
            raise ValueError(f"{err} (for tensors[{i}], dtype {t.dtype})") from None
    return name


def _dtype_code(d: torch.dtype) -> int:
    """The same int for ``d`` on every rank, computed from its name (not from this
    process's history), and different for every torch dtype (a sum of the name's bytes
    made float8_e4m3fnuz and float8_e5m2fnuz alike: ``test_dtype_codes_differ_...``)."""
    return zlib.crc32(str(d).encode())


def _dtype_names() -> dict[int, str]:
    """Every torch dtype by its code: a rank names the dtypes other ranks sent, also one
    it never used itself."""
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return {_dtype_code(d): str(d).replace("torch.", "") for d in dtypes}


def debug_check(
    opname: str, pg: PG, ts: Sequence[Tensor], /, vary: Sequence[int] | None = None, **fields: Any
) -> None:
    """Debug mode: the arguments, and the list's length, shapes and dtypes, must agree on
    every rank; else an error naming the ranks and the first differing position.

    ``vary``: per tensor, the dimension whose size may differ between ranks (the gathered
    dim of ``all_gather_coalesced``); the other dims, the dtype and ``requires_grad`` must
    still agree. Skipped while compiling (a host read) and under torch's
    ``LocalTensorMode``, as the field check is there (one program states every rank's
    arguments; its per-rank sizes are not ints to encode)."""
    if not _config.DEBUG.get() or compiling() or local_tensor_mode_on():
        return
    b = _b()
    b.check_consistent(opname, {**fields, "length": len(ts)}, pg)
    world = _world(pg)
    if world == 1:
        return
    row: list[int] = []
    for i, t in enumerate(ts):
        row += [_dtype_code(t.dtype), int(records_grad(t)), t.ndim, -1 if vary is None else vary[i], *t.shape]
    device = _b().comm_device(pg)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    with untyped():  # (host integers: spmd_types' checker refused them on in-process ranks)
        width = int(b.all_gather(torch.tensor([mine.numel()], dtype=torch.int64, device=device), pg).max())
        padded = torch.full((1, width), -1, dtype=torch.int64, device=device)
        padded[0, : mine.numel()] = mine
        table = b.all_gather(padded, pg).cpu().tolist()
    if all(r == table[0] for r in table):
        return
    descs = [_decode(r, len(ts)) for r in table]
    for i in range(len(ts)):
        per_rank = [d[i] for d in descs]
        if any(p[0] != per_rank[0][0] for p in per_rank):
            by_value: dict[str, list[int]] = {}
            for r, p in enumerate(per_rank):
                by_value.setdefault(p[1], []).append(r)
            listing = "; ".join(f"ranks {rs}: {v}" for v, rs in by_value.items())
            note = "" if vary is None else f" (sizes along dim {vary[i]} may differ, the other dims may not)"
            raise CrossRankMismatchError(
                f"diffcomm.{opname}(): the tensor lists differ between ranks, first at position {i} "
                f"(tensors[{i}]): {listing}{note}. Every rank must pass the same number of tensors "
                "with the same shapes, dtypes and requires_grad, in the same order"
            )


def _decode(row: list[int], n: int) -> list[tuple[Any, str]]:
    """Per tensor: ``(what must agree, its description)``."""
    names = _dtype_names()
    out, i = [], 0
    for _ in range(n):
        code, grad, nd, vary = row[i], row[i + 1], row[i + 2], row[i + 3]
        shape = tuple(row[i + 4 : i + 4 + nd])
        i += 4 + nd
        key = (code, grad, nd, tuple(-1 if d == vary else s for d, s in enumerate(shape)))
        shown = "[" + ", ".join("*" if d == vary else str(s) for d, s in enumerate(shape)) + "]"
        out.append((key, f"shape {shown} dtype {names.get(code, code)} requires_grad={bool(grad)}"))
    return out


def check_dims(ts: Sequence[Tensor], dim: Any, op: str) -> list[int]:
    dims = []
    for i, t in enumerate(ts):
        if t.ndim == 0:
            raise A.arg_error(op, f"tensors[{i}]", "a tensor with at least one dimension", "a 0-dim tensor")
        dims.append(A.check_dim(t, dim, op))
    return dims


def check_split_sizes_list(
    split_sizes: Any,
    ts: Sequence[Tensor],
    dims: Sequence[int],
    world: int,
    op: str,
    gathered: bool,
    rank: int,
) -> tuple[tuple[int, ...], ...]:
    """``split_sizes`` of a coalesced gather/scatter, validated (before any communication):
    one entry per tensor, each ``world`` non-negative ints. ``gathered``
    (``all_gather_coalesced``): entry ``i`` lists every rank's ``tensors[i].shape[dim]``,
    this rank's equal to its own; else (``reduce_scatter_coalesced``) it splits
    ``tensors[i].shape[dim]``."""
    if isinstance(split_sizes, Tensor) or not isinstance(split_sizes, list | tuple):
        raise A.arg_error(
            op,
            "split_sizes",
            "a list with one list of per-rank sizes per tensor",
            type(split_sizes).__name__,
            TypeError,
        )
    if len(split_sizes) != len(ts):
        raise A.arg_error(
            op, "split_sizes", f"one entry per tensor ({len(ts)})", f"{len(split_sizes)} entries"
        )
    out = []
    for i, (s, t, d) in enumerate(zip(split_sizes, ts, dims)):
        arg = f"split_sizes[{i}]"
        if isinstance(s, Tensor) or not isinstance(s, list | tuple):
            raise A.arg_error(op, arg, f"a list of {world} per-rank sizes", type(s).__name__, TypeError)
        total = sum(int(v) for v in s) if gathered and all(isinstance(v, int) for v in s) else t.shape[d]
        sizes = A.check_split_sizes(s, total, world, op, arg)
        if gathered and sizes[rank] != t.shape[d]:
            raise A.arg_error(
                op, arg, f"to list tensors[{i}].shape[{d}]={t.shape[d]} at this rank's position", sizes
            )
        out.append(tuple(int(v) for v in sizes))
    return tuple(out)


def even_split_sizes(
    ts: Sequence[Tensor], dims: Sequence[int], world: int, op: str
) -> tuple[tuple[int, ...], ...]:
    """The even split of each ``tensors[i]`` along its dim over ``world`` ranks (a coalesced
    scatter given no ``split_sizes``); a size that does not divide is an error naming it."""
    for i, (t, d) in enumerate(zip(ts, dims)):
        if t.shape[d] % world:
            raise A.arg_error(
                op,
                f"tensors[{i}]",
                f"of a size along dim {d} divisible by the group size {world} (or pass `split_sizes`)",
                f"shape {list(t.shape)}",
            )
    return tuple((t.shape[d] // world,) * world for t, d in zip(ts, dims))


def even_or_none(sizes: tuple[tuple[int, ...], ...] | None) -> tuple[tuple[int, ...], ...] | None:
    """``None`` when every tensor's per-rank sizes are equal (the even path), else ``sizes``."""
    if sizes is None or all(s.count(s[0]) == len(s) for s in sizes if s):
        return None
    return sizes


Spec = tuple[tuple[int, ...], str, bool, bool]  # a case's tensor: shape, dtype, requires_grad, used


def case_specs(world: int) -> tuple[tuple[Spec, ...], tuple[Spec, ...], tuple[Spec, ...]]:
    """The test cases' tensor lists (``mixed``, without int64, with ``world`` rows along dim
    0): float64, float32, int64, an empty tensor, a 0-dim one, one not requiring grad,
    one unused output."""
    mixed: tuple[Spec, ...] = (
        ((2, 3), "float64", True, True),
        ((), "float32", True, True),
        ((0, 3), "float64", True, True),
        ((3,), "int64", False, True),
        ((3, 1), "float32", False, True),
        ((3, 2), "float64", True, False),
    )
    no_int = tuple(s for s in mixed if s[1] != "int64")
    with_dim = tuple(((world, *s[0][1:]) if s[0] else (world,), *s[1:]) for s in mixed)
    return mixed, no_int, with_dim
