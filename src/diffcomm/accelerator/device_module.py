"""Accelerators over a ``torch.<device>`` module: :class:`TorchModuleAccelerator`, CUDA, XPU.

Part of :mod:`diffcomm.accelerator`; import the public names from there.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .base import Accelerator, DeviceLike, _SampledPeak


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

    # streams: the module's classes, unless a subclass names its own (CPU, MPS)
    _stream_class: type | None = None
    _event_class: type | None = None

    @property
    def Stream(self) -> type:
        return self._stream_class or self._module.Stream

    @property
    def Event(self) -> type:
        return self._event_class or self._module.Event

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

    def started_stream(self) -> Any | None:
        started = getattr(self._module, "is_initialized", None)
        return self._module.current_stream() if started is not None and started() else None

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
    def _nvtx(self) -> Any:
        return torch.cuda.nvtx


class XPUAccelerator(TorchModuleAccelerator):
    """Intel GPUs over ``torch.xpu``; communication backend ``xccl``."""

    name = "xpu"
    _communication_backend = "xccl"


class OneDeviceAccelerator(TorchModuleAccelerator):
    """A :class:`TorchModuleAccelerator` with one device (index 0) and one default stream
    of its own ``_stream_class``, communicating over ``gloo``, whose peak memory is
    sampled from ``_bytes_in_use()`` (:class:`CPUAccelerator`, :class:`MPSAccelerator`)."""

    _communication_backend = "gloo"
    _stream_class: type

    def __init__(self) -> None:
        super().__init__()
        self._default = self._stream_class()
        self._peak = _SampledPeak(self._bytes_in_use)

    def _bytes_in_use(self) -> int:
        """The memory in use now, the number the peak is sampled from."""
        raise NotImplementedError

    def current_device(self) -> int:
        return 0  # (torch.cpu.current_device() returns the string "cpu")

    def default_stream(self, device: DeviceLike = None) -> Any:
        self._index(device)
        return self._default

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)  # one device: all of them is this one
