"""An all_gather whose row counts nobody has given: the counts travel with the rows.

``all_gather(x)`` without ``split_sizes`` must learn every rank's ``x.shape[0]`` before
it can gather (uneven sizes just work). Exchanging them first is a second collective,
which doubles a small gather's latency. Instead, once a group has gathered rows of a
given trailing shape and dtype, each rank sends ``[its row count | its rows, padded to
M]``, where ``M`` is the largest count that group has seen for them. That is one
collective. Every rank reads every count from the result, so every rank takes the same
decision:

* every count ``<= M``: the rows are unpadded and the gather is done;
* a count ``> M`` (a rank's rows did not fit): the gather runs again with the counts now
  known (two collectives, as with an exchange first). ``M`` grows to the new largest,
  and it shrinks when the counts fall below a quarter of it.

``M`` is remembered per group record (:class:`~diffcomm._groups.GroupInfo`, made anew
for a new world) and per (trailing shape, dtype), and it is updated from the gathered
counts only. So it is the same on every rank of the group, and every rank makes the same
choice between one collective and two. Before a group has gathered such rows, the counts
are exchanged first and ``M`` is set from them.

Used for host-memory (gloo) groups and rows of at most :data:`MAX_BYTES` per rank:
there the saved collective outweighs the copies into and out of the padded buffer. On an
accelerator the counts would have to come back to the host (a device synchronisation),
so the CPU side channel exchange stays.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ._c10d import c10d_all_gather
from ._commslog import label
from ._dispatch import dispatch
from ._groups import GroupInfo

#: Bytes in front of each rank's rows: its row count (one int64), padded so that every
#: rank's rows start aligned for any dtype.
HEAD = 64
#: Largest padded rows per rank (bytes) gathered with their counts; larger gathers
#: exchange the counts first (the copies would cost more than the collective saved).
MAX_BYTES = 256 * 1024
#: (trailing shape, dtype) keys remembered per group, oldest first out (the same on
#: every rank: updated only from gathered counts).
KEEP = 64


def all_gather_unsized(
    x: torch.Tensor,
    info: GroupInfo,
    gather: Callable[[torch.Tensor, list[int]], torch.Tensor],
    exchange: Callable[[int], list[int]],
    gather_into_tensor: bool,
) -> tuple[torch.Tensor, list[int]]:
    """Gather ``x`` (any strides) along dim 0 over ``info``'s group without knowing the
    other ranks' row counts; returns the result and every rank's count.

    ``gather(x, sizes)`` is the gather with known counts, ``exchange(n)`` the count
    exchange; ``gather_into_tensor``: the backend has a one-tensor all_gather (without
    it, always exchange first)."""
    key = (tuple(x.shape[1:]), x.dtype)
    out, table = all_gather_counted(
        x,
        [x.shape[0]],
        _first,
        key,
        info,
        gather,
        lambda counts: [[n] for n in exchange(counts[0])],
        gather_into_tensor,
    )
    return out, [row[0] for row in table]


def _first(row: list[int]) -> int:
    return row[0]


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
            table = exchange(counts)
        sizes = [rows_of(r) for r in table]
        _remember(seen, key, max(sizes, default=0))
        with label(name):
            return gather(x, sizes), table
    m = seen[key]
    n = rows_of(counts)
    world = info.size
    head = -(-8 * k // HEAD) * HEAD  # the counts, padded so that the rows start aligned
    stride = head + -(-m * row // HEAD) * HEAD
    send = torch.empty(stride, dtype=torch.uint8)
    send[: 8 * k].view(torch.int64).copy_(torch.tensor(counts, dtype=torch.int64))
    kept = min(n, m)
    if kept:  # through a typed view of the buffer (head keeps it aligned): any strides of x
        send[head : head + kept * row].view(x.dtype).view(kept, *rest).copy_(x[:kept])
    got = torch.empty(world * stride, dtype=torch.uint8)
    with label(name):
        dispatch(
            "all_gather",
            info.pg,
            got.numel(),
            lambda: c10d_all_gather(got, send, info.pg),
            lambda: got.copy_(send.repeat(world)),
            got,
        )
    rows = got.view(world, stride)
    table: list[list[int]] = rows[:, : 8 * k].contiguous().view(torch.int64).view(world, k).tolist()
    sizes = [rows_of(r) for r in table]
    top = max(sizes)
    if top > m:  # a rank's rows did not fit: every rank saw it; gather them, counts known
        _remember(seen, key, top)
        with label(name):
            return gather(x, sizes), table
    if 4 * top < m:
        _remember(seen, key, top)
    out = torch.empty((sum(sizes), *rest), dtype=x.dtype)
    if top and sizes.count(top) == world:  # one strided copy (every rank's rows start aligned)
        block = rows[:, head : head + top * row].view(x.dtype).view(world, top, *rest)
        out.view(world, top, *rest).copy_(block)
    elif top:
        at = 0
        for r, s in enumerate(sizes):
            if s:
                out[at : at + s].copy_(rows[r, head : head + s * row].view(x.dtype).view(s, *rest))
            at += s
    return out, table


def _remember(seen: dict[Any, int], key: Any, m: int) -> None:
    seen.pop(key, None)
    seen[key] = m
    while len(seen) > KEEP:
        del seen[next(iter(seen))]


def remember_rows(info: GroupInfo, key: Any, m: int) -> None:
    """Set ``M`` of ``key`` for ``info``'s group (from counts every rank has)."""
    _remember(info.gathered_rows, key, m)
