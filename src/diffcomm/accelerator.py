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

This module imports only torch, the standard library, psutil and ``diffcomm._config`` /
``diffcomm._errors``.
"""

from __future__ import annotations

import abc
import contextlib
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import psutil
import torch

from . import _config
from ._errors import DiffcommError

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
    "available_accelerators",
]

DeviceLike = int | str | torch.device | None
"""A device argument: ``None`` (the current device), an index, ``"cuda:1"`` or a device."""

# Every dtype torch may place on a device; ``supported_dtypes`` probes each.
_CANDIDATE_DTYPES: tuple[torch.dtype, ...] = tuple(
    dt
    for dt in (
        getattr(torch, name, None)
        for name in (
            "bool",
            "uint8",
            "int8",
            "int16",
            "int32",
            "int64",
            "uint16",
            "uint32",
            "uint64",
            "float16",
            "bfloat16",
            "float32",
            "float64",
            "complex32",
            "complex64",
            "complex128",
            "float8_e4m3fn",
            "float8_e5m2",
            "float8_e4m3fnuz",
            "float8_e5m2fnuz",
        )
    )
    if isinstance(dt, torch.dtype)
)


class Accelerator(abc.ABC):
    """One kind of device (``cpu``, ``cuda``, ``mps``, ``xpu``) behind one small interface.

    Subclasses set :attr:`name` and ``_communication_backend``, call
    ``super().__init__()`` and implement the abstract methods; everything else
    (:meth:`device`, :meth:`fork_rng`, :meth:`generator`, :meth:`supported_dtypes`, the
    profiler ranges) is shared. Obtain the machine's accelerator with
    :func:`get_accelerator`; instances hold a little state (peak-memory baseline, range
    stack), so use that shared instance rather than constructing new ones.
    """

    name: ClassVar[str]
    """Device type, as in ``torch.device(name)``: ``"cpu"``, ``"cuda"``, ``"mps"``, ``"xpu"``."""

    _communication_backend: ClassVar[str]
    _nvtx: Any = None  # a module with range_push/range_pop (torch.cuda.nvtx), or None

    def __init__(self) -> None:
        self._dtype_cache: dict[int, list[torch.dtype]] = {}
        self._compute_cache: dict[tuple[int, torch.dtype], bool] = {}
        self._ranges = threading.local()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r}>"

    # ---------------------------------------------------------------- devices

    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether this kind of device can be used in this process.

        Returns:
            ``True`` when at least one device is usable (always for CPU).
        """

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of devices of this kind visible to the process.

        Returns:
            The count (``1`` for CPU: all cores form one device; ``0`` when unavailable).
        """

    @abc.abstractmethod
    def current_device(self) -> int:
        """Index of the device that ``device()`` and the other ``device=None`` calls use.

        Returns:
            The current device index (always ``0`` for CPU and MPS).
        """

    @abc.abstractmethod
    def set_device(self, index: DeviceLike) -> None:
        """Make ``index`` the current device of this process.

        Args:
            index: device index, ``"cuda:1"``-style string or ``torch.device``.

        Raises:
            ValueError: the index is out of range or names another device type.
        """

    @abc.abstractmethod
    def synchronize(self, device: DeviceLike = None) -> None:
        """Block the host until all queued work on ``device`` has finished.

        Args:
            device: the device (default: current). A no-op on CPU, whose work is
                synchronous.
        """

    def device(self, index: DeviceLike = None) -> torch.device:
        """The ``torch.device`` for a device index.

        Args:
            index: device index, string or ``torch.device`` of this type (default: current).

        Returns:
            ``torch.device(name, index)``; for CPU always ``torch.device("cpu")``.

        Raises:
            ValueError: the index is out of range or names another device type.
        """
        return torch.device(self.name, self._index(index))

    def _index(self, device: DeviceLike) -> int:
        """Normalise a device argument to a validated index of this accelerator."""
        if device is None:
            return self.current_device()
        if isinstance(device, bool):
            raise TypeError(f"device must be an int, str or torch.device, got {device!r}")
        if isinstance(device, int):
            index = device
        elif isinstance(device, str | torch.device):
            dev = torch.device(device)
            if dev.type != self.name:
                raise ValueError(f"device={device!r} is not a {self.name!r} device")
            index = self.current_device() if dev.index is None else dev.index
        else:
            raise TypeError(f"device must be an int, str or torch.device, got {type(device).__name__}")
        count = self.device_count()
        if not 0 <= index < count:
            raise ValueError(
                f"device index {index} is out of range: this process sees {count} {self.name} device(s)"
            )
        return index

    # --------------------------------------------------------- streams/events

    @property
    @abc.abstractmethod
    def Stream(self) -> type:  # noqa: N802 - mirrors torch.cuda.Stream
        """The stream class of this device (``torch.cuda.Stream``, :class:`CPUStream`...)."""

    @property
    @abc.abstractmethod
    def Event(self) -> type:  # noqa: N802 - mirrors torch.cuda.Event
        """The event class of this device (``torch.cuda.Event``, :class:`CPUEvent`...)."""

    def stream(self, device: DeviceLike = None, priority: int = 0) -> Any:
        """Create a new stream.

        Args:
            device: the device the stream belongs to (default: current).
            priority: stream priority; lower is higher priority (ignored on CPU/MPS).

        Returns:
            An instance of :attr:`Stream`.
        """
        return self.Stream(device=self.device(device), priority=priority)

    def event(self, enable_timing: bool = False) -> Any:
        """Create a new event.

        Args:
            enable_timing: record time so that :meth:`elapsed_time` works (as in torch,
                ``elapsed_time`` on an event created without it raises).

        Returns:
            An instance of :attr:`Event` with ``record(stream=None)``, ``query()``,
            ``synchronize()``, ``wait(stream=None)`` and ``elapsed_time(end) -> ms``.
        """
        return self.Event(enable_timing=enable_timing)

    @abc.abstractmethod
    def current_stream(self, device: DeviceLike = None) -> Any:
        """The stream that work is queued on now.

        Args:
            device: the device (default: current).

        Returns:
            An instance of :attr:`Stream`.
        """

    @abc.abstractmethod
    def default_stream(self, device: DeviceLike = None) -> Any:
        """The stream that is current when no :meth:`stream_context` is active.

        Args:
            device: the device (default: current).

        Returns:
            An instance of :attr:`Stream`.
        """

    @abc.abstractmethod
    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context manager making ``stream`` the current stream inside the block.

        Args:
            stream: a stream of this device, or ``None`` for a no-op block.

        Returns:
            A context manager; ``current_stream()`` is restored on exit.
        """

    # -------------------------------------------------------------------- RNG

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the default generator of the current device.

        Args:
            seed: the seed (an int).
        """

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> None:
        """Seed the default generators of every device of this kind.

        Args:
            seed: the seed (an int).
        """

    @abc.abstractmethod
    def initial_seed(self) -> int:
        """The seed the current device's default generator was last seeded with.

        Returns:
            The seed.
        """

    @abc.abstractmethod
    def seed(self) -> int:
        """Seed the current device's default generator with a non-deterministic number.

        Returns:
            The new seed.
        """

    @abc.abstractmethod
    def get_rng_state(self, device: DeviceLike = None) -> torch.Tensor:
        """Snapshot of a device's default generator.

        Args:
            device: the device (default: current).

        Returns:
            A ``torch.uint8`` CPU tensor to pass to :meth:`set_rng_state`.
        """

    @abc.abstractmethod
    def set_rng_state(self, state: torch.Tensor, device: DeviceLike = None) -> None:
        """Restore a device's default generator from :meth:`get_rng_state`.

        Args:
            state: a ``torch.uint8`` tensor from :meth:`get_rng_state`.
            device: the device (default: current).
        """

    @contextlib.contextmanager
    def fork_rng(self, devices: Iterable[DeviceLike] | None = None, enabled: bool = True) -> Iterator[None]:
        """Context manager that restores the default generator state(s) on exit.

        Unlike ``torch.random.fork_rng`` it forks only this accelerator's generators (on
        CPU: torch's default CPU generator), and by default only the current device.

        Args:
            devices: devices whose generators to fork (default: the current device).
            enabled: ``False`` makes the block a no-op (handy to toggle forking).

        Returns:
            A context manager yielding ``None``.
        """
        if not enabled:
            yield
            return
        if devices is None:
            indices = [self._index(None)]
        else:
            indices = sorted({self._index(d) for d in devices})
        saved = [(index, self.get_rng_state(index)) for index in indices]
        try:
            yield
        finally:
            for index, state in saved:
                self.set_rng_state(state, index)

    def generator(self, seed: int | None = None, device: DeviceLike = None) -> torch.Generator:
        """A new, independent ``torch.Generator`` on a device.

        Args:
            seed: its seed; ``None`` seeds it non-deterministically (``Generator.seed()``).
            device: the device (default: current).

        Returns:
            The generator (not the default one: using it does not advance global RNG).
        """
        gen = torch.Generator(device=self.device(device))
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(seed))
        return gen

    # ----------------------------------------------------------------- memory

    @abc.abstractmethod
    def memory_allocated(self, device: DeviceLike = None) -> int:
        """Bytes currently in use (CUDA/XPU: by tensors; CPU: resident set of the process).

        Args:
            device: the device (default: current).

        Returns:
            Bytes.
        """

    @abc.abstractmethod
    def max_memory_allocated(self, device: DeviceLike = None) -> int:
        """Peak of :meth:`memory_allocated` since start or the last reset.

        Args:
            device: the device (default: current).

        Returns:
            Bytes.
        """

    @abc.abstractmethod
    def memory_reserved(self, device: DeviceLike = None) -> int:
        """Bytes held for the process (CUDA/XPU: caching allocator; CPU: virtual size).

        Args:
            device: the device (default: current).

        Returns:
            Bytes.
        """

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device: DeviceLike = None) -> None:
        """Start a new peak measurement for :meth:`max_memory_allocated`.

        Args:
            device: the device (default: current).
        """

    @abc.abstractmethod
    def memory_stats(self, device: DeviceLike = None) -> dict[str, Any]:
        """Memory statistics as a flat dict.

        Args:
            device: the device (default: current).

        Returns:
            A dict that always holds ``"allocated_bytes.all.current"``,
            ``"allocated_bytes.all.peak"`` and ``"reserved_bytes.all.current"`` (the
            key names of ``torch.cuda.memory_stats``); devices may add more keys.
        """

    @abc.abstractmethod
    def total_memory(self, device: DeviceLike = None) -> int:
        """Total memory of the device (CPU: system RAM, or the container's limit if lower).

        Args:
            device: the device (default: current).

        Returns:
            Bytes.
        """

    @abc.abstractmethod
    def available_memory(self, device: DeviceLike = None) -> int:
        """Memory that could still be allocated on the device without swapping.

        Args:
            device: the device (default: current).

        Returns:
            Bytes.
        """

    # ----------------------------------------------------------------- dtypes

    def supported_dtypes(self, device: DeviceLike = None) -> list[torch.dtype]:
        """Dtypes a tensor can be created with on the device.

        Each candidate dtype is probed once by allocating a tiny ``torch.zeros`` on the
        device; the result is cached. Arithmetic support can be narrower (e.g. float8
        tensors can be created on CPU but not added).

        Args:
            device: the device (default: current).

        Returns:
            The dtypes, in a fixed order (bool, integers, floats, complex, float8).
        """
        index = self._index(device)
        if index not in self._dtype_cache:
            dev = self.device(index)
            found = []
            for dtype in _CANDIDATE_DTYPES:
                try:
                    with warnings.catch_warnings():  # e.g. "ComplexHalf is experimental"
                        warnings.simplefilter("ignore")
                        torch.zeros(2, dtype=dtype, device=dev)
                except (RuntimeError, TypeError, NotImplementedError):
                    continue
                found.append(dtype)
            self._dtype_cache[index] = found
        return list(self._dtype_cache[index])

    def _computes(self, dtype: torch.dtype, device: DeviceLike = None) -> bool:
        """Whether a tiny matmul and add in ``dtype`` run on the device (cached)."""
        index = self._index(device)
        key = (index, dtype)
        if key not in self._compute_cache:
            ok = dtype in self.supported_dtypes(index)
            if ok:
                try:
                    a = torch.ones(2, 2, dtype=dtype, device=self.device(index))
                    (a @ a + a).sum().item()
                except (RuntimeError, TypeError, NotImplementedError):
                    ok = False
            self._compute_cache[key] = ok
        return self._compute_cache[key]

    def is_bf16_supported(self) -> bool:
        """Whether bfloat16 tensors can be created and computed with (matmul, add).

        Returns:
            ``True`` if so. On CPU this is true on any machine torch supports; it says
            nothing about speed (fast only with AVX512-BF16/AMX, see
            ``torch.cpu.get_capabilities()``).
        """
        return self._computes(torch.bfloat16)

    def is_fp16_supported(self) -> bool:
        """Whether float16 tensors can be created and computed with (matmul, add).

        Returns:
            ``True`` if so (see :meth:`is_bf16_supported` for what it means on CPU).
        """
        return self._computes(torch.float16)

    # ------------------------------------------------------------ profiling

    def _range_stack(self) -> list[Any]:
        stack = getattr(self._ranges, "stack", None)
        if stack is None:
            stack = self._ranges.stack = []
        return stack

    def range_push(self, name: str) -> None:
        """Open a named profiler range on this thread (close it with :meth:`range_pop`).

        The range is a ``torch.autograd.profiler.record_function``, so it appears in
        ``torch.profiler.profile()`` events and traces; on CUDA it is also an NVTX range.

        Args:
            name: the label shown in the profiler.
        """
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        rf = torch.autograd.profiler.record_function(name)
        rf.__enter__()
        self._range_stack().append(rf)
        if self._nvtx is not None:
            self._nvtx.range_push(name)

    def range_pop(self) -> None:
        """Close the range most recently opened on this thread by :meth:`range_push`.

        Raises:
            RuntimeError: no range is open on this thread.
        """
        stack = self._range_stack()
        if not stack:
            raise RuntimeError("range_pop() without a matching range_push() on this thread")
        rf = stack.pop()
        if self._nvtx is not None:
            self._nvtx.range_pop()
        rf.__exit__(None, None, None)

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        """Context manager: a named profiler range around the block.

        Args:
            name: the label shown in the profiler (``torch.profiler``; NVTX on CUDA).

        Returns:
            A context manager yielding ``None``.
        """
        self.range_push(name)
        try:
            yield
        finally:
            self.range_pop()

    # -------------------------------------------------------- communication

    def communication_backend_name(self) -> str:
        """The default ``torch.distributed`` backend for this device.

        Returns:
            ``"gloo"`` for CPU and MPS, ``"nccl"`` for CUDA, ``"xccl"`` for XPU.
        """
        return self._communication_backend


class TorchModuleAccelerator(Accelerator):
    """An :class:`Accelerator` implemented over the ``torch.<name>`` module.

    ``torch.cuda`` and ``torch.xpu`` share one API, so :class:`CUDAAccelerator` and
    :class:`XPUAccelerator` are this class with a name; MPS and CPU override what their
    modules lack. Constructing one never touches the hardware.
    """

    def __init__(self) -> None:
        super().__init__()
        self._module: Any = getattr(torch, self.name)
        self._captured_default_streams: dict[int, Any] = {}

    # devices
    def is_available(self) -> bool:
        return bool(self._module.is_available())

    def device_count(self) -> int:
        return int(self._module.device_count()) if self.is_available() else 0

    def current_device(self) -> int:
        return int(self._module.current_device())

    def set_device(self, index: DeviceLike) -> None:
        self._module.set_device(self._index(index))

    def synchronize(self, device: DeviceLike = None) -> None:
        self._module.synchronize(self._index(device))

    # streams
    @property
    def Stream(self) -> type:  # noqa: N802
        return self._module.Stream

    @property
    def Event(self) -> type:  # noqa: N802
        return self._module.Event

    def current_stream(self, device: DeviceLike = None) -> Any:
        return self._module.current_stream(self._index(device))

    def default_stream(self, device: DeviceLike = None) -> Any:
        index = self._index(device)
        if hasattr(self._module, "default_stream"):
            return self._module.default_stream(index)
        # torch.xpu has no default_stream(): remember the stream that was current the
        # first time we were asked, which is the default one unless a stream context
        # was active at that moment.
        if index not in self._captured_default_streams:
            self._captured_default_streams[index] = self._module.current_stream(index)
        return self._captured_default_streams[index]

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self._module.stream(stream)

    # RNG
    def manual_seed(self, seed: int) -> None:
        self._module.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        self._module.manual_seed_all(int(seed))

    def initial_seed(self) -> int:
        return int(self._module.initial_seed())

    def seed(self) -> int:
        self._module.seed()
        return self.initial_seed()

    def get_rng_state(self, device: DeviceLike = None) -> torch.Tensor:
        return self._module.get_rng_state(self.device(device))

    def set_rng_state(self, state: torch.Tensor, device: DeviceLike = None) -> None:
        self._module.set_rng_state(state, self.device(device))

    # memory
    def memory_allocated(self, device: DeviceLike = None) -> int:
        return int(self._module.memory_allocated(self._index(device)))

    def max_memory_allocated(self, device: DeviceLike = None) -> int:
        return int(self._module.max_memory_allocated(self._index(device)))

    def memory_reserved(self, device: DeviceLike = None) -> int:
        return int(self._module.memory_reserved(self._index(device)))

    def reset_peak_memory_stats(self, device: DeviceLike = None) -> None:
        self._module.reset_peak_memory_stats(self._index(device))

    def memory_stats(self, device: DeviceLike = None) -> dict[str, Any]:
        index = self._index(device)
        stats = dict(self._module.memory_stats(index))
        stats.setdefault("allocated_bytes.all.current", self.memory_allocated(index))
        stats.setdefault("allocated_bytes.all.peak", self.max_memory_allocated(index))
        stats.setdefault("reserved_bytes.all.current", self.memory_reserved(index))
        return stats

    def total_memory(self, device: DeviceLike = None) -> int:
        return int(self._module.get_device_properties(self._index(device)).total_memory)

    def available_memory(self, device: DeviceLike = None) -> int:
        free, _total = self._module.mem_get_info(self._index(device))
        return int(free)


class CUDAAccelerator(TorchModuleAccelerator):
    """NVIDIA (and ROCm, which torch exposes as ``cuda``) GPUs over ``torch.cuda``.

    Profiler ranges are also NVTX ranges, visible in Nsight Systems.
    """

    name = "cuda"
    _communication_backend = "nccl"

    @property
    def _nvtx(self) -> Any:  # type: ignore[override]
        return torch.cuda.nvtx


class XPUAccelerator(TorchModuleAccelerator):
    """Intel GPUs over ``torch.xpu``; communication backend ``xccl``."""

    name = "xpu"
    _communication_backend = "xccl"


# ----------------------------------------------------------------------------- host memory


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            raw = f.read().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() else None


def _cgroup_limit_and_usage() -> tuple[int | None, int | None]:
    """Memory limit and usage of this container's cgroup (v2, then v1), if limited."""
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit = _read_int(limit_path)
        if limit is not None and limit < (1 << 60):  # "max" or a huge number: no limit
            return limit, _read_int(usage_path)
    return None, None


def _process() -> psutil.Process:
    # A psutil.Process remembers its pid; build it per call so forked children are right.
    return psutil.Process(os.getpid())


def _kernel_peak_rss() -> int:
    """Peak resident set size of this process as the kernel tracks it, in bytes."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def _reset_kernel_peak_rss() -> bool:
    """Reset the kernel's peak RSS (Linux >= 4.0: ``5`` > /proc/self/clear_refs)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class _SampledPeak:
    """A peak that is the maximum of the values sampled at each call since a reset."""

    def __init__(self, sample: Callable[[], int]) -> None:
        self._sample = sample
        self.peak: int | None = None  # None: not reset; callers use their native peak

    def observe(self) -> int:
        value = self._sample()
        if self.peak is not None:
            self.peak = max(self.peak, value)
        return value

    def reset(self) -> None:
        self.peak = self._sample()


# -------------------------------------------------------------------------------- CPU


class CPUEvent:
    """An event on the CPU: synchronous semantics, real wall-clock timing.

    CPU work has finished by the time the host records an event, so :meth:`query` is
    always ``True`` and :meth:`synchronize` / :meth:`wait` return at once. :meth:`record`
    stores ``time.perf_counter()`` and :meth:`elapsed_time` returns real milliseconds.

    Args:
        enable_timing: as in ``torch.cuda.Event``: without it ``elapsed_time`` raises.
        blocking: accepted for signature compatibility; ignored.
        interprocess: accepted for signature compatibility; ignored.
    """

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        """Record the event now (all earlier CPU work is complete).

        Args:
            stream: ignored (CPU work is synchronous).
        """
        self._time = time.perf_counter()

    def query(self) -> bool:
        """Whether the recorded work is complete.

        Returns:
            Always ``True``.
        """
        return True

    def synchronize(self) -> None:
        """Wait for the recorded work: returns at once on CPU."""

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` wait for this event: returns at once on CPU.

        Args:
            stream: ignored.
        """

    def elapsed_time(self, end_event: CPUEvent) -> float:
        """Milliseconds between recording this event and recording ``end_event``.

        Args:
            end_event: a later :class:`CPUEvent`.

        Returns:
            Milliseconds as a float (wall clock, ``time.perf_counter``).

        Raises:
            RuntimeError: either event lacks ``enable_timing`` or was never recorded.
        """
        if not isinstance(end_event, CPUEvent):
            raise TypeError(f"end_event must be a CPUEvent, got {type(end_event).__name__}")
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("both events must be created with enable_timing=True")
        if self._time is None or end_event._time is None:
            raise RuntimeError("both events must be recorded before calling elapsed_time()")
        return (end_event._time - self._time) * 1000.0

    def __repr__(self) -> str:
        state = "recorded" if self._time is not None else "unrecorded"
        return f"<CPUEvent {state} enable_timing={self.enable_timing}>"


class CPUStream(torch.cpu.Stream):
    """A stream on the CPU: work runs synchronously, so every wait returns at once.

    A subclass of ``torch.cpu.Stream`` (so ``torch.cpu.stream(s)`` accepts it) that adds
    the ``torch.cuda.Stream`` members that one lacks: :meth:`query`, :meth:`synchronize`,
    and a :meth:`record_event` that returns a :class:`CPUEvent`.

    Args:
        device: ``None``, ``"cpu"`` or ``torch.device("cpu")``.
        priority: accepted for signature compatibility; ignored.
    """

    def __init__(self, device: DeviceLike = None, priority: int = 0) -> None:
        super().__init__(priority)
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"device={device!r} is not a CPU device")
        self.priority = priority

    @property
    def device(self) -> torch.device:
        """Always ``torch.device("cpu")``."""
        return torch.device("cpu")

    def query(self) -> bool:
        """Whether all work on the stream is complete: always ``True``."""
        return True

    def synchronize(self) -> None:
        """Wait for all work on the stream: returns at once."""

    def wait_stream(self, stream: Any) -> None:
        """Make future work wait for ``stream``: already so on CPU.

        Args:
            stream: any stream.
        """

    def wait_event(self, event: Any) -> None:
        """Make future work wait for ``event``: already so on CPU.

        Args:
            event: any event.
        """

    def record_event(self, event: CPUEvent | None = None) -> CPUEvent:  # type: ignore[override]
        """Record an event on this stream.

        Args:
            event: the event to record (default: a new timing-enabled :class:`CPUEvent`).

        Returns:
            The recorded event.
        """
        if event is None:
            event = CPUEvent(enable_timing=True)
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<CPUStream priority={self.priority}>"


class CPUAccelerator(TorchModuleAccelerator):
    """The CPU: one device (all cores), synchronous streams, real RNG and memory numbers.

    - **RNG** is torch's default CPU generator (``torch.default_generator``), the one
      ``torch.rand`` and CPU dropout use. :meth:`manual_seed` seeds only it (unlike
      ``torch.manual_seed``, which also seeds every GPU).
    - **Streams/events**: :class:`CPUStream` / :class:`CPUEvent`; the stream context is
      ``torch.cpu.StreamContext``.
    - **Memory** is measured on the process, by the OS (psutil, ``/proc``): see each method.
    """

    name = "cpu"
    _communication_backend = "gloo"

    def __init__(self) -> None:
        super().__init__()
        self._default = CPUStream()
        self._peak = _SampledPeak(lambda: _process().memory_info().rss)

    # devices: torch.cpu answers is_available/device_count/set_device/synchronize
    def current_device(self) -> int:
        return 0  # torch.cpu.current_device() returns the string "cpu"

    def device(self, index: DeviceLike = None) -> torch.device:
        self._index(index)
        return torch.device("cpu")

    # streams
    @property
    def Stream(self) -> type:  # noqa: N802
        return CPUStream

    @property
    def Event(self) -> type:  # noqa: N802
        return CPUEvent

    def current_stream(self, device: DeviceLike = None) -> CPUStream:
        self._index(device)
        current = torch.cpu.current_stream()
        return current if isinstance(current, CPUStream) else self._default

    def default_stream(self, device: DeviceLike = None) -> CPUStream:
        self._index(device)
        return self._default

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        if stream is not None and not isinstance(stream, torch.cpu.Stream):
            raise TypeError(f"stream must be a CPUStream or None, got {type(stream).__name__}")
        return torch.cpu.StreamContext(stream)

    # RNG: torch's default CPU generator
    def manual_seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    def initial_seed(self) -> int:
        return int(torch.default_generator.initial_seed())

    def seed(self) -> int:
        return int(torch.default_generator.seed())

    def get_rng_state(self, device: DeviceLike = None) -> torch.Tensor:
        self._index(device)
        return torch.default_generator.get_state()

    def set_rng_state(self, state: torch.Tensor, device: DeviceLike = None) -> None:
        self._index(device)
        torch.default_generator.set_state(state)

    # memory: the process as the OS sees it
    def memory_allocated(self, device: DeviceLike = None) -> int:
        """Resident set size (RSS) of this process now, in bytes.

        All memory the process has in RAM: tensors, but also the Python heap, loaded
        libraries and freed memory the C allocator has not yet returned to the OS.

        Args:
            device: ignored beyond validation (there is one CPU device).

        Returns:
            Bytes.
        """
        self._index(device)
        return self._peak.observe()

    def max_memory_allocated(self, device: DeviceLike = None) -> int:
        """Peak RSS of this process since start or since :meth:`reset_peak_memory_stats`.

        Measured by the kernel where it can be: ``VmHWM`` of ``/proc/self/status`` on
        Linux (exact, every page counted), ``getrusage`` peak elsewhere. If a reset could
        not reset the kernel's counter (not Linux, or ``/proc/self/clear_refs`` not
        writable), the peak after the reset is **sampled**: the largest RSS seen by any
        memory call of this accelerator since the reset, so a short spike between two
        calls is missed.

        Args:
            device: ignored beyond validation.

        Returns:
            Bytes.
        """
        current = self.memory_allocated(device)
        if self._peak.peak is not None:
            return self._peak.peak
        return max(_kernel_peak_rss(), current)

    def memory_reserved(self, device: DeviceLike = None) -> int:
        """Virtual memory size (VMS) of this process: address space it has reserved.

        Most of it is usually not resident (see :meth:`memory_allocated` for RSS).

        Args:
            device: ignored beyond validation.

        Returns:
            Bytes.
        """
        self._index(device)
        return int(_process().memory_info().vms)

    def reset_peak_memory_stats(self, device: DeviceLike = None) -> None:
        """Start a new peak for :meth:`max_memory_allocated` at the current RSS.

        On Linux this resets the kernel's own peak counter (writes ``5`` to
        ``/proc/self/clear_refs``, which also resets ``VmHWM`` and ``ru_maxrss`` for
        anyone else reading them in this process). Where that fails, the peak is sampled
        from now on (see :meth:`max_memory_allocated`).

        Args:
            device: ignored beyond validation.
        """
        self._index(device)
        if _reset_kernel_peak_rss():
            self._peak.peak = None
        else:
            self._peak.reset()

    def memory_stats(self, device: DeviceLike = None) -> dict[str, Any]:
        """RSS, peak RSS, VMS and system memory, under ``torch.cuda``-style keys.

        Args:
            device: ignored beyond validation.

        Returns:
            ``{"allocated_bytes.all.current": RSS, "allocated_bytes.all.peak": peak RSS,
            "reserved_bytes.all.current": VMS, "total_bytes": total_memory(),
            "available_bytes": available_memory(), "peak_is_sampled": bool}``.
        """
        return {
            "allocated_bytes.all.current": self.memory_allocated(device),
            "allocated_bytes.all.peak": self.max_memory_allocated(device),
            "reserved_bytes.all.current": self.memory_reserved(device),
            "total_bytes": self.total_memory(device),
            "available_bytes": self.available_memory(device),
            "peak_is_sampled": self._peak.peak is not None,
        }

    def total_memory(self, device: DeviceLike = None) -> int:
        """System RAM (``psutil.virtual_memory().total``), or the cgroup limit if lower.

        Args:
            device: ignored beyond validation.

        Returns:
            Bytes.
        """
        self._index(device)
        total = int(psutil.virtual_memory().total)
        limit, _usage = _cgroup_limit_and_usage()
        return min(total, limit) if limit is not None else total

    def available_memory(self, device: DeviceLike = None) -> int:
        """RAM available without swapping (``psutil.virtual_memory().available``).

        Inside a memory-limited container, the smaller of that and the limit minus the
        container's current usage.

        Args:
            device: ignored beyond validation.

        Returns:
            Bytes.
        """
        self._index(device)
        available = int(psutil.virtual_memory().available)
        limit, usage = _cgroup_limit_and_usage()
        if limit is not None and usage is not None:
            available = min(available, max(0, limit - usage))
        return available


# -------------------------------------------------------------------------------- MPS


class _MPSEvent:
    """``torch.mps.Event`` with the ``stream`` arguments of the other event classes."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self._event = torch.mps.Event(enable_timing=enable_timing)

    def record(self, stream: Any = None) -> None:
        self._event.record()

    def wait(self, stream: Any = None) -> None:
        self._event.wait()

    def query(self) -> bool:
        return bool(self._event.query())

    def synchronize(self) -> None:
        self._event.synchronize()

    def elapsed_time(self, end_event: _MPSEvent) -> float:
        return float(self._event.elapsed_time(end_event._event))


class _MPSStream:
    """The single MPS command queue, shaped like a ``torch.cuda.Stream``."""

    def __init__(self, device: DeviceLike = None, priority: int = 0) -> None:
        self.priority = priority

    @property
    def device(self) -> torch.device:
        return torch.device("mps")

    def query(self) -> bool:
        event = _MPSEvent()
        event.record()
        return event.query()

    def synchronize(self) -> None:
        torch.mps.synchronize()

    def wait_stream(self, stream: Any) -> None:
        """One queue: work is already ordered."""

    def wait_event(self, event: Any) -> None:
        event.wait(self)

    def record_event(self, event: _MPSEvent | None = None) -> _MPSEvent:
        if event is None:
            event = _MPSEvent(enable_timing=True)
        event.record(self)
        return event


class MPSAccelerator(TorchModuleAccelerator):
    """Apple-silicon GPUs over ``torch.mps``: one device and one stream (command queue).

    ``torch.mps`` has no peak-memory counter, so :meth:`max_memory_allocated` is
    sampled like the CPU fallback. Communication backend: ``gloo`` (tensors are staged
    through host memory).
    """

    name = "mps"
    _communication_backend = "gloo"

    def __init__(self) -> None:
        super().__init__()
        self._stream = _MPSStream()
        self._peak = _SampledPeak(lambda: int(torch.mps.current_allocated_memory()))

    def is_available(self) -> bool:
        return bool(torch.backends.mps.is_available())

    def current_device(self) -> int:
        return 0

    def set_device(self, index: DeviceLike) -> None:
        self._index(index)

    def synchronize(self, device: DeviceLike = None) -> None:
        self._index(device)
        torch.mps.synchronize()

    @property
    def Stream(self) -> type:  # noqa: N802
        return _MPSStream

    @property
    def Event(self) -> type:  # noqa: N802
        return _MPSEvent

    def current_stream(self, device: DeviceLike = None) -> Any:
        self._index(device)
        return self._stream

    def default_stream(self, device: DeviceLike = None) -> Any:
        self._index(device)
        return self._stream

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)  # one queue: nothing to switch

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    def initial_seed(self) -> int:
        return int(torch.mps._get_default_mps_generator().initial_seed())

    def get_rng_state(self, device: DeviceLike = None) -> torch.Tensor:
        self._index(device)
        return torch.mps.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: DeviceLike = None) -> None:
        self._index(device)
        torch.mps.set_rng_state(state)

    def memory_allocated(self, device: DeviceLike = None) -> int:
        self._index(device)
        return self._peak.observe()

    def max_memory_allocated(self, device: DeviceLike = None) -> int:
        current = self.memory_allocated(device)
        return current if self._peak.peak is None else self._peak.peak

    def memory_reserved(self, device: DeviceLike = None) -> int:
        self._index(device)
        return int(torch.mps.driver_allocated_memory())

    def reset_peak_memory_stats(self, device: DeviceLike = None) -> None:
        self._index(device)
        self._peak.reset()

    def memory_stats(self, device: DeviceLike = None) -> dict[str, Any]:
        return {
            "allocated_bytes.all.current": self.memory_allocated(device),
            "allocated_bytes.all.peak": self.max_memory_allocated(device),
            "reserved_bytes.all.current": self.memory_reserved(device),
            "peak_is_sampled": True,
        }

    def total_memory(self, device: DeviceLike = None) -> int:
        self._index(device)
        return int(torch.mps.recommended_max_memory())

    def available_memory(self, device: DeviceLike = None) -> int:
        return max(0, self.total_memory(device) - self.memory_reserved(device))


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
_override: Accelerator | None = None


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
        if _override is not None:
            return _override
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
        global _override
        with _lock:
            _override = self._old

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
    global _override
    if isinstance(accelerator, str):
        new = get_accelerator(accelerator)
    elif isinstance(accelerator, Accelerator):
        new = accelerator
    else:
        raise TypeError(f"accelerator must be a name or an Accelerator, got {type(accelerator).__name__}")
    with _lock:
        old, _override = _override, new
    return _AcceleratorRestore(new, old)
