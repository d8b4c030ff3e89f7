"""diffcomm under torch's ``LocalTensorMode`` (torch's local-tensor package).

``LocalTensorMode(n)`` runs one program for ``n`` simulated ranks at once: every tensor is
a ``LocalTensor`` holding each rank's values, and torch's fake process group reports
**rank 0 on every simulated rank**. A raw op whose result depends on the rank (its own
chunk of a reduce_scatter, the root of a reduce, a peer of a send) would give every rank
rank 0's answer if it ran on that fake group. :class:`LocalTensorBackend` is the backend
adapter :func:`~diffcomm.backend.get_backend` returns while such a mode is on: it computes
every collective **per simulated rank** from the ``LocalTensor``'s per-rank values (for
each copy of the group, in group-rank order), exactly what each real rank gets:

* reductions combine the ranks' tensors **in rank order** (``avg``: the sum, then divided
  by the group size), as an in-process world does;
* a rooted op reads the root's tensor and gives the other ranks exact zeros;
* uneven sizes (a ``LocalTensor`` whose ranks hold different lengths) travel as they are
  where the op takes them (all_gather / gather with sizes, uneven all_to_all); elsewhere a
  shape that differs per rank is the RuntimeError real ranks' mismatch is (:func:`_check_alike`);
* ``shift`` / ``ppermute`` (whose pairs are the same on every rank) move each rank's
  tensor to its peer (:meth:`LocalTensorBackend.ppermute`); so does the ring of
  ``ring_attention`` / ``usp_attention``, whose positions and masks are computed per rank
  from :meth:`LocalTensorBackend.rank_tensor`.

* an uneven ``all_to_all`` takes split sizes that differ per simulated rank (``SymInt`` s
  over torch's ``LocalIntNode``), each rank's own; host-side plans computed from each
  rank's data (MoE routing) run per rank (:meth:`LocalTensorBackend.each_rank`).

What cannot be one program for every rank raises :class:`LocalTensorModeError` naming the
op and why, before any communication: reading the rank as a Python int (it differs per
simulated rank, one program holds one int), ``send`` / ``recv`` / ``sendrecv`` (peers are
per-rank ints), output split sizes that contradict what the ranks send.
The comms logger, flight recorder and comm-off switches do not see these ops (there is no
transport to log or switch off). docs/in_process.md has the table, op by op.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._errors import DiffcommError
from .._torch import functorch_off, local_group_instances, local_int, local_tensor_api
from .buffers import joined
from .torch_distributed import NARROW, CoalescedOps, Sizes, narrow_reduce

_HELPERS = frozenset(
    {
        "world_size",
        "backend_name",
        "capabilities",
        "comm_device",
        "global_rank",
        "overrides",
    }
)


class LocalTensorModeError(DiffcommError, NotImplementedError):
    """A diffcomm op that cannot give each simulated rank its own answer under torch's
    ``LocalTensorMode`` (see :mod:`diffcomm.backend.local_tensor`)."""


def refuse(op: str, why: str) -> LocalTensorModeError:
    """The error for ``op`` under ``LocalTensorMode``: what it is, why, what to do."""
    return LocalTensorModeError(
        f"diffcomm: `{op}` under torch's LocalTensorMode is not supported: {why}. Run the "
        "ranks with dc.LocalWorld(n, in_process=True) instead: the same values as real "
        "processes, in this process (docs/in_process.md)."
    )


RANK_WHY = (
    "it reads this rank as a Python int, and one program holds one int for every simulated "
    "rank (torch's fake process group says 0 on each: every rank would get rank 0's answer)"
)
PEER_WHY = (
    "its peers are per-rank Python ints, and one program holds rank 0's (use dc.shift or "
    "dc.ppermute, whose pairs are the same on every rank)"
)

Ranked = dict[int, torch.Tensor]  # one tensor per simulated (global) rank


def _reduce(op: str, ts: Sequence[torch.Tensor], name: str) -> torch.Tensor:
    """``ts`` reduced in rank order (what an in-process world and gloo give, to rounding):
    a new tensor, also for a group of one (its rank's own tensor was returned: an in-place
    change of ``all_reduce``'s result changed the input, which a real rank's never does).
    The dtypes the gloo adapter reduces in a wider one (uint16/32/64, which torch has no
    arithmetic in: "maximum_cpu" not implemented for 'UInt32') are reduced the same way,
    and fp8 is refused alike, naming the op ``name``."""
    if ts[0].dtype in NARROW:  # (elementwise: the stacked ranks widened at once)
        return narrow_reduce(torch.stack(list(ts)), op, lambda w: _reduce(op, w.unbind(0), name), name)
    if len(ts) == 1:
        return ts[0].clone()
    if op in ("sum", "avg"):
        out = functools.reduce(operator.add, ts)
        return out / len(ts) if op == "avg" else out
    if op == "product":
        return functools.reduce(operator.mul, ts)
    if op == "max":
        return functools.reduce(torch.maximum, ts)
    if op == "min":
        return functools.reduce(torch.minimum, ts)
    raise ValueError(f"diffcomm.backend: unknown reduce op {op!r}")


class LocalTensorBackend(CoalescedOps):
    """The backend adapter while a ``LocalTensorMode`` is on: every raw op computed per
    simulated rank from the ``LocalTensor``'s values (see the module)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name in _HELPERS:
            return getattr(self._inner, name)
        raise refuse(name, "diffcomm has no per-rank form of this raw op")

    # ---- the per-rank machinery --------------------------------------------------------
    @staticmethod
    def _mode() -> Any:
        mode = local_tensor_api().local_tensor_mode()
        assert mode is not None  # (this adapter is only returned while a mode is on)
        return mode

    def _values(self, x: torch.Tensor) -> Ranked:
        """Each simulated rank's tensor of ``x`` (a plain tensor is every rank's)."""
        local = getattr(x, "_local_tensors", None)
        if local is not None:
            return dict(local)
        return {r: x for r in self._mode().ranks}

    def _each(
        self,
        xs: Sequence[torch.Tensor],
        group: Any,
        fn: Callable[..., list[torch.Tensor]],
        alike: str | None = None,
        rows: Sequence[int] | None = None,
        op: str | None = None,
    ) -> Any:
        """Run ``fn(*[every group rank's tensor of each x])`` -> one output per group rank
        (in group-rank order), for every copy of ``group``; the outputs as one
        ``LocalTensor``. ``alike``: the op's name, whose ranks must hold the first x in one
        shape (``rows``: dim 0 may differ, group rank ``i``'s must be ``rows[i]``), as real
        processes' buffers must (:func:`_check_alike`); ``op``: the raw op's name where it
        is not ``alike``'s (errors name it)."""
        lt = local_tensor_api()
        mode = self._mode()
        values = [self._values(x) for x in xs]
        copies = group_copies(group, op or alike or "a collective")
        out: Ranked = {}
        with mode.disable():
            for members in copies:
                if not all(r in v for v in values for r in members):
                    raise refuse("a collective", f"the tensor holds no values for some of ranks {members}")
                if alike is not None:
                    _check_alike(alike, {r: values[0][r].shape for r in members}, rows)
                got = fn(*[[v[r].detach() for r in members] for v in values])
                for r, y in zip(members, got, strict=True):
                    out[r] = y
            return lt.LocalTensor(out)

    def _ints(self, n: Any, group: Any) -> list[int]:
        """Every group rank's value of the int ``n`` (one per simulated rank; the same
        list in every copy of the group, else refused)."""
        rows = {tuple(local_int(n, r) for r in members) for members in group_copies(group, "size exchange")}
        if len(rows) != 1:
            raise refuse("size exchange", "the copies of the group hold different sizes")
        return list(rows.pop())

    # ---- the rank, checks ------------------------------------------------------------
    def rank(self, group: Any) -> int:
        raise refuse("rank (the group rank)", RANK_WHY)

    def rank_is(self, group: Any, r: int, device: torch.device) -> torch.Tensor:
        """A 0-dim bool tensor, per simulated rank: whether it is group rank ``r``."""
        with functorch_off():  # (a constant, also inside torch.func.jvp: see functorch_off)
            proto = torch.empty(0, device=device)
            return self._each(
                [proto],
                group,
                lambda ps: [torch.tensor(i == r, device=device) for i in range(len(ps))],
                op="the group rank",
            )

    def rank_tensor(self, group: Any, device: torch.device) -> torch.Tensor:
        """A 0-dim int64 tensor, per simulated rank: its group rank (to compute with,
        e.g. ``ids - rank * rows``, where an int holding one value per rank cannot go)."""
        with functorch_off():  # (a constant, also inside torch.func.jvp: see functorch_off)
            proto = torch.empty(0, device=device)
            return self._each(
                [proto],
                group,
                lambda ps: [torch.tensor(i, device=device) for i in range(len(ps))],
                op="the group rank",
            )

    def each_rank(self, group: Any, fn: Callable[..., Any], *xs: torch.Tensor) -> Any:
        """``fn(group rank, each x's tensor on that rank)`` run for every simulated rank
        (the mode off: plain tensors and ints, so ``fn`` may branch on them), its results
        combined field by field: tensors into one ``LocalTensor`` (their sizes may differ
        per rank), ints into one int holding each rank's (a ``SymInt`` where they differ),
        tuples field by field; other values must be alike on every rank. For host-side
        plans computed from each rank's data (MoE routing)."""
        lt = local_tensor_api()
        mode = self._mode()
        values = [self._values(x) for x in xs]
        got: dict[int, Any] = {}
        copies = group_copies(group, "a per-rank plan")
        with mode.disable():
            for members in copies:
                for i, r in enumerate(members):
                    got[r] = fn(i, *[v[r].detach() for v in values])
        ranks = sorted(got)

        def combine(items: dict[int, Any]) -> Any:
            first = items[ranks[0]]
            if isinstance(first, torch.Tensor):
                return lt.LocalTensor(items)
            if isinstance(first, tuple):
                return tuple(combine({r: items[r][j] for r in ranks}) for j in range(len(first)))
            if isinstance(first, int) and not isinstance(first, bool):
                return lt._combine_int_rank_results(items)
            if any(items[r] != first for r in ranks):
                raise refuse("a per-rank plan", f"its {type(first).__name__} values differ per rank")
            return first

        return combine(got)

    def ints_tensor(self, ns: Sequence[Any], device: torch.device) -> torch.Tensor:
        """A 1-D int64 tensor of ``ns`` (ints, or ``SymInt`` s holding one int per
        simulated rank): each simulated rank's own values."""
        lt = local_tensor_api()
        with functorch_off(), self._mode().disable():
            return lt.LocalTensor(
                {
                    r: torch.tensor([local_int(n, r) for n in ns], dtype=torch.int64, device=device)
                    for r in self._mode().ranks
                }
            )

    def own_slice(self, sizes: Sequence[int], group: Any) -> tuple[Any, Any]:
        """(start, length) of this rank's chunk of ``sizes`` along a dim, each an int per
        simulated rank (a ``SymInt`` where they differ): to ``narrow`` with. Compared,
        such an int is one answer for all ranks — ``!=`` true where any rank differs (a
        mismatch check), ``==`` only where all agree —, so never branch on it to pick a
        rank's value (:meth:`rank_is` gives that per rank)."""
        starts: dict[int, int] = {}
        lengths: dict[int, int] = {}
        for members in group_copies(group, "the group rank"):
            for i, r in enumerate(members):
                starts[r], lengths[r] = sum(sizes[:i]), sizes[i]
        lt = local_tensor_api()
        ranks = sorted(self._mode().ranks)
        return (
            lt._combine_int_rank_results({r: starts[r] for r in ranks}),
            lt._combine_int_rank_results({r: lengths[r] for r in ranks}),
        )

    def check_consistent(self, op: str, fields: dict[str, Any], group: Any) -> None:
        """Nothing to compare: one program states one value for every rank."""

    def barrier(self, group: Any) -> None:
        """The simulated ranks run in lockstep: nothing to wait for."""

    # ---- collectives -----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: str, group: Any) -> torch.Tensor:
        return self._each([x], group, lambda ts: [_reduce(op, ts, "all_reduce") for _ in ts], "all_reduce")

    _all_reduce_into = all_reduce

    def broadcast(self, x: torch.Tensor, src: int, group: Any) -> torch.Tensor:
        return self._each([x], group, lambda ts: [ts[src].clone() for _ in ts], "broadcast")

    _broadcast_into = broadcast

    def reduce(self, x: torch.Tensor, dst: int, op: str, group: Any) -> torch.Tensor:
        def fn(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            red = _reduce(op, ts, "reduce")
            return [red if i == dst else torch.zeros_like(red) for i in range(len(ts))]

        return self._each([x], group, fn, "reduce")

    def all_gather(self, x: torch.Tensor, group: Any, sizes: Sequence[int] | None = None) -> torch.Tensor:
        return self._each([x], group, lambda ts: [joined(ts) for _ in ts], "all_gather", sizes)

    def all_gather_unsized(self, x: torch.Tensor, group: Any, dim: int = 0) -> tuple[torch.Tensor, list[int]]:
        sizes = self._ints(x.shape[0], group)
        return self.all_gather(x, group, sizes), sizes

    def reduce_scatter(
        self, x: torch.Tensor, op: str, group: Any, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        def fn(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            red = _reduce(op, ts, "reduce_scatter")
            sizes = list(split_sizes) if split_sizes is not None else [red.shape[0] // len(ts)] * len(ts)
            return [c.clone() for c in red.split(sizes)]

        return self._each([x], group, fn, "reduce_scatter")

    def gather(
        self, x: torch.Tensor, dst: int, group: Any, sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        def fn(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            full = joined(ts)
            return [full if i == dst else torch.zeros_like(full) for i in range(len(ts))]

        return self._each([x], group, fn, "gather", sizes)

    def scatter(
        self, x: torch.Tensor, src: int, group: Any, split_sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        def fn(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            n = ts[src].shape[0]
            sizes = list(split_sizes) if split_sizes is not None else [n // len(ts)] * len(ts)
            return [c.clone() for c in ts[src].split(sizes)]

        return self._each([x], group, fn, op="scatter")

    def _even_all_to_all(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        """Chunk ``j`` of rank ``i``'s ``x`` to rank ``j`` (equal chunks)."""
        return self._each([x], group, lambda ts: _all_to_all_parts(ts, len(ts)), "all_to_all")

    def _uneven_all_to_all(
        self, x: torch.Tensor, group: Any, input_split_sizes: Sizes, output_split_sizes: Sizes
    ) -> torch.Tensor:
        """Chunk ``j`` of rank ``i``'s ``x`` to rank ``j``. Split sizes may be ``SymInt``s
        holding one int per simulated rank; ``output_split_sizes`` must agree with what
        arrives (checked per rank)."""
        groups = group_copies(group, "all_to_all")
        values = self._values(x)
        ins: dict[int, list[int]] = {}
        for members in groups:
            for r in members:
                if input_split_sizes is None:
                    ins[r] = [values[r].shape[0] // len(members)] * len(members)
                else:
                    ins[r] = [local_int(s, r) for s in input_split_sizes]
        lt = local_tensor_api()
        out: Ranked = {}
        with self._mode().disable():
            for members in groups:
                sent = {r: values[r].detach().split(ins[r]) for r in members}
                for j, r in enumerate(members):
                    parts = [sent[s][j] for s in members]
                    if output_split_sizes is not None:
                        want = [local_int(s, r) for s in output_split_sizes]
                        if want != [p.shape[0] for p in parts]:
                            raise refuse(
                                "all_to_all",
                                f"rank {r}'s output_split_sizes {want} disagree with the sizes the "
                                f"ranks send it {[p.shape[0] for p in parts]}",
                            )
                    out[r] = joined(parts)
            return lt.LocalTensor(out)

    def ppermute(self, x: torch.Tensor, perm: Sequence[tuple[int, int]], group: Any) -> torch.Tensor:
        """Group rank ``d`` gets rank ``s``'s ``x`` for each ``(s, d)``; zeros if none."""

        def fn(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            src = {d: s for s, d in perm}
            for d, s in src.items():  # (a receiver's buffer is its own x: the sender's shape)
                _check_alike("ppermute", {s: ts[s].shape, d: ts[d].shape}, None, group_ranks=True)
            return [ts[src[i]].clone() if i in src else torch.zeros_like(ts[i]) for i in range(len(ts))]

        return self._each([x], group, fn, op="ppermute")

    # ---- host integers -----------------------------------------------------------------
    def exchange_sizes(self, n: int, group: Any) -> list[int]:
        return self._ints(n, group)

    def exchange_size_lists(self, ns: Sequence[int], group: Any) -> list[list[int]]:
        cols = [self._ints(n, group) for n in ns]
        size = len(group_copies(group, "size exchange")[0])
        return [[c[i] for c in cols] for i in range(size)]

    exchange_records = exchange_size_lists

    #: no counted gather (the sizes travelling with the data): ``all_gather_coalesced``
    #: exchanges the sizes first, as for any adapter without one
    all_gather_coalesced_unsized = None

    # ---- point to point: peers are per-rank ints ----------------------------------------
    def recv(self, out: torch.Tensor, src: int, group: Any, tag: int = 0) -> torch.Tensor:
        raise refuse("recv", PEER_WHY)

    def batch_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int, int]], group: Any) -> None:
        raise refuse("send/recv (batch_p2p)", PEER_WHY)


def group_copies(group: Any, op: str) -> list[list[int]]:
    """The global ranks of every copy of ``group`` (each in group-rank order) that ``op``
    runs on: torch's fake group is rank 0's, and under the mode it stands for one group per
    copy of its layout (the other rows of a mesh axis; the other parts of a partition that
    every rank made with ``new_group``). Refused unless the copies tile the simulated
    ranks, each rank in exactly one: torch lays out a group that is no regular grid as
    copies that overlap (``new_group([0, 1, 2, 4])`` at world 8 copies to ``[2, 3, 4, 6]``,
    and ranks 2 and 4, members, got that copy's sum), leave ranks out or name ranks beyond
    the world, or fails inside its layout code (an ``AssertionError``, a ``RecursionError``)."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    try:
        copies = local_group_instances(group)
    except (AssertionError, RecursionError):
        copies = None
    world = sorted(local_tensor_api().local_tensor_mode().ranks)
    if copies is None or sorted(r for c in copies for r in c) != world:
        laid = "" if copies is None else f" (torch lays it out as the copies {copies})"
        raise refuse(
            op,
            f"its group of ranks {ranks} does not tile the {len(world)} simulated ranks into "
            f"copies of itself{laid}; under the mode the group, rank 0's, stands for one group "
            "per copy of its layout, so each rank must be in exactly one (a DeviceMesh axis, "
            "or a partition such as new_group([0, 1]) and new_group([2, 3]) at world 4)",
        )
    return copies


def _check_alike(
    op: str, shapes: dict[int, torch.Size], rows: Sequence[int] | None, group_ranks: bool = False
) -> None:
    """Refuse tensors whose shapes differ between the simulated ranks where ``op`` needs
    one shape (``rows``: dim 0 may differ, the ``i``-th rank's must be ``rows[i]``). Real
    processes' buffers are sized from each rank's own tensor: there gloo aborts or leaves
    garbage, and the in-process world raises; computed per rank here, ``torch.add`` would
    broadcast a one-row tensor and ``cat`` join any lengths, a value no real run gives."""
    got = list(shapes.values())
    rest = {s[1:] for s in got} if rows is not None else set(got)
    lengths_ok = rows is None or all(len(s) > 0 and s[0] == n for s, n in zip(got, rows, strict=True))
    if len(rest) == 1 and lengths_ok:
        return
    who = "group rank" if group_ranks else "rank"
    held = ", ".join(f"{who} {r}: {tuple(s)}" for r, s in shapes.items())
    want = "one shape" if rows is None else f"dim 0 of {list(rows)} rows and one shape beyond it"
    raise RuntimeError(
        f"diffcomm under torch's LocalTensorMode: {op}: the simulated ranks hold tensors of "
        f"{held}, where the op needs {want}: the ranks called it with different shapes or "
        "split sizes (on real processes gloo aborts a rank that receives more than it "
        "expects, or leaves garbage; LocalWorld(n, in_process=True) raises)"
    )


def _all_to_all_parts(ts: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The even all_to_all of the group's tensors ``ts``: chunk ``j`` of each to rank ``j``."""
    chunks = [t.tensor_split(n) for t in ts]  # n equal chunks (also of an empty t)
    return [joined([chunks[i][j] for i in range(n)]) for j in range(n)]
