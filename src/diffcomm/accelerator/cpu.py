"""The CPU accelerator: real generators, synchronous streams/events, process memory.

Part of :mod:`diffcomm.accelerator`; import the public names from there.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

import psutil
import torch

from .base import DeviceLike
from .device_module import OneDeviceAccelerator

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


class CPUAccelerator(OneDeviceAccelerator):
    """The CPU: one device (all cores), synchronous streams, real RNG and memory numbers.

    - **RNG** is torch's default CPU generator (``torch.default_generator``), the one
      ``torch.rand`` and CPU dropout use. :meth:`manual_seed` seeds only it (unlike
      ``torch.manual_seed``, which also seeds every GPU).
    - **Streams/events**: :class:`CPUStream` / :class:`CPUEvent`; the stream context is
      ``torch.cpu.StreamContext``.
    - **Memory** is measured on the process, by the OS (psutil, ``/proc``): see each method.
      Every memory method returns bytes.

    There is one CPU device: a ``device`` argument is validated (``None``, ``"cpu"``,
    ``0``, ...) and otherwise ignored.
    """

    name = "cpu"
    _stream_class = CPUStream
    _event_class = CPUEvent

    def _bytes_in_use(self) -> int:
        return int(_process().memory_info().rss)

    # devices: torch.cpu answers is_available/device_count/set_device/synchronize
    def device(self, index: DeviceLike = None) -> torch.device:
        self._index(index)
        return torch.device("cpu")

    # streams
    def current_stream(self, device: DeviceLike = None) -> CPUStream:
        self._index(device)
        current = torch.cpu.current_stream()
        return current if isinstance(current, CPUStream) else self._default

    def started_stream(self) -> None:
        return None  # CPU work is synchronous: nothing for another thread to order after

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        if stream is not None and not isinstance(stream, torch.cpu.Stream):
            raise TypeError(f"stream must be a CPUStream or None, got {type(stream).__name__}")
        return torch.cpu.StreamContext(stream)

    # RNG: torch's default CPU generator
    def manual_seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

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
        """
        current = self.memory_allocated(device)
        if self._peak.peak is not None:
            return self._peak.peak
        return max(_kernel_peak_rss(), current)

    def memory_reserved(self, device: DeviceLike = None) -> int:
        """Virtual memory size (VMS) of this process: address space it has reserved.

        Most of it is usually not resident (see :meth:`memory_allocated` for RSS).
        """
        self._index(device)
        return int(_process().memory_info().vms)

    def reset_peak_memory_stats(self, device: DeviceLike = None) -> None:
        """Start a new peak for :meth:`max_memory_allocated` at the current RSS.

        On Linux this resets the kernel's own peak counter (writes ``5`` to
        ``/proc/self/clear_refs``, which also resets ``VmHWM`` and ``ru_maxrss`` for
        anyone else reading them in this process). Where that fails, the peak is sampled
        from now on (see :meth:`max_memory_allocated`).
        """
        self._index(device)
        if _reset_kernel_peak_rss():
            self._peak.peak = None
        else:
            self._peak.reset()

    def memory_stats(self, device: DeviceLike = None) -> dict[str, Any]:
        """RSS, peak RSS, VMS and system memory, under ``torch.cuda``-style keys.

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
        """System RAM (``psutil.virtual_memory().total``), or the cgroup limit if lower."""
        self._index(device)
        total = int(psutil.virtual_memory().total)
        limit, _usage = _cgroup_limit_and_usage()
        return min(total, limit) if limit is not None else total

    def available_memory(self, device: DeviceLike = None) -> int:
        """RAM available without swapping (``psutil.virtual_memory().available``).

        Inside a memory-limited container, the smaller of that and the limit minus the
        container's current usage.
        """
        self._index(device)
        available = int(psutil.virtual_memory().available)
        limit, usage = _cgroup_limit_and_usage()
        if limit is not None and usage is not None:
            available = min(available, max(0, limit - usage))
        return available
