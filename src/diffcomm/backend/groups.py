"""The group record: what diffcomm needs to know about a process group, probed once.

:func:`group_info` returns a :class:`GroupInfo` cached per group (dropped when the group
is destroyed or the default group changes): the group, this rank, the size, the name of
the c10d backend that moves its data (asked of the group itself: :func:`data_backend`),
that backend's :class:`Capabilities`, and the device small metadata tensors live on
(asked of the accelerator). The backends' ``rank`` / ``world_size`` / ``backend_name`` /
``capabilities`` / ``comm_device`` read it, so a call asks ``torch.distributed`` nothing
twice. :func:`cpu_group` is the channel host-side integers (sizes) travel on.

Everything here is re-exported by :mod:`diffcomm.backend`, its public home.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import _lifecycle, _torch
from ..accelerator import comm_device, get_accelerator
from .in_process import per_rank

ProcessGroup = Any  # dist.ProcessGroup | None (None = the default group)


@dataclass
class Capabilities:
    """What the c10d backend behind a group's data can do natively: its name comes from the
    group (:func:`data_backend`, once per group), what that backend can do in this torch
    from :func:`static_capabilities`.

    Each field picks a path in the backend adapter; without the capability diffcomm runs
    an equivalent built from ops the backend has (same values, more traffic):

    * ``avg``: ``ReduceOp.AVG`` (else a sum, divided by the group size);
    * ``reduce_scatter``: a native reduce_scatter (else an all_reduce, each rank keeping
      its chunk);
    * ``all_gather_into_tensor``: one flat output tensor (else a list of outputs);
    * ``uneven_all_to_all``: split sizes that differ (else every chunk padded to the
      largest, agreed by a one-integer max all_reduce, and an even all_to_all; every
      all_to_all then pads, since a rank cannot see whether its peers' splits are even);
    * ``complex_reduce``: complex sum/avg (else the real view travels);
    * ``gather_scatter``: native gather and scatter (else an all_gather that every rank
      receives, and a broadcast of which each rank keeps its chunk);
    * ``nan_extrema``: a floating max/min that is NaN where any rank's element is, as
      ``torch.max`` (else each NaN travels as a flag beside the values: one collective
      of twice the bytes. gloo's max/min keep the non-NaN operand: a NaN on rank 1
      beside 1.0 on rank 0 gave 1.0. Only diffcomm's in-process transport is known to
      propagate it; nccl and unknown backends are not relied on).

    Uneven all_gather and gather are never native with a single output tensor: diffcomm
    always pads them to the largest size, so that is no field.
    """

    backend: str
    avg: bool
    reduce_scatter: bool
    all_gather_into_tensor: bool
    uneven_all_to_all: bool
    complex_reduce: bool
    gather_scatter: bool
    nan_extrema: bool

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def static_capabilities(name: str) -> Capabilities:
    """Known capabilities of c10d backends in the torch versions diffcomm supports.

    ``gloo`` in torch < 2.6 lacks ``reduce_scatter_tensor`` and ``ReduceOp.AVG``;
    ``nccl`` lacks gather/scatter before 2.x builds that emulate them (torch does).
    An unknown name gets the conservative set: only what every c10d backend has.
    """
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if name == "gloo":
        new = version >= (2, 6)
        return Capabilities(name, new, new, True, True, True, True, False)
    if name == "inproc":  # diffcomm's in-process transport (backend/in_process.py): everything
        return Capabilities(name, True, True, True, True, True, True, True)
    if name == "nccl":
        return Capabilities(name, True, True, True, True, True, True, False)
    return Capabilities(name, False, False, False, True, False, True, False)


@dataclass(eq=False)
class GroupInfo:
    """What diffcomm needs to know about a process group, probed once per group.

    ``pg`` is the group as the ops pass it (``None`` for the default group); ``rank`` and
    ``size`` are group-local; ``backend`` names the c10d backend behind its data
    (:func:`data_backend`); ``caps`` is that backend's :class:`Capabilities`; ``device``
    the device small metadata tensors live on for it.
    ``cpu_pg`` is the group host-side integers (sizes) travel on: the group itself when
    its device is the CPU or it has a CPU backend (``"cpu:gloo,cuda:nccl"``), else a gloo
    group of the same ranks, made on first use. ``gathered_rows``: what an all_gather
    without given sizes has learned on this group (:mod:`diffcomm.backend.sized_gather`).
    """

    pg: ProcessGroup
    rank: int
    size: int
    backend: str
    caps: Capabilities
    device: torch.device
    cpu_pg: Any = None
    has_cpu_pg: bool = False
    #: ``"row bytes"`` -> the most bytes of rows a rank of this group sent recently in an
    #: all_gather without given sizes (see :mod:`diffcomm.backend.sized_gather`)
    gathered_rows: dict[Any, int] = field(default_factory=dict)


_INFOS: dict[Any, GroupInfo] = {}
_INFO_WORLD: list[Any] = [None]  # the default group the cached records belong to
per_rank(_INFOS, _INFO_WORLD)  # a rank's own in an in-process world


#: torch's one record of the process groups. ``C10D._default_pg`` is the default group
#: (or ``None``), read as a plain attribute on the hot path: the ``C10D.default_pg``
#: property (or an ``operator.attrgetter``) costs five times as much, and it is read a few
#: times per op. torch keeps the group there since 2.0 (we require 2.6).
C10D = _torch.C10D


def group_info(group: ProcessGroup) -> GroupInfo:
    """The cached :class:`GroupInfo` of ``group`` (a resolved group or ``None``)."""
    default = C10D._default_pg
    if default is not _INFO_WORLD[0]:  # a new world: every old record is stale
        _INFOS.clear()
        _INFO_WORLD[0] = default
    info = _INFOS.get(group)
    if info is None:
        # the default group passed by name (``dist.group.WORLD``, a 1-d mesh's group) is
        # the group ``None`` names: one record, so one row budget whichever name a rank uses
        same = group is not None and group is default
        info = _INFOS[group] = group_info(None) if same else _probe(group)
    return info


def _probe_default_group() -> None:
    """Probe the new default group at once, eagerly: its record is then cached when a
    user's first op runs inside ``torch.compile`` (dynamo cannot trace the probe: it reads
    the group's C++ object)."""
    group_info(None)


_lifecycle.on_init("group record", _probe_default_group)


def _forget(group: ProcessGroup, exiting: bool) -> None:
    """Drop the records of a group torch is about to destroy (``None``: every group).

    A record holds its group: kept, it would keep torch's ``ProcessGroupGloo`` (and its
    worker threads) alive past ``destroy_process_group()`` until the interpreter
    finalizes, where a worker that needs the GIL aborts the process."""
    if group is None:
        _INFOS.clear()
        _INFO_WORLD[0] = None
    else:
        _INFOS.pop(group, None)  # (a record is keyed by its group)


_lifecycle.on_destroy("group record", _forget)


@_torch.compiler_disable  # reads the group's C++ object: dynamo cannot trace it
def _probe(group: ProcessGroup) -> GroupInfo:
    """A group's record, asked of the group. Traced code does not ask for it (under
    ``torch.compile`` the ops read a group's rank and size through dynamo, so a brand-new
    subgroup's first op traces whole under ``fullgraph=True``). Where an op breaks the
    graph and its eager part is the group's first use (the default group is probed at
    ``init_process_group``), the probe breaks the graph once more and runs eagerly."""
    if not dist.is_initialized():
        return GroupInfo(group, 0, 1, "none", static_capabilities("none"), torch.device("cpu"))
    name = data_backend(group)
    return GroupInfo(
        group,
        dist.get_rank(group),
        dist.get_world_size(group),
        name,
        static_capabilities(name),
        comm_device(name),
    )


def data_backend(group: ProcessGroup) -> str:
    """The name of the c10d backend that moves ``group``'s data tensors, asked of the group.

    ``torch.distributed.get_backend`` names what the group was created with, which need
    not be a backend: ``"undefined"`` after ``init_process_group()`` without a backend
    (torch's default), ``"cpu:gloo"`` or ``"cpu:gloo,cuda:nccl"`` for a per-device map.
    The group knows the backend object behind each device type: this asks it for the one
    behind the accelerator's device type where the group has one (the device the tensors
    live on), else behind the CPU, and returns its name (``"gloo"``, ``"nccl"``, ...).
    A group that cannot say (a Python-level backend such as torch's fake group) keeps
    ``get_backend``'s name.
    """
    reported = str(dist.get_backend(group)).lower()
    types = _device_types(group)
    if not types:
        return reported
    kind = get_accelerator().name
    try:
        device = torch.device(kind if kind in types else "cpu")
        live = str(_torch.pg_device_backend(_pg(group), device).name()).lower()
    except Exception:  # no per-device backend to ask: the reported name
        return reported
    return live or reported


def _pg(group: ProcessGroup) -> Any:
    return group if group is not None else _torch.default_pg()


def _device_types(group: ProcessGroup) -> set[str]:
    """The device types ``group`` has a backend for (none when it cannot say)."""
    try:
        return {d.type for d in _pg(group)._device_types}
    except Exception:  # a group that cannot say
        return set()


def cpu_group(info: GroupInfo) -> ProcessGroup:
    """The group host-side integers travel on for ``info`` (see :class:`GroupInfo`).

    Every member of the group calls this at the same point of the program (the first
    size exchange on it), so the members-only group creation lines up.
    """
    if not info.has_cpu_pg:
        if info.device.type == "cpu" or "cpu" in _device_types(info.pg):
            info.cpu_pg = info.pg
        else:
            ranks = dist.get_process_group_ranks(info.pg if info.pg is not None else dist.group.WORLD)
            info.cpu_pg = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        info.has_cpu_pg = True
    return info.cpu_pg


def world(group: ProcessGroup) -> int:
    """The size of ``group`` (1 outside an initialised process group)."""
    return group_info(group).size if dist.is_initialized() else 1
