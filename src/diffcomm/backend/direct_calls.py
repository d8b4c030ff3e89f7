"""Direct calls of the ``ProcessGroup`` methods behind the hottest raw ops.

``dist.all_reduce``, ``dist.broadcast``, ``dist.reduce``, ``all_gather_single``, ``reduce_scatter_single``
and ``dist.all_to_all_single`` are Python wrappers (an exception logger, the
torch-function check, the group lookup, the coalescing-block check, a fresh options
object) around the ``ProcessGroup`` method of the same job: about a dozen Python calls,
several microseconds, on every call (twice per forward+backward). For the common case
(a plain, real tensor, a group this rank is in, no ``dist._coalescing_manager`` block)
these functions call the process group directly, as the wrapper would, with options made
once; anything else goes through the wrapper. Every function blocks until the op is done.

Used by :mod:`diffcomm.backend.torch_distributed` only, inside its :func:`~diffcomm.backend.dispatch.dispatch`
calls (so the flight recorder and the comms logger see each op). Also here: the names of
the single-tensor gather / scatter under both torch spellings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import _torch
from .groups import C10D as _C10D
from .groups import ProcessGroup
from .in_process import InProcessGroup as _IN_PROCESS

_NON_MEMBER = dist.GroupMember.NON_GROUP_MEMBER
_COALESCING = _torch.coalescing_state()  # one dict for the life of the process (torch mutates it)
_ALLREDUCE_OPTS: dict[Any, Any] = {}


def _direct_group(t: torch.Tensor, group: ProcessGroup) -> Any:
    """The process group to call directly, or ``None`` where torch's wrapper must run."""
    pg = _C10D._default_pg if group is None else group
    if pg is None or pg is _NON_MEMBER or type(t) is not torch.Tensor or t.is_complex():
        return None
    if type(pg) is _IN_PROCESS:  # a Python group: torch's wrapper calls its methods
        return None
    state = _COALESCING
    if state and pg in state:  # inside dist._coalescing_manager: the wrapper records it
        return None
    return pg


def _reduce_opts(cache: dict[Any, Any], make: Callable[[], Any], op: Any) -> Any:
    """Make the blocking options object for reduce op ``op`` and keep it in ``cache``
    (callers look there first, inline: ``cache.get(op) or _reduce_opts(...)``)."""
    opts = cache[op] = make()
    opts.reduceOp = op
    opts.asyncOp = False
    return opts


def c10d_all_reduce(t: torch.Tensor, op: Any, group: ProcessGroup) -> None:
    """``dist.all_reduce(t, op, group=group)`` (blocking, in place)."""
    pg = _direct_group(t, group)
    if pg is None:
        dist.all_reduce(t, op, group=group)
    else:
        opts = _ALLREDUCE_OPTS.get(op) or _reduce_opts(_ALLREDUCE_OPTS, dist.AllreduceOptions, op)
        work = pg.allreduce([t], opts)
        if work is not None:  # see _wait (inline: every raw op passes here)
            work.wait()


_PG_ALLGATHER = _torch.pg_method("all_gather_single", "_allgather_base")
_PG_REDUCE_SCATTER = _torch.pg_method("reduce_scatter_single", "_reduce_scatter_base")
_PG_ALLTOALL = _torch.pg_method("all_to_all_single", "alltoall_base")
_ALLGATHER_OPTS = dist.distributed_c10d.AllgatherOptions()
_ALLGATHER_OPTS.asyncOp = False
_ALLTOALL_OPTS = dist.AllToAllOptions()
_ALLTOALL_OPTS.asyncOp = False
_REDUCE_SCATTER_OPTS: dict[Any, Any] = {}


def _wait(work: Any) -> None:
    """Wait for a blocking op's work (the hot ops write this inline: a call frame costs
    as much as the rest of the wait)."""
    if work is not None:  # backends that sync in C++ return no work
        work.wait()


def c10d_all_gather(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup) -> None:
    """``all_gather_single(out, x, group=group)`` (blocking; real tensors, as :func:`wire`
    makes them)."""
    pg = _direct_group(x, group)
    if pg is None:
        all_gather_single(out, x, group=group)
    else:
        work = _PG_ALLGATHER(pg, out, x, _ALLGATHER_OPTS)
        if work is not None:  # see _wait
            work.wait()


def c10d_reduce_scatter(out: torch.Tensor, x: torch.Tensor, op: Any, group: ProcessGroup) -> None:
    """``reduce_scatter_single(out, x, op=op, group=group)`` (blocking)."""
    pg = _direct_group(x, group)
    if pg is None:
        reduce_scatter_single(out, x, op=op, group=group)
    else:
        cache = _REDUCE_SCATTER_OPTS
        opts = cache.get(op) or _reduce_opts(cache, dist.ReduceScatterOptions, op)
        work = _PG_REDUCE_SCATTER(pg, out, x, opts)
        if work is not None:  # see _wait
            work.wait()


def c10d_all_to_all(
    out: torch.Tensor, x: torch.Tensor, outs: list[int] | None, ins: list[int] | None, group: ProcessGroup
) -> None:
    """``all_to_all_single(out, x, outs, ins, group=group)`` (blocking)."""
    pg = _direct_group(x, group)
    if pg is None or x.dtype != out.dtype:  # torch's wrapper names the dtype mismatch
        dist.all_to_all_single(out, x, outs, ins, group=group)
    else:
        outs, ins = [] if outs is None else outs, [] if ins is None else ins
        work = _PG_ALLTOALL(pg, out, x, outs, ins, _ALLTOALL_OPTS)
        if work is not None:  # see _wait
            work.wait()


def c10d_broadcast(t: torch.Tensor, src: int, group: ProcessGroup) -> None:
    """``dist.broadcast(t, group_src=src, group=group)`` (blocking, in place; ``src`` is
    group-local)."""
    pg = _direct_group(t, group)
    if pg is None or (t.element_size() == 1 and t.is_floating_point()):  # fp8: torch's workaround
        dist.broadcast(t, group_src=src, group=group)
        return
    opts = _BROADCAST_OPTS.get(src)
    if opts is None:  # made once per root, then shared (as the reduce options)
        opts = _BROADCAST_OPTS[src] = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.asyncOp = False
    work = pg.broadcast([t], opts)
    if work is not None:  # see _wait
        work.wait()


_BROADCAST_OPTS: dict[int, Any] = {}


_REDUCE_OPTS: dict[Any, Any] = {}


def c10d_reduce(t: torch.Tensor, dst: int, op: Any, group: ProcessGroup) -> None:
    """``dist.reduce(t, group_dst=dst, op=op, group=group)`` (blocking, in place on
    ``dst``; ``dst`` is group-local)."""
    pg = _direct_group(t, group)
    if pg is None:
        dist.reduce(t, group_dst=dst, op=op, group=group)
        return
    opts = _REDUCE_OPTS.get((op, dst))
    if opts is None:
        opts = _REDUCE_OPTS[(op, dst)] = dist.ReduceOptions()
        opts.reduceOp = op
        opts.rootRank = dst
        opts.asyncOp = False
    work = pg.reduce([t], opts)
    if work is not None:  # see _wait
        work.wait()


# torch >= 2.12 renamed the single-tensor forms; use whichever this torch has (version gap
# hidden here, so no deprecation warning reaches users).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
