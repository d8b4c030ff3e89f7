"""``torch.autocast`` for the parallel layers' own code: where a layer computes past
torch's autocast-aware ops (a bias added after the reduction, a fused autograd Function,
the vocab-parallel loss), it does what autocast does to the serial layer's op, so values,
output dtypes and gradient dtypes follow the serial model under the same autocast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

#: the dtypes autocast lowers to; a tensor in one of these is in "low precision"
_LOW = (torch.float16, torch.bfloat16)


def _eligible(t: Tensor) -> bool:
    """Whether autocast casts ``t`` at all: a floating tensor but float64 (torch's
    ``is_autocast_eligible``: a float64 tensor reaches its op as it is, so ``F.linear``
    and SDPA of float64 tensors stay float64 under autocast)."""
    return t.is_floating_point() and t.dtype != torch.float64


def autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts ``t`` to, ``None`` when it casts nothing: autocast
    off on ``t``'s device type (or the device type has no autocast, e.g. ``meta``), or ``t``
    not eligible (float64, not floating)."""
    return _device_dtype(t.device.type) if _eligible(t) else None


def _device_dtype(kind: str) -> torch.dtype | None:
    """The dtype of ``torch.autocast`` on device type ``kind``, ``None`` when it is off."""
    try:
        if not torch.is_autocast_enabled(kind):
            return None
        return torch.get_autocast_dtype(kind)
    except RuntimeError:  # no autocast for this device type
        return None


def like_output(b: Tensor, y: Tensor) -> Tensor:
    """Bias ``b`` to add to the output ``y`` of an autocast matmul: in ``y``'s dtype under
    autocast (as ``F.linear``'s bias, so the output keeps the serial layer's dtype, not
    float32 by type promotion), else ``b`` itself."""
    if b.dtype != y.dtype and y.dtype in _LOW and autocast_dtype(y) is not None:
        return b.to(y.dtype)
    return b


def run_lowered(fn: Callable[..., Tensor], tensors: tuple[Tensor | None, ...], *rest: Any) -> Tensor:
    """``fn(*tensors, *rest)`` as autocast runs ``F.linear`` (``fn``: a fused linear
    Function's ``apply``, which autocast does not see into): under autocast the eligible
    ``tensors`` (floating but float64, which autocast leaves as they are: float64 SDPA and
    ``F.linear`` stay float64) cast to its dtype first (differentiable casts, so the
    gradients return to the parameters' dtype) and ``fn`` run with autocast off, as
    ``torch.amp.custom_fwd(cast_inputs=...)`` does; else ``fn`` as it is."""
    first = next(t for t in tensors if t is not None)
    dtype = _device_dtype(first.device.type)
    if dtype is None:
        return fn(*tensors, *rest)
    cast = tuple(t.to(dtype) if t is not None and _eligible(t) else t for t in tensors)
    with torch.autocast(first.device.type, enabled=False):
        return fn(*cast, *rest)
