"""The traceable path: :class:`TraceableBackend`, the raw ops as PyTorch's functional
collectives, for code ``torch.compile`` traces (:func:`diffcomm.backend.get_backend`
returns it while :func:`diffcomm._torch.compiling`). Re-exported by
:mod:`diffcomm.backend`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import _torch
from .._torch import compiling
from ..accelerator import comm_device
from .buffers import joined
from .groups import Capabilities, ProcessGroup, group_info, static_capabilities
from .torch_distributed import (
    NARROW,
    CoalescedOps,
    Sizes,
    check_reducible,
    nan_flagged,
    nan_flags,
    narrow_reduce,
    own_rows,
    pad_chunks,
    pad_rows,
    split_rows,
    unflag,
    unpad_rows,
    unwire,
    wire,
)


class TraceableBackend(CoalescedOps):
    """The raw ops as PyTorch's functional collectives, for code ``torch.compile`` traces.

    Dynamo cannot trace c10d's in-place ``broadcast``/``reduce``/``gather``/``scatter``
    nor the logger and switches of :func:`~diffcomm.backend.dispatch` (context variables, thread locals,
    timers), so :func:`get_backend` returns this adapter while
    :func:`diffcomm._torch.compiling`. It also works eagerly (``set_backend``), which is
    how its semantics are tested against :class:`TorchDistributedBackend`: dim 0,
    out-of-place, group-local ranks, zeros off the root, uneven sizes padded. Differences:

    * nothing is exchanged at trace time: :meth:`exchange_sizes` raises (pass ``split_sizes=``
      to ``all_gather``/``gather``, ``output_split_sizes=`` to an uneven ``all_to_all``);
    * ``reduce`` is an all_reduce kept on ``dst`` only; ``gather`` and ``scatter`` are one
      ``all_to_all_single`` with rank-dependent splits (no functional gather/scatter);
      ``avg`` is a sum divided by the group size;
    * :func:`log_comms`, :func:`comm_off`, the timeout message and the debug-mode
      cross-rank check (:meth:`check_consistent`) do not apply inside compiled code.
    """

    # ---- group helpers -------------------------------------------------------------
    def rank(self, group: ProcessGroup) -> int:
        return dist.get_rank(group)

    def world_size(self, group: ProcessGroup) -> int:
        return dist.get_world_size(group)

    def global_rank(self, group: ProcessGroup, rank: int) -> int:
        return rank if group is None else dist.get_global_rank(group, rank)

    def backend_name(self, group: ProcessGroup) -> str:
        return str(dist.get_backend(group)).lower()

    def capabilities(self, group: ProcessGroup = None) -> Capabilities:
        return static_capabilities(self.backend_name(group))

    def comm_device(self, group: ProcessGroup) -> torch.device:
        return comm_device(self.backend_name(group))

    @staticmethod
    def _pg(group: ProcessGroup) -> Any:
        return group if group is not None else dist.group.WORLD

    @staticmethod
    def _done(t: torch.Tensor) -> torch.Tensor:
        # eager functional collectives return an AsyncCollectiveTensor; traced ones are waited
        return t.wait() if isinstance(t, _funcol().AsyncCollectiveTensor) else t

    # ---- reductions ----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        if x.dtype in NARROW:  # as TorchDistributedBackend's: in a wider dtype, fp8 refused
            # (the bytes of the wire view were summed: int16 200 + 100 gave 44, in uint8)
            return narrow_reduce(x.clone(), op, lambda w: self.all_reduce(w, op, group), "all_reduce")
        if x.is_complex() and op == "product":
            return torch.prod(self.all_gather(x.unsqueeze(0), group), dim=0)
        wire_op = "sum" if op == "avg" else op
        if nan_flagged(op, x, self.capabilities(group)):  # (as TorchDistributedBackend's)
            return unflag(self._done(_funcol().all_reduce(nan_flags(x, op), op, self._pg(group))))
        out = unwire(self._done(_funcol().all_reduce(_live(x), wire_op, self._pg(group))), x)
        return out / self.world_size(group) if op == "avg" else out

    def _all_reduce_into(self, x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
        return self.all_reduce(x, op, group)  # functional collectives are out of place

    def _broadcast_into(self, x: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor:
        return self.broadcast(x, src, group)

    def reduce(self, x: torch.Tensor, dst: int, op: str, group: ProcessGroup) -> torch.Tensor:
        out = self.all_reduce(x, op, group)  # every rank takes part; only dst keeps it
        return out if self.rank(group) == dst else torch.zeros_like(out)

    def broadcast(self, x: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        return unwire(self._done(_funcol().broadcast(_live(x), src, self._pg(group))), x)

    # ---- gather family (dim 0) -----------------------------------------------------
    def exchange_sizes(self, n: int, group: ProcessGroup) -> list[int]:
        """Every rank's ``n``; raises ``ValueError`` while compiling (pass ``split_sizes=``)."""
        if not compiling():  # eager use (tests): a host read is fine
            mine = torch.tensor([n], dtype=torch.int64, device=group_info(group).device)
            return [int(v) for v in self.all_gather(mine, group).tolist()]
        raise ValueError(
            "diffcomm: under torch.compile the per-rank sizes of an all_gather/gather cannot "
            "be exchanged (that needs a host read, `.tolist()`, which dynamo cannot trace); "
            "pass `split_sizes=` (every rank's size along `dim`, e.g. `split_sizes=[n] * world` when even)"
        )

    def exchange_size_lists(self, ns: Sequence[int], group: ProcessGroup) -> list[list[int]]:
        """Every rank's list ``ns``; raises ``ValueError`` while compiling (pass ``split_sizes=``)."""
        if not compiling():
            return super().exchange_size_lists(ns, group)
        return [self.exchange_sizes(int(ns[0]) if ns else 0, group)]  # raises the standard message

    def _rows(
        self, x: torch.Tensor, group: ProcessGroup, sizes: Sequence[int] | None, gathered: bool
    ) -> tuple[int, int, torch.Tensor, list[int]]:
        """``(world, rank, x made contiguous, rows per rank)``: ``sizes``, or by default
        ``x``'s rows on every rank (``gathered``: a gather's parts) or an even split of them
        (a scatter's chunks)."""
        world, rank = self.world_size(group), self.rank(group)
        x = x.contiguous()
        if gathered and sizes is None:
            return world, rank, x, [x.shape[0]] * world
        return world, rank, x, split_rows(sizes, x.shape[0], world)

    def all_gather(
        self, x: torch.Tensor, group: ProcessGroup, sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        _, _, x, sizes = self._rows(x, group, sizes, gathered=True)
        m = max(sizes)
        padded = pad_rows(x, m)
        buf = unwire(self._done(_funcol_all_gather(_live(padded), 0, self._pg(group))), x)
        if all(s == m for s in sizes):
            return buf
        return unpad_rows(list(buf.split(m)), sizes)

    def reduce_scatter(
        self, x: torch.Tensor, op: str, group: ProcessGroup, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        world, rank, x, sizes = self._rows(x, group, split_sizes, gathered=False)
        if op not in ("sum", "avg") or x.dtype in NARROW:  # (narrow: reduced in a wider dtype)
            check_reducible(x.dtype, "reduce_scatter")
            return own_rows(self.all_reduce(x, op, group), sizes, rank)
        m = max(sizes)
        if all(s == m for s in sizes):
            inp = x
        else:  # pad each chunk to the largest, so one reduce_scatter does it
            pad = pad_chunks(x, sizes, m)
            inp = joined(pad)
        out = unwire(self._done(_funcol_reduce_scatter(_live(inp), "sum", 0, self._pg(group))), x)
        out = out if sizes[rank] == m else out[: sizes[rank]]
        return out / world if op == "avg" else out

    def gather(
        self, x: torch.Tensor, dst: int, group: ProcessGroup, sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        world, rank, x, sizes = self._rows(x, group, sizes, gathered=True)
        ins = [x.shape[0] if j == dst else 0 for j in range(world)]
        outs = list(sizes) if rank == dst else [0] * world
        out = self.all_to_all(x, group, ins, outs)
        return out if rank == dst else x.new_zeros((sum(sizes), *x.shape[1:]))

    def scatter(
        self, x: torch.Tensor, src: int, group: ProcessGroup, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        world, rank, x, sizes = self._rows(x, group, split_sizes, gathered=False)
        ins = list(sizes) if rank == src else [0] * world
        outs = [sizes[rank] if j == src else 0 for j in range(world)]
        return self.all_to_all(x if rank == src else x[:0], group, ins, outs)

    def _even_all_to_all(self, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return self._uneven_all_to_all(x, group, None, None)

    def _uneven_all_to_all(
        self, x: torch.Tensor, group: ProcessGroup, input_split_sizes: Sizes, output_split_sizes: Sizes
    ) -> torch.Tensor:
        world = self.world_size(group)
        x = x.contiguous()
        ins = split_rows(input_split_sizes, x.shape[0], world)
        if output_split_sizes is None:
            if input_split_sizes is not None:
                raise ValueError(
                    "diffcomm.all_to_all(): under torch.compile the received split sizes cannot be "
                    "exchanged (a host read dynamo cannot trace); pass `output_split_sizes=`"
                )
            output_split_sizes = ins
        out = self._done(
            _funcol().all_to_all_single(_live(x), list(output_split_sizes), ins, self._pg(group))
        )
        return unwire(out, x)

    def barrier(self, group: ProcessGroup) -> None:
        raise RuntimeError("diffcomm: barrier() cannot run inside torch.compile'd code")

    def check_consistent(self, op: str, fields: dict[str, Any], group: ProcessGroup) -> None:
        """Skipped inside compiled code: the cross-rank check needs a host read."""


_funcol = _torch.functional_collectives


def _live(t: torch.Tensor) -> torch.Tensor:
    """``wire(t)``, made a tensor that tracing never runs for real.

    FakeTensorMode (dynamo's tracing, and AOTAutograd's traces after it) propagates
    *constants*: a tensor of at most one element built from Python values
    (``torch.tensor([n])``) is a constant, and an op whose inputs are all constants is
    **run for real** at trace time to get its value. For a functional collective that is a
    real collective during compilation — once per trace (dynamo, and twice more under
    AOTAutograd), on the compiling rank only. When every rank compiles the frame at once
    those pair up among themselves (wasted but right); a compile on one rank alone (a
    guard that fails there only: another shape, a rank-dependent Python value) runs them
    against the other ranks' next collectives: silently wrong values, then a timeout. The
    collective in the compiled graph still runs at run time: nothing is folded away.
    Multiplying by ``torch.ones(())`` (a factory: never a constant) keeps the value and
    makes the input no constant, so tracing never communicates. Only tensors of at most
    one element can be constants (``CONSTANT_NUMEL_LIMIT``), so only they pay the one
    scalar multiply (``tests/ops/test_compile_trace_time.py``)."""
    t = wire(t)
    if t.numel() > 1:
        return t
    return t * torch.ones((), dtype=t.dtype, device=t.device)


def _funcol_all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    f = _funcol()
    return (getattr(f, "all_gather_single", None) or f.all_gather_tensor)(x, dim, group)


def _funcol_reduce_scatter(x: torch.Tensor, op: str, dim: int, group: Any) -> torch.Tensor:
    f = _funcol()
    return (getattr(f, "reduce_scatter_single", None) or f.reduce_scatter_tensor)(x, op, dim, group)
