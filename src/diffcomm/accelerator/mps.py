"""The MPS accelerator (Apple silicon): one device, one stream, sampled peak memory.

Part of :mod:`diffcomm.accelerator`; import the public names from there.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .. import _torch
from .base import DeviceLike
from .device_module import OneDeviceAccelerator

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


class MPSAccelerator(OneDeviceAccelerator):
    """Apple-silicon GPUs over ``torch.mps``: one device and one stream (command queue).

    ``torch.mps`` has no peak-memory counter, so :meth:`max_memory_allocated` is
    sampled like the CPU fallback. Communication backend: ``gloo`` (tensors are staged
    through host memory).
    """

    name = "mps"
    _stream_class = _MPSStream
    _event_class = _MPSEvent

    def _bytes_in_use(self) -> int:
        return int(torch.mps.current_allocated_memory())

    def is_available(self) -> bool:
        return bool(torch.backends.mps.is_available())

    def set_device(self, index: DeviceLike) -> None:
        self._index(index)

    def synchronize(self, device: DeviceLike = None) -> None:
        self._index(device)
        torch.mps.synchronize()

    def current_stream(self, device: DeviceLike = None) -> Any:
        self._index(device)
        return self._default

    def started_stream(self) -> None:
        return None  # one command queue: nothing to switch to

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)  # one queue: nothing to switch

    def initial_seed(self) -> int:
        return _torch.mps_initial_seed()

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
