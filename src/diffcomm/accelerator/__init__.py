"""The accelerator of this machine: devices, streams/events, RNG, memory, dtypes, ranges.

One small interface, :class:`Accelerator`, implemented once over the ``torch.<device>``
module (:class:`TorchModuleAccelerator`: ``torch.cuda``, ``torch.xpu``, ``torch.mps``),
with the CPU overriding what differs. The CPU is complete, not a stub: real generators
(torch's default CPU generator), synchronous stream/event semantics with wall-clock event
timing, and real memory numbers (process RSS, peak RSS, system memory).

Usage::

    from diffcomm.accelerator import get_accelerator

    acc = get_accelerator()                 # cuda > xpu > mps > cpu, or DIFFCOMM_ACCELERATOR
    x = torch.randn(4, device=acc.device())
    start, end = acc.event(enable_timing=True), acc.event(enable_timing=True)
    start.record()
    with acc.range("matmul"):               # shows up in torch.profiler traces
        y = x @ x
    end.record()
    end.synchronize()
    print(start.elapsed_time(end), "ms", acc.max_memory_allocated(), "bytes")

The package: :mod:`~diffcomm.accelerator.base` (the interface and what every kind
shares), :mod:`~diffcomm.accelerator.device_module` (``torch.cuda`` / ``torch.xpu``),
:mod:`~diffcomm.accelerator.cpu`, :mod:`~diffcomm.accelerator.mps`, and here the selection
(:func:`get_accelerator`) and :func:`comm_device`, which the backend and the launcher ask
for the device a communication backend works on. It imports only torch, the standard
library, psutil and ``diffcomm._config`` / ``diffcomm._errors``.
"""

from __future__ import annotations

import threading

import torch

from .. import _config
from .._errors import DiffcommError
from .base import Accelerator, DeviceLike  # noqa: F401 - DeviceLike: the argument type, importable here
from .cpu import CPUAccelerator, CPUEvent, CPUStream
from .device_module import CUDAAccelerator, TorchModuleAccelerator, XPUAccelerator
from .mps import MPSAccelerator

__all__ = [
    "Accelerator",
    "TorchModuleAccelerator",
    "CPUAccelerator",
    "CUDAAccelerator",
    "XPUAccelerator",
    "MPSAccelerator",
    "CPUStream",
    "CPUEvent",
    "get_accelerator",
    "set_accelerator",
    "selected",
    "available_accelerators",
    "comm_accelerator",
    "comm_device",
]


# -------------------------------------------------------------------------- selection

_CLASSES: dict[str, type[Accelerator]] = {
    "cpu": CPUAccelerator,
    "cuda": CUDAAccelerator,
    "mps": MPSAccelerator,
    "xpu": XPUAccelerator,
}
_DETECTION_ORDER = ("cuda", "xpu", "mps", "cpu")

_lock = threading.RLock()
_instances: dict[str, Accelerator] = {}
_detected: str | None = None
#: the selection of :func:`set_accelerator` (a box: one per rank in an in-process world,
#: as a rank process has its own; ``diffcomm.backend.in_process`` registers it)
_OVERRIDE: list[Accelerator | None] = [None]


def _instance(name: str) -> Accelerator:
    with _lock:
        if name not in _instances:
            _instances[name] = _CLASSES[name]()
        return _instances[name]


def available_accelerators() -> list[str]:
    """Names of the accelerators usable in this process, in detection order.

    Returns:
        A sublist of ``["cuda", "xpu", "mps", "cpu"]``; ``"cpu"`` is always last.
    """
    return [name for name in _DETECTION_ORDER if _instance(name).is_available()]


def _detect() -> str:
    global _detected
    with _lock:
        if _detected is None:
            _detected = available_accelerators()[0]
        return _detected


def get_accelerator(name: str | None = None) -> Accelerator:
    """The accelerator to use: ``set_accelerator``, else ``DIFFCOMM_ACCELERATOR``, else detected.

    Detection prefers ``cuda``, then ``xpu``, then ``mps``, then ``cpu``; it runs once and
    is cached. Each kind has one shared instance.

    Args:
        name: ask for a specific kind (``"cpu"``, ``"cuda"``, ``"mps"``, ``"xpu"``)
            instead of the selected one.

    Returns:
        The :class:`Accelerator`.

    Raises:
        ValueError: an unknown name (in ``DIFFCOMM_ACCELERATOR`` or ``name``); the
            message lists the legal values.
        DiffcommError: (a ``RuntimeError``) the named accelerator is not available here.

    Example::

        acc = get_accelerator()
        acc.manual_seed(0)
        x = torch.randn(3, device=acc.device())
    """
    if name is None:
        chosen = _OVERRIDE[0]
        if chosen is not None:
            return chosen
        name = _config.ACCELERATOR.get()  # raises ValueError with the legal values
        if name is None:
            return _instance(_detect())
        source = f"DIFFCOMM_ACCELERATOR={name!r}"
    else:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {type(name).__name__}")
        key = name.strip().lower()
        if key not in _CLASSES:
            raise ValueError(f"name={name!r} is not a known accelerator; legal values: {tuple(_CLASSES)}")
        source, name = f"accelerator {name!r}", key
    acc = _instance(name)
    if not acc.is_available():
        raise DiffcommError(
            f"{source} was requested but {name} is not available on this machine "
            f"(torch {torch.__version__}); available here: {available_accelerators()}"
        )
    return acc


class _AcceleratorRestore:
    """Returned by :func:`set_accelerator`: already applied; as a ``with`` block, restores."""

    def __init__(self, new: Accelerator, old: Accelerator | None) -> None:
        self._new = new
        self._old = old

    def __enter__(self) -> Accelerator:
        return self._new

    def __exit__(self, *exc: object) -> None:
        with _lock:
            _OVERRIDE[0] = self._old

    def __repr__(self) -> str:
        return f"<set_accelerator {self._new.name!r}>"


def set_accelerator(accelerator: str | Accelerator) -> _AcceleratorRestore:
    """Select the accelerator :func:`get_accelerator` returns (over the environment).

    Args:
        accelerator: a name (checked like ``get_accelerator(name)``) or an
            :class:`Accelerator` instance (used as is, e.g. a custom subclass).

    Returns:
        An object that, used as a ``with`` block, restores the previous selection on exit
        (the selection is already applied when it is returned)::

            with set_accelerator("cpu") as acc:
                ...                          # get_accelerator() is acc here

    Raises:
        ValueError: an unknown name.
        DiffcommError: the named accelerator is not available here.
        TypeError: neither a str nor an Accelerator.
    """
    if isinstance(accelerator, str):
        new = get_accelerator(accelerator)
    elif isinstance(accelerator, Accelerator):
        new = accelerator
    else:
        raise TypeError(f"accelerator must be a name or an Accelerator, got {type(accelerator).__name__}")
    with _lock:
        old, _OVERRIDE[0] = _OVERRIDE[0], new
    return _AcceleratorRestore(new, old)


def selected() -> str | Accelerator | None:
    """What :func:`set_accelerator` selected now, as it would be passed to it again.

    Returns:
        A kind's name (``"cpu"``) when its shared instance is selected, another
        :class:`Accelerator` as itself, ``None`` when nothing is (the environment or
        detection decides). A :class:`~diffcomm.LocalWorld` run carries it to its ranks.
    """
    with _lock:
        chosen = _OVERRIDE[0]
    if chosen is None:
        return None
    return chosen.name if _instances.get(chosen.name) is chosen else chosen


# ---------------------------------------------------------------------- communication

# The accelerator each device-specific c10d backend works on (nccl -> cuda, xccl -> xpu);
# every other backend (gloo, mpi, ucc, fake, ...) takes host tensors.
_BACKEND_KINDS: dict[str, str] = {
    cls._communication_backend: name
    for name, cls in _CLASSES.items()
    if cls._communication_backend != CPUAccelerator._communication_backend
}
_HOST = torch.device("cpu")


def comm_accelerator(backend_name: str) -> Accelerator:
    """The accelerator whose devices the c10d backend ``backend_name`` communicates on.

    Args:
        backend_name: as ``torch.distributed.get_backend`` reports it (``"gloo"``,
            ``"nccl"``, ``"xccl"``, ...); case-insensitive.

    Returns:
        The CUDA accelerator for ``nccl`` and the XPU one for ``xccl`` when that device is
        available here; the CPU accelerator for every other backend (and as the fallback).

    Example::

        acc = comm_accelerator("nccl")          # the launcher: pick the local rank's GPU
        if acc.name != "cpu":
            acc.set_device(local_rank % acc.device_count())
    """
    kind = _BACKEND_KINDS.get(str(backend_name).lower())
    if kind is not None:
        acc = _instance(kind)
        if acc.is_available():
            return acc
    return _instance("cpu")


def comm_device(backend_name: str) -> torch.device:
    """The device small tensors sent over the c10d backend ``backend_name`` must live on.

    Sizes, headers and other metadata the backend exchanges go on this device: the
    current CUDA device for ``nccl``, the current XPU for ``xccl``, the CPU otherwise.

    Args:
        backend_name: as ``torch.distributed.get_backend`` reports it; case-insensitive.

    Returns:
        A ``torch.device`` (``torch.device("cpu")`` for gloo, mpi, ucc and unknown names).

    Example::

        sizes = torch.tensor([n], device=comm_device(dist.get_backend(group)))
    """
    if str(backend_name).lower() not in _BACKEND_KINDS:
        return _HOST  # the hot path: no accelerator query for host backends
    acc = comm_accelerator(backend_name)
    return _HOST if acc.name == "cpu" else acc.device()
