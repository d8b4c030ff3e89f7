"""A collective's buffers joined: :func:`joined`, ``torch.cat`` outside the caller's
``torch.autocast``.

``torch.autocast`` is for the user's math, not for the buffers a collective packs, pads
or reassembles: CPU autocast's ``cat`` refuses fp8 and float16 ("Unexpected floating
ScalarType in at::autocast::prioritize"), which gloo moves as they are, so a plain
``scatter`` of uneven chunks, an ``all_to_all`` across dims or a coalesced op of float16
tensors failed inside ``with torch.autocast("cpu", dtype=torch.bfloat16)``. Every cat over
a collective's buffers (the adapters', the in-process transport's, the ops' packing)
calls :func:`joined`. Re-exported by :mod:`diffcomm.backend`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def joined(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat(parts, dim)`` outside the caller's ``torch.autocast`` (a no-op where
    none is on: the same values, one check of autocast's state)."""
    kind = parts[0].device.type
    try:
        on = torch.is_autocast_enabled(kind)
    except RuntimeError:  # no autocast for this device type
        on = False
    if not on:
        return torch.cat(list(parts), dim)
    with torch.autocast(kind, enabled=False):
        return torch.cat(list(parts), dim)
