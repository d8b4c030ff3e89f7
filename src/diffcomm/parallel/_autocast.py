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


def autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts to on ``t``'s device type, ``None`` when autocast
    is off there (or the device type has no autocast, e.g. ``meta``)."""
    kind = t.device.type
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
    Function's ``apply``, which autocast does not see into): under autocast the floating
    ``tensors`` cast to its dtype first (differentiable casts, so the gradients return to
    the parameters' dtype) and ``fn`` run with autocast off, as
    ``torch.amp.custom_fwd(cast_inputs=...)`` does; else ``fn`` as it is."""
    first = next(t for t in tensors if t is not None)
    dtype = autocast_dtype(first)
    if dtype is None:
        return fn(*tensors, *rest)
    cast = tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)
    with torch.autocast(first.device.type, enabled=False):
        return fn(*cast, *rest)
