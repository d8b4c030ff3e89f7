"""An all_gather whose row counts nobody has given: the counts travel with the rows,
and with them every rank's other dims and dtype, so a mismatch is an error on every rank.

``all_gather(x)`` without ``split_sizes`` must learn every rank's ``x.shape[0]`` before
it can gather (uneven sizes just work). Exchanging them first is a second collective,
which doubles a small gather's latency. Instead, once a group has gathered rows, each
rank sends ``[its shape record | its rows, padded to B bytes]``, where ``B`` is the
largest row bytes that group has seen recently. That is one collective. Every rank reads
every record from the result, so every rank takes the same decision:

* the records disagree outside the gathered dim's size (another dim's size, the number of
  dims, the dtype, the gathered dim itself): a :class:`~diffcomm.CrossRankMismatchError`
  (a ``ValueError``) on every rank, naming the ranks and the dim - instead of wrong
  values or, had the ranks sent
  different byte counts, gloo aborting the process;
* every rank's rows fit in ``B``: the rows are unpadded and the gather is done;
* a rank's rows did not fit: the gather runs again with the counts now known (two
  collectives, as with an exchange first). ``B`` grows to the new largest, and it shrinks
  when the rows fall below a quarter of it.

``B`` is one number per group record (:class:`~diffcomm.backend.groups.GroupInfo`, made anew
for a new world), updated from the gathered records only, so it is the same on every
rank whatever shape each rank passes: every rank sends the same number of bytes and
makes the same choice between one collective and two. (Keyed by the shape, it would not
be: a rank whose shape is wrong would take the other path and the byte counts would
differ.) Before a group has gathered rows, the records alone are exchanged first (the
*size exchange*, :func:`exchange_first`) and ``B`` is set from them; that exchange checks
the records too, and so does ``gather``'s.

Used for host-memory (gloo) groups and rows of at most :data:`MAX_BYTES` per rank:
there the saved collective outweighs the copies into and out of the padded buffer. On an
accelerator the counts would have to come back to the host (a device synchronisation),
so the CPU side channel exchange stays.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._errors import CrossRankMismatchError
from ..diagnostics.logger import label
from .direct_calls import c10d_all_gather
from .dispatch import dispatch
from .groups import GroupInfo

#: int64 slots of a rank's shape record: ``[rows, dtype and the gathered dim, number of
#: other dims, hash of the other dims, the first SHOWN other dims (-1 past the last)]``.
RECORD = 16
SHOWN = RECORD - 4
#: Bytes in front of each rank's rows: its shape record (aligned for any dtype).
HEAD = RECORD * 8
#: Largest padded rows per rank (bytes) gathered with their records; larger gathers
#: exchange the records first (the copies would cost more than the collective saved).
MAX_BYTES = 256 * 1024
_BUDGET = "row bytes"  # the key of B in ``GroupInfo.gathered_rows``
_PACK = struct.Struct(f"={RECORD}q").pack  # a record as native int64s (the wire's byte order)
_UNPACK = struct.Struct(f"={RECORD}q").unpack_from

_DTYPES = {zlib.crc32(str(d).encode()): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def shape_record(n: int, rest: tuple[int, ...], dtype: torch.dtype, dim: int) -> list[int]:
    """A rank's shape record (:data:`RECORD` ints): ``n`` rows of ``rest`` in ``dtype``,
    gathered along ``dim`` (non-negative). The dim travels too: ranks gathering a square
    ``x`` along different dims agree in everything else and moved the same bytes, a
    silently wrong value on every rank."""
    return [n, *_record_tail(rest, dtype, dim)]


@functools.lru_cache(maxsize=256)
def _record_tail(rest: tuple[int, ...], dtype: torch.dtype, dim: int) -> tuple[int, ...]:
    dims = list(rest[:SHOWN]) + [-1] * (SHOWN - min(len(rest), SHOWN))
    kind = zlib.crc32(str(dtype).encode()) | dim << 32  # (a crc32 fits in the low 32 bits)
    return (kind, len(rest), zlib.crc32(repr(rest).encode()), *dims)


def check_records(table: list[list[int]], op: str, dim: int) -> list[int]:
    """Every rank's row count from the gathered shape records; raises
    :class:`~diffcomm.CrossRankMismatchError` (the same on every rank, which all hold the
    same table) when the ranks' ``x`` differ in anything but ``x.shape[dim]``."""
    if all(row[1:] == table[0][1:] for row in table):
        return [row[0] for row in table]

    def shape(row: list[int]) -> str:
        rest = row[4 : 4 + min(row[2], SHOWN)]
        dims = [*rest[:dim], row[0], *rest[dim:]]
        more = ", ..." if row[2] > SHOWN else ""
        return "(" + ", ".join(map(str, dims)) + more + ("," if len(dims) == 1 else "") + ")"

    def by_value(key: Any) -> str:
        groups: dict[Any, list[int]] = {}
        for r, row in enumerate(table):
            groups.setdefault(key(row), []).append(r)
        return "; ".join(f"{v} on rank(s) {rs}" for v, rs in groups.items())

    if any(row[1] >> 32 != table[0][1] >> 32 for row in table):
        raise CrossRankMismatchError(
            f"diffcomm.{op}(): the ranks must concatenate along the same `dim`, but `dim` differs: "
            + by_value(lambda row: row[1] >> 32)
            + " (as a non-negative index). Every rank must pass the same dim."
        )
    if any(row[1] != table[0][1] for row in table):
        what = "its dtype differs: " + by_value(
            lambda row: str(_DTYPES.get(row[1] & 0xFFFFFFFF, "an unknown dtype"))
        )
    elif any(row[2] != table[0][2] for row in table):
        what = "its number of dims differs: " + by_value(lambda row: f"{row[2] + 1}-d")
    else:
        shown = range(min(table[0][2], SHOWN))
        at = next((i for i in shown if any(row[4 + i] != table[0][4 + i] for row in table)), None)
        if at is None:
            what = f"its shape differs beyond dim {SHOWN}"
        else:
            d = at if at < dim else at + 1
            what = f"x.shape[{d}] differs: " + by_value(lambda row: row[4 + at])
    shapes = by_value(shape) if all(row[1] == table[0][1] for row in table) else ""
    raise CrossRankMismatchError(
        f"diffcomm.{op}(): the ranks' `x` must agree in every dim but `dim`={dim} (the one "
        f"{op} concatenates along) and in dtype, but {what}"
        + (f" (x.shape: {shapes})" if shapes and "dtype" not in what else "")
        + ". Every rank must pass the same shape apart from x.shape[dim]."
    )


def exchange_first(
    x: torch.Tensor, exchange: Callable[[list[int]], list[list[int]]], op: str, dim: int
) -> list[int]:
    """Every rank's ``x.shape[dim]`` by exchanging shape records (one tiny all_gather),
    checked across ranks (:func:`check_records`)."""
    shape = tuple(x.shape)
    rest = shape[:dim] + shape[dim + 1 :]
    return check_records(exchange(shape_record(shape[dim], rest, x.dtype, dim)), op, dim)


def all_gather_unsized(
    x: torch.Tensor,
    info: GroupInfo,
    gather: Callable[[torch.Tensor, list[int]], torch.Tensor],
    exchange: Callable[[list[int]], list[list[int]]],
    gather_into_tensor: bool,
    dim: int = 0,
) -> tuple[torch.Tensor, list[int]]:
    """Gather ``x`` (any strides) along dim 0 over ``info``'s group without knowing the
    other ranks' row counts; returns the result and every rank's count.

    ``gather(x, sizes)`` is the gather with known counts, ``exchange(record)`` the
    record exchange (every rank's record); ``gather_into_tensor``: the backend has a
    one-tensor all_gather (without it, always exchange first). ``dim``: the user's
    gathered dim (``x`` is the user's tensor with it moved to 0), for error messages."""
    n = x.shape[0]
    rest = tuple(x.shape[1:])
    row = math.prod(rest) * x.element_size()
    seen: dict[Any, int] = info.gathered_rows
    budget = seen.get(_BUDGET)
    # every term is the same on every rank (group facts, B): the same path everywhere
    speculate = (
        budget is not None
        and gather_into_tensor
        and info.size > 1
        and budget <= MAX_BYTES
        and info.device.type == "cpu"
    )
    record = shape_record(n, rest, x.dtype, dim)
    if not speculate or x.device.type != "cpu":
        with label("all_gather (size exchange)"):
            sizes = check_records(exchange(record), "all_gather", dim)
        _remember(seen, max(sizes, default=0) * row)
        with label("all_gather"):
            return gather(x, sizes), sizes
    assert budget is not None
    world = info.size
    stride = HEAD + -(-budget // HEAD) * HEAD
    send = torch.empty(stride, dtype=torch.uint8)
    # the record through numpy and struct: a torch.tensor from a list costs ~10 us
    send.numpy()[:HEAD] = np.frombuffer(_PACK(*record), np.uint8)
    k = min(n, budget // row) if row else n
    if k and row:  # through a typed view of the buffer (HEAD keeps it aligned): any strides of x
        send[HEAD : HEAD + k * row].view(x.dtype).view(k, *rest).copy_(x[:k])
    table = _gather_padded(send, info, "all_gather")
    raw = table.numpy().reshape(-1).data  # (a memoryview: the buffer struct unpacks from)
    sizes = check_records([list(_UNPACK(raw, r * stride)) for r in range(world)], "all_gather", dim)
    top = max(sizes)
    if top * row > budget:  # a rank's rows did not fit: every rank saw it; gather them, counts known
        _remember(seen, top * row)
        with label("all_gather"):
            return gather(x, sizes), sizes
    if 4 * top * row < budget:
        _remember(seen, top * row)
    return _unpad(table, HEAD, sizes, row, rest, x.dtype), sizes


def _gather_padded(send: torch.Tensor, info: GroupInfo, name: str) -> torch.Tensor:
    """Every rank's padded buffer ``send`` (bytes, the same length on every rank), as a
    ``(world, len(send))`` table: one all_gather."""
    world = info.size
    got = torch.empty(world * send.numel(), dtype=torch.uint8)
    with label(name):
        dispatch(
            "all_gather",
            info.pg,
            got.numel(),
            lambda: c10d_all_gather(got, send, info.pg),
            lambda: got.copy_(send.repeat(world)),
            got,
        )
    return got.view(world, send.numel())


def _unpad(
    table: torch.Tensor, at: int, sizes: list[int], row: int, rest: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The rows of every rank, concatenated, from the gathered padded ``table`` (rank
    ``r``'s ``sizes[r]`` rows of ``row`` bytes start at byte ``at`` of its line)."""
    world, top = table.shape[0], max(sizes, default=0)
    out = torch.empty((sum(sizes), *rest), dtype=dtype)
    if top and row and sizes.count(top) == world:  # one strided copy (every rank's rows start aligned)
        out.view(world, top, *rest).copy_(table[:, at : at + top * row].view(dtype).view(world, top, *rest))
    elif top and row:
        pos = 0
        for r, n in enumerate(sizes):
            if n:
                out[pos : pos + n].copy_(table[r, at : at + n * row].view(dtype).view(n, *rest))
            pos += n
    return out


def _remember(seen: dict[Any, int], row_bytes: int) -> None:
    seen[_BUDGET] = row_bytes


# --------------------------------------------------------------------------------------
# coalesced lists: several counts per rank, one padded row budget per list key
# --------------------------------------------------------------------------------------

#: list keys remembered per group, oldest first out (the same on every rank: updated only
#: from gathered counts)
KEEP = 64
#: alignment of the counts in front of a coalesced gather's rows
_ALIGN = 64


def can_speculate(
    key: Any, row_bytes: int, info: GroupInfo, device: torch.device, gather_into_tensor: bool
) -> bool:
    """Whether a gather of rows of ``row_bytes`` under ``key`` goes out with its counts in
    one collective (the group has gathered such rows, on the host, small enough); the
    same answer on every rank of the group (it reads only what they share)."""
    m = info.gathered_rows.get(key)
    return (
        m is not None
        and gather_into_tensor
        and info.size > 1
        and row_bytes > 0
        and m * row_bytes <= MAX_BYTES
        and info.device.type == "cpu"
        and device.type == "cpu"
    )


def all_gather_counted(
    x: torch.Tensor,
    counts: list[int],
    rows_of: Callable[[list[int]], int],
    key: Any,
    info: GroupInfo,
    gather: Callable[[torch.Tensor, list[int]], torch.Tensor],
    exchange: Callable[[list[int]], list[list[int]]],
    gather_into_tensor: bool,
    name: str = "all_gather",
) -> tuple[torch.Tensor, list[list[int]]]:
    """Gather ``x`` (rows along dim 0, any strides) when no rank knows the others'
    ``counts`` — a few integers per rank from which ``rows_of(counts)`` gives that rank's
    row count (:func:`all_gather_unsized`: the row count itself; a coalesced gather: every
    tensor's size along its dim). Returns the rows of every rank, concatenated, and every
    rank's ``counts`` (the table).

    The counts travel in front of the rows, padded to the largest row count ``M`` this
    group has seen under ``key``: one collective; when a rank's rows did not fit, a second
    gather with the counts now known; before the group has seen ``key``, the counts are
    exchanged first (``exchange(counts)`` -> table) and the rows gathered after."""
    k = len(counts)
    rest = tuple(x.shape[1:])
    row = math.prod(rest) * x.element_size()
    seen: dict[Any, int] = info.gathered_rows
    if not can_speculate(key, row, info, x.device, gather_into_tensor):
        with label(f"{name} (size exchange)"):
            exchanged = exchange(counts)
        sizes = [rows_of(r) for r in exchanged]
        _remember_key(seen, key, max(sizes, default=0))
        with label(name):
            return gather(x, sizes), exchanged
    m = seen[key]
    n = rows_of(counts)
    world = info.size
    head = -(-8 * k // _ALIGN) * _ALIGN  # the counts, padded so that the rows start aligned
    stride = head + -(-m * row // _ALIGN) * _ALIGN
    send = torch.empty(stride, dtype=torch.uint8)
    send[: 8 * k].view(torch.int64).copy_(torch.tensor(counts, dtype=torch.int64))
    kept = min(n, m)
    if kept:  # through a typed view of the buffer (head keeps it aligned): any strides of x
        send[head : head + kept * row].view(x.dtype).view(kept, *rest).copy_(x[:kept])
    rows = _gather_padded(send, info, name)
    table: list[list[int]] = rows[:, : 8 * k].contiguous().view(torch.int64).view(world, k).tolist()
    sizes = [rows_of(r) for r in table]
    top = max(sizes)
    if top > m:  # a rank's rows did not fit: every rank saw it; gather them, counts known
        _remember_key(seen, key, top)
        with label(name):
            return gather(x, sizes), table
    if 4 * top < m:
        _remember_key(seen, key, top)
    return _unpad(rows, head, sizes, row, rest, x.dtype), table


def _remember_key(seen: dict[Any, int], key: Any, m: int) -> None:
    seen.pop(key, None)
    seen[key] = m
    while len(seen) > KEEP:
        del seen[next(k for k in seen if k != _BUDGET)]


def remember_rows(info: GroupInfo, key: Any, m: int) -> None:
    """Set ``M`` of ``key`` for ``info``'s group (from counts every rank has)."""
    _remember_key(info.gathered_rows, key, m)
