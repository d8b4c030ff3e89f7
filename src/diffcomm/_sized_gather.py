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
    n = x.shape[0]
    rest = tuple(x.shape[1:])
    row = math.prod(rest) * x.element_size()
    key = (rest, x.dtype)
    seen: dict[Any, int] = info.gathered_rows
    m = seen.get(key)
    speculate = (
        m is not None
        and gather_into_tensor
        and info.size > 1
        and row > 0
        and m * row <= MAX_BYTES
        and info.device.type == "cpu"
        and x.device.type == "cpu"
    )
    if not speculate:
        with label("all_gather (size exchange)"):
            sizes = exchange(n)
        _remember(seen, key, max(sizes, default=0))
        with label("all_gather"):
            return gather(x, sizes), sizes
    assert m is not None
    world = info.size
    stride = HEAD + -(-m * row // HEAD) * HEAD
    send = torch.empty(stride, dtype=torch.uint8)
    send[:8].view(torch.int64).fill_(n)
    k = min(n, m)
    if k:  # through a typed view of the buffer (HEAD keeps it aligned): any strides of x
        send[HEAD : HEAD + k * row].view(x.dtype).view(k, *rest).copy_(x[:k])
    got = torch.empty(world * stride, dtype=torch.uint8)
    with label("all_gather"):
        dispatch(
            "all_gather",
            info.pg,
            got.numel(),
            lambda: c10d_all_gather(got, send, info.pg),
            lambda: got.copy_(send.repeat(world)),
            got,
        )
    table = got.view(world, stride)
    sizes: list[int] = table[:, :8].contiguous().view(torch.int64).view(-1).tolist()
    top = max(sizes)
    if top > m:  # a rank's rows did not fit: every rank saw it; gather them, counts known
        _remember(seen, key, top)
        with label("all_gather"):
            return gather(x, sizes), sizes
    if 4 * top < m:
        _remember(seen, key, top)
    out = torch.empty((sum(sizes), *rest), dtype=x.dtype)
    if top and sizes.count(top) == world:  # one strided copy (every rank's rows start aligned)
        rows = table[:, HEAD : HEAD + top * row].view(x.dtype).view(world, top, *rest)
        out.view(world, top, *rest).copy_(rows)
    elif top:
        at = 0
        for r, s in enumerate(sizes):
            if s:
                out[at : at + s].copy_(table[r, HEAD : HEAD + s * row].view(x.dtype).view(s, *rest))
            at += s
    return out, sizes


def _remember(seen: dict[Any, int], key: Any, m: int) -> None:
    seen.pop(key, None)
    seen[key] = m
    while len(seen) > KEEP:
        del seen[next(iter(seen))]
