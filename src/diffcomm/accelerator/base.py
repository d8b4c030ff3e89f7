"""The :class:`Accelerator` interface and what every kind shares (dtypes, RNG forks, ranges).

Part of :mod:`diffcomm.accelerator`; import the public names from there.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch

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
    def Stream(self) -> type:  # mirrors torch.cuda.Stream
        """The stream class of this device (``torch.cuda.Stream``, :class:`CPUStream`...)."""

    @property
    @abc.abstractmethod
    def Event(self) -> type:  # mirrors torch.cuda.Event
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

    def started_stream(self) -> Any | None:
        """This thread's current stream, or ``None`` if this process has not started the
        device runtime (no work can be queued yet; asking for a stream would start it).

        Another thread that must order its work after this thread's (the asynchronous
        communication engine) runs under ``stream_context(started_stream())``. ``None`` on
        CPU and on devices with one queue.
        """
        return None

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
