"""The raw ops over ``torch.distributed``: :class:`TorchDistributedBackend`, the default
:class:`~diffcomm.backend.Backend`.

Everything here is out-of-place (returns new tensors, never writes into its inputs) and
works along **dim 0 of a contiguous tensor**; the collectives move dims and make
contiguous before calling in. Ranks are **group-local**. Backend gaps are filled here and
only here (an uneven all_gather on gloo, a reduce_scatter a backend lacks, ``avg`` on a
backend without it...), so the autograd layer never branches on "nccl" or "gloo". Every
raw call goes through :func:`diffcomm.backend.dispatch.dispatch` (the hottest ones then call the
process group directly: :mod:`diffcomm.backend.direct_calls`); facts about the group come from the
cached group record (:func:`diffcomm.backend.groups.group_info`).

Also here, shared with the traceable adapter: the coalesced ops (:class:`CoalescedOps`)
and the padding / complex-as-real helpers. Re-exported by :mod:`diffcomm.backend`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import _torch
from .._errors import CrossRankMismatchError
from .._replication import spmd_types_untyped
from ..diagnostics.logger import label
from .buffers import joined
from .consistency import PAD, encode, mismatch
from .direct_calls import (
    c10d_all_gather,
    c10d_all_reduce,
    c10d_all_to_all,
    c10d_broadcast,
    c10d_reduce,
    c10d_reduce_scatter,
)
from .dispatch import dispatch as _dispatch
from .dispatch import run_coalesced
from .dispatch import tensor_nbytes as _nbytes
from .groups import Capabilities, GroupInfo, ProcessGroup, cpu_group, group_info
from .sized_gather import all_gather_counted, all_gather_unsized, can_speculate
from .sized_gather import remember_rows as _remember_rows

# Size: ~940 lines, over the ~600 guideline: it is the one class that answers every
# raw op of the Backend protocol on torch.distributed (eight collectives, p2p, barrier,
# the gathering of the cross-rank consistency check, whose encoding is .consistency),
# with each op's gap-filling beside it (uneven sizes on gloo, reduce ops a backend lacks,
# max/min that drop a NaN, complex numbers as real pairs), plus the coalesced ops the
# traceable adapter shares. Splitting the gap-filling from its op would put one
# op's behaviour in two files.

_SUM = dist.ReduceOp.SUM
#: (see _replication.spmd_types_checking)
_FUNCTION_ATTRS = torch.autograd.Function.__dict__


def _untyped() -> Any:
    """spmd_types' checker paused around the host integers diffcomm exchanges (sizes, debug
    mode's field codes): :func:`~diffcomm._replication.spmd_types_untyped`."""
    return spmd_types_untyped(_FUNCTION_ATTRS)


_TORCH_OPS = {
    "sum": _SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
#: the ops that reach c10d as they are, whatever the backend and floating dtype (the common
#: case, without further calls; avg may be a sum then a division, max/min may carry NaN flags)
_PLAIN_OPS = {"sum": _SUM, "product": dist.ReduceOp.PRODUCT}
#: the reductions whose floating result is NaN where any rank's element is (as torch's)
_EXTREMA = frozenset({"max", "min"})


def _opening(x: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, GroupInfo, int, int]:
    """A raw op's first lines: the contiguous ``x``, the group's record, its size and this
    rank."""
    info = group_info(group)
    return x.contiguous(), info, info.size, info.rank


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous plain tensor c10d can read. ``scatter`` hands c10d a list of
    chunks, which c10d reads without dispatching to a tensor subclass: a wrapper subclass
    (a user's ``__torch_dispatch__`` wrapper, torch's ``AsyncCollectiveTensor``) has no
    storage of its own, and gloo crashed reading it ("writev: Bad address"), taking the
    world down. Its values are copied into a plain tensor (the chunk of a plain tensor is
    already one: no copy)."""
    if type(t) is torch.Tensor:
        return t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _broadcast_into(out: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor:
    """broadcast into ``out`` (contiguous, owned by the caller) in place; returns it (a
    module function: the hot path calls it without a method lookup)."""
    w = wire(out) if out.dtype in _VIEWED else out  # complex as real pairs, fp8 etc. as bytes
    _dispatch("broadcast", group, out.nbytes, c10d_broadcast, _keep, out, (w, src, group))
    return out


#: split sizes along dim 0, one per rank (``None``: even)
Sizes = Sequence[int] | None


class CoalescedOps:
    """The raw ops every adapter shares: the :meth:`all_to_all` entry point (even or uneven,
    each adapter's own), and the coalesced raw ops: a list of flat buffers (one per dtype,
    packed by the caller), one raw call each, logged as **one** op (``<op>_coalesced``,
    total bytes, ``parts`` = the raw calls). Each buffer follows the single op's rules
    (dim 0, out-of-place)."""

    if TYPE_CHECKING:  # the single ops the subclasses provide

        def all_reduce(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor: ...
        def _all_reduce_into(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor: ...
        def broadcast(self, x: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor: ...

        _broadcast_into: Callable[[torch.Tensor, int, ProcessGroup], torch.Tensor]

        def reduce(self, x: torch.Tensor, dst: int, op: str, group: ProcessGroup) -> torch.Tensor: ...
        def all_gather(
            self, x: torch.Tensor, group: ProcessGroup, sizes: Sequence[int] | None = None
        ) -> torch.Tensor: ...
        def reduce_scatter(
            self, x: torch.Tensor, op: str, group: ProcessGroup, split_sizes: Sequence[int] | None = None
        ) -> torch.Tensor: ...
        def world_size(self, group: ProcessGroup) -> int: ...
        def comm_device(self, group: ProcessGroup) -> torch.device: ...

        def _even_all_to_all(self, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor: ...
        def _uneven_all_to_all(
            self, x: torch.Tensor, group: ProcessGroup, input_split_sizes: Sizes, output_split_sizes: Sizes
        ) -> torch.Tensor: ...

    def all_to_all(
        self,
        x: torch.Tensor,
        group: ProcessGroup,
        input_split_sizes: Sequence[int] | None = None,
        output_split_sizes: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Send chunk ``j`` of ``x`` (dim 0) to rank ``j``; concatenate what arrives. Every
        adapter's entry point: no split sizes is the even exchange (``_even_all_to_all``, the
        common case), else ``_uneven_all_to_all`` (the sizes as given)."""
        if input_split_sizes is None and output_split_sizes is None:
            return self._even_all_to_all(x, group)
        return self._uneven_all_to_all(x, group, input_split_sizes, output_split_sizes)

    def coalesced(
        self, op: str, group: ProcessGroup, xs: Sequence[torch.Tensor], fn: Callable[[torch.Tensor], Any]
    ) -> list[torch.Tensor]:
        return [fn(x) for x in xs]

    def all_reduce_coalesced(
        self, xs: Sequence[torch.Tensor], op: str, group: ProcessGroup, owned: bool = False
    ) -> list[torch.Tensor]:
        """``owned``: the buffers are the caller's fresh contiguous packing, free to be
        reduced in place (saves a copy of the payload)."""
        fn = self._all_reduce_into if owned else self.all_reduce
        return self.coalesced("all_reduce", group, xs, lambda x: fn(x, op, group))

    def broadcast_coalesced(
        self, xs: Sequence[torch.Tensor], src: int, group: ProcessGroup, owned: bool = False
    ) -> list[torch.Tensor]:
        fn = self._broadcast_into if owned else self.broadcast
        return self.coalesced("broadcast", group, xs, lambda x: fn(x, src, group))

    def reduce_coalesced(
        self, xs: Sequence[torch.Tensor], dst: int, op: str, group: ProcessGroup
    ) -> list[torch.Tensor]:
        return self.coalesced("reduce", group, xs, lambda x: self.reduce(x, dst, op, group))

    def all_gather_coalesced(
        self, xs: Sequence[torch.Tensor], group: ProcessGroup, sizes: Sequence[Sequence[int]] | None = None
    ) -> list[torch.Tensor]:
        """all_gather along dim 0 of each buffer; ``sizes[k]``: every rank's length of
        buffer ``k`` (``None``: even)."""
        if sizes is None:
            return self.coalesced("all_gather", group, xs, lambda x: self.all_gather(x, group))
        it = iter(sizes)
        return self.coalesced("all_gather", group, xs, lambda x: self.all_gather(x, group, list(next(it))))

    def reduce_scatter_coalesced(
        self,
        xs: Sequence[torch.Tensor],
        op: str,
        group: ProcessGroup,
        sizes: Sequence[Sequence[int]] | None = None,
    ) -> list[torch.Tensor]:
        """reduce_scatter along dim 0 of each buffer; ``sizes[k]``: the per-rank split of
        buffer ``k`` (``None``: even)."""
        if sizes is None:
            return self.coalesced("reduce_scatter", group, xs, lambda x: self.reduce_scatter(x, op, group))
        it = iter(sizes)
        return self.coalesced(
            "reduce_scatter", group, xs, lambda x: self.reduce_scatter(x, op, group, list(next(it)))
        )

    def exchange_size_lists(self, ns: Sequence[int], group: ProcessGroup) -> list[list[int]]:
        """Every rank's list ``ns`` (the same length on every rank): one small all_gather
        of int64 on the group's device (an adapter with a host side channel overrides it)."""
        world = self.world_size(group)
        if world == 1:
            return [list(ns)]
        mine = torch.tensor(list(ns), dtype=torch.int64, device=self.comm_device(group))
        table = self.all_gather(mine.reshape(1, len(ns)), group).cpu().tolist()
        return [[int(v) for v in row] for row in table]


class TorchDistributedBackend(CoalescedOps):
    """The default :class:`Backend`: ``torch.distributed`` (gloo, nccl, mpi, ucc, xccl)."""

    def __init__(self) -> None:
        self.overrides: dict[str, bool] = {}  # force a capability off/on (tests of fallbacks)

    # ---- group helpers (from the cached group record) --------------------------------
    def rank(self, group: ProcessGroup) -> int:
        return group_info(group).rank

    def world_size(self, group: ProcessGroup) -> int:
        return group_info(group).size

    def comm_device(self, group: ProcessGroup) -> torch.device:
        return group_info(group).device

    def global_rank(self, group: ProcessGroup, rank: int) -> int:
        if group is None:
            return rank
        return dist.get_global_rank(group, rank)

    def backend_name(self, group: ProcessGroup) -> str:
        return group_info(group).backend

    def capabilities(self, group: ProcessGroup = None) -> Capabilities:
        return self._caps(group_info(group))

    def _caps(self, info: GroupInfo) -> Capabilities:
        """``info``'s capabilities with this adapter's overrides (a group record at hand)."""
        caps = info.caps
        if self.overrides:
            caps = Capabilities(**{**caps.as_dict(), **self.overrides})
        return caps

    #: Run a raw single op on each buffer; log them as one ``<op>_coalesced``.
    coalesced = staticmethod(run_coalesced)

    # ---- reductions ----------------------------------------------------------------
    def _reduce_op(self, op: str, x: torch.Tensor, group: ProcessGroup) -> tuple[Any, bool]:
        """torch ReduceOp to use, and whether to divide by the world size afterwards."""
        if op not in _TORCH_OPS:
            raise ValueError(
                f"diffcomm.backend: unknown reduce op {op!r}; legal: {tuple(_TORCH_OPS)} "
                "(normalise user input with diffcomm.backend.args.normalize_op first)"
            )
        if op == "avg" and not (self.capabilities(group).avg and x.is_floating_point()):
            return dist.ReduceOp.SUM, True
        return _TORCH_OPS[op], False

    def _as_wire(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
        # complex sum/avg travel as real pairs where the backend has no complex reduction
        if x.is_complex() and op in ("sum", "avg") and not self.capabilities(group).complex_reduce:
            return torch.view_as_real(x)
        return x

    def all_reduce(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
        return self._all_reduce_into(x.clone(memory_format=torch.contiguous_format), op, group)

    def _all_reduce_into(self, out: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
        """all_reduce of ``out`` (contiguous, owned by the caller) in place; returns it."""
        x = out
        if x.dtype in NARROW:
            return narrow_reduce(out, op, lambda w: self._all_reduce_into(w, op, group), "all_reduce")
        torch_op = _PLAIN_OPS.get(op) if not x.is_complex() else None
        if torch_op is not None:  # the common case, without further calls
            divide, wire = False, out
        else:
            if x.is_complex() and op == "product":
                return self._complex_product(out, group)
            torch_op, divide = self._reduce_op(op, x, group)
            if nan_flagged(op, x, self.capabilities(group)):
                both = nan_flags(out, op)
                _dispatch(
                    "all_reduce", group, both.nbytes, c10d_all_reduce, _keep, both, (both, torch_op, group)
                )
                return out.copy_(unflag(both))
            wire = self._as_wire(out, op, group)
        _dispatch("all_reduce", group, x.nbytes, c10d_all_reduce, _keep, out, (wire, torch_op, group))
        if divide:
            out.div_(self.world_size(group))
        return out

    def _complex_product(self, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        parts = self.all_gather(x.reshape(1, *x.shape), group)
        return torch.prod(parts, dim=0)

    def reduce(self, x: torch.Tensor, dst: int, op: str, group: ProcessGroup) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        if out.dtype in NARROW:
            return narrow_reduce(out, op, lambda w: self.reduce(w, dst, op, group), "reduce")
        torch_op = _PLAIN_OPS.get(op) if not out.is_complex() else None
        if torch_op is not None:  # the common case, without further calls (as all_reduce)
            divide, wire = False, out
        else:
            torch_op, divide = self._reduce_op(op, x, group)
            if nan_flagged(op, out, self.capabilities(group)):
                both = nan_flags(out, op)
                _dispatch(
                    "reduce", group, both.nbytes, c10d_reduce, _keep, both, (both, dst, torch_op, group)
                )
                return out.copy_(unflag(both)) if group_info(group).rank == dst else out.zero_()
            wire = self._as_wire(out, op, group)
        _dispatch("reduce", group, x.nbytes, c10d_reduce, _keep, out, (wire, dst, torch_op, group))
        info = group_info(group)
        if info.rank != dst:
            out.zero_()
        elif divide:
            out.div_(info.size)
        return out

    def broadcast(self, x: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor:
        return _broadcast_into(x.clone(memory_format=torch.contiguous_format), src, group)

    _broadcast_into = staticmethod(_broadcast_into)

    # ---- gather family (dim 0) -----------------------------------------------------
    # The size exchanges run eagerly under torch.compile without fullgraph (a graph break,
    # as check_consistent below): a gather or all_to_all without its sizes reached them
    # from the eager part of a broken frame and dynamo traced on into the c10d call, where
    # it failed on the group object (InternalTorchDynamoError "Member '_device_types' is
    # not registered for this opaque object type"). Compiled code never calls them: the
    # compiled adapter's exchange is the message to pass the sizes.
    @_torch.compiler_disable
    def exchange_sizes(self, n: int, group: ProcessGroup) -> list[int]:
        """Every rank's ``n`` (a small all_gather); used for uneven sizes."""
        info = group_info(group)
        world = info.size
        if world == 1:
            return [n]
        side = cpu_group(info)  # host integers: never a device round trip
        mine = torch.tensor([n], dtype=torch.int64)
        out = torch.empty(world, dtype=torch.int64)
        with _untyped():
            _dispatch(
                "all_gather",
                side,
                8,
                lambda: c10d_all_gather(out, mine, side),
                lambda: out.fill_(n),
                None,
            )
        return [int(v) for v in out.tolist()]

    def exchange_size_lists(self, ns: Sequence[int], group: ProcessGroup) -> list[list[int]]:
        """Every rank's list ``ns`` (one per tensor of a coalesced call; the same length on
        every rank): **one** small all_gather of host integers on the CPU side channel,
        whatever the list's length (:meth:`exchange_records`)."""
        if not ns:
            return [[] for _ in range(group_info(group).size)]
        return self.exchange_records(ns, group)

    def all_gather_coalesced_unsized(
        self,
        bufs: Sequence[torch.Tensor],
        counts: list[int],
        lengths: Callable[[int, list[int]], int],
        key: Any,
        group: ProcessGroup,
    ) -> tuple[list[torch.Tensor], list[list[int]]]:
        """:meth:`all_gather_coalesced` of ``bufs`` (one flat buffer per dtype) when no rank
        knows the others' sizes: ``counts`` (this rank's size along the gathered dim of
        every tensor) and ``lengths(g, counts)`` (buffer ``g``'s length on a rank with
        those counts). Returns the gathered buffers and every rank's counts.

        Once the group has gathered such a list (``key``), the counts travel in front of
        the first buffer's data (:func:`~diffcomm.backend.sized_gather.all_gather_counted`): one
        collective per dtype, the other buffers gathered with their lengths then known.
        Before that (or for large buffers) the counts are exchanged first, in one small
        all_gather for the whole list."""
        info = group_info(group)
        caps = self._caps(info)
        head = bufs[0]
        if not can_speculate(key, head.element_size(), info, head.device, caps.all_gather_into_tensor):
            with label("size exchange"):  # (inside the op's own label)
                exchanged = self.exchange_size_lists(counts, group)
            first = [lengths(0, row) for row in exchanged]
            _remember_rows(info, key, max(first, default=0))
            lens = [[lengths(g, row) for row in exchanged] for g in range(len(bufs))]
            return self.all_gather_coalesced(bufs, group, lens), exchanged
        table: list[list[int]] = []
        at = iter(range(len(bufs)))

        def one(x: torch.Tensor) -> torch.Tensor:
            g = next(at)
            if g:  # the lengths are known from the first buffer's counts
                return self.all_gather(x, group, [lengths(g, row) for row in table])
            out, got = all_gather_counted(
                x,
                counts,
                lambda row: lengths(0, row),
                key,
                info,
                lambda t, sizes: self.all_gather(t, group, sizes),
                lambda cs: self.exchange_size_lists(cs, group),
                caps.all_gather_into_tensor,
                "size exchange",  # used only by a first call, which does not come here
            )
            table.extend(got)
            return out

        return self.coalesced("all_gather", group, bufs, one), table

    @_torch.compiler_disable  # (eagerly under compile: see exchange_sizes)
    def exchange_records(self, record: Sequence[int], group: ProcessGroup) -> list[list[int]]:
        """Every rank's ``record`` (a fixed number of ints, the same on every rank: one
        small all_gather); the shape records of :mod:`diffcomm.backend.sized_gather`."""
        info = group_info(group)
        if info.size == 1:
            return [list(record)]
        side = cpu_group(info)  # host integers: never a device round trip
        mine = torch.tensor(record, dtype=torch.int64)
        out = torch.empty(info.size * len(record), dtype=torch.int64)
        with _untyped():
            _dispatch(
                "all_gather",
                side,
                out.nbytes,
                lambda: c10d_all_gather(out, mine, side),
                lambda: out.copy_(mine.repeat(info.size)),
                None,
            )
        return out.view(info.size, len(record)).tolist()

    def all_gather_unsized(
        self, x: torch.Tensor, group: ProcessGroup, dim: int = 0
    ) -> tuple[torch.Tensor, list[int]]:
        """:meth:`all_gather` of ``x`` (dim 0) when no rank knows the others' row counts:
        the result and every rank's count, in one collective where the group has gathered
        rows before (:mod:`diffcomm.backend.sized_gather`), else an exchange first; either way
        the ranks' other dims and dtypes are compared (``dim``: the user's gathered dim,
        for the message)."""
        info = group_info(group)
        return all_gather_unsized(
            x,  # copied into the message through a typed view: no contiguous copy first
            info,
            lambda t, sizes: self.all_gather(t, group, sizes),
            lambda record: self.exchange_records(record, group),
            self._caps(info).all_gather_into_tensor,
            dim,
        )

    def all_gather(
        self, x: torch.Tensor, group: ProcessGroup, sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Concatenate every rank's ``x`` along dim 0. ``sizes``: every rank's ``x.shape[0]``."""
        x, info = x.contiguous(), group_info(group)  # (_opening's lines, inline on this hot path)
        world = info.size
        even = sizes is None or sizes.count(sizes[0]) == world
        into_tensor = (self._caps(info) if self.overrides else info.caps).all_gather_into_tensor
        if even and into_tensor:  # the common case, in few calls
            shape = x.shape  # each .shape builds a torch.Size: read it once
            out = x.new_empty(shape[0] * world, *shape[1:])  # int sizes: torch parses them fastest
            args = (wire(out), wire(x), group) if x.dtype in _VIEWED else (out, x, group)
            _dispatch("all_gather", group, out.nbytes, c10d_all_gather, _gather_own, out, args)
            return out
        return self._padded_all_gather(x, group, sizes, world, even, into_tensor)

    def _padded_all_gather(
        self,
        x: torch.Tensor,
        group: ProcessGroup,
        sizes: Sequence[int] | None,
        world: int,
        even: bool,
        into_tensor: bool,
    ) -> torch.Tensor:
        """:meth:`all_gather` uneven (or without an into-tensor op): every rank padded to
        the largest size, gathered, unpadded."""
        if sizes is None:
            sizes = [x.shape[0]] * world
        padded, buf, chunks, skip = _padded_gather(x, sizes, world, torch.empty)

        def run() -> None:
            if into_tensor:
                c10d_all_gather(wire(buf), wire(padded), group)
            else:
                dist.all_gather([wire(c) for c in chunks], wire(padded), group=group)

        _dispatch("all_gather", group, _nbytes(buf), run, skip, buf)
        return buf if even else unpad_rows(chunks, sizes)

    def reduce_scatter(
        self, x: torch.Tensor, op: str, group: ProcessGroup, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Chunk ``rank`` (along dim 0) of the reduction over ranks of ``x``."""
        x, info = x.contiguous(), group_info(group)  # (_opening's lines, inline on this hot path)
        world, rank = info.size, info.rank
        even = split_sizes is None or split_sizes.count(split_sizes[0]) == world
        caps = self._caps(info) if self.overrides else info.caps  # (no call without overrides)
        if not caps.reduce_scatter or op not in ("sum", "avg") or x.dtype in NARROW:
            # gap filled: reduce everything, keep own chunk (2x traffic, documented; a
            # dtype c10d cannot reduce is reduced by all_reduce in a wider one)
            check_reducible(x.dtype, "reduce_scatter")
            sizes = split_rows(split_sizes, x.shape[0], world)
            return own_rows(self.all_reduce(x, op, group), sizes, rank).clone()
        if even:
            inp = x
        else:  # pad each chunk to the largest, so one reduce_scatter_tensor does it
            assert split_sizes is not None
            inp = joined(pad_chunks(x, split_sizes, max(split_sizes)))
        shape = inp.shape  # each .shape builds a torch.Size: read it once
        out = x.new_empty(shape[0] // world if world else 0, *shape[1:])
        if inp.is_complex():
            wire_in, wire_out = self._as_wire(inp, op, group), self._as_wire(out, op, group)
        else:
            wire_in, wire_out = inp, out
        run: Callable[..., None]
        how: Any
        if world > 1 and info.backend in _REDUCE_SCATTER_BY_ALL_TO_ALL and wire_in.is_floating_point():
            run, how, divide = _all_to_all_sum, world, op == "avg"  # op is "sum" or "avg" here
        else:
            run = c10d_reduce_scatter
            how, divide = (_SUM, False) if op == "sum" else self._reduce_op(op, x, group)
        args = (wire_out, wire_in, how, group)
        _dispatch("reduce_scatter", group, inp.nbytes, run, _scatter_own, out, args)
        if divide:
            out.div_(world)
        return out if split_sizes is None or even else out[: split_sizes[rank]].clone()

    def gather(
        self, x: torch.Tensor, dst: int, group: ProcessGroup, sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Concatenation along dim 0 on ``dst``; zeros of the same shape elsewhere."""
        x, info, world, rank = _opening(x, group)
        if sizes is None:
            sizes = [x.shape[0]] * world
        if not self._caps(info).gather_scatter:  # no native gather: every rank gathers
            full = self.all_gather(x, group, sizes)
            return full if rank == dst else torch.zeros_like(full)
        padded, buf, chunks, skip = _padded_gather(x, sizes, world, torch.zeros)  # zeros off dst

        def run() -> None:
            dist.gather(
                wire(padded), [wire(c) for c in chunks] if rank == dst else None, group_dst=dst, group=group
            )

        _dispatch("gather", group, _nbytes(buf), run, skip, buf)
        return buf if all(s == sizes[0] for s in sizes) else unpad_rows(chunks, sizes)

    def scatter(
        self, x: torch.Tensor, src: int, group: ProcessGroup, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Chunk ``rank`` (along dim 0) of ``src``'s ``x`` (``x`` has one shape on every rank)."""
        x, info, world, rank = _opening(x, group)
        rest = tuple(x.shape[1:])
        sizes = split_rows(split_sizes, x.shape[0], world)
        if not self._caps(info).gather_scatter:  # no native scatter: broadcast, keep own chunk
            return own_rows(self.broadcast(x, src, group), sizes, rank).clone()
        m = max(sizes)
        out = torch.empty((m, *rest), dtype=x.dtype, device=x.device)
        if rank == src:
            parts = [wire(_owned(p)) for p in pad_chunks(x, sizes, m)]
        else:
            parts = None
        _dispatch(
            "scatter",
            group,
            _nbytes(x),
            lambda: dist.scatter(wire(out), parts, group_src=src, group=group),
            lambda: out[: sizes[rank]].copy_(own_rows(x, sizes, rank)),
            out,
        )
        return out if sizes[rank] == m else out[: sizes[rank]].clone()

    def _uneven_all_to_all(
        self, x: torch.Tensor, group: ProcessGroup, input_split_sizes: Sizes, output_split_sizes: Sizes
    ) -> torch.Tensor:
        """:meth:`all_to_all` with split sizes given."""
        x, info, world, rank = _opening(x, group)
        rest = tuple(x.shape[1:])
        ins = list(input_split_sizes) if input_split_sizes is not None else None
        outs = list(output_split_sizes) if output_split_sizes is not None else None
        if outs is None:
            outs = [x.shape[0] // world] * world if ins is None else None
        if outs is None:  # infer: what rank j sends me is its ins[me]; exchange the matrix
            sizes = torch.tensor(ins, dtype=torch.int64, device=info.device)
            outs = self._even_all_to_all(sizes, group, False).tolist()  # every rank infers: even
        if (ins is not None or output_split_sizes is not None) and not self._caps(info).uneven_all_to_all:
            return self._padded_all_to_all(x, group, split_rows(ins, x.shape[0], world), outs, info)
        out = torch.empty((sum(outs), *rest), dtype=x.dtype, device=x.device)
        # no split sizes at all: the even all_to_all (gloo's alltoall, not its alltoallv)
        c10d_outs = None if ins is None and output_split_sizes is None else outs

        def skip() -> None:
            me_in = split_rows(ins, x.shape[0], world)
            own = own_rows(x, me_in, rank)
            n = min(own.shape[0], out.shape[0])
            out.zero_()
            out[:n].copy_(own[:n])

        _dispatch(
            "all_to_all",
            group,
            max(_nbytes(x), _nbytes(out)),
            lambda: c10d_all_to_all(wire(out), wire(x), c10d_outs, ins, group),
            skip,
            out,
        )
        return out

    def _even_all_to_all(self, x: torch.Tensor, group: ProcessGroup, padding: bool = True) -> torch.Tensor:
        """:meth:`all_to_all` of ``x`` in equal chunks, one per rank (gloo's alltoall, not
        its alltoallv). Where uneven ones are padded (``padding``: unless this is the padded
        exchange itself), a peer whose own split is uneven pads: so does this rank."""
        if self.overrides and padding and not self._caps(group_info(group)).uneven_all_to_all:
            return self._even_as_padded(x, group)
        x = x.contiguous()
        # x's own shape (even); empty_like is the cheapest allocation torch has (any size
        # argument is parsed, a torch.Size worst of all), and x is contiguous, so out is too
        out = torch.empty_like(x)
        args = (wire(out), wire(x), None, None, group) if x.dtype in _VIEWED else (out, x, None, None, group)
        _dispatch("all_to_all", group, x.nbytes, c10d_all_to_all, _own_chunk, out, args)
        return out

    def _even_as_padded(self, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        """The padded path (its max all_reduce first) with this rank's even chunks as the
        sizes: the op passes no sizes when a rank's own split is even, its peers' may not be."""
        world = group_info(group).size
        sizes = [x.shape[0] // world] * world
        return self._uneven_all_to_all(x, group, sizes, sizes)

    def _padded_all_to_all(
        self, x: torch.Tensor, group: ProcessGroup, ins: list[int], outs: list[int], info: GroupInfo
    ) -> torch.Tensor:
        """Uneven all_to_all on a backend without one: every chunk padded to the largest
        chunk any rank sends (one tiny max all_reduce), an even all_to_all, the padding cut.
        Every rank of the call takes this path (it depends on the group's capabilities
        only: a rank whose own split is even, called with no sizes, pads too), so the
        all_reduce lines up."""
        biggest = torch.tensor([max(ins + outs)], dtype=torch.int64, device=info.device)
        m = int(self.all_reduce(biggest, "max", group).item())
        if m == 0:  # nothing travels anywhere
            return x.new_empty((0, *x.shape[1:]))
        got = self._even_all_to_all(joined(pad_chunks(x, ins, m)), group, False).split(m)
        return unpad_rows(got, outs)

    # ---- point to point ------------------------------------------------------------
    def recv(self, out: torch.Tensor, src: int, group: ProcessGroup, tag: int = 0) -> torch.Tensor:
        """Receive into ``out`` (a fresh buffer the caller owns) and return it."""
        _dispatch(
            "recv",
            group,
            _nbytes(out),
            lambda: dist.recv(wire(out), group_src=src, group=group, tag=tag),
            lambda: out.zero_(),
            out,
            messages=(("recv", src, tag),),
        )
        return out

    def batch_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int, int]], group: ProcessGroup) -> None:
        """Run ``[("send"|"recv", tensor, peer, tag), ...]`` together (deadlock-free)."""
        if not ops:
            return
        p2p = [
            dist.P2POp(
                dist.isend if kind == "send" else dist.irecv,
                wire(t),
                group=group,
                tag=tag,
                group_peer=peer,
            )
            for kind, t, peer, tag in ops
        ]

        def run() -> None:
            for work in dist.batch_isend_irecv(p2p):
                work.wait()

        def skip() -> None:
            for kind, t, _, _ in ops:
                if kind == "recv":
                    t.zero_()

        nbytes = sum(_nbytes(t) for _, t, _, _ in ops)
        messages = tuple((kind, peer, tag) for kind, _, peer, tag in ops)
        _dispatch("batch_p2p", group, nbytes, run, skip, ops[0][1], messages=messages)

    def barrier(self, group: ProcessGroup) -> None:
        _dispatch("barrier", group, 0, lambda: dist.barrier(group=group), lambda: None)

    # ---- debug-mode consistency check ----------------------------------------------
    # Run eagerly under torch.compile without fullgraph (a graph break): traced, the
    # gather of a width it just read back is symbolic and dynamo failed on it (the check
    # in compiled code is the compiled adapter's, which skips it).
    @_torch.compiler_disable
    def check_consistent(self, op: str, fields: dict[str, Any], group: ProcessGroup) -> None:
        """Compare ``fields`` across the ranks of ``group``; raise naming who differs.

        The fields are encoded as one int64 vector per rank (:mod:`.consistency`: two
        small all_gathers whatever they hold, the widths then the padded vectors); the
        fields that differ are named with every rank's value.
        """
        world = self.world_size(group)
        if world == 1:
            return
        names = list(fields)
        flat = encode(fields)
        # named as the user's op (a desync here reads "all_reduce (debug check)", not a
        # raw all_gather the user never called)
        with label(f"{op} (debug check)"), _untyped():
            width_t = torch.tensor([len(flat)], dtype=torch.int64, device=group_info(group).device)
            m = max(self.all_gather(width_t, group).tolist())
            vec = torch.full((m,), PAD, dtype=torch.int64, device=width_t.device)
            vec[: len(flat)] = torch.tensor(flat, dtype=torch.int64)
            table = self.all_gather(vec.reshape(1, m), group).cpu().tolist()
        if (message := mismatch(op, names, table)) is not None:
            raise CrossRankMismatchError(message)


# What a hot op does when switched off (``skip(*args)``, see :func:`dispatch`), as
# module-level functions of the op's own arguments: no closure is made per call.


def _keep(*_: Any) -> None:
    """all_reduce / broadcast / reduce switched off: the buffer keeps this rank's values."""


def _gather_own(out: torch.Tensor, x: torch.Tensor, _group: ProcessGroup) -> None:
    """all_gather switched off: every rank's part is this rank's own ``x``."""
    if x.shape[0]:
        out.copy_(x.repeat(out.shape[0] // x.shape[0], *([1] * (x.dim() - 1))))


#: c10d backends whose floating-point ``reduce_scatter`` (sum, avg) runs as an all_to_all of
#: the chunks and a local sum: gloo's own reduce_scatter_tensor took 1.7-2.3x the time of
#: ``all_to_all_single`` + sum here (worlds 2 and 4, 16 KiB - 16 MiB per rank; see
#: docs/performance.md), the same bytes on the wire. The price is one transient buffer of
#: the input's size.
_REDUCE_SCATTER_BY_ALL_TO_ALL = frozenset({"gloo"})


def _all_to_all_sum(out: torch.Tensor, x: torch.Tensor, world: int, group: ProcessGroup) -> None:
    """Sum-reduce_scatter ``x`` (contiguous, ``world`` equal chunks along dim 0) into ``out``:
    chunk ``j`` of every rank goes to rank ``j`` (one all_to_all), which sums what it got in
    rank order."""
    chunks = torch.empty_like(x)
    c10d_all_to_all(chunks, x, None, None, group)
    torch.sum(chunks.view(world, *out.shape), dim=0, out=out)


def _scatter_own(out: torch.Tensor, x: torch.Tensor, _op: Any, group: ProcessGroup) -> None:
    """reduce_scatter switched off: this rank's chunk of its own ``x``, unreduced."""
    start = group_info(group).rank * out.shape[0]
    out.copy_(x[start : start + out.shape[0]])


def _own_chunk(out: torch.Tensor, x: torch.Tensor, _outs: Any, _ins: Any, group: ProcessGroup) -> None:
    """The even all_to_all switched off: only this rank's own chunk arrives (zeros elsewhere)."""
    info = group_info(group)
    chunk = x.shape[0] // info.size
    out.zero_()
    out[:chunk].copy_(x[info.rank * chunk : (info.rank + 1) * chunk])


def _padded_gather(
    x: torch.Tensor, sizes: Sequence[int], world: int, new: Callable[..., torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], Callable[[], Any]]:
    """The pieces of a gather whose ranks send different row counts: ``x`` padded to the
    largest size ``m``, a receive buffer of ``world * m`` rows made by ``new``
    (``torch.empty`` / ``torch.zeros``), its per-rank chunks, and the comm-off result
    (``x`` padded, repeated for every rank)."""
    m = max(sizes) if sizes else 0
    padded = pad_rows(x, m)
    buf = new((world * m, *x.shape[1:]), dtype=x.dtype, device=x.device)
    chunks = list(buf.split(m)) if m > 0 else [buf[:0]] * world
    return padded, buf, chunks, lambda: buf.copy_(padded.repeat(world, *([1] * (x.dim() - 1))))


def pad_rows(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x`` with zero rows appended along dim 0 up to ``m`` rows (uneven sizes travel padded)."""
    if x.shape[0] == m:
        return x
    return joined([x, x.new_zeros((m - x.shape[0], *x.shape[1:]))])


def split_rows(split_sizes: Sequence[int] | None, n: int, world: int) -> list[int]:
    """The rows per rank of a split of ``n`` rows: ``split_sizes``, or ``None`` for an
    even split (``n // world`` each)."""
    return list(split_sizes) if split_sizes is not None else [n // world] * world


def own_rows(x: torch.Tensor, sizes: Sequence[int], rank: int) -> torch.Tensor:
    """Rank ``rank``'s chunk of ``x`` split along dim 0 into ``sizes`` rows (a view)."""
    start = sum(sizes[:rank])
    return x[start : start + sizes[rank]]


def pad_chunks(x: torch.Tensor, sizes: Sequence[int], m: int) -> list[torch.Tensor]:
    """``x`` split along dim 0 into chunks of ``sizes`` rows, each padded to ``m`` rows."""
    return [pad_rows(c, m) for c in x.split(list(sizes))]


def unpad_rows(chunks: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate the first ``sizes[r]`` rows of each padded per-rank chunk."""
    return joined([c[:s] for c, s in zip(chunks, sizes)])


#: fp8 dtypes: moved (all_gather, all_to_all, gather, scatter, broadcast, p2p) as bytes,
#: since c10d's gloo has no fp8 type ("Invalid scalar type"); a byte view is exact for any
#: backend, so it is used everywhere rather than probed. Reductions of fp8 are not offered
#: (``precision=`` reduces by moving fp8 bytes and summing locally).
_AS_BYTES = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)
#: integer dtypes c10d's gloo cannot move or reduce ("Invalid scalar type"; nccl lacks
#: int16): moved as bytes too, and reduced in a wider dtype (:func:`narrow_reduce`)
_NARROW_INTS = frozenset(
    getattr(torch, name) for name in ("int16", "uint16", "uint32", "uint64") if hasattr(torch, name)
)
_AS_BYTES = _AS_BYTES | _NARROW_INTS
#: dtypes :func:`wire` views as another dtype: complex (as real pairs) and fp8 (as bytes)
_VIEWED = frozenset({torch.complex32, torch.complex64, torch.complex128}) | _AS_BYTES
#: dtypes the reductions treat apart (:func:`narrow_reduce`)
NARROW = _AS_BYTES

#: the wider dtype each narrow integer dtype is reduced in: exact for max/min (every value
#: fits), and for sum/product the wider result cast back keeps its low bits, which is the
#: narrow dtype's own wrap-around arithmetic
_WIDER = {torch.int16: torch.int32}
for _name, _wide in (("uint16", torch.int32), ("uint32", torch.int64)):
    if hasattr(torch, _name):
        _WIDER[getattr(torch, _name)] = _wide
_UINT64 = getattr(torch, "uint64", None)
_SIGN_BIT = -(2**63)


def narrow_reduce(
    out: torch.Tensor, op: str, reduce: Callable[[torch.Tensor], torch.Tensor], name: str
) -> torch.Tensor:
    """Reduce ``out`` (a fresh buffer) in a dtype c10d can reduce, by ``reduce`` (the
    reduction applied to that buffer, in place or not), and return the result in
    ``out``'s dtype. fp8 has no exact reduction and is refused (before any communication,
    alike on every rank: the dtype is the ranks' common one); ``precision=`` reduces fp8
    on the wire with a float accumulator."""
    dtype = out.dtype
    if dtype in _WIDER:
        return reduce(out.to(_WIDER[dtype])).to(dtype)
    if dtype == _UINT64:  # no wider integer: int64's bits (sum, product: the same bits mod 2^64)
        bits = out.view(torch.int64)
        if op in (
            "max",
            "min",
        ):  # the unsigned order is the signed order of the bits with the sign bit flipped
            return reduce(bits ^ _SIGN_BIT).bitwise_xor_(_SIGN_BIT).view(dtype)
        return reduce(bits).view(dtype)
    raise _unreducible(dtype, name)


def check_reducible(dtype: torch.dtype, name: str) -> None:
    """Refuse (before any communication) a reduction of a dtype :func:`narrow_reduce`
    cannot reduce in a wider one: fp8."""
    if dtype in NARROW and dtype not in _WIDER and dtype != _UINT64:
        raise _unreducible(dtype, name)


def _unreducible(dtype: torch.dtype, name: str) -> TypeError:
    return TypeError(
        f"diffcomm.{name}(): a {str(dtype).replace('torch.', '')} tensor cannot be reduced (c10d has "
        "no reduction of it, and summing in it would round at every step); reduce it in a float "
        "dtype, or reduce a float tensor with precision=diffcomm.Precision(...) for an fp8 wire"
    )


def nan_flagged(op: str, x: torch.Tensor, caps: Capabilities) -> bool:
    """Whether ``op`` on ``x`` travels with NaN flags (:func:`nan_flags`): a floating
    max/min on a backend whose max/min drop a NaN (``caps.nan_extrema``)."""
    return op in _EXTREMA and x.is_floating_point() and not caps.nan_extrema


def nan_flags(x: torch.Tensor, op: str) -> torch.Tensor:
    """``x`` (floating) stacked over its NaN flags, for a max/min (``op``) on a backend whose
    max/min drop a NaN (gloo keeps the non-NaN operand: 1.0 for ranks holding 1.0 and NaN,
    where torch's max is NaN). The flag is 1 (max) or -1 (min) where ``x`` is NaN, else 0:
    reduced with ``op`` in the same collective, it is nonzero where any rank's element is
    NaN (:func:`unflag`). One collective of twice the bytes. (Written into one buffer, not
    ``torch.stack``: CPU autocast's stack refuses float16, as its cat: see :func:`joined`.)"""
    both = x.new_empty((2, *x.shape))
    both[0].copy_(x)
    flag = both[1].copy_(x.isnan())
    if op == "min":
        flag.neg_()
    return both


def unflag(both: torch.Tensor) -> torch.Tensor:
    """The values of a reduced :func:`nan_flags` stack, NaN where a rank's element was."""
    return torch.where(both[1] != 0, math.nan, both[0])


def wire(t: torch.Tensor) -> torch.Tensor:
    """The view c10d moves: complex tensors as real pairs (for ops c10d cannot take complex
    in), fp8 and narrow integer tensors as ``uint8`` bytes (gloo has no such type).

    Every view keeps dim 0's size, which c10d counts split sizes in: the bytes of a 0-dim
    or 1-D tensor of wider elements get a trailing dim of their own. (Viewed directly, a
    1-D int16 tensor had twice as many rows as its split sizes named, and an uneven
    ``all_to_all`` of it, or any ``all_to_all`` across dims, tore the world down with gloo's
    "Split sizes doesn't match total dim 0 size"; a 0-dim one raised torch's "self.dim()
    cannot be 0 to view" in ``broadcast`` and the ring exchanges.)"""
    if t.is_complex():
        return torch.view_as_real(t)
    if t.dtype not in _AS_BYTES:
        return t
    if t.ndim < 2 and t.element_size() > 1:
        t = t.view(-1, 1)
    return t.view(torch.uint8)


def unwire(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A collective's result ``t`` received in the view :func:`wire` gave ``like`` (the
    tensor sent), as a tensor of ``like``'s dtype: the inverse view (for an adapter whose
    collectives return new tensors, :class:`~diffcomm.backend.compiled.TraceableBackend`)."""
    if like.is_complex():
        return torch.view_as_complex(t)
    if like.dtype not in _AS_BYTES:
        return t
    out = t.view(like.dtype)
    if like.ndim < 2 and like.element_size() > 1:  # the trailing dim wire() added
        out = out.squeeze(-1) if like.ndim else out.reshape(())
    return out
